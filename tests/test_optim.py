"""fsdpfn.optim across real gloo ranks (world 1..4): K steps of sgd/adamw on shards equal K steps of
torch.optim on the full single-process parameters; clip_grad_norm equals torch's on the full grads."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import fsdpfn
import fsdpfn.optim as optim
from fsdpfn.testing import spmd
from fsdpfn.testing import strategies as fst
from fsdpfn.testing.models import ParamTree

F64 = (torch.float64,)
LOW = (torch.float32, torch.bfloat16, torch.float16, torch.complex64)
K = 3
_MESHES: dict = {}  # per worker process and default group: meshes are reused across examples


@dataclass(frozen=True)
class Decay:
    """A picklable lr schedule: ``base * rate ** step``."""

    base: float
    rate: float

    def __call__(self, step: int) -> float:
        return self.base * self.rate**step


def _mesh(shape=None):
    key = (shape, dist.group.WORLD)  # a call that raised renews the pool's groups: its meshes go too
    if key not in _MESHES:
        for stale in [k for k in _MESHES if k[1] is not key[1]]:
            del _MESHES[stale]
        _MESHES[key] = fsdpfn.init_mesh(shape)
    return _MESHES[key]


def _full_grads(model: torch.nn.Module, seed: int, k: int, p_drop: float) -> dict[str, torch.Tensor | None]:
    """Step ``k``'s full gradients (identical in every process); ``None`` for frozen or dropped ones."""
    g = torch.Generator().manual_seed(seed * 1009 + k)
    out: dict[str, torch.Tensor | None] = {}
    for n, p in model.named_parameters():
        wide = torch.complex128 if p.dtype.is_complex else torch.float64
        t = torch.randn(p.shape, generator=g, dtype=wide).to(p.dtype)
        drop = bool(torch.rand((), generator=g) < p_drop)
        out[n] = t if p.requires_grad and not drop else None
    return out


def _shard_grads(full: dict[str, torch.Tensor | None], params: fsdpfn.Sharded) -> fsdpfn.Sharded:
    plan = params.plan
    zeros = {n: torch.zeros(plan.specs[n].shape, dtype=plan.dtypes[n]) for n, t in full.items() if t is None}
    filled = {n: t if t is not None else zeros[n] for n, t in full.items()}
    return fsdpfn.reshard(filled, params).replace({n: None for n, t in full.items() if t is None})


def _make(kind: str, hp: dict) -> optim.GradientTransformation:
    return optim.adamw(**hp) if kind == "adamw" else optim.sgd(**hp)


def _torch_opt(kind: str, hp: dict, params: list[torch.nn.Parameter], foreach: bool | None) -> torch.optim.Optimizer:
    """torch's optimizer; ``foreach=True`` means the kernel fsdpfn runs on CPU (AdamW: the fused one, which
    torch refuses for complex parameters; fsdpfn runs it on their real view)."""
    hp = dict(hp, lr=0.0 if callable(hp["lr"]) else hp["lr"])
    every = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    if kind != "adamw":
        return torch.optim.SGD(params, foreach=foreach, **hp)
    if foreach and all(p.is_floating_point() for p in every):
        return torch.optim.AdamW(params, fused=True, **hp)
    return torch.optim.AdamW(params, foreach=foreach, **hp)


# ---- workers (module level: they run in the spmd pool) ---------------------------------------
def _opt_worker(tree: ParamTree, kind: str, hp: dict, seed: int, p_drop: float):
    model = tree.build()
    params = fsdpfn.shard(model, _mesh())
    opt = _make(kind, hp)
    state = opt.init(params)
    for k in range(K):
        params, state = opt.update(_shard_grads(_full_grads(model, seed, k, p_drop), params), state, params)
    trees = {f: dict(getattr(state, f).items()) for f in state._fields if f != "count"}
    return params.plan.rank, dict(params.items()), trees, int(state.count)


