"""Ranks as threads: ``fully_shard`` under PyTorch's threaded process group (``FSDPTestMultiThread``).

PyTorch's own FSDP unit tests — and many users' — run every rank as a thread of one process on
``torch.testing._internal.distributed.multi_threaded_pg``. Nothing a rank owns may then be kept per
process (a cached default mesh, a module-level switch), and the core may use only the collectives that
group implements (it has no ``isend``/``irecv``). Every test here runs against torch's
``torch.distributed.fsdp.fully_shard`` and ``fsdpfn.compat.fully_shard`` alike (one generated class per
implementation and world size 1, 2, 4, 8) and compares training with a single-thread reference: the
mean over ranks of each rank's own loss, computed without any process group.

The threads share one CPU RNG, so every random value comes from an explicit ``torch.Generator``.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_fsdp import FSDPTestMultiThread

from fsdpfn.testing import torch_version

# torch 2.11's threaded process group is broken as a harness (seen on the GPU machine, 2026-11-26): its own
# teardown raises in every test (`ThreadLocalWorld` has no `comms`), and one run crashed the process with a
# segfault inside DTensor's sharding propagation (FakeTensorMode.__enter__, from nn.Parameter(DTensor), the
# call torch's fully_shard makes too). The same comparisons run on torch >= 2.13 (CI's torch).
pytestmark = pytest.mark.skipif(
    torch_version() < (2, 13), reason="torch < 2.13: its threaded process group harness fails in its own teardown and sharding propagation"
)

IMPLS = {"torch": "torch.distributed.fsdp", "fsdpfn": "fsdpfn.compat"}
WORLDS = (1, 2, 4, 8)
D, H, OUT, BATCH, STEPS, LR = 5, 12, 3, 2, 2, 0.1  # H=12 over 8 ranks: uneven chunks, empty shards
WIDE = (2048, 512)  # a 4 MiB fp32 first weight: above the size from which gloo would use point-to-point exchanges
TOL = dict(rtol=1e-5, atol=1e-6)  # float32; the reduction may sum ranks in another order


def _mlp(d_in: int = D, hidden: int = H) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, OUT))


def _init(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Give ``model`` the same parameters on every rank-thread (the global RNG is shared and raced)."""
    g = torch.Generator().manual_seed(seed)
    values = {n: torch.randn(p.shape, generator=g) * 0.3 for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(values[n])
    return values


def _batch(step: int, rank: int, d_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, d_in, generator=g), torch.randn(BATCH, OUT, generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


class _Reference:
    """Single-process SGD on the mean over ranks of the per-rank losses; the forward runs in
    ``param_dtype`` (on parameters and inputs cast to it, as FSDP's mixed precision does) and the
    gradients are averaged in float32."""

    def __init__(self, model: nn.Module, values: dict[str, torch.Tensor], world: int, param_dtype: torch.dtype | None):
        self.model, self.world, self.dtype = model, world, param_dtype
        self.params = {n: v.clone().requires_grad_(True) for n, v in values.items()}

    def step(self, step: int, d_in: int) -> tuple[list[float], dict[str, torch.Tensor]]:
        losses, grads = [], {n: torch.zeros_like(p) for n, p in self.params.items()}
        for r in range(self.world):
            x, y = _batch(step, r, d_in)
            params = self.params
            if self.dtype is not None:
                params = {n: p.to(self.dtype) for n, p in params.items()}
                x = x.to(self.dtype)
            loss = _loss(torch.func.functional_call(self.model, params, (x,)), y)
            for n, g in zip(self.params, torch.autograd.grad(loss, list(self.params.values()))):
                grads[n] += g
            losses.append(loss.item())
        grads = {n: g / self.world for n, g in grads.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p -= LR * grads[n]
        return losses, grads


class _ThreadedTraining:
    """The tests; a generated ``FSDPTestMultiThread`` subclass per implementation and world size runs them."""

    IMPL: str
    WORLD: int

    @property
    def world_size(self) -> int:
        return self.WORLD

    def _fully_shard(self) -> Any:
        return importlib.import_module(IMPLS[self.IMPL]).fully_shard

    def _policy(self, param_dtype: torch.dtype | None) -> Any:
        mp = importlib.import_module(IMPLS[self.IMPL]).MixedPrecisionPolicy
        return mp(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype is not None else mp()

    def test_nested_mlp_trains_like_one_process(self) -> None:
        self.run_subtests(
            {"reshard_after_forward": [True, False], "param_dtype": [None, torch.bfloat16]},
            self._train,
        )

    def test_wide_layer_trains_like_one_process(self) -> None:
        # Gathers and reductions of >= 1 MiB: gloo runs them as point-to-point exchanges, which the
        # threaded group does not have (isend raises) — the plain collectives must be used instead.
        self._train(reshard_after_forward=True, param_dtype=None, shape=WIDE, steps=1)

    def test_hsdp_trains_like_one_process(self) -> None:
        # (replicate, shard) = (2, world / 2): each rank-thread builds the 2-D mesh and its groups
        replicas = 2 if self.world_size > 1 else 1
        self._train(reshard_after_forward=True, param_dtype=None, mesh_shape=(replicas, self.world_size // replicas))

    def _train(
        self,
        reshard_after_forward: bool,
        param_dtype: torch.dtype | None,
        shape: tuple[int, int] = (D, H),
        steps: int = STEPS,
        mesh_shape: tuple[int, int] | None = None,
    ) -> None:
        fully_shard = self._fully_shard()
        d_in, hidden = shape
        model = _mlp(d_in, hidden)
        values = _init(model, seed=7)
        ref = _Reference(_mlp(d_in, hidden), values, self.world_size, param_dtype)
        policy = self._policy(param_dtype)
        if mesh_shape is None:  # torch's default mesh, made in this rank's thread
            mesh = init_device_mesh("cpu", (self.world_size,))
            kw = {}
        else:
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
            kw = {"mesh": mesh}
        for layer in (model[0], model[2]):
            fully_shard(layer, reshard_after_forward=reshard_after_forward, mp_policy=policy, **kw)
        fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=policy, **kw)
        rank = dist.get_rank()
        assert model[0].weight.device_mesh == mesh, (model[0].weight.device_mesh, mesh)
        assert model[0].weight.device_mesh.mesh_dim_names == mesh.mesh_dim_names
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        tol = TOL if param_dtype is None else dict(rtol=1e-3, atol=1e-5)
        where = f"[{self.IMPL}, world {self.world_size}, rank {rank}]"
        for step in range(steps):
            x, y = _batch(step, rank, d_in)
            loss = _loss(model(x), y)
            loss.backward()
            ref_losses, ref_grads = ref.step(step, d_in)
            torch.testing.assert_close(loss.item(), ref_losses[rank], **tol, msg=lambda m: f"{where} step {step} loss: {m}")
            for name, p in model.named_parameters():
                assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), (where, name)
                assert p.grad.device_mesh == p.device_mesh, (where, name, p.grad.device_mesh, p.device_mesh)
                torch.testing.assert_close(
                    p.grad.full_tensor(), ref_grads[name], **tol, msg=lambda m: f"{where} step {step} grad {name}: {m}"
                )
            opt.step()
            opt.zero_grad()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.full_tensor(), ref.params[name].detach(), **tol, msg=lambda m: f"{where} {name}: {m}")


for _impl in IMPLS:
    for _world in WORLDS:
        _name = f"TestThreads_{_impl}_w{_world}"
        globals()[_name] = type(_name, (_ThreadedTraining, FSDPTestMultiThread), {"IMPL": _impl, "WORLD": _world})
del _impl, _world, _name


class TestThreadsDebugSwitch(FSDPTestMultiThread):
    """fsdpfn only (torch has no such switch): ``check_collectives`` is per rank-thread, and the plan
    check runs on the threaded group's collectives."""

    @property
    def world_size(self) -> int:
        return 2

    def test_each_rank_thread_checks_its_own_collectives(self) -> None:
        from fsdpfn.core import Comm
        from fsdpfn.debug import CollectivePlanError, check_collectives, checking

        comm = Comm(init_device_mesh("cpu", (2,)))
        assert comm.exchange is None  # the threaded group has no isend/irecv
        rank = dist.get_rank()
        with check_collectives():
            assert checking()
            got = comm.all_gather(torch.full((3,), float(rank)), label="same").wait()
            torch.testing.assert_close(got, torch.tensor([[0.0] * 3, [1.0] * 3]))
            dist.barrier()  # both threads are inside their blocks: neither switch leaked to the other
            try:  # ranks diverge: rank 1 gathers another size, and both raise instead of hanging
                comm.all_gather(torch.zeros(3 + rank), label=f"unit{rank}").wait()
            except CollectivePlanError as e:
                assert "unit0" in str(e) and "unit1" in str(e), e
            else:
                raise AssertionError("diverging collectives were not reported")
            dist.barrier()
        assert not checking()
