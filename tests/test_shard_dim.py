"""``fsdpfn.shard(..., shard_placement_fn=lambda p: Shard(d))``: any shard dim in the functional layer.

Each parameter is split with ``torch.chunk`` along its own dim (uneven sizes included), as
``distribute_tensor(x, mesh, [Shard(d)])`` lays it out. A property over random per-parameter dims, shapes,
unit plans and worlds 1-4 checks the local shards, gradients, the global gradient norm and parameters after
``fsdpfn.optim.adamw`` steps against single-process training, and ``to_dtensor`` placements and values;
then a save/load round trip at another world size (and other dims), a meta-device module, tensor-parallel
parameters (against ``fsdpfn.compat.fully_shard`` with the same function) and the refusals.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fsdpfn.testing import spmd

TIMEOUT = 120
STEPS = 2
LR = 1e-2
MAX_NORM = 0.5  # small enough to clip: the norm feeds the update
TOL = dict(rtol=1e-5, atol=1e-6)


class Mixer(nn.Module):
    """A 3-D weight ``w`` (``a x b x c``) contracted with the input, then two linears: parameters of 1, 2
    and 3 dims, so every shard dim has something to split."""

    def __init__(self, a: int, b: int, c: int):
        super().__init__()
        self.w = nn.Parameter(torch.empty(a, b, c))
        self.head = nn.Linear(c, a)
        self.proj = nn.Linear(a, a)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.w.normal_(std=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.head(torch.tanh(torch.einsum("abc,nb->nac", self.w, x)).sum(1))))


NAMES = ("w", "head.weight", "head.bias", "proj.weight", "proj.bias")
NDIM = {"w": 3, "head.weight": 2, "head.bias": 1, "proj.weight": 2, "proj.bias": 1}


def _placement_fn(dims: dict[str, int]):
    """A ``shard_placement_fn`` giving each parameter (found by identity, as FSDP2's callers do) its dim;
    ``None`` (dim 0) where ``dims`` has none."""
    from torch.distributed.tensor import Shard

    def fn(p: nn.Parameter):
        d = fn.by_id.get(id(p))
        return None if d is None else Shard(d)

    fn.by_id = {}
    fn.bind = lambda model: fn.by_id.update({id(model.get_parameter(n)): d for n, d in dims.items() if d is not None})
    return fn


def _shard(model: nn.Module, dims: dict[str, int], **kw):
    import fsdpfn

    fn = _placement_fn(dims)
    fn.bind(model)
    return fsdpfn.shard(model, fsdpfn.init_mesh(), shard_placement_fn=fn, **kw)


def _x(rank: int, step: int, b: int) -> torch.Tensor:
    return torch.randn(3, b, generator=torch.Generator().manual_seed(100 * rank + step))


def _check_layout(params, full: dict[str, torch.Tensor], dims: dict[str, int]) -> None:
    """Local shards are ``torch.chunk`` slices along each parameter's dim; ``to_dtensor`` gives ``Shard(d)``
    DTensors whose full tensors are the full weights."""
    import fsdpfn
    from torch.distributed.tensor import Shard

    plan = params.plan
    sd = fsdpfn.to_dtensor(params)
    for n, value in full.items():
        d = (dims.get(n) or 0) % NDIM[n]
        spec = fsdpfn.ShardSpec(tuple(value.shape), plan.world, d)
        assert plan.specs[n].dim == d, (n, plan.specs[n], d)
        torch.testing.assert_close(params[n], fsdpfn.shard_tensor(value, spec, plan.rank), rtol=0, atol=0, msg=lambda m, n=n: f"shard {n}: {m}")
        assert sd[n].placements == (Shard(d),), (n, sd[n].placements)
        torch.testing.assert_close(sd[n].full_tensor(), value, rtol=0, atol=0, msg=lambda m, n=n: f"to_dtensor {n}: {m}")


def _w_train(sizes: tuple[int, int, int], dims: dict[str, int], units: list[str]) -> None:
    import torch.distributed as dist

    import fsdpfn

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Mixer(*sizes)
    ref = copy.deepcopy(model)
    params = _shard(model, dims, units=units, min_bucket_bytes=None)
    _check_layout(params, {n: p.detach() for n, p in ref.named_parameters()}, dims)
    apply = fsdpfn.fsdp(model)
    opt = fsdpfn.optim.adamw(lr=LR)
    state = opt.init(params)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    step_fn = fsdpfn.value_and_grad(lambda p, x: apply(p, x).pow(2).sum())
    for step in range(STEPS):
        losses = [ref(_x(r, step, sizes[1])).pow(2).sum() for r in range(world)]
        torch.stack(losses).mean().backward()  # fsdpfn averages gradients over the ranks
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        loss, grads = step_fn(params, _x(rank, step, sizes[1]))
        torch.testing.assert_close(loss, losses[rank].detach(), **TOL)
        grads, norm = fsdpfn.optim.clip_grad_norm(grads, MAX_NORM)
        torch.testing.assert_close(norm, ref_norm, **TOL)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], fsdpfn.shard_tensor(p.grad, params.plan.specs[n], rank), **TOL, msg=lambda m, n=n: f"grad {n} at step {step}: {m}")
        params, state = opt.update(grads, state, params)
        ref_opt.step()
        ref_opt.zero_grad()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(params[n], fsdpfn.shard_tensor(p.detach(), params.plan.specs[n], rank), **TOL, msg=lambda m, n=n: f"param {n}: {m}")
    gathered = fsdpfn.unshard(params)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(gathered[n], p.detach(), **TOL)
    full = fsdpfn.full_state_dict(params, rank0_only=False)
    for n, v in ref.state_dict().items():
        torch.testing.assert_close(full[n], v, **TOL)


_dims = st.fixed_dictionaries({n: st.one_of(st.none(), st.integers(-NDIM[n], NDIM[n] - 1)) for n in NAMES})


@settings(max_examples=max(5, settings().max_examples // 5))  # 20 at the default 100: ~0.1-1 s each once the pools are up
@given(
    sizes=st.tuples(st.integers(1, 5), st.integers(1, 4), st.integers(1, 5)),
    dims=_dims,
    units=st.lists(st.sampled_from(["head", "proj"]), unique=True),
    world=st.integers(1, 4),
)
def test_any_dim_trains_like_the_unsharded_model(sizes, dims, units, world):
    spmd(world, _w_train, sizes, dims, units, timeout=TIMEOUT)


# ---- save at one world size and dims, load at another --------------------------------------------------
SIZES = (5, 3, 7)  # uneven over 2 and 3 ranks on every dim
DIMS_SAVE = {"w": 2, "head.weight": -1, "head.bias": 0, "proj.weight": 1, "proj.bias": None}
DIMS_LOAD = {"w": 1, "head.weight": 0, "head.bias": None, "proj.weight": -1, "proj.bias": 0}


def _trained() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Mixer(*SIZES)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(0.25)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _w_save(path: str) -> None:
    import fsdpfn

    torch.manual_seed(0)
    model = Mixer(*SIZES)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(0.25)
    params = _shard(model, DIMS_SAVE, units=["head"])
    opt = fsdpfn.optim.adamw(lr=LR)
    fsdpfn.checkpoint.save(path, {"model": params, "opt": opt.init(params)})


def _w_load(path: str) -> None:
    import fsdpfn

    torch.manual_seed(1)  # other weights: the load must replace them
    like = _shard(Mixer(*SIZES), DIMS_LOAD, units=["proj"])
    opt = fsdpfn.optim.adamw(lr=LR)
    got = fsdpfn.checkpoint.load(path, {"model": like, "opt": opt.init(like)})
    _check_layout(got["model"], _trained(), DIMS_LOAD)
    state = fsdpfn.from_dtensor(fsdpfn.to_dtensor(got["model"]), like)  # the DTensor round trip too
    for n in NAMES:
        torch.testing.assert_close(state[n], got["model"][n], rtol=0, atol=0)


def test_save_load_reloads_at_another_world_size_and_other_dims(tmp_path):
    path = str(tmp_path / "ckpt")
    spmd(2, _w_save, path, timeout=TIMEOUT)
    spmd(3, _w_load, path, timeout=TIMEOUT)


# ---- meta-device module ----------------------------------------------------------------------------------
def _w_meta(dims: dict[str, int]) -> None:
    import fsdpfn

    def build():
        torch.manual_seed(0)
        with torch.device("meta"):
            return Mixer(*SIZES)

    params = _shard(build(), dims, units=["head", "proj"])
    plain = fsdpfn.shard(build(), fsdpfn.init_mesh(), units=["head", "proj"])  # dim 0: the same values
    full = fsdpfn.unshard(plain)
    _check_layout(params, {n: full[n] for n in NAMES}, dims)


@pytest.mark.parametrize("world", [2, 3])
def test_meta_module_materialises_shards_on_their_dims(world):
    spmd(world, _w_meta, DIMS_SAVE, timeout=TIMEOUT)


# ---- tensor-parallel parameters: dims of the TP-local tensor ----------------------------------------------
class Net(nn.Module):
    def __init__(self, widths: tuple[int, ...]):
        super().__init__()
        for i in range(3):
            setattr(self, f"l{i}", nn.Linear(widths[i], widths[i + 1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(torch.tanh(self.l0(x)))))


TP_WIDTHS = (3, 6, 2, 5)  # l0 colwise and l1 rowwise over tp 2; TP-local sizes 3 split unevenly over dp 2
TP_DIMS = {"l0.weight": 1, "l0.bias": 0, "l1.weight": -1, "l1.bias": None, "l2.weight": 1, "l2.bias": 0}


def _w_tp() -> None:
    import fsdpfn
    from fsdpfn.compat import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = fsdpfn.init_mesh((2, 2), names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()

    def build():
        torch.manual_seed(0)
        return parallelize_module(Net(TP_WIDTHS), mesh["tp"], {"l0": ColwiseParallel(), "l1": RowwiseParallel()})

    torch.manual_seed(0)
    ref = Net(TP_WIDTHS)
    fn, cp = build(), build()
    place = _placement_fn(TP_DIMS)
    place.bind(fn)
    place.bind(cp)
    params = fsdpfn.shard(fn, mesh["dp"], units=["l1"], shard_placement_fn=place)
    for n in ("l0", "l1", "l2"):
        fully_shard(getattr(cp, n), mesh=mesh["dp"], shard_placement_fn=place)
    fully_shard(cp, mesh=mesh["dp"], shard_placement_fn=place)
    apply = fsdpfn.fsdp(fn)
    opt, opt_cp = fsdpfn.optim.adamw(lr=LR), torch.optim.AdamW(cp.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    state = opt.init(params)
    for step in range(STEPS):
        losses = [ref(_x(r, step, TP_WIDTHS[0])).pow(2).sum() for r in range(2)]
        torch.stack(losses).mean().backward()
        x = _x(dp_rank, step, TP_WIDTHS[0])
        loss, grads = fsdpfn.value_and_grad(lambda p, x: apply(p, x).pow(2).sum())(params, x)
        cp(x).pow(2).sum().backward()
        torch.testing.assert_close(loss, losses[dp_rank].detach(), **TOL)
        got = fsdpfn.to_dtensor(grads)
        for n, p in cp.named_parameters():  # compat's layout is FSDP2's (tests/test_compat_shard_dim.py)
            assert got[n].placements == p.grad.placements, (n, got[n].placements, p.grad.placements)
            torch.testing.assert_close(got[n].to_local(), p.grad.to_local(), **TOL)
            torch.testing.assert_close(got[n].full_tensor(), ref.get_parameter(n).grad, **TOL)
        params, state = opt.update(grads, state, params)
        for o in (opt_cp, ref_opt):
            o.step()
            o.zero_grad()
    sd = fsdpfn.to_dtensor(params)
    for n, p in cp.named_parameters():
        assert (sd[n].placements, sd[n].shape) == (p.placements, p.shape), n
        torch.testing.assert_close(sd[n].to_local(), p.to_local().detach(), **TOL)
        torch.testing.assert_close(sd[n].full_tensor(), ref.get_parameter(n).detach(), **TOL)
    gathered = fsdpfn.unshard(params)  # over dp only: TP parameters come back as DTensors on mesh["tp"]
    for n, p in ref.named_parameters():
        value = gathered[n]
        torch.testing.assert_close(value.full_tensor() if isinstance(value, DTensor) else value, p.detach(), **TOL)


def test_tensor_parallel_parameters_shard_their_local_tensor_on_any_dim():
    spmd(4, _w_tp, timeout=TIMEOUT)


# ---- refusals ------------------------------------------------------------------------------------------
class _Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.0))
        self.lin = nn.Linear(2, 3)


def _w_errors() -> dict:
    import fsdpfn
    import fsdpfn.compat
    from torch.distributed.tensor import Replicate, Shard

    mesh = fsdpfn.init_mesh()
    cases = {
        "range": lambda: fsdpfn.shard(_Scalar(), mesh, shard_placement_fn=lambda p: Shard(2) if p.ndim == 2 else None),
        "negative": lambda: fsdpfn.shard(_Scalar(), mesh, shard_placement_fn=lambda p: Shard(-3) if p.ndim == 2 else None),
        "type": lambda: fsdpfn.shard(_Scalar(), mesh, shard_placement_fn=lambda p: Replicate() if p.ndim == 1 else None),
        "scalar": lambda: fsdpfn.shard(_Scalar(), mesh, shard_placement_fn=lambda p: Shard(0)),
        "callable": lambda: fsdpfn.shard(_Scalar(), mesh, shard_placement_fn=Shard(0)),
        "compat_callable": lambda: fsdpfn.compat.fully_shard(_Scalar(), mesh=mesh, shard_placement_fn=Shard(0)),
    }
    out = {}
    for k, f in cases.items():
        try:
            f()
        except Exception as e:  # noqa: BLE001 - we report what was raised
            out[k] = (type(e), str(e))
        else:
            out[k] = (None, "no error")
    # a 0-d parameter with the default (None) is still held whole by the first rank
    params = fsdpfn.shard(_Scalar(), mesh, shard_placement_fn=lambda p: Shard(-1) if p.ndim else None)
    out["ok"] = (params.plan.specs["s"].dim, params.plan.specs["lin.weight"].dim)
    return out


ERRORS = {
    "range": (AssertionError, r"^Shard dim 2 is invalid for 2D tensor: torch.Size\(\[3, 2\]\)\nshard: parameter 'lin.weight' of _Scalar; return Shard\(d\) with d in \[-2, 1\]"),
    "negative": (AssertionError, r"^Shard dim -1 is invalid for 2D tensor.*\nshard: parameter 'lin.weight' of _Scalar"),
    "type": (ValueError, r"^Invalid shard_placement_fn result: R\nshard: parameter 'lin.bias' of _Scalar; return None or a Shard\(dim\)"),
    "scalar": (ValueError, r"^shard: shard_placement_fn returned Shard\(dim=0\) for parameter 's' of _Scalar, a 0-d parameter: it has no dim to shard. Return None"),
    "callable": (TypeError, r"^shard: shard_placement_fn must be a callable \(parameter\) -> Shard\(dim\) or None, got Shard"),
    "compat_callable": (TypeError, r"^fully_shard: shard_placement_fn must be a callable \(parameter\) -> Shard\(dim\) or None, got Shard"),
}


def test_bad_shard_placement_fn_results_name_the_parameter():
    for got in spmd(1, _w_errors, timeout=TIMEOUT):
        assert got.pop("ok") == (0, 1)
        for case, (exc, pattern) in ERRORS.items():
            kind, msg = got[case]
            assert kind is not None and issubclass(kind, exc), (case, kind, msg)
            assert __import__("re").search(pattern, msg), (case, msg)
