"""Low-precision all-gather: FSDP2's ``fsdp_pre_all_gather``/``fsdp_post_all_gather`` extension in
``fsdpfn.compat`` and ``fsdpfn.AllGatherTransform`` in the functional layer.

``RowInt8`` is a tensor subclass of our own holding a float32 parameter that all-gathers as int8 values
plus one float32 scale per row (two inputs of two dtypes) and rebuilds the dequantised float32 tensor.
Quantisation is per row, so the gathered tensor is exactly ``_qdq`` of the full parameter: training
through the extension equals single-process training of a model whose forward uses ``_qdq(w)`` with a
straight-through gradient. That is checked over worlds 1-4 and uneven shapes (both signature forms), and
against torch's own ``fully_shard`` in the same process group. torchao's float8 training (the real
client) is compared with torch's ``fully_shard`` at world 2, with the all-gather bytes counted.
"""

from __future__ import annotations

import importlib
import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._pytree import tree_map_only

import fsdpfn
from fsdpfn.testing import spmd

TORCH, COMPAT = "torch.distributed.fsdp", "fsdpfn.compat"
TIMEOUT = 90
STEPS = 2
TOL = dict(rtol=1e-5, atol=1e-6)


# --- the subclass -------------------------------------------------------------------------------------
def _row_scale(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(x.shape[0], math.prod(x.shape[1:])) if x.dim() else x.reshape(1, 1)
    return (rows.abs().amax(dim=1) / 127).clamp_min(1e-8) if rows.shape[1] else rows.new_ones(rows.shape[0])


def _quantise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = _row_scale(x)
    q = torch.round(x / scale.view(-1, *[1] * (x.dim() - 1))).clamp(-127, 127).to(torch.int8)
    return q, scale


def _dequantise(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(torch.float32) * scale.view(-1, *[1] * (q.dim() - 1))).to(dtype)


def _qdq(x: torch.Tensor) -> torch.Tensor:
    """What the gathered tensor is: per-row int8 quantise-dequantise of the full parameter."""
    return _dequantise(*_quantise(x), x.dtype)


# Ops whose results stay RowInt8 (sharding, copies, views): what FSDP2 and fsdpfn do to a parameter.
_KEEP = {
    torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default, torch.ops.aten.slice.Tensor, torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default, torch.ops.aten.as_strided.default, torch.ops.aten.clone.default,
    torch.ops.aten._to_copy.default, torch.ops.aten.new_zeros.default, torch.ops.aten.empty_like.default,
    torch.ops.aten.zeros_like.default,
}  # fmt: skip


class RowInt8(torch.Tensor):
    """A float32 parameter all-gathered as per-row int8 + scales (FSDP2's five-argument form)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> RowInt8:
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            device=data.device, requires_grad=data.requires_grad,
        )  # fmt: skip

    def __init__(self, data: torch.Tensor):
        self._data = data

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._data!r})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, _meta: Any, _size: Any, _stride: Any) -> RowInt8:
        return cls(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        sub = type(next(a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, RowInt8)))
        a, k = tree_map_only(RowInt8, lambda t: t._data, (args, kwargs or {}))
        out = func(*a, **k)
        if func._schema.name.endswith("_"):  # in place: self (the _foreach_ ones return nothing)
            return None if out is None else args[0]
        if func in _KEEP:
            return tree_map_only(torch.Tensor, sub, out)
        return out

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: Any, module: Any, mp_policy: Any) -> Any:
        # FSDP2 wants inputs of the padded shard size when the split is uneven: pad the rows ourselves
        chunk = -(-outer_size[0] // mesh.size())
        q, scale = _quantise(self._data)
        pad = chunk - q.shape[0]
        if pad:
            q = torch.cat([q, q.new_zeros(pad, *q.shape[1:])])
            scale = torch.cat([scale, scale.new_ones(pad)])
        return (q, scale), ("rowint8", tuple(outer_size))

    def fsdp_post_all_gather(self, outputs: tuple, metadata: Any, param_dtype: torch.dtype, *, out: Any = None) -> Any:
        q, scale = outputs
        assert metadata[0] == "rowint8" and q.dtype == torch.int8 and scale.dtype == torch.float32
        full = _dequantise(q, scale, param_dtype)
        if out is not None:  # FSDP2 re-gathers into the tensor it made the first time
            out.data.copy_(full[: out.shape[0]]) if out.shape != full.shape else out.data.copy_(full)
            return None
        return full, (q, scale)


class RowInt8Old(RowInt8):
    """The same with the older one-argument ``fsdp_pre_all_gather(mesh)`` (unpadded local rows)."""

    def fsdp_pre_all_gather(self, mesh: Any) -> Any:  # type: ignore[override]
        q, scale = _quantise(self._data)
        return (q, scale), ("rowint8", None)


class Net(nn.Module):
    def __init__(self, a: int, b: int, c: int):
        super().__init__()
        self.l1, self.l2 = nn.Linear(a, b), nn.Linear(b, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


def _net(sizes: tuple[int, int, int], forms: tuple[type | None, type | None]) -> Net:
    torch.manual_seed(0)
    net = Net(*sizes)
    for lin, form in zip((net.l1, net.l2), forms):
        if form is not None:
            lin.weight = nn.Parameter(form(lin.weight.detach().clone()))
    return net


class _Ref(nn.Module):
    """The single-process reference: the plain ``Net`` whose quantised weights go through ``_qdq``
    with a straight-through gradient."""

    def __init__(self, net: Net, forms: tuple[type | None, type | None]):
        super().__init__()
        self.net, self.forms = net, forms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def lin(m: nn.Linear, form: Any, h: torch.Tensor) -> torch.Tensor:
            w = m.weight if form is None else m.weight + (_qdq(m.weight.detach()) - m.weight.detach())
            return nn.functional.linear(h, w, m.bias)

        return lin(self.net.l2, self.forms[1], torch.tanh(lin(self.net.l1, self.forms[0], x)))


def _x(rank: int, step: int, a: int) -> torch.Tensor:
    return torch.randn(3, a, generator=torch.Generator().manual_seed(100 * rank + step))


def _plain_local(t: torch.Tensor) -> torch.Tensor:
    t = t.to_local() if hasattr(t, "to_local") else t
    return (t._data if isinstance(t, RowInt8) else t).detach().clone()


def _train_compat(lib_name: str, sizes: tuple[int, int, int], forms: tuple, mp: bool = False, hsdp: bool = False) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    lib = importlib.import_module(lib_name)
    net = _net(sizes, forms)
    kw: dict = {}
    if mp:  # the extension's post gets param_dtype=bfloat16
        kw["mp_policy"] = lib.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if hsdp:  # the extension's pre gets the shard mesh
        kw["mesh"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.fully_shard(net.l1, **kw)
        lib.fully_shard(net, **kw)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    out: dict = {"loss": [], "types": {n: type(p.to_local()).__name__ for n, p in net.named_parameters()}}
    for step in range(STEPS):
        loss = net(_x(dist.get_rank(), step, sizes[0])).pow(2).sum()
        loss.backward()
        out["loss"].append(loss.detach().float())
        if step == 0:
            out["grad"] = {n: _plain_local(p.grad) for n, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
    out["param"] = {n: _plain_local(p) for n, p in net.named_parameters()}
    return out


def _local_rows(full: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    chunks = torch.chunk(full, dist.get_world_size(), dim=0)
    rank = dist.get_rank()
    return chunks[rank] if rank < len(chunks) else full[:0]


def _assert_like_one_process(got: dict, sizes: tuple[int, int, int], forms: tuple) -> None:
    """This rank's losses, step-0 gradients and final parameters equal the single-process model's
    (quantised alike, AdamW with torch's default weight decay) trained on every rank's batch."""
    import torch.distributed as dist

    world = dist.get_world_size()
    ref = _Ref(_net(sizes, (None, None)), forms)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        for r in range(world):
            loss = ref(_x(r, step, sizes[0])).pow(2).sum()
            (loss / world).backward()
            if r == dist.get_rank():
                torch.testing.assert_close(got["loss"][step], loss.detach(), **TOL)
        if step == 0:
            for n, p in ref.net.named_parameters():
                torch.testing.assert_close(got["grad"][n], _local_rows(p.grad), **TOL)
        opt.step()
        opt.zero_grad()
    for n, p in ref.net.named_parameters():
        torch.testing.assert_close(got["param"][n], _local_rows(p.detach()), **TOL)


def _w_matches_one_process(sizes: tuple[int, int, int], forms: tuple) -> None:
    got = _train_compat(COMPAT, sizes, forms)
    for name, form in zip(("l1.weight", "l2.weight"), forms):
        assert got["types"][name] == ("Tensor" if form is None else form.__name__), got["types"]
    _assert_like_one_process(got, sizes, forms)


FORMS = st.sampled_from([(RowInt8, None), (None, RowInt8Old), (RowInt8Old, RowInt8)])


@settings(max_examples=6)
@given(world=st.integers(1, 4), sizes=st.tuples(st.integers(1, 6), st.integers(1, 7), st.integers(1, 5)), forms=FORMS)
def test_compat_extension_trains_like_one_process(world, sizes, forms):
    spmd(world, _w_matches_one_process, sizes, forms, timeout=TIMEOUT)


def _w_matches_fsdp2(sizes: tuple[int, int, int], forms: tuple, mp: bool = False, hsdp: bool = False) -> None:
    ref, got = _train_compat(TORCH, sizes, forms, mp, hsdp), _train_compat(COMPAT, sizes, forms, mp, hsdp)
    assert got["types"] == ref["types"]
    tol = dict(rtol=1e-3, atol=1e-5) if mp else TOL  # bfloat16 compute: the same ops, summed in another order
    torch.testing.assert_close(torch.stack(got["loss"]), torch.stack(ref["loss"]), **tol)
    for what in ("grad", "param"):
        for n, t in ref[what].items():
            torch.testing.assert_close(got[what][n], t, **tol)


@pytest.mark.parametrize(
    "world,sizes,forms,mp,hsdp",
    [
        (2, (4, 6, 2), (RowInt8, RowInt8Old), False, False),
        (3, (5, 6, 3), (RowInt8Old, RowInt8), False, False),
        (4, (3, 8, 4), (None, RowInt8), False, False),
        (2, (4, 6, 2), (RowInt8, RowInt8Old), True, False),
        (4, (4, 6, 2), (RowInt8, RowInt8Old), False, True),
    ],
)
def test_compat_extension_matches_fsdp2(world, sizes, forms, mp, hsdp):
    # even splits of the quantised weights (uneven biases): FSDP2 wants every input of an unevenly split
    # parameter to have the padded shard's full shape, which leaves no room for a per-row scale
    spmd(world, _w_matches_fsdp2, sizes, forms, mp, hsdp, timeout=TIMEOUT)


# --- torchao float8 training (the real client) -------------------------------------------------------
def _float8_net(float8_gather: bool) -> nn.Module:
    """A float8-trained MLP, all-gathering its weights in float8 (``float8_gather``) or not."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    convert_to_float8_training(net, config=Float8LinearConfig(enable_fsdp_float8_all_gather=float8_gather))
    return net


def _train_float8(lib_name: str, float8: bool, mp: bool = False) -> dict:
    import torch.distributed as dist

    lib = importlib.import_module(lib_name)
    net = _float8_net(float8)
    kw = {"mp_policy": lib.MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if mp else {}
    for m in (net[0], net[2], net):
        lib.fully_shard(m, **kw)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    stats = None
    out: dict = {"loss": [], "gathered": [], "types": {n: type(p.to_local()).__name__ for n, p in net.named_parameters()}}
    for step in range(3):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * dist.get_rank() + step))
        if stats is not None:
            stats.log.clear()
        loss = net(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["loss"].append(loss.detach())
        if lib_name == COMPAT:
            from fsdpfn.compat.state import state_of

            stats = state_of(net).root.comm.stats
            stats.recording = True
            if step:  # the first step's log began after lazy init: count whole steps only
                out["gathered"].append(sum(n for kind, _, n in stats.log if kind == "all_gathers"))
    out["param"] = {n: _plain_local(p) for n, p in net.named_parameters()}
    return out


def _w_float8() -> dict:
    ref, got = _train_float8(TORCH, True), _train_float8(COMPAT, True)
    assert got["types"] == ref["types"] and got["types"]["0.weight"] == "WeightWithDynamicFloat8CastTensor"
    torch.testing.assert_close(torch.stack(got["loss"]), torch.stack(ref["loss"]), **TOL)
    for n, t in ref["param"].items():
        torch.testing.assert_close(got["param"][n]._tensor if hasattr(got["param"][n], "_tensor") else got["param"][n],
                                   t._tensor if hasattr(t, "_tensor") else t, **TOL)  # fmt: skip
    # the baseline: the same float8 training with weights all-gathered in bfloat16 (mixed precision)
    bf16 = _train_float8(COMPAT, False, mp=True)
    return {"float8": got["gathered"], "bf16": bf16["gathered"]}


def test_torchao_float8_matches_fsdp2_and_gathers_half_of_bf16():
    pytest.importorskip("torchao.float8")
    got = spmd(2, _w_float8, timeout=TIMEOUT)
    for rank in got:
        assert rank["float8"] and len(rank["float8"]) == len(rank["bf16"]), rank
        for f8, bf in zip(rank["float8"], rank["bf16"]):
            assert 0 < f8 <= 0.55 * bf, (f8, bf, f8 / bf)


# --- the functional layer: shard(..., all_gather_transforms=) ----------------------------------------
def _row_pre(shard: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], Any]:
    return _quantise(shard), "rowint8"


def _row_post(outputs: tuple[torch.Tensor, ...], metadata: Any, dtype: torch.dtype) -> torch.Tensor:
    assert metadata == "rowint8"
    return _dequantise(*outputs, dtype)


def _train_functional(sizes: tuple[int, int, int], forms: tuple, explicit: bool, units: Any) -> dict:
    import torch.distributed as dist

    from fsdpfn import optim

    if explicit:  # a plain module and transforms by name
        net = _net(sizes, (None, None))
        row = fsdpfn.AllGatherTransform(_row_pre, _row_post)
        transforms = {f"l{i + 1}.weight": row for i, form in enumerate(forms) if form is not None}
        params = fsdpfn.shard(net, fsdpfn.init_mesh(), units=units, all_gather_transforms=transforms)
    else:  # the subclass module: its extension is found without asking
        net = _net(sizes, forms)
        params = fsdpfn.shard(net, fsdpfn.init_mesh(), units=units)
    stats = params.plan.comm.stats
    stats.recording = True
    apply = fsdpfn.fsdp(net)
    opt = optim.adamw(lr=1e-2, weight_decay=0.01)
    state = opt.init(params)
    step_fn = fsdpfn.value_and_grad(lambda p, x: apply(p, x).pow(2).sum())
    out: dict = {"loss": []}
    for step in range(STEPS):
        stats.log.clear()
        loss, grads = step_fn(params, _x(dist.get_rank(), step, sizes[0]))
        out["loss"].append(loss.detach())
        if step == 0:
            out["grad"] = {n: _plain_local(g) for n, g in grads.items()}
            out["gathered"] = [(label, n) for kind, label, n in stats.log if kind == "all_gathers"]
        params, state = opt.update(grads, state, params)
    out["param"] = {n: _plain_local(p) for n, p in params.items()}
    return out


def _w_functional(sizes: tuple[int, int, int], forms: tuple, explicit: bool, units: Any) -> None:
    import torch.distributed as dist

    world = dist.get_world_size()
    got = _train_functional(sizes, forms, explicit, units)
    _assert_like_one_process(got, sizes, forms)
    # the transformed weights travel as int8 + float32 scales, one uint8 collective per unit
    if world > 1 and units is None and forms == (RowInt8, RowInt8):
        a, b, c = sizes
        scales = (-(-b // world) + -(-c // world)) * world * 4
        assert any(n == a * b + b * c + scales for _, n in got["gathered"]), got["gathered"]


@settings(max_examples=5)
@given(
    world=st.integers(1, 4),
    sizes=st.tuples(st.integers(1, 6), st.integers(1, 7), st.integers(1, 5)),
    forms=FORMS,
    explicit=st.booleans(),
    units=st.sampled_from([None, ["l1"], ["l1", "l2"]]),
)
def test_functional_all_gather_transform_trains_like_one_process(world, sizes, forms, explicit, units):
    spmd(world, _w_functional, sizes, forms, explicit, units, timeout=TIMEOUT)


# --- refusals ---------------------------------------------------------------------------------------
class _PreOnly(torch.Tensor):
    def fsdp_pre_all_gather(self, *args, **kwargs):  # pragma: no cover - never called
        raise AssertionError  # and no fsdp_post_all_gather: half an extension


def _w_refusals() -> None:
    from torch.distributed.tensor import Shard

    from fsdpfn.compat import fully_shard

    net = _net((4, 6, 2), (RowInt8, None))
    with pytest.raises(NotImplementedError, match=r"parameter 'weight' of Linear is a RowInt8 with fsdp_pre_all_gather.*dim 0"):
        fully_shard(net.l1, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    plain = _net((4, 6, 2), (None, None))
    half = _net((4, 6, 2), (None, None))
    half.l1.weight = nn.Parameter(half.l1.weight.detach().as_subclass(_PreOnly))
    with pytest.raises(ValueError, match=r"shard: parameter 'l1.weight' of Net is a _PreOnly defining only fsdp_pre_all_gather; define both"):
        fsdpfn.shard(half, fsdpfn.init_mesh(), donate=False)  # half an extension is refused as fully_shard refuses it
    row = fsdpfn.AllGatherTransform(_row_pre, _row_post)
    with pytest.raises(ValueError, match=r"all_gather_transforms names 'l3.weight', which is not a sharded parameter"):
        fsdpfn.shard(plain, fsdpfn.init_mesh(), all_gather_transforms={"l3.weight": row}, donate=False)
    with pytest.raises(TypeError, match=r"all_gather_transforms\['l1.weight'\] must be a fsdpfn.AllGatherTransform"):
        fsdpfn.shard(plain, fsdpfn.init_mesh(), all_gather_transforms={"l1.weight": (_row_pre, _row_post)}, donate=False)
    with pytest.raises(NotImplementedError, match=r"parameter 'l1.weight' has an all-gather transform and is sharded on dim 1"):
        fsdpfn.shard(plain, fsdpfn.init_mesh(), all_gather_transforms={"l1.weight": row}, donate=False, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    # the traced executor (torch.compile of a whole step) has no transform path
    from fsdpfn.ops.api import gather_collective
    from fsdpfn.ops.traced import run_traced

    params = fsdpfn.shard(plain, fsdpfn.init_mesh(), all_gather_transforms={"l1.weight": row}, donate=False, min_bucket_bytes=None)
    plan = params.plan
    b = gather_collective(plan, plan.units, 1.0)
    with pytest.raises(NotImplementedError, match=r"traced executor .* cannot gather \['l1.weight'\] through their all-gather"):
        run_traced(b, [params[f] for f in b.fqns])


def test_extension_refusals():
    spmd(2, _w_refusals, timeout=TIMEOUT)


def test_uneven_inputs_must_split_like_the_shard():
    from fsdpfn.layout import ShardSpec
    from fsdpfn.ops.extension import ExtensionGather

    spec = ShardSpec((5, 2), 2)  # rows 3 + 2
    bad = fsdpfn.AllGatherTransform(lambda s: ((s.reshape(-1),), None), _row_post)
    ext = ExtensionGather(("w",), (spec,), (bad,), (torch.float32,))
    with pytest.raises(ValueError, match=r"all-gather transform of 'w': .* must have 2 \(this rank's rows\) or 3 \(the padded rows\) rows, got shape \(4,\)"):
        ext.pack([torch.ones(2, 2)], rank=1, device=torch.device("cpu"))
    # this rank's rows are padded, the padded rows taken as they are
    good = fsdpfn.AllGatherTransform(lambda s: (_quantise(s), None), _row_post)
    flat, _ = ExtensionGather(("w",), (spec,), (good,), (torch.float32,)).pack([torch.ones(2, 2)], rank=1, device=torch.device("cpu"))
    assert flat.dtype == torch.uint8 and flat.numel() == 3 * 2 + 3 * 4  # int8 rows, float32 scales, padded to 3
