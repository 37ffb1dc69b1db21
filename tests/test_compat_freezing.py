"""Freezing and unfreezing parameters after ``fully_shard`` (``p.requires_grad_(...)`` between steps).

Fine-tuning recipes change which parameters train as they go: a backbone frozen for the first steps and
trained after, layers frozen progressively, one weight of a unit frozen while its neighbours train. The
compat root plans each unit's buckets with the parameters' ``requires_grad`` (a frozen parameter is
gathered but never reduced); a plan made while a parameter was frozen once dropped its gradient after it
was unfrozen, silently. Every step must train exactly the parameters that require a gradient then, as one
process does on the whole batch.
"""

import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from fsdpfn.testing import spmd

STEPS = 3
# Adam divides by sqrt(v) + eps: a gradient element near its default 1e-8 (world 3, seed 137) turns
# float-rounding differences of the reduction into 3e-5 of the update; a larger eps keeps it well-posed
EPS = 1e-3


class _Net(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList([nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 6)])
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


# head.bias always trains, so every step's loss has a gradient
NAMES = [f"blocks.{i}.{w}" for i in range(3) for w in ("weight", "bias")] + ["head.weight"]


def _batch(rank: int, step: int, seed: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(seed + 101 * rank + 7 * step))


def _set_frozen(model: nn.Module, frozen: list[str]) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)


def _reference(world: int, seed: int, schedule: list[list[str]]) -> dict[str, torch.Tensor]:
    model = _Net(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, eps=EPS)
    for step, frozen in enumerate(schedule):
        _set_frozen(model, frozen)
        sum(model(_batch(r, step, seed)).pow(2).mean() for r in range(world)).div(world).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(seed: int, schedule: list[list[str]], reshard: bool, fuse: int | None):
    """Freeze ``schedule[0]`` before ``fully_shard``, then each step's set before its forward. Returns the
    full values and, per step, the names that had a gradient after backward."""
    from fsdpfn.compat import fully_shard

    model = _Net(seed)
    _set_frozen(model, schedule[0])
    for b in model.blocks:
        fully_shard(b, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    model.set_min_bucket_bytes(fuse)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, eps=EPS)
    with_grad = []
    for step, frozen in enumerate(schedule):
        _set_frozen(model, frozen)
        model(_batch(dist.get_rank(), step, seed)).pow(2).mean().backward()
        with_grad.append(sorted(n for n, p in model.named_parameters() if p.grad is not None))
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor().clone() for n, p in model.named_parameters()}, with_grad


@settings(max_examples=10, deadline=None)
@given(
    world=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    schedule=st.lists(st.lists(st.sampled_from(NAMES), unique=True), min_size=STEPS, max_size=STEPS),
    reshard=st.booleans(),
    fuse=st.sampled_from([None, 1 << 20]),
)
@example(world=2, seed=0, schedule=[NAMES[:2], [], []], reshard=True, fuse=None)  # a block unfrozen after step 0
@example(world=2, seed=1, schedule=[[], [NAMES[2]], [NAMES[2], NAMES[3]]], reshard=False, fuse=1 << 20)
def test_each_step_trains_exactly_the_parameters_that_require_a_gradient(world, seed, schedule, reshard, fuse):
    want = _reference(world, seed, schedule)
    for rank, (got, with_grad) in enumerate(spmd(world, _train, seed, schedule, reshard, fuse)):
        for step, frozen in enumerate(schedule):
            trainable = sorted(n for n in want if n not in frozen)
            assert with_grad[step] == trainable, (rank, step, with_grad[step], trainable)
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")


def _adversarial_reference(world: int, seed: int, micro: int) -> dict[str, torch.Tensor]:
    """Adversarial training with gradient accumulation, on one process: for each microbatch, the input
    gradient of the loss with every parameter frozen (FGSM), then the loss on the perturbed input."""
    model = _Net(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(2):
        for rank in range(world):
            for k in range(micro):
                x = _batch(rank, 10 * step + k, seed).requires_grad_()
                _set_frozen(model, NAMES + ["head.bias"])
                (xg,) = torch.autograd.grad(model(x).pow(2).mean(), x)
                _set_frozen(model, [])
                (model(x.detach() + 0.1 * xg.sign()).pow(2).mean() / (world * micro)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _adversarial(seed: int, micro: int, reshard: bool):
    from fsdpfn.compat import fully_shard

    model = _Net(seed)
    for b in model.blocks:
        fully_shard(b, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(2):
        for k in range(micro):
            x = _batch(dist.get_rank(), 10 * step + k, seed).requires_grad_()
            model.set_requires_gradient_sync(False)
            _set_frozen(model, NAMES + ["head.bias"])  # frozen while earlier microbatches' gradients wait
            (xg,) = torch.autograd.grad(model(x).pow(2).mean(), x)
            _set_frozen(model, [])
            model.set_requires_gradient_sync(k == micro - 1)
            (model(x.detach() + 0.1 * xg.sign()).pow(2).mean() / micro).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor().clone() for n, p in model.named_parameters()}


@settings(max_examples=6, deadline=None)
@given(world=st.integers(1, 3), seed=st.integers(0, 2**16), micro=st.integers(1, 3), reshard=st.booleans())
@example(world=2, seed=0, micro=2, reshard=True)
def test_gradients_accumulated_without_sync_survive_a_freeze_in_between(world, seed, micro, reshard):
    """A model frozen between microbatches (an input-gradient pass, a GAN's generator step) keeps the
    gradients its earlier microbatches accumulated without sync: they are reduced with the last one (a
    reduction that ran while a parameter was frozen once dropped its pending gradient)."""
    want = _adversarial_reference(world, seed, micro)
    for rank, got in enumerate(spmd(world, _adversarial, seed, micro, reshard)):
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")