def _clip_worker(tree: ParamTree, seed: int, max_norm: float, norm_type: float, mesh_shape):
    model = tree.build()
    params = fsdpfn.shard(model, _mesh(mesh_shape))
    grads = _shard_grads(_full_grads(model, seed, 0, 0.0), params)
    stats = params.plan.comm.stats
    stats.reset()
    clipped, total = optim.clip_grad_norm(grads, max_norm, norm_type)
    same = all(clipped[n] is grads[n] for n in params.plan.params)
    one_collective = stats.all_reduces == (1 if params.plan.world * params.plan.replicas > 1 else 0)
    return params.plan.rank, total, dict(clipped.items()), same and one_collective


def _reference(tree: ParamTree, kind: str, hp: dict, seed: int, p_drop: float, foreach: bool | None = None):
    model = tree.build()
    trainable = [p for p in model.parameters() if p.requires_grad]
    mask = hp.get("weight_decay_mask")
    hp = {k: v for k, v in hp.items() if k != "weight_decay_mask"}
    if mask is not None:  # torch's way: a parameter group without weight decay
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        decays = [mask(n, tuple(p.shape)) if callable(mask) else mask.get(n, True) for n, p in zip(names, trainable)]
        trainable = [g for g in ({"params": [p for p, d in zip(trainable, decays) if d]},
                                 {"params": [p for p, d in zip(trainable, decays) if not d], "weight_decay": 0.0}) if g["params"]]
    opt = _torch_opt(kind, hp, trainable, foreach) if trainable else None
    named = dict(model.named_parameters())
    stepped = {n: 0 for n in named}
    for k in range(K):
        for n, g in _full_grads(model, seed, k, p_drop).items():
            named[n].grad = g
            stepped[n] += g is not None
        if opt is not None:
            if callable(hp["lr"]):
                for group in opt.param_groups:
                    group["lr"] = hp["lr"](k + 1)  # the schedule sees the update's number, from 1
            opt.step()
    return model, opt, stepped


# Low precision: the kernels round each op of the update; where the update cancels the parameter, one
# rounding of an O(1) intermediate is 1 ulp of 1 (2**-8 in bf16), so the absolute tolerance is that scale.
LOW_TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.complex64: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-2, atol=1e-2),
    torch.bfloat16: dict(rtol=2e-2, atol=5e-2),
}


def _check_against_torch(tree, kind, hp, seed, p_drop, world, out, foreach=None, low=False):
    model, opt, stepped = _reference(tree, kind, hp, seed, p_drop, foreach)
    by_rank = sorted(out, key=lambda o: o[0])
    assert [o[3] for o in by_rank] == [K] * world
    for n, p in model.named_parameters():
        tol = LOW_TOL[p.dtype] if low else dict(rtol=1e-6, atol=1e-7)
        spec = fsdpfn.ShardSpec(tuple(p.shape), world)
        got = fsdpfn.unshard_tensors([o[1][n] for o in by_rank], spec)
        torch.testing.assert_close(got, p.detach(), **tol, msg=lambda m: f"param {n!r}: {m}")
        torch_state = opt.state.get(p, {}) if opt is not None else {}
        for field, shards in by_rank[0][2].items():
            if field == "step":
                steps = {float(o[2]["step"][n]) if o[2]["step"][n] is not None else None for o in by_rank}
                # updates this parameter received; sgd counts them only for a dampened momentum buffer's
                # first step (a zeroed buffer starts undampened ones exactly), as torch's SGD keeps none
                keeps = p.requires_grad and not (kind == "sgd" and not (hp.get("momentum") and hp.get("dampening")))
                want = float(stepped[n]) if keeps else None
                assert steps == {want}, (n, steps, want)
                if "step" in torch_state:
                    assert float(torch_state["step"]) == want
                continue
            if shards[n] is None or field not in torch_state or torch_state[field] is None:
                continue
            got = fsdpfn.unshard_tensors([o[2][field][n] for o in by_rank], spec)
            torch.testing.assert_close(got, torch_state[field], **tol, msg=lambda m: f"{field} of {n!r}: {m}")


# ---- strategies ---------------------------------------------------------------------------------
def _lrs(low: float = 1e-3, high: float = 0.5):
    const = st.floats(low, high)
    return st.one_of(const, st.builds(Decay, const, st.floats(0.5, 1.0)))


