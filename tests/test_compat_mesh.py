"""The user's mesh: parameters, gradients, state-dict values and optimizer states are ``DTensor``s on
exactly the ``DeviceMesh`` passed to ``fully_shard(mesh=...)`` — or, with none, on torch's default
``init_device_mesh(device, (world,))`` without dim names — so DTensors the user builds on that mesh mix
with them. Each test runs torch's ``torch.distributed.fsdp.fully_shard`` and ``fsdpfn.compat``'s
(parametrised) on 1-D, 2-D (HSDP) and sub-meshes, and checks the gradients against the mean over the
data-parallel ranks of each rank's single-process gradients.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdpfn.testing import spmd

LIBS = ("torch.distributed.fsdp", "fsdpfn.compat")
TIMEOUT = 60
D, H, OUT, BATCH = 4, 6, 3, 2
TOL = dict(rtol=1e-5, atol=1e-6)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, OUT))


def _x(rank: int) -> torch.Tensor:
    return torch.randn(BATCH, D, generator=torch.Generator().manual_seed(rank))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum()


def _math_grads(ranks: list[int]) -> dict[str, torch.Tensor]:
    """Mean over ``ranks`` (global ranks of one data-parallel group) of each one's own gradients."""
    total: dict[str, torch.Tensor] = {}
    for r in ranks:
        m = _model()
        _loss(m(_x(r))).backward()
        for n, p in m.named_parameters():
            total[n] = total.get(n, 0) + p.grad
    return {n: g / len(ranks) for n, g in total.items()}


def _shard(lib: str, mesh: DeviceMesh | None) -> nn.Module:
    fully_shard = importlib.import_module(lib).fully_shard
    model = _model()
    kw = {} if mesh is None else {"mesh": mesh}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fully_shard(model[0], **kw)
        fully_shard(model, **kw)
    return model


def _check_on(model: nn.Module, mesh: DeviceMesh, placements: tuple, dp_ranks: list[int], tag: str) -> None:
    """Everything the model hands out lives on ``mesh``; one step's gradients are the group mean."""
    _loss(model(_x(dist.get_rank()))).backward()
    want = _math_grads(dp_ranks)
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor), (tag, n)
        assert p.device_mesh == mesh, f"{tag} {n}: parameter on {p.device_mesh}, want {mesh}"
        assert p.device_mesh.mesh_dim_names == mesh.mesh_dim_names, (tag, n, p.device_mesh.mesh_dim_names)
        assert p.placements == placements, (tag, n, p.placements)
        assert p.grad.device_mesh == mesh and p.grad.placements == placements, (tag, n, p.grad.device_mesh)
        torch.testing.assert_close(p.grad.full_tensor(), want[n], **TOL, msg=lambda m: f"{tag} grad {n}: {m}")
    for k, v in model.state_dict().items():
        assert isinstance(v, DTensor) and v.device_mesh == mesh, f"{tag} state_dict[{k!r}] on {v.device_mesh}"
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    opt.step()
    for p in model.parameters():
        assert opt.state[p]["exp_avg"].device_mesh == mesh, tag
    # a DTensor the user builds on the same mesh mixes with the parameters, in and out of place
    before = {n: p.full_tensor() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            mine = distribute_tensor(torch.full(p.shape, 0.5), mesh, p.placements)
            torch.testing.assert_close((p * mine).full_tensor(), before[n] * 0.5, msg=f"{tag} {n}: p * user DTensor")
            p.add_(mine)
            torch.testing.assert_close(p.full_tensor(), before[n] + 0.5, msg=f"{tag} {n}: p.add_(user DTensor)")
    model.zero_grad()
    out = model(_x(dist.get_rank()))  # the next forward sees the values the user wrote
    ref = _model()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(before[n] + 0.5)
    torch.testing.assert_close(out, ref(_x(dist.get_rank())), **TOL, msg=f"{tag}: forward after the user's update")


def _w_default(lib: str) -> None:
    world = dist.get_world_size()
    model = _shard(lib, None)
    torch_default = init_device_mesh("cpu", (world,))  # what torch's fully_shard builds when given no mesh
    p = model[0].weight
    assert p.device_mesh.mesh_dim_names is None, f"[{lib}] default mesh has dim names {p.device_mesh.mesh_dim_names}"
    # a second default-sharded root lives on the same (equal) mesh: its parameters mix with the first's
    other = _shard(lib, None)
    with torch.no_grad():
        torch.testing.assert_close((p + other[0].weight).full_tensor(), 2 * p.full_tensor())
    _check_on(model, torch_default, (Shard(0),), list(range(world)), f"[{lib}] default mesh")


@pytest.mark.parametrize("lib", LIBS)
def test_default_mesh_is_torchs_unnamed_mesh_over_the_world(lib):
    spmd(2, _w_default, lib, timeout=TIMEOUT)


def _w_given(lib: str, shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    placements = (Shard(0),) if len(shape) == 1 else (Replicate(), Shard(0))
    model = _shard(lib, mesh)
    assert model[0].weight.device_mesh == mesh
    _check_on(model, mesh, placements, list(range(dist.get_world_size())), f"[{lib}] mesh {shape} {names}")


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize(
    "world, shape, names",
    [(2, (2,), ("dp",)), (4, (2, 2), ("replicate", "shard")), (4, (2, 2), ("dp_replicate", "dp_shard"))],
    ids=["1d", "hsdp", "hsdp-own-names"],
)
def test_params_grads_state_dict_live_on_the_users_mesh(lib, world, shape, names):
    spmd(world, _w_given, lib, shape, names, timeout=TIMEOUT)


def _w_submesh(lib: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    dp = mesh["dp"]  # FSDP over the last dim only; the first belongs to another parallelism
    group = dist.get_process_group_ranks(dp.get_group())
    model = _shard(lib, dp)
    _check_on(model, dp, (Shard(0),), group, f"[{lib}] sub-mesh 'dp' of (tp, dp)")


@pytest.mark.parametrize("lib", LIBS)
def test_fsdp_over_a_sub_mesh_of_a_2d_mesh(lib):
    spmd(4, _w_submesh, lib, timeout=TIMEOUT)
