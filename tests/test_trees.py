"""``fsdpfn.trees``: a unit's inputs and outputs with dataclasses torch's pytree does not know.

A unit returning a plain ``@dataclass`` was one opaque leaf: under ``torch.func.grad`` the tensors inside
were constants to the unit's autograd function (gradients 1.0 off one process, silently), and
mixed-precision casts skipped them (FSDP2 casts them)."""

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn import trees
from fsdpfn.testing import spmd


@dataclasses.dataclass
class Pair:
    h: torch.Tensor
    aux: object
    n: int = 0


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: object
    tag: str = "t"
    cached: int = dataclasses.field(default=7, init=False)


def _values():
    tensors = st.builds(lambda n: torch.arange(float(n)), st.integers(0, 3))
    scalars = st.one_of(st.integers(-3, 3), st.none(), st.text(max_size=2))
    return st.recursive(
        st.one_of(tensors, scalars),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.tuples(inner, inner),
            st.dictionaries(st.sampled_from("abc"), inner, max_size=3),
            st.builds(Pair, inner, inner, st.integers(0, 2)),
            st.builds(Frozen, inner),
        ),
        max_leaves=8,
    )


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=60, deadline=None)
@given(value=_values())
def test_flatten_reaches_every_tensor_and_unflatten_rebuilds_the_value(value):
    leaves, spec = trees.flatten(value)
    assert _same(trees.unflatten(leaves, spec), value)
    doubled = trees.map_leaves(lambda v: v * 2 if isinstance(v, torch.Tensor) else v, value)
    got = [v for v in trees.leaves(doubled) if isinstance(v, torch.Tensor)]
    want = [v * 2 for v in leaves if isinstance(v, torch.Tensor)]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin, self.gate = nn.Linear(width, width), nn.Linear(width, 1)

    def forward(self, x):
        x = x.h if isinstance(x, Pair) else x
        return Pair(torch.tanh(self.lin(x)), self.gate(x), 1)


class _Net(nn.Module):
    def __init__(self, width: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.b1, self.b2, self.head = _Block(width), _Block(width), nn.Linear(width, 2)

    def forward(self, x):
        o1 = self.b1(x)
        o2 = self.b2(o1)
        return self.head(o2.h).pow(2).mean() + o1.aux.mean() + o2.aux.pow(2).mean()


def _batch(width: int, rank: int) -> torch.Tensor:
    return torch.randn(3, width, generator=torch.Generator().manual_seed(rank))


def _func_grad(width, seed, reshard):
    import torch.distributed as dist

    model = _Net(width, seed)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["b1", "b2"])
    apply = fsdpfn.fsdp(model, reshard_after_forward=reshard)
    grads = torch.func.grad(lambda p: apply(p, _batch(width, dist.get_rank())))(params)
    return fsdpfn.full_state_dict(grads, rank0_only=False)


@settings(max_examples=6, deadline=None)
@given(world=st.integers(1, 3), width=st.integers(1, 5), seed=st.integers(0, 2**16), reshard=st.booleans())
def test_torch_func_grad_through_units_that_return_a_dataclass_equals_one_process(world, width, seed, reshard):
    model = _Net(width, seed)
    (sum(model(_batch(width, r)) for r in range(world)) / world).backward()
    for rank, got in enumerate(spmd(world, _func_grad, width, seed, reshard)):
        for name, p in model.named_parameters():
            msg = f"rank {rank} {name}"
            torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{msg}: {m}")


def _input_dtypes(impl):
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    seen = []

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            seen.append((x.h.dtype, x.aux.dtype))
            return self.lin(x.h) + x.aux

    model = nn.Sequential(Inner())
    x = Pair(torch.randn(2, 4), torch.randn(2, 4))
    if impl == "functional":
        policy = fsdpfn.MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0"], mp_policy=policy)
        out = fsdpfn.fsdp(model)(params, x)
    else:
        if impl == "torch":
            from torch.distributed.fsdp import fully_shard

            policy = TorchPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        else:
            from fsdpfn.compat import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        fully_shard(model[0], mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        out = model(x)
    return seen, out.dtype


def test_mixed_precision_casts_reach_a_dataclass_input_as_fsdp2s_do():
    torch_seen, torch_out = spmd(1, _input_dtypes, "torch")[0]
    assert torch_seen == [(torch.bfloat16, torch.bfloat16)]  # the behaviour matched
    for impl in ("compat", "functional"):
        seen, out = spmd(1, _input_dtypes, impl)[0]
        assert (seen, out) == (torch_seen, torch_out), impl
