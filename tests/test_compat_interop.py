"""State interchange between torch's FSDP2 and fsdpfn.compat: a ``state_dict()`` of one loads into the other
with ``load_state_dict`` (also ``assign=True``) and the loaded model then computes what the source computes; a
``torch.distributed.checkpoint`` saved by one at one world size loads into the other at another, exactly; torch's
``torch.distributed.checkpoint.state_dict`` helpers (full model and optimizer state on rank 0, loaded with
``broadcast_from_rank0``) resume training at another world size as one process would; and a plain (non-DTensor)
state dict is refused with an error that names the parameter, on every rank.

``IMPL`` names the module under test. Point it at ``"torch.distributed.fsdp"`` (or set the environment variable
``FSDPFN_COMPAT_UNDER_TEST``) to run torch against itself: that must pass.
"""

from __future__ import annotations

import importlib
import os
import re
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed import checkpoint as dcp

from fsdpfn.testing import spmd
from fsdpfn.testing.models import TinyTransformer

IMPL = os.environ.get("FSDPFN_COMPAT_UNDER_TEST", "fsdpfn.compat")  # the implementation under test
REF = "torch.distributed.fsdp"  # the reference
# d_in, dim, d_out, *hiddens: dim 5 does not divide by 2 or 4, and the 1-row head leaves trailing ranks empty
WIDTHS = (4, 5, 1, 6, 3)
SRC_SEED, DST_SEED = 1, 2  # the loading model starts from other values, so a load that does nothing shows
TIMEOUT = 60  # seconds per spmd call: a hang fails the test instead of waiting for the default 120 s


def _impl():
    """Import the implementation under test in the test process: a missing module fails at once, before any
    worker pool is involved."""
    return importlib.import_module(IMPL)


def _plain(seed):
    d_in, dim, d_out, *hiddens = WIDTHS
    torch.manual_seed(seed)
    return TinyTransformer(d_in, dim, list(hiddens), d_out)


def _plain_params(seed):
    return {n: p.detach() for n, p in _plain(seed).named_parameters()}