@st.composite
def adamw_hps(draw):
    return dict(
        lr=draw(_lrs()),
        betas=(draw(st.floats(0.0, 0.99)), draw(st.floats(0.0, 0.999))),
        eps=draw(st.sampled_from([1e-8, 1e-6, 1e-3])),
        weight_decay=draw(st.sampled_from([0.0, 1e-2, 0.3])),
        amsgrad=draw(st.booleans()),
        maximize=draw(st.booleans()),
    )


@st.composite
def sgd_hps(draw):
    momentum = draw(st.sampled_from([0.0, 0.5, 0.9]))
    nesterov = momentum > 0 and draw(st.booleans())
    return dict(
        lr=draw(_lrs()),
        momentum=momentum,
        dampening=0.0 if nesterov else draw(st.sampled_from([0.0, 0.1, 0.5])),
        weight_decay=draw(st.sampled_from([0.0, 1e-2, 0.3])),
        nesterov=nesterov,
        maximize=draw(st.booleans()),
    )


# ---- properties -------------------------------------------------------------------------------
@given(world=fst.world_sizes(), seed=st.integers(0, 1000), p_drop=st.sampled_from([0.0, 0.3]), data=st.data())
def test_adamw_on_shards_equals_torch_adamw(world, seed, p_drop, data):
    tree = data.draw(fst.param_trees(dtypes_=F64, max_params=4))
    hp = data.draw(adamw_hps())
    out = spmd(world, _opt_worker, tree, "adamw", hp, seed, p_drop)
    _check_against_torch(tree, "adamw", hp, seed, p_drop, world, out)


@given(world=fst.world_sizes(), seed=st.integers(0, 1000), p_drop=st.sampled_from([0.0, 0.3]), data=st.data())
def test_sgd_on_shards_equals_torch_sgd(world, seed, p_drop, data):
    tree = data.draw(fst.param_trees(dtypes_=F64, max_params=4))
    hp = data.draw(sgd_hps())
    out = spmd(world, _opt_worker, tree, "sgd", hp, seed, p_drop)
    _check_against_torch(tree, "sgd", hp, seed, p_drop, world, out)


def _two_dims(fqn, shape):
    return len(shape) >= 2  # the GPT recipe: no decay for biases and norms


@given(world=fst.world_sizes(), seed=st.integers(0, 1000), kind=st.sampled_from(["adamw", "sgd"]), data=st.data())
def test_a_weight_decay_mask_equals_torchs_group_without_decay(world, seed, kind, data):
    # weight_decay_mask (a function of name and shape, or a mapping that may leave names out) against
    # torch.optim with the unmasked parameters in a group of weight_decay=0.0
    tree = data.draw(fst.param_trees(dtypes_=F64, max_params=4))
    hp = data.draw(adamw_hps() if kind == "adamw" else sgd_hps())
    names = [n for n, _ in tree.build().named_parameters()]
    chosen = data.draw(st.dictionaries(st.sampled_from(names), st.booleans()) if names else st.just({}))
    mask = data.draw(st.sampled_from([_two_dims, chosen]))
    hp = dict(hp, weight_decay=data.draw(st.sampled_from([1e-2, 0.3])), weight_decay_mask=mask)
    out = spmd(world, _opt_worker, tree, kind, hp, seed, 0.0)
    _check_against_torch(tree, kind, hp, seed, 0.0, world, out)


@given(world=fst.world_sizes(), seed=st.integers(0, 1000), kind=st.sampled_from(["adamw", "sgd"]), data=st.data())
def test_low_precision_and_complex_params_match_torch(world, seed, kind, data):
    tree = data.draw(fst.param_trees(dtypes_=LOW, max_params=3))
    hp = data.draw(adamw_hps() if kind == "adamw" else sgd_hps())
    hp["eps"] = 1e-3 if kind == "adamw" else None
    hp = {k: v for k, v in hp.items() if v is not None}
    out = spmd(world, _opt_worker, tree, kind, hp, seed, 0.0)
    # Elementwise kernels: the shards see the very ops torch's kernel (AdamW's fused, SGD's foreach) runs
    # on the full tensors.
    _check_against_torch(tree, kind, hp, seed, 0.0, world, out, foreach=True, low=True)


