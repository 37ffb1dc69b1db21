"""What a unit's parameter slot holds outside the unit's forward (``fsdpfn.ops.placeholder``), and the
direct-call checks of a donated module (``fsdpfn.ops.shard``).

torch's CPU matmul takes a ``meta`` tensor beside real ones and returns uninitialised memory: a unit's
weight read by another module's forward trained on gradients of 1e29, and a donated ``Conv2d`` (or
``Linear`` without bias) called outside ``apply`` returned garbage, both silently. Now both raise, by name.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn.ops.placeholder import Placeholder, PlaceholderUsedError
from fsdpfn.testing import spmd

OPS = {
    "matmul": lambda w: torch.ones(2, 4) @ w.t(),
    "linear": lambda w: F.linear(torch.ones(2, 4), w),
    "conv2d": lambda w: F.conv2d(torch.ones(1, 4, 5, 5), w.view(3, 4, 1, 1)),
    "add": lambda w: w + 1.0,
    "clone": lambda w: w.clone(),
    "sum": lambda w: w.sum(),
    "embedding": lambda w: F.embedding(torch.tensor([0, 2]), w),
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_a_placeholder_refuses_every_operation_by_name_and_reads_like_its_parameter(op):
    w = Placeholder((3, 4), torch.bfloat16, "embed.weight", "embed")
    assert (w.shape, w.dtype, w.is_meta, w.dim(), w.numel()) == (torch.Size([3, 4]), torch.bfloat16, True, 2, 12)
    assert torch.ones(2).to(w.dtype).dtype == torch.bfloat16  # metadata reads (x.to(self.weight.dtype)) work
    with pytest.raises(PlaceholderUsedError, match=r"parameter 'embed.weight' of unit 'embed' was used outside that"):
        OPS[op](w)


class _TiedHead(nn.Module):
    """A head that reads the embedding's weight in the root's forward."""

    def __init__(self, width: int, vocab: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.body = nn.Embedding(vocab, width), nn.Sequential(nn.Linear(width, width), nn.Tanh())

    def forward(self, x):
        return self.body(self.embed(x)) @ self.embed.weight.t()


def _tied_head(width, vocab, seed, units, reshard, donate):
    import torch.distributed as dist

    model = _TiedHead(width, vocab, seed)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units, donate=donate)
    apply = fsdpfn.fsdp(model, reshard_after_forward=reshard)
    x = torch.randint(0, vocab, (2, 3), generator=torch.Generator().manual_seed(dist.get_rank()))
    try:
        _, grads = fsdpfn.value_and_grad(lambda p: apply(p, x).pow(2).mean())(params)
    except PlaceholderUsedError as e:
        return "refused", str(e)
    return "ran", fsdpfn.full_state_dict(grads, rank0_only=False)


@settings(max_examples=8, deadline=None)
@given(world=st.integers(1, 3), width=st.integers(2, 6), vocab=st.integers(2, 9), seed=st.integers(0, 2**16),
       embed_a_unit=st.booleans(), reshard=st.booleans(), donate=st.booleans())  # fmt: skip
def test_a_units_weight_read_by_another_module_is_refused_or_equals_one_process(
    world, width, vocab, seed, embed_a_unit, reshard, donate
):
    """With ``embed`` a unit of its own the root's read is refused on every rank; with ``embed`` in the
    root unit (gathered for the whole call) the same model trains as one process does."""
    units = ["embed", "body"] if embed_a_unit else ["body"]
    results = spmd(world, _tied_head, width, vocab, seed, units, reshard, donate)
    if embed_a_unit:
        for rank, (what, msg) in enumerate(results):
            assert what == "refused", f"rank {rank} ran"
            assert "parameter 'embed.weight' of unit 'embed' was used outside that unit's forward" in msg
        return
    model = _TiedHead(width, vocab, seed)
    xs = [torch.randint(0, vocab, (2, 3), generator=torch.Generator().manual_seed(r)) for r in range(world)]
    (sum(model(x).pow(2).mean() for x in xs) / world).backward()
    for rank, (what, grads) in enumerate(results):
        assert what == "ran"
        for name, p in model.named_parameters():
            msg = f"rank {rank} {name}"
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{msg}: {m}")


@pytest.mark.parametrize("child", ["0", "2"])
def test_a_donated_modules_children_called_directly_are_refused_by_name(child):
    """A ``Conv2d`` and a ``Linear`` without bias compute with a ``meta`` weight on the CPU and return
    uninitialised memory; called outside ``apply`` after ``shard`` donated them, they now raise."""

    def run(child):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 3, bias=False))
        params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0"])
        x = torch.randn(2, 3, 8, 8)
        sub = model.get_submodule(child)
        said = rf"{type(sub).__name__} '{child}' of Sequential was called directly \(outside apply\), but its"
        with pytest.raises(RuntimeError, match=said):
            sub(x if child == "0" else torch.randn(2, 144))
        full = fsdpfn.full_state_dict(params, rank0_only=False)
        want = torch.func.functional_call(model, full, (x,))  # values swapped in: still allowed
        torch.testing.assert_close(fsdpfn.fsdp(model)(params, x), want)

    run(child)