# ---- worker side ------------------------------------------------------------------------------------------
def _sharded(lib_name, seed, mesh=None):
    """The model from ``seed``, each block then the root wrapped by ``lib_name``'s ``fully_shard`` on a 1-D
    mesh over the whole world."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    lib = importlib.import_module(lib_name)
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (dist.get_world_size(),))
    model = _plain(seed)
    for block in model.blocks:
        lib.fully_shard(block, mesh=mesh)
    lib.fully_shard(model, mesh=mesh)
    return model


def _full(name, t):
    from torch.distributed.tensor import DTensor

    assert isinstance(t, DTensor), f"{name} is a {type(t).__name__}, not a DTensor"
    return t.full_tensor().detach().clone()


def _meta(t):
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return ("not a DTensor", type(t).__name__)
    return (tuple(t.placements), tuple(t.shape), tuple(t.to_local().shape), t.dtype, t.device_mesh.mesh.tolist())


def _load_state_dict_worker(src_name, dst_name, assign):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import torch.nn.functional as F

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # the head returns a view: harmless
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        src, dst = _sharded(src_name, SRC_SEED, mesh), _sharded(dst_name, DST_SEED, mesh)
        sd = src.state_dict()
        sd_meta = {k: _meta(v) for k, v in sd.items()}
        result = dst.load_state_dict(sd, assign=assign)
        full = {n: _full(n, p) for n, p in dst.named_parameters()}
        dst_meta = {k: _meta(v) for k, v in dst.state_dict().items()}
        # the loaded model computes what the source computes, forward and backward (its hooks use the new values)
        g = torch.Generator().manual_seed(dist.get_rank())
        x, y = torch.randn(2, 3, WIDTHS[0], generator=g), torch.randn(2, 3, WIDTHS[2], generator=g)
        outs, grads = [], []
        for model in (src, dst):
            out = model(x)
            F.mse_loss(out, y).backward()
            outs.append(out.detach().clone())
            grads.append({n: _full(f"{n}.grad", p.grad) for n, p in model.named_parameters()})
    return dict(
        missing=list(result.missing_keys), unexpected=list(result.unexpected_keys), full=full,
        sd_meta=sd_meta, dst_meta=dst_meta, outs=outs, grads=grads,
    )


def _dcp_save(lib_name, path, seed):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        dcp.save(_sharded(lib_name, seed).state_dict(), checkpoint_id=path)


def _dcp_load(lib_name, path):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        model = _sharded(lib_name, DST_SEED)
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=path)
        model.load_state_dict(sd)
        full = {n: _full(n, p) for n, p in model.named_parameters()}
        return full, {k: _meta(v) for k, v in model.state_dict().items()}


def _load_plain_worker(lib_name, fqn):
    """Load a state dict with plain tensors (all of them if ``fqn`` is None, else only ``fqn``'s) and return what
    was raised as ``(type name, message)``, or None. The exception is caught here rather than left to ``spmd``:
    that checks that every rank raised and none is left stuck in a collective (the barrier), and it keeps the
    worker pool, which a raising call discards (restarting one costs seconds)."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        model = _sharded(lib_name, DST_SEED)
        plain = _plain(SRC_SEED).state_dict()
        if fqn is None:
            sd = plain
        else:
            sd = _sharded(lib_name, SRC_SEED).state_dict()
            sd[fqn] = plain[fqn]
        try:
            model.load_state_dict(sd)
        except Exception as exc:  # noqa: BLE001 - any type will do, the message is what is checked
            err = (type(exc).__name__, str(exc))
        else:
            err = None
        dist.barrier()
    return err


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(2, 3, WIDTHS[0], generator=g), torch.randn(2, 3, WIDTHS[2], generator=g)


def _adamw_steps(model, opt, steps, world, rank=None):
    """Train ``steps`` steps of the mean squared error on the batches of ``world`` ranks: every rank's batch
    summed and divided by ``world`` when ``rank`` is None (one process), else ``rank``'s own."""
    import torch.nn.functional as F

    for step in steps:
        ranks = range(world) if rank is None else [rank]
        loss = sum(F.mse_loss(model(x), y) for x, y in (_batch(r, step) for r in ranks))
        (loss / world if rank is None else loss).backward()
        opt.step()
        opt.zero_grad()


def _export_full_state(lib_name, steps):
    """Train, then take the full model and optimizer state with torch's helpers (rank 0 holds it; the others
    get empty dicts)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        model = _sharded(lib_name, SRC_SEED)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        _adamw_steps(model, opt, range(steps), dist.get_world_size(), dist.get_rank())
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=full), get_optimizer_state_dict(model, opt, options=full)


def _resume_full_state(lib_name, msd, osd, start):
    """A model from other values loads ``msd``/``osd`` (given on rank 0 only) and trains one step more."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        model = _sharded(lib_name, DST_SEED)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        first = dist.get_rank() == 0
        set_model_state_dict(model, msd if first else {}, options=options)
        set_optimizer_state_dict(model, opt, osd if first else {}, options=options)
        _adamw_steps(model, opt, [start], dist.get_world_size(), dist.get_rank())
        return {n: _full(n, p) for n, p in model.named_parameters()}


# ---- test side --------------------------------------------------------------------------------------------
def _assert_full_equal(got, want, where):
    assert list(got) == list(want), f"{where}: parameter names {list(got)} != {list(want)}"
    for n in want:
        diff = (got[n] - want[n]).abs().max() if got[n].shape == want[n].shape else f"shape {tuple(got[n].shape)}"
        assert torch.equal(got[n], want[n]), f"{where}: {n} differs from the saved model's: {diff}"


def _assert_sharded_state_dict(meta, want, where):
    """``state_dict()`` holds DTensors over the whole parameter, sharded on dim 0 over a 1-D mesh."""
    from torch.distributed.tensor import Shard

    assert list(meta) == list(want), f"{where}: state_dict keys {list(meta)} != {list(want)}"
    for k, m in meta.items():
        assert m[0] == (Shard(0),) and m[1] == tuple(want[k].shape), f"{where}: state_dict()[{k!r}] is {m}"


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
@pytest.mark.parametrize("direction", ["torch->impl", "impl->torch"])
def test_state_dict_loads_across_libraries(direction, assign):
    _impl()
    src, dst = (REF, IMPL) if direction == "torch->impl" else (IMPL, REF)
    want = _plain_params(SRC_SEED)
    for rank, r in enumerate(spmd(2, _load_state_dict_worker, src, dst, assign, timeout=TIMEOUT)):
        where = f"{direction}, assign={assign}, rank {rank}"
        assert r["missing"] == [] and r["unexpected"] == [], (
            f"{where}: missing keys {r['missing']}, unexpected keys {r['unexpected']}"
        )
        _assert_sharded_state_dict(r["sd_meta"], want, f"{where}: the source's")
        assert r["dst_meta"] == r["sd_meta"], f"{where}: the loaded state_dict differs in layout from the source"
        _assert_full_equal(r["full"], want, where)
        torch.testing.assert_close(
            r["outs"][1], r["outs"][0], rtol=1e-6, atol=1e-7, msg=lambda m: f"{where}: output: {m}"
        )
        for n in want:
            torch.testing.assert_close(
                r["grads"][1][n], r["grads"][0][n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {n}.grad: {m}"
            )


def test_dcp_checkpoint_from_torch_loads_at_other_world_sizes(tmp_path):
    _impl()
    path = str(tmp_path / "torch-w2")
    spmd(2, _dcp_save, REF, path, SRC_SEED, timeout=TIMEOUT)
    want = _plain_params(SRC_SEED)
    for world in (1, 4):
        for rank, (full, meta) in enumerate(spmd(world, _dcp_load, IMPL, path, timeout=TIMEOUT)):
            where = f"saved by torch at world 2, loaded at world {world}, rank {rank}"
            _assert_full_equal(full, want, where)
            _assert_sharded_state_dict(meta, want, where)


def test_dcp_checkpoint_to_torch_from_another_world_size(tmp_path):
    _impl()
    path = str(tmp_path / "impl-w4")
    seed = SRC_SEED + 10
    spmd(4, _dcp_save, IMPL, path, seed, timeout=TIMEOUT)
    want = _plain_params(seed)
    for rank, (full, meta) in enumerate(spmd(2, _dcp_load, REF, path, timeout=TIMEOUT)):
        where = f"saved by {IMPL} at world 4, loaded by torch at world 2, rank {rank}"
        _assert_full_equal(full, want, where)
        _assert_sharded_state_dict(meta, want, where)


@pytest.mark.parametrize(
    "fqn", [None, "blocks.1.up.weight", "head.bias"], ids=["all-plain", "one-block-param", "one-root-param"]
)
def test_plain_state_dict_is_refused_naming_the_parameter(fqn):
    _impl()
    names = list(_plain_params(SRC_SEED))
    pattern = re.escape(fqn) if fqn is not None else "|".join(re.escape(n) for n in names)
    for rank, err in enumerate(spmd(2, _load_plain_worker, IMPL, fqn, timeout=TIMEOUT)):
        what = "a plain full state dict" if fqn is None else f"a state dict whose {fqn} is a plain tensor"
        assert err is not None, f"rank {rank}: loading {what} raised nothing"
        assert re.search(pattern, err[1]), f"rank {rank}: loading {what}: the {err[0]} names no parameter: {err[1]}"


@settings(max_examples=4, deadline=None)
@given(save_world=st.integers(1, 3), load_world=st.integers(1, 3), steps=st.integers(1, 2))
def test_full_state_helpers_resume_training_at_another_world_size(save_world, load_world, steps):
    """``get_model_state_dict``/``get_optimizer_state_dict`` with ``full_state_dict=True, cpu_offload=True``
    after ``steps`` AdamW steps at ``save_world``, loaded by ``set_*_state_dict`` with ``broadcast_from_rank0``
    at ``load_world`` into a model from other values, then one step more: the parameters one process gets
    training the same batches (every moment and step count carried over, or the step would differ)."""
    _impl()
    reference = _plain(SRC_SEED)
    opt = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.1)
    _adamw_steps(reference, opt, range(steps), save_world)
    _adamw_steps(reference, opt, [steps], load_world)
    want = {n: p.detach() for n, p in reference.named_parameters()}
    msd, osd = spmd(save_world, _export_full_state, IMPL, steps, timeout=TIMEOUT)[0]
    assert sorted(msd) == sorted(want), f"the exported model state has keys {sorted(msd)}"
    for rank, got in enumerate(spmd(load_world, _resume_full_state, IMPL, msd, osd, steps, timeout=TIMEOUT)):
        for n, w in want.items():
            torch.testing.assert_close(
                got[n], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"saved at world {save_world}, resumed at "
                f"{load_world}, rank {rank}: {n}: {m}"
            )
