"""``fully_shard`` on different meshes under one root (torchtitan's MoE: each block's experts on a mesh
of their own inside blocks on another), and ``replicate`` inside ``fully_shard`` (or the other way
round), as torch runs them.

A module sharded on another mesh than the ``fully_shard`` call enclosing it (or by the other kind of call)
roots a plan of its own
(``UnitState.outer``), run inside the enclosing root's forward: its parameters are gathered and reduced
over its own mesh, its own unit reshards after forward as any non-root unit, and the root module's
``zero_grad``/``reset_iter_state`` reach it. Before, the root refused the tree (``NotImplementedError``).
Checked against one process on the whole batch, with both meshes covering every rank (a 1-D mesh and
an HSDP mesh, either one inside), gradient accumulation with a dropped microbatch, activation
checkpointing around the blocks and torchtitan's explicit prefetch lists (the next block and its experts).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fsdpfn.testing import spmd

EXAMPLES = int(os.environ.get("FSDPFN_NESTED_MESH_EXAMPLES", "12"))
STEPS, LR = 2, 0.1


class Block(nn.Module):
    def __init__(self, width: int, hidden: int, ckpt: bool):
        super().__init__()
        self.attn = nn.Linear(width, width)
        self.experts = nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, width))
        self.gate = nn.Linear(width, 1)
        self.ckpt = ckpt

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.attn(x))
        # the product saves the experts' output: a checkpoint's recompute comes before the backward reaches
        # the nested root's output (it raised CheckpointError before the root's values were swapped in there)
        return x + self.experts(h) * torch.sigmoid(self.gate(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._run, x, use_reentrant=False) if self.ckpt else self._run(x)


class Net(nn.Module):
    def __init__(self, width: int, hidden: int, blocks: int, ckpt: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(5, width)
        self.blocks = nn.ModuleList(Block(width, hidden, ckpt) for _ in range(blocks))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _batch(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 5, generator=torch.Generator().manual_seed(1000 * step + 100 * micro + rank))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _reference(cfg: dict, world: int) -> dict[str, torch.Tensor]:
    model = Net(cfg["width"], cfg["hidden"], cfg["blocks"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for s in range(STEPS):
        for m in range(cfg["micro"]):
            for r in range(world):
                (_loss(model(_batch(s, m, r))) / (world * cfg["micro"])).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.named_parameters()}


def _meshes(replicas: int):
    world = dist.get_world_size()
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    hsdp = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("rep", "shard"))
    return flat, hsdp


def _train(cfg: dict) -> dict[str, torch.Tensor] | None:
    from fsdpfn.compat import fully_shard, replicate
    from fsdpfn.compat.state import state_of

    rank = dist.get_rank()
    flat, hsdp = _meshes(cfg["replicas"])
    if cfg["kinds"] == "two meshes":
        inner, outer = (hsdp, flat) if cfg["inner_hsdp"] else (flat, hsdp)
        inner_call = outer_call = fully_shard
    else:  # replicate inside fully_shard or the other way round, on one mesh
        inner, outer = flat, flat
        inner_call, outer_call = (replicate, fully_shard) if cfg["kinds"] == "replicate in fully_shard" else (fully_shard, replicate)
    kw = {} if cfg["raf"] is None else {"reshard_after_forward": cfg["raf"]}
    model = Net(cfg["width"], cfg["hidden"], cfg["blocks"], cfg["ckpt"])
    kw_in, kw_out = (kw if inner_call is fully_shard else {}), (kw if outer_call is fully_shard else {})
    for blk in model.blocks:
        inner_call(blk.experts, mesh=inner, **kw_in)
        outer_call(blk, mesh=outer, **kw_out)
    outer_call(model, mesh=outer, **kw_out)
    if cfg["prefetch"]:  # torchtitan's explicit prefetch under EP: the next block and its experts
        blocks = list(model.blocks)
        for blk, nxt in zip(blocks, blocks[1:]):
            blk.set_modules_to_forward_prefetch([nxt, nxt.experts])
        for blk, prev in zip(blocks[1:], blocks):
            blk.set_modules_to_backward_prefetch([prev, prev.experts])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for s in range(STEPS):
        if cfg["drop"]:  # a microbatch run without sync and dropped: reaches no reduction
            model.set_requires_gradient_sync(False)
            _loss(model(_batch(s, 99, rank))).backward()
            model.zero_grad()
        for m in range(cfg["micro"]):
            model.set_requires_gradient_sync(m == cfg["micro"] - 1)
            (_loss(model(_batch(s, m, rank))) / cfg["micro"]).backward()
        opt.step()
        opt.zero_grad()
    for blk in model.blocks:
        p = blk.experts[0].weight
        assert isinstance(p, DTensor) and p.device_mesh == inner, (p.device_mesh, inner)
        assert blk.attn.weight.device_mesh == outer
        nested = state_of(blk.experts).root
        assert nested is not state_of(model).root and nested.comm.mesh == inner
        assert state_of(blk.experts).kind == inner_call.__name__
        if inner_call is fully_shard:  # a unit, not FSDP's root: reshards by default
            assert nested.reshards("") == (cfg["raf"] is not False)
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.named_parameters()}
    return full if rank == 0 else None


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    world=st.integers(2, 4),
    data=st.data(),
    kinds=st.sampled_from(["two meshes", "replicate in fully_shard", "fully_shard in replicate"]),
    inner_hsdp=st.booleans(),
    raf=st.sampled_from([None, True, False]),
    width=st.integers(2, 7),
    hidden=st.integers(1, 9),
    blocks=st.integers(1, 3),
    micro=st.integers(1, 2),
    drop=st.booleans(),
    ckpt=st.booleans(),
    prefetch=st.booleans(),
)
def test_blocks_and_experts_on_two_meshes_match_one_process(
    world, data, kinds, inner_hsdp, raf, width, hidden, blocks, micro, drop, ckpt, prefetch
):
    replicas = data.draw(st.sampled_from([r for r in range(1, world + 1) if world % r == 0]), label="replicas")
    cfg = dict(
        replicas=replicas, kinds=kinds, inner_hsdp=inner_hsdp, raf=raf, width=width, hidden=hidden, blocks=blocks, micro=micro,
        drop=drop, ckpt=ckpt, prefetch=prefetch,
    )  # fmt: skip
    got = spmd(world, _train, cfg)[0]
    ref = _reference(cfg, world)
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def _reverse_order() -> str:
    from fsdpfn.compat import fully_shard

    flat, hsdp = _meshes(1)
    model = Net(4, 4, 1)
    fully_shard(model, mesh=flat)
    fully_shard(model.blocks[0].experts, mesh=hsdp)  # after the root's call: not nested in its plan
    with pytest.raises(NotImplementedError, match=r"'blocks.0.experts'.*apply fully_shard to the modules inside first"):
        model(_batch(0, 0, 0))
    return "ok"


def test_module_on_another_mesh_sharded_after_the_root_is_refused_by_name():
    assert spmd(2, _reverse_order) == ["ok", "ok"]


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)
        self.head.weight = self.experts.weight  # one parameter on both sides of the mesh boundary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.experts(x))


def _tied_across() -> str:
    from fsdpfn.compat import fully_shard

    flat, hsdp = _meshes(1)
    model = _Tied()
    fully_shard(model.experts, mesh=hsdp)
    fully_shard(model, mesh=flat)
    with pytest.raises(ValueError, match=r"'head.weight' is shared with a parameter already managed"):
        model(torch.ones(2, 4))
    return "ok"


def test_parameter_tied_across_two_meshes_is_refused_by_name():
    assert spmd(2, _tied_across) == ["ok", "ok"]


class _StackedExperts(nn.Module):
    """Expert weights stacked on dim 0, expert-parallel: a DTensor sharded over the ``ep`` mesh dim (each
    ep rank runs its own experts on its own tokens: no token exchange, which does not change the layout)."""

    def __init__(self, experts: int, width: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, width, width) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w.to_local() if isinstance(self.w, DTensor) else self.w
        return sum(torch.tanh(x @ w[i]) for i in range(w.shape[0]))


class _MoEBlock(nn.Module):
    def __init__(self, experts: int, width: int):
        super().__init__()
        self.attn = nn.Linear(width, width)
        self.experts = _StackedExperts(experts, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.experts(self.attn(x))


def _moe(lib: str, raf: bool | None, shard_dim: int) -> dict:
    import importlib
    import warnings

    from torch.distributed.tensor import Shard, distribute_tensor

    fully_shard = importlib.import_module(lib).fully_shard
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_mod_ep", "ep"))
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), _MoEBlock(4, 6), _MoEBlock(4, 6), nn.Linear(6, 3))
    kw = {} if raf is None else {"reshard_after_forward": raf}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's redistribute of _StridedShard warns
        for blk in (model[1], model[2]):
            blk.experts.w = nn.Parameter(distribute_tensor(blk.experts.w.data, mesh["ep"], [Shard(0)]))
            fully_shard(blk.experts, mesh=mesh["dp_mod_ep"], shard_placement_fn=lambda p: Shard(shard_dim), **kw)
            fully_shard(blk, mesh=flat, **kw)
        fully_shard(model, mesh=flat, **kw)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for s in range(STEPS):
            _loss(model(_batch(s, 0, rank))).backward()
            opt.step()
            opt.zero_grad()
        return {
            k: (p.full_tensor().detach(), tuple(p.placements), p.device_mesh.mesh.tolist(), p.device_mesh.mesh_dim_names)
            for k, p in model.named_parameters()
        }


@pytest.mark.parametrize("raf", [None, False])
@pytest.mark.parametrize("shard_dim", [0, 1])
def test_expert_parallel_experts_on_their_own_mesh_equal_torch(raf, shard_dim):
    """torchtitan's MoE layout at world 4: experts a DTensor over ``ep`` sharded again over ``dp_mod_ep``
    (``_StridedShard`` where FSDP2 puts it, or on dim 1 by ``shard_placement_fn``), blocks over all ranks:
    placements, meshes and training equal torch's ``fully_shard``."""
    ours = spmd(4, _moe, "fsdpfn.compat", raf, shard_dim)
    theirs = spmd(4, _moe, "torch.distributed.fsdp", raf, shard_dim)
    for rank in range(4):
        assert ours[rank].keys() == theirs[rank].keys()
        for k, (value, *layout) in theirs[rank].items():
            assert ours[rank][k][1:] == tuple(layout), (rank, k, ours[rank][k][1:], layout)
            torch.testing.assert_close(ours[rank][k][0], value, rtol=1e-5, atol=1e-6)