@st.composite
def mesh_shapes(draw, world: int):
    replicas = draw(st.sampled_from([r for r in range(1, world + 1) if world % r == 0]))
    return None if replicas == 1 else (replicas, world // replicas)


@given(world=fst.world_sizes(), seed=st.integers(0, 1000), data=st.data())
def test_clip_grad_norm_equals_torch_on_full_grads(world, seed, data):
    tree = data.draw(fst.param_trees(dtypes_=F64, max_params=4))
    max_norm = data.draw(st.sampled_from([0.0, 0.1, 1.0, 5.0, 1e6]))
    norm_type = data.draw(st.sampled_from([1.0, 2.0, 3.5, math.inf]))
    shape = data.draw(mesh_shapes(world))
    out = spmd(world, _clip_worker, tree, seed, max_norm, norm_type, shape)
    model = tree.build()
    for n, g in _full_grads(model, seed, 0, 0.0).items():
        dict(model.named_parameters())[n].grad = g
    # torch cannot take the inf-norm of an empty gradient; empty ones add nothing to any norm
    want = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.numel()], max_norm, norm_type)
    shard_world = world // (shape[0] if shape else 1)
    for rank, total, clipped, same in out:
        assert same  # clipped in place, with exactly one all-reduce
        torch.testing.assert_close(total, want.to(total.dtype), rtol=1e-9, atol=1e-12)
        for n, p in model.named_parameters():
            if p.grad is None:
                assert clipped[n] is None
                continue
            spec = fsdpfn.ShardSpec(tuple(p.shape), shard_world)
            torch.testing.assert_close(clipped[n], fsdpfn.shard_tensor(p.grad, spec, rank), rtol=1e-9, atol=1e-12)


@given(seed=st.integers(0, 1000), norm_type=st.sampled_from([2.0, math.inf]), data=st.data())
def test_clip_grad_norm_does_not_depend_on_world_size(seed, norm_type, data):
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.complex64)
    tree = data.draw(fst.param_trees(dtypes_=dtypes, max_params=4))
    norms = [spmd(w, _clip_worker, tree, seed, 1.0, norm_type, None)[0][1] for w in (1, 2, 3)]
    for n in norms[1:]:
        torch.testing.assert_close(n, norms[0], rtol=1e-6, atol=1e-7)


# ---- in place / donation ---------------------------------------------------------------------------
def _inplace_worker(kind: str, hp: dict):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))  # rank 1 of 2: empty "1.weight"
    model[1].bias.requires_grad_(False)
    params = fsdpfn.shard(model, _mesh())
    opt = _make(kind, hp)
    grads = _shard_grads(_full_grads(model, 7, 0, 0.0), params)
    saved = {k: v.clone() if v is not None else None for k, v in grads.items()}

    def tensors(tree):
        return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]

    # inplace=False: inputs stay untouched, results equal the in-place ones
    state = opt.init(params)
    before = [t.clone() for t in tensors((params, state))]
    p_copy, s_copy = _make(kind, dict(hp, inplace=False)).update(grads, state, params)
    untouched = all(torch.equal(a, b) for a, b in zip(before, tensors((params, state))))
    def ptrs_of(tree):
        return {t.data_ptr() for t in tensors(tree) if t.numel()}

    no_shared = not ptrs_of(s_copy) & ptrs_of(state)
    # inplace=True: same storage, new containers
    ptrs = [t.data_ptr() for t in tensors((params, state))]
    objs = [id(t) for t in tensors((params, state))]
    frozen = params["1.bias"]
    p_new, s_new = opt.update(grads, state, params)
    same_storage = [t.data_ptr() for t in tensors((p_new, s_new))] == ptrs
    same_objects = [id(t) for t in tensors((p_new, s_new))] == objs
    equal = all(torch.equal(a, b) for a, b in zip(tensors((p_copy, s_copy)), tensors((p_new, s_new))))
    grads_kept = all(torch.equal(grads[k], v) for k, v in saved.items() if v is not None)
    frozen_same = p_new["1.bias"] is frozen
    # the tree passed in is donated: its leaves refuse to be read (they are p_new's now), its metadata reads
    refused = []
    for read in (lambda: params["0.weight"], lambda: list(params.values()), lambda: tensors(params),
                 lambda: params.replace({})):  # fmt: skip
        try:
            read()
            refused.append(False)
        except fsdpfn.layout.DonatedError as e:
            refused.append(f"donated to fsdpfn.optim.{kind}.update" in str(e) and "inplace=False" in str(e))
    metadata = params.plan is p_new.plan and "donated" in repr(params)
    return (untouched, no_shared, same_storage, same_objects, equal, grads_kept, frozen_same, p_new is not params,
            all(refused), metadata)  # fmt: skip


