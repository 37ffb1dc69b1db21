"""Fuzzing: random malformed inputs (specs, unit plans, corrupted trees, bogus gradients) each end in a
documented error (docs/errors.md) or in a correct result — never a hang, a crash or a wrong number."""

import re

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn.testing import spmd
from fsdpfn.testing import strategies as fst
from test_errors import TRIGGERS

DOCUMENTED = [(exc, pattern) for _, exc, pattern in TRIGGERS.values()] + [
    (TypeError, r"ShardSpec: (shape must be a sequence of ints|dim must be an int)"),
    (ValueError, r"ShardSpec: (dim=-?\d+ is out of range for shape|world must be an int >= 1|shape .* has a negative size)"),
    (ValueError, r"parameter '[^']+' is frozen \(requires_grad=False\) and takes no gradient"),
    (ValueError, r"leaf '[^']+' is \(.*\) torch\.\w+ but rank \d of this plan holds"),
    (TypeError, r"leaf '[^']+' is \w+, expected this rank's shard"),
    (ValueError, r"gradient of '[^']+' has shape \(.*\), expected"),
    (KeyError, r"is not a parameter of this plan"),
    (ValueError, r"divide_by=-?[\d.]+ must be a positive number"),
    (ValueError, r"op='\w+' is not a reduction"),
    (ValueError, r"units: \w+ has no submodule"),
    (ValueError, r"units: '[\w.]+' is a tensor of \w+, not a submodule"),
    (ValueError, r"units: '[\w.]+' is named twice"),
    (TypeError, r"units: .* is not a submodule name"),
]


def _documented(exc_type, message):
    return any(issubclass(exc_type, exc) and re.search(p, message) for exc, p in DOCUMENTED)


EXAMPLES = settings(max_examples=200)


@EXAMPLES
@given(
    shape=st.one_of(st.lists(st.integers(-3, 6), max_size=4).map(tuple), st.just("abc"), st.just(None)),
    world=st.one_of(st.integers(-2, 20), st.just(2.5), st.just(True), st.just("2")),
    dim=st.one_of(st.integers(-6, 6), st.just(1.0), st.just(None)),
)
def test_fuzzed_specs_are_valid_or_rejected_with_documented_errors(shape, world, dim):
    try:
        spec = fsdpfn.ShardSpec(shape, world, dim)
    except (ValueError, TypeError) as e:
        assert _documented(type(e), str(e)), (shape, world, dim, e)
        return
    covered = sum(spec.local_rows(r) for r in range(spec.world))
    assert covered == spec.rows and 0 <= spec.dim < max(len(spec.shape), 1)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 4)
        self.b = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.frozen = nn.Linear(4, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.b(self.a(x)))


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the parent checks it is a documented error
        return (type(e), str(e))


def _fuzz_units(units):
    return _outcome(lambda: [u.name for u in fsdpfn.shard(_Net(), fsdpfn.init_mesh(), units=units).plan.units])


@EXAMPLES
@given(
    units=st.one_of(
        st.lists(st.sampled_from(["a", "b", "b.0", "frozen", "c", "b.9", "", "A", "b.", "frozen.weight"]), max_size=4),
        st.sampled_from([nn.Linear, (nn.Linear, nn.Tanh), nn.Conv2d]),
        st.sampled_from([3, 2.5, b"a", object()]),
        st.lists(st.one_of(st.integers(), st.none()), min_size=1, max_size=2),
    )
)
def test_fuzzed_unit_plans_shard_or_fail_with_documented_errors(units):
    if not isinstance(units, (list, tuple, type, str)) and not callable(units):
        units = str(units) if isinstance(units, bytes) else units
    try:
        (result,) = spmd(1, _fuzz_units, units)
    except Exception as e:  # an argument that does not even pickle is the caller's problem, not ours
        assert "pickle" in str(e).lower(), e
        return
    kind, value = result
    if kind == "ok":
        assert value[0] == "" or value[0] in ("a", "b", "b.0", "frozen")
    else:
        assert _documented(kind, value), value


def _fuzz_tree(leaf, corruption, dtype, shape):
    model = _Net()
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["b", "frozen"])
    apply = fsdpfn.fsdp(model)
    good = params[leaf]
    if corruption == "shape":
        bad = torch.zeros(shape, dtype=good.dtype)
    elif corruption == "dtype":
        bad = good.to(dtype)
    elif corruption == "none":
        bad = None
    elif corruption == "number":
        bad = 3
    else:
        bad = good.clone()
    tree = params.replace({leaf: bad})
    x = torch.ones(2, 3)

    def run():
        loss, grads = fsdpfn.value_and_grad(lambda p: apply(p, x).sum())(tree)
        ref_loss, _ = fsdpfn.value_and_grad(lambda p: apply(p, x).sum())(params)
        return bool(torch.equal(loss, ref_loss))  # a harmless "corruption" must give the right answer

    return _outcome(run)


@EXAMPLES
@given(
    leaf=st.sampled_from(["a.weight", "a.bias", "b.0.weight", "frozen.weight", "frozen.bias"]),
    corruption=st.sampled_from(["shape", "dtype", "none", "number", "clone"]),
    dtype=fst.dtypes(),
    shape=fst.shapes(max_dims=3, max_side=5),
)
def test_fuzzed_trees_end_in_documented_errors(leaf, corruption, dtype, shape):
    for kind, value in spmd(2, _fuzz_tree, leaf, corruption, dtype, shape):
        if kind != "ok":
            assert _documented(kind, value), value
        elif corruption in ("clone", "dtype"):
            assert value is True  # an unchanged leaf (or a same-dtype cast) gives the very same loss
        else:
            assert corruption == "shape"  # zeros of the right local shape: valid input, other values


def _fuzz_grads(entries, op):
    model = _Net()
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["b"])
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    grads = {}
    for name, mode in entries:
        if mode == "none":
            grads[name] = None
        elif mode == "wrong":
            grads[name] = torch.ones(7)
        else:
            grads[name] = torch.ones(shapes.get(name, (1,)))
    kw = {"divide_by": op} if isinstance(op, (int, float)) and not isinstance(op, bool) else {"op": op}

    def run():
        out = fsdpfn.reduce(grads, params, **kw)
        return {k: out[k] for k in params.plan.params}

    return _outcome(run)


@EXAMPLES
@given(
    entries=st.lists(
        st.tuples(
            st.sampled_from(["a.weight", "a.bias", "b.0.weight", "frozen.weight", "nope", "b.0"]),
            st.sampled_from(["ok", "none", "wrong"]),
        ),
        max_size=4,
    ),
    op=st.sampled_from(["avg", "sum", "mean", 2, 0, -1.5]),
)
def test_fuzzed_gradients_end_in_documented_errors(entries, op):
    for kind, value in spmd(2, _fuzz_grads, entries, op):
        if kind != "ok":
            assert _documented(kind, value), value
            continue
        # a valid call: the reduction of all-ones gradients is (sum over 2 ranks) * scale, or zero
        scale = {"avg": 0.5, "sum": 1.0}.get(op, 1.0 / op if isinstance(op, (int, float)) else None)
        given_names = {n for n, m in dict(entries).items() if m == "ok"}  # a repeated name: the last wins
        for name, g in value.items():
            if name.startswith("frozen"):
                assert g is None
            elif name in given_names:
                assert torch.all(g == 2 * scale)
            else:
                assert torch.all(g == 0)
