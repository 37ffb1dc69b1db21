"""``fsdpfn.compat.fully_shard`` over tensor parallelism: a module parallelised with
``torch.distributed.tensor.parallel.parallelize_module`` on ``mesh["tp"]`` and sharded on ``mesh["dp"]`` of
one 2-D mesh (world 4 = dp 2 x tp 2) trains exactly as under torch's ``fully_shard``. Each check runs torch's
FSDP2 and fsdpfn.compat in the same worker on identical models and per-rank data and compares, after several
AdamW steps: the losses, the first step's gradients (placements and global values), the parameters and
``state_dict()`` values (mesh, placements, local shards); and a DCP checkpoint saved by one loads into the
other.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpfn.testing import fsdp2_lacks, spmd
from fsdpfn.testing.models import NormMLPBlock

TORCH, COMPAT = "torch.distributed.fsdp", "fsdpfn.compat"
TIMEOUT = 120
STEPS = 3
D = 8


class MLP(nn.Module):
    """Colwise ``up`` then Rowwise ``down`` (the Megatron MLP); ``head`` stays a plain (dp-only) parameter."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.down(torch.tanh(self.up(x)))))


class Blocks(nn.Module):
    """Two pre-norm residual MLP blocks (with sequence parallelism their LayerNorms run on sequence shards)
    and a head."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.blocks = nn.ModuleList(NormMLPBlock(d, h) for _ in range(2))
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        if isinstance(x, DTensor):
            x = x.full_tensor()  # sequence-parallel output: a DTensor sharded on the sequence dim
        return self.head(x)


# ---- worker side ------------------------------------------------------------------------------------------
def _build(lib_name: str, kind: str, hidden: int, mp: bool, mesh, dim: int = 0):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    lib = importlib.import_module(lib_name)
    torch.manual_seed(0)
    kw = {"mesh": _dp(mesh)}
    if dim:
        kw["shard_placement_fn"] = lambda p: Shard(dim) if p.ndim > dim else None
    if mp:
        kw["mp_policy"] = lib.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's FSDP2 warns about view outputs
        if kind == "mlp":
            model = MLP(D, hidden)
            parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        else:
            model = Blocks(D, hidden)
            for b in model.blocks:
                if kind == "blocks":
                    plan = {
                        "norm": SequenceParallel(),
                        "up": ColwiseParallel(input_layouts=Shard(1)),
                        "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                    }
                else:  # plain TP: each block's output is the all-reduce's AsyncCollectiveTensor, saved by the next block
                    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
                parallelize_module(b, mesh["tp"], plan)
            for b in model.blocks:
                lib.fully_shard(b, **kw)
        lib.fully_shard(model, **kw)
    return model


def _dp(mesh):
    """The data-parallel part of the mesh: ``dp`` (2-D), or ``(replicate, shard)`` (3-D HSDP x TP)."""
    return mesh["dp"] if "dp" in mesh.mesh_dim_names else mesh["replicate", "shard"]


def _input(kind: str, mesh, step: int):
    from torch.distributed.tensor import Shard

    dp = _dp(mesh).get_coordinate()
    dp = dp[0] * 10 + dp[-1]
    g = torch.Generator().manual_seed(100 * dp + step)  # same batch on the two TP ranks of a dp rank
    if kind == "mlp":
        return torch.randn(3, D, generator=g)
    x = torch.randn(2, 4, D, generator=g)
    if kind == "blocks_tp":
        return x
    tp = mesh["tp"]
    return DTensor.from_local(x.chunk(tp.size(), dim=1)[tp.get_local_rank()], tp, (Shard(1),))


def _train(lib_name: str, kind: str, hidden: int, mp: bool, dim: int = 0) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.get_world_size() == 8:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _build(lib_name, kind, hidden, mp, mesh, dim)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict = {"loss": []}
    for step in range(STEPS):
        loss = model(_input(kind, mesh, step)).float().pow(2).sum()
        loss.backward()
        out["loss"].append(loss.detach())
        if step == 0:
            out["grad"] = {n: (p.grad.placements, p.grad.full_tensor()) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    out["param"] = {n: (p.device_mesh, p.placements, tuple(p.shape), p.to_local().detach().clone()) for n, p in model.named_parameters()}
    out["state"] = {n: (v.device_mesh, v.placements, tuple(v.shape), v.to_local().clone()) for n, v in model.state_dict().items()}
    return out


def _compare(ref: dict, got: dict, tol: dict) -> None:
    torch.testing.assert_close(torch.stack(got["loss"]), torch.stack(ref["loss"]), **tol)
    assert got["grad"].keys() == ref["grad"].keys()
    for n, (placements, full) in ref["grad"].items():
        assert got["grad"][n][0] == placements, (n, got["grad"][n][0], placements)
        torch.testing.assert_close(got["grad"][n][1], full, **tol, msg=lambda m, n=n: f"grad {n}: {m}")
    for what in ("param", "state"):
        assert got[what].keys() == ref[what].keys(), what
        for n, (mesh, placements, shape, local) in ref[what].items():
            g_mesh, g_placements, g_shape, g_local = got[what][n]
            assert (g_mesh, g_placements, g_shape) == (mesh, placements, shape), (what, n, g_mesh, g_placements, g_shape)
            torch.testing.assert_close(g_local, local, **tol, msg=lambda m, n=n, w=what: f"{w} {n}: {m}")


def _w_parity(kind: str, hidden: int, mp: bool, dim: int = 0) -> None:
    tol = dict(rtol=2e-2, atol=2e-3) if mp else dict(rtol=1e-5, atol=1e-6)
    _compare(_train(TORCH, kind, hidden, mp, dim), _train(COMPAT, kind, hidden, mp, dim), tol)


@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["mlp", "blocks_tp", "blocks"], ids=["mlp", "tp_blocks", "sequence_parallel_blocks"])
def test_training_matches_fsdp2_with_tensor_parallel(kind, mp):
    spmd(4, _w_parity, kind, 6, mp, timeout=TIMEOUT)


def test_shard_dim_1_over_tensor_parallel_matches_fsdp2():
    # dp shards the weights on dim 1: Shard(1) beside the colwise Shard(0), _StridedShard(1) under the rowwise Shard(1)
    spmd(4, _w_parity, "mlp", 8, False, 1, timeout=TIMEOUT)


@settings(max_examples=3)
@given(tp_rows=st.integers(1, 5))
def test_uneven_dp_splits_of_tp_shards_match_fsdp2(tp_rows):
    # hidden = 2 * tp_rows over tp 2 (TP itself needs even splits), then dp 2 over the TP-local rows:
    # odd counts split unevenly, and a 1-row TP shard leaves dp rank 1 empty
    spmd(4, _w_parity, "mlp", 2 * tp_rows, False, timeout=TIMEOUT)


def test_hsdp_times_tp_3d_matches_fsdp2():
    # world 8 = replicate 2 x shard 2 x tp 2: placements (Replicate(), _StridedShard(0, sf=2), Shard(0)) & co.
    spmd(8, _w_parity, "mlp", 6, False, timeout=TIMEOUT)


def _w_dcp(path: str) -> None:
    from torch.distributed import checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for src, dst in ((TORCH, COMPAT), (COMPAT, TORCH)):
        source = _build(src, "mlp", 6, False, mesh)
        with torch.no_grad():
            for p in source.parameters():
                p.add_(1.0)  # the destination starts from other values, so a load that does nothing shows
        where = f"{path}/{src}"
        dcp.save(source.state_dict(), checkpoint_id=where)
        target = _build(dst, "mlp", 6, False, mesh)
        state = target.state_dict()
        dcp.load(state, checkpoint_id=where)
        target.load_state_dict(state)
        for (n, p), q in zip(source.named_parameters(), target.parameters()):
            assert (q.placements, q.shape) == (p.placements, p.shape), n
            torch.testing.assert_close(q.to_local(), p.to_local(), msg=lambda m, n=n: f"{src} -> {dst} {n}: {m}")
        x = _input("mlp", mesh, 0)
        torch.testing.assert_close(target(x), source(x))


def test_dcp_checkpoints_interchange_with_fsdp2_tp(tmp_path):
    spmd(4, _w_dcp, str(tmp_path), timeout=TIMEOUT)


# ---- dp_mesh_dims: parameters are DTensors on the whole (dp, tp) mesh, Replicate() on dp -------------------
SPMD_PLACEMENTS = {"up.weight": 0, "up.bias": 0, "down.weight": 1, "down.bias": None, "head.weight": None, "head.bias": None}


def _train_spmd(lib_name: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import torch.distributed as dist

    lib = importlib.import_module(lib_name)
    if dist.get_world_size() == 8:  # HSDP x TP: replicate 2 x shard 2 x tp 2
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "dp", "tp"))
        dims = DataParallelMeshDims(shard="dp", replicate="replicate")
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dims = DataParallelMeshDims(shard="dp")
    dp = mesh.ndim - 1  # data-parallel dims first, then tp
    torch.manual_seed(0)
    model = MLP(D, 6)
    for fqn, p in list(model.named_parameters()):
        owner, _, attr = fqn.rpartition(".")
        tp = SPMD_PLACEMENTS[fqn]
        value = distribute_tensor(p.detach(), mesh, [Replicate()] * dp + [Replicate() if tp is None else Shard(tp)])
        setattr(model.get_submodule(owner), attr, nn.Parameter(value))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict = {"loss": []}
    coord = mesh.get_coordinate()
    for step in range(STEPS):
        x = torch.randn(3, D, generator=torch.Generator().manual_seed(100 * (coord[0] * 10 + coord[dp - 1]) + step))
        loss = model(DTensor.from_local(x, mesh, [Shard(0)] * dp + [Replicate()])).pow(2).sum()
        loss.backward()
        out["loss"].append(loss.full_tensor().detach())
        if step == 0:
            out["grad"] = {n: (p.grad.placements, p.grad.full_tensor()) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    out["param"] = {n: (p.device_mesh, p.placements, tuple(p.shape), p.to_local().detach().clone()) for n, p in model.named_parameters()}
    out["state"] = {n: (v.device_mesh, v.placements, tuple(v.shape), v.to_local().clone()) for n, v in model.state_dict().items()}
    return out


def _w_spmd() -> None:
    _compare(_train_spmd(TORCH), _train_spmd(COMPAT), dict(rtol=1e-5, atol=1e-6))


@pytest.mark.skipif(bool(fsdp2_lacks("DataParallelMeshDims")), reason=fsdp2_lacks("DataParallelMeshDims"))
@pytest.mark.parametrize("world", [4, 8], ids=["dp_x_tp", "replicate_x_dp_x_tp"])
def test_dp_mesh_dims_on_a_whole_spmd_mesh_matches_fsdp2(world):
    spmd(world, _w_spmd, timeout=TIMEOUT)


def _w_dcp_save(path: str, lib_name: str) -> None:
    from torch.distributed import checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _build(lib_name, "mlp", 8, False, mesh)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-2.0)
    dcp.save(model.state_dict(), checkpoint_id=path)


def _w_dcp_load_at_dp1(path: str) -> None:
    from torch.distributed import checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))  # world 2: dp 1 x tp 2
    model = _build(COMPAT, "mlp", 8, False, mesh)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    torch.manual_seed(0)
    want = MLP(D, 8)  # what was saved: the seed's values times -2
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), dict(want.named_parameters())[n].detach() * -2.0, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("saver", [TORCH, COMPAT], ids=["from_fsdp2", "from_fsdpfn"])
def test_dcp_checkpoint_of_dp2_x_tp2_reloads_at_dp1_x_tp2(tmp_path, saver):
    spmd(4, _w_dcp_save, str(tmp_path), saver, timeout=TIMEOUT)
    spmd(2, _w_dcp_load_at_dp1, str(tmp_path), timeout=TIMEOUT)


@pytest.mark.parametrize("dims", [dict(shard="dp"), dict(replicate="r"), dict(shard=("a", "b"), replicate="r"), dict()])
def test_our_data_parallel_mesh_dims_reads_as_torchs(dims):
    # fsdpfn.compat re-exports torch's DataParallelMeshDims where torch has one (2.12+) and its own where not
    from fsdpfn.compat.dp_mesh_dims import DataParallelMeshDims as Ours

    if not dims:
        with pytest.raises(ValueError, match="At least one of shard or replicate must be set in DataParallelMeshDims"):
            Ours(**dims)
        return
    ours = Ours(**dims)
    want = {"shard": (dims["shard"],) if isinstance(dims.get("shard"), str) else tuple(dims.get("shard") or ()),
            "replicate": (dims["replicate"],) if isinstance(dims.get("replicate"), str) else tuple(dims.get("replicate") or ())}
    assert (ours.shard_names, ours.replicate_names) == (want["shard"], want["replicate"])
    if not fsdp2_lacks("DataParallelMeshDims"):
        from torch.distributed.fsdp import DataParallelMeshDims as Torchs

        theirs = Torchs(**dims)
        assert (ours.shard_names, ours.replicate_names) == (theirs.shard_names, theirs.replicate_names)