@pytest.mark.parametrize(
    "kind, hp",
    [
        ("adamw", dict(lr=0.1, amsgrad=True)),
        ("adamw", dict(lr=Decay(0.1, 0.9), weight_decay=0.0, maximize=True)),
        ("sgd", dict(lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.1)),
        ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True)),
        ("sgd", dict(lr=0.1)),
    ],
)
def test_update_is_in_place_and_inplace_false_copies(kind, hp):
    for result in spmd(2, _inplace_worker, kind, hp):
        assert all(result), result


# ---- bad input -----------------------------------------------------------------------------------
def _bad_update(case: str):
    """Run a bad call; return the exception (caught here, so the spmd pool survives)."""
    try:
        _bad_call(case)
    except Exception as e:  # noqa: BLE001 - returned to the test, which checks type and message
        return type(e), str(e)
    return None, "no error"


def _bad_call(case: str):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    model[1].bias.requires_grad_(False)
    params = fsdpfn.shard(model, _mesh())
    other = fsdpfn.shard(torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Linear(2, 2)), _mesh())
    opt = optim.adamw(lr=0.1) if not case.startswith("sgd") else optim.sgd(0.1, momentum=0.9)
    state = opt.init(params)
    trainable = params.plan.requires_grad
    grads = fsdpfn.Sharded({k: torch.zeros_like(v) if trainable[k] else None for k, v in params.items()}, params.plan)
    if case == "other_plan":
        opt.update(fsdpfn.Sharded({k: torch.zeros_like(v) for k, v in other.items()}, other.plan), state, params)
    elif case == "wrong_shape":
        opt.update(grads.replace({"0.weight": torch.zeros(7)}), state, params)
    elif case in ("state_other_plan", "sgd_state_other_plan"):
        opt.update(grads, opt.init(other), params)
    elif case == "frozen_grad":
        opt.update(grads.replace({"1.bias": torch.zeros_like(params["1.bias"])}), state, params)
    elif case == "not_sharded":
        opt.update(dict(grads.items()), state, params)
    elif case == "state_type":
        optim.sgd(0.1).update(grads, state, params)
    elif case == "bad_lr":
        optim.adamw(lr=-1.0)
    elif case == "nesterov":
        optim.sgd(0.1, nesterov=True)
    elif case == "clip_not_sharded":
        optim.clip_grad_norm(dict(grads.items()), 1.0)
    elif case == "clip_wrong_shape":
        optim.clip_grad_norm(grads.replace({"0.bias": torch.zeros(9)}), 1.0)
    elif case == "clip_norm_type":
        optim.clip_grad_norm(grads, 1.0, norm_type=0)
    elif case == "mask_type":
        optim.adamw(weight_decay_mask=["0.bias"])
    elif case == "mask_unknown":
        optim.sgd(0.1, weight_decay=0.1, weight_decay_mask={"0.biass": False}).update(grads, optim.sgd(0.1).init(params), params)
    elif case == "mask_result":
        optim.adamw(weight_decay_mask=lambda fqn, shape: len(shape)).update(grads, state, params)


@pytest.mark.parametrize(
    "case, exc, match",
    [
        ("other_plan", ValueError, r"grads were built for another plan.*leaf '0.weight'"),
        ("wrong_shape", ValueError, r"grads leaf '0.weight' has shape \(7,\)"),
        ("state_other_plan", ValueError, r"state.step was built for another plan.*leaf '0.weight'"),
        ("sgd_state_other_plan", ValueError, r"state.step was built for another plan.*leaf '0.weight'"),
        ("frozen_grad", ValueError, r"grads leaf '1.bias' is a Tensor but parameter '1.bias' is frozen"),
        ("not_sharded", TypeError, "grads must be a fsdpfn.Sharded"),
        ("state_type", TypeError, "state must be the SGDState"),
        ("bad_lr", ValueError, "invalid lr=-1.0"),
        ("nesterov", ValueError, "nesterov=True requires momentum > 0"),
        ("clip_not_sharded", TypeError, "grads must be a fsdpfn.Sharded"),
        ("clip_wrong_shape", ValueError, r"grads leaf '0.bias' has shape \(9,\)"),
        ("clip_norm_type", ValueError, "norm_type=0 must be a positive number"),
        ("mask_type", TypeError, r"weight_decay_mask must be None, a function \(fqn, shape\) -> bool or a mapping fqn -> bool, got list"),
        ("mask_unknown", ValueError, r"weight_decay_mask names '0.biass', which is not a parameter of this tree"),
        ("mask_result", TypeError, r"weight_decay_mask\('0.weight', shape\) must return True or False, got 2"),
    ],
)
def test_bad_input_to_optim_names_the_leaf(case, exc, match):
    for got, message in spmd(2, _bad_update, case):
        assert got is not None and issubclass(got, exc), (got, message)
        assert re.search(match, message), message


def _state_tree_worker():
    import optree

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model[1].requires_grad_(False)
    params = fsdpfn.shard(model, _mesh())
    state = optim.adamw(amsgrad=False).init(params)
    leaves = optree.tree_leaves(state, namespace="torch")  # optree skips None
    doubled = optree.tree_map(lambda t: t * 2, state, namespace="torch")
    torch_leaves = torch.utils._pytree.tree_leaves(state)  # torch's pytree keeps None as a leaf
    restored = torch.utils._pytree.tree_unflatten(torch_leaves, torch.utils._pytree.tree_structure(state))
    return (
        # the count is an int (no tensor bytes beyond torch.optim.AdamW's own), the rest tensors
        isinstance(state.count, int) and all(isinstance(x, torch.Tensor) for x in leaves[1:])
        and len(leaves) == 1 + 3 * 2  # count + step/exp_avg/exp_avg_sq of the 2 trainable params
        and doubled.count == 0
        and type(doubled) is optim.AdamWState
        and doubled.exp_avg.plan is params.plan
        and all(v is None for v in state.max_exp_avg_sq.values())
        and state.exp_avg["1.weight"] is None
        and type(restored) is optim.AdamWState
        and restored.exp_avg["0.weight"] is state.exp_avg["0.weight"]
    )


def test_state_is_a_pytree_of_tensors_and_none():
    """The state flattens to its int count and tensors (None at frozen leaves) and maps back to an AdamWState."""
    assert spmd(1, _state_tree_worker) == [True]


def _step_high_water(widths: list[int], kind: str) -> tuple[int, int, int]:
    """(bytes allocated above what was resident during one update, total shard bytes, largest shard bytes)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=[str(i) for i in range(len(widths) - 1)])
    grads = params.replace({k: torch.randn_like(v) for k, v in params.items()})
    opt = optim.adamw() if kind == "adamw" else optim.sgd(lr=0.1, momentum=0.9, nesterov=True)
    state = opt.init(params)
    params, state = opt.update(grads, state, params)  # SGD's momentum buffers exist from here on
    tracker = MemTracker()
    tracker.track_external(*params.values(), *grads.values(), *(t for t in torch.utils._pytree.tree_leaves(state) if isinstance(t, torch.Tensor)))
    with tracker:
        before = tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"]
        params, state = opt.update(grads, state, params)
    high = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - before
    sizes = [v.numel() * v.element_size() for v in params.values()]
    return high, sum(sizes), max(sizes)


@given(widths=st.lists(st.integers(1, 96), min_size=3, max_size=9), kind=st.sampled_from(["adamw", "sgd"]))
def test_an_update_holds_at_most_one_group_of_temporaries(widths, kind):
    # torch's foreach kernels allocate temporaries as large as their inputs: over every shard at once
    # that is one more copy of all of them, at the step's peak; in groups, at most one group's worth.
    # AdamW on CPU runs the fused kernel, which allocates none.
    for high, total, largest in spmd(2, _step_high_water, widths, kind):
        bound = 0 if kind == "adamw" else max(total / optim._common.FOREACH_PARTS, largest)
        assert high <= bound + 4096, (high, total, largest)  # + the step counters and list overheads

