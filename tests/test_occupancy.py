"""One module, one thread at a time (``fsdpfn.transform.occupancy``): ``apply`` swaps gathered values into
the module's own slots for a call, so a second thread starting a call on a module while another thread's
call is open is refused by name, before it touches the module or issues a collective; calls one after
another from different threads, and different modules in different threads, run as in one thread."""

import threading

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
from fsdpfn.testing import spmd


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).detach()


def _hold_inside(unit: nn.Module, thread_name: str):
    """A forward hook that parks thread ``thread_name`` inside ``unit``'s forward until released."""
    inside, go = threading.Event(), threading.Event()

    def hook(_m, _a, _o):
        if threading.current_thread().name == thread_name:
            inside.set()
            assert go.wait(60), "the test never released the parked thread"

    return unit.register_forward_hook(hook), inside, go


def _concurrent_worker(seed: int, two_trees: bool):
    """Thread 'first' is parked inside unit '2' while the main thread calls apply on the same module: the
    main thread's call is refused, 'first' finishes with the right numbers, and the module serves calls
    afterwards. ``two_trees``: the second call is on another parameter tree (a second model's), through the
    same ``apply`` (a serving pool), where nothing else would notice."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model, other = _model(seed), _model(seed + 1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed + rank))
    want, want_other = _reference(model, x), _reference(other, x)
    mesh = fsdpfn.init_mesh()
    params = fsdpfn.shard(model, mesh, units=["0", "2", "4"], donate=False)
    params_other = fsdpfn.shard(other, mesh, units=["0", "2", "4"], donate=False) if two_trees else params
    apply = fsdpfn.fsdp(model)
    hook, inside, go = _hold_inside(model[2], "first")
    got: dict[str, torch.Tensor] = {}
    first = threading.Thread(target=lambda: got.setdefault("first", apply(params, x).detach()), name="first")
    first.start()
    try:
        assert inside.wait(60)
        try:
            apply(params_other, x)
        except RuntimeError as exc:
            refused = str(exc)
        else:
            refused = ""
    finally:
        go.set()
        first.join(60)
        hook.remove()
    after = apply(params_other, x).detach()
    return refused, torch.equal(got["first"], want), torch.equal(after, want_other if two_trees else want)


@settings(max_examples=6, deadline=None)
@given(world=st.integers(1, 3), seed=st.integers(0, 2**16), two_trees=st.booleans())
def test_a_second_thread_is_refused_while_a_call_is_open(world, seed, two_trees):
    for refused, first_right, after_right in spmd(world, _concurrent_worker, seed, two_trees):
        assert "is in an apply call in another thread ('first')" in refused
        assert "give each thread its own module (copy.deepcopy(model)" in refused
        assert first_right, "the parked thread's call must finish with its own weights"
        assert after_right, "the refusal must leave the module usable"


def _sequential_worker(seed: int, threads: int):
    """``threads`` threads take turns: each runs a training step (value_and_grad) on the shared module;
    the losses and gradients equal those of the same steps in the main thread."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = _model(seed)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0", "2"], donate=False)
    apply = fsdpfn.fsdp(model)
    batches = [torch.randn(4, 6, generator=torch.Generator().manual_seed(seed + 10 * i + rank)) for i in range(threads)]
    step = fsdpfn.value_and_grad(lambda p, x: F.mse_loss(apply(p, x), torch.zeros(4, 3)))
    in_main = [step(params, x) for x in batches]
    in_threads: list = [None] * threads
    for i, x in enumerate(batches):  # one after another, each in a thread of its own
        t = threading.Thread(target=lambda i=i, x=x: in_threads.__setitem__(i, step(params, x)), name=f"t{i}")
        t.start()
        t.join(60)
    same = all(
        torch.equal(a[0], b[0]) and all(torch.equal(a[1][k], b[1][k]) for k in a[1].params())
        for a, b in zip(in_main, in_threads)
    )
    return same


@settings(max_examples=4, deadline=None)
@given(world=st.integers(1, 3), seed=st.integers(0, 2**16), threads=st.integers(1, 3))
def test_calls_one_after_another_from_threads_equal_the_main_threads(world, seed, threads):
    assert all(spmd(world, _sequential_worker, seed, threads))


def test_a_call_that_raised_in_a_thread_frees_the_module():
    model = _model(0)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0", "2"], donate=False)
    apply = fsdpfn.fsdp(model)
    x = torch.randn(4, 6)
    errors: list[BaseException] = []

    def bad():
        try:
            apply(params, torch.randn(4, 5))  # wrong width: the forward raises inside unit '0'
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=bad)
    t.start()
    t.join(60)
    assert errors and "in another thread" not in str(errors[0])
    assert torch.equal(apply(params, x), _reference(model, x))


def test_different_modules_in_concurrent_threads_are_independent():
    """Rank-threads the right way: each its own module, calls overlapping in time."""
    models = [_model(s) for s in (1, 2)]
    applies, trees = [], []
    for m in models:
        trees.append(fsdpfn.shard(m, fsdpfn.init_mesh(), units=["0", "2"], donate=False))
        applies.append(fsdpfn.fsdp(m))
    x = torch.randn(4, 6)
    hook, inside, go = _hold_inside(models[0][2], "a")
    got: dict[str, torch.Tensor] = {}
    a = threading.Thread(target=lambda: got.setdefault("a", applies[0](trees[0], x).detach()), name="a")
    a.start()
    try:
        assert inside.wait(60)
        got["b"] = applies[1](trees[1], x).detach()  # another module: not refused
    finally:
        go.set()
        a.join(60)
        hook.remove()
    assert torch.equal(got["a"], _reference(models[0], x)) and torch.equal(got["b"], _reference(models[1], x))


def test_interleaved_calls_on_two_trees_never_compute_with_the_other_trees_weights():
    """Thread 'a' parks inside unit '2' on tree A, thread 'b' then starts a call on tree B through the same
    ``apply`` and parks inside unit '0', 'a' finishes first. Before the occupancy check 'a''s unit '4' took
    'b''s gathered weights (the innermost open call's) and 'a''s output was silently wrong; now 'b' is
    refused and 'a' is right."""
    model, other = _model(3), _model(4)
    x = torch.randn(4, 6)
    want = _reference(model, x)
    mesh = fsdpfn.init_mesh()
    tree_a = fsdpfn.shard(model, mesh, units=["0", "2", "4"], donate=False)
    tree_b = fsdpfn.shard(other, mesh, units=["0", "2", "4"], donate=False)
    apply = fsdpfn.fsdp(model)
    hook_a, a_in, a_go = _hold_inside(model[2], "a")
    hook_b, b_in, b_go = _hold_inside(model[0], "b")
    got: dict[str, object] = {}

    def run(name, tree):
        try:
            got[name] = apply(tree, x).detach()
        except RuntimeError as exc:
            got[name] = exc

    a = threading.Thread(target=run, args=("a", tree_a), name="a")
    b = threading.Thread(target=run, args=("b", tree_b), name="b")
    try:
        a.start()
        assert a_in.wait(60)
        b.start()
        b_in.wait(2)  # never set once 'b' is refused at the start of its call
        a_go.set()
        a.join(60)
    finally:
        a_go.set()
        b_go.set()
        a.join(60)
        b.join(60)
        hook_a.remove()
        hook_b.remove()
    assert isinstance(got["a"], torch.Tensor) and torch.equal(got["a"], want)
    assert isinstance(got["b"], RuntimeError) and "in another thread ('a')" in str(got["b"])


def test_a_thread_that_ended_with_a_call_open_does_not_hold_the_module():
    """A compiled forward that raises leaves its call open until the next call of its ``apply``; if its
    thread is gone by then, another thread's call is not refused on its account."""
    from fsdpfn.transform.occupancy import enter_module, leave_module

    model = _model(5)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0", "2"], donate=False)
    apply = fsdpfn.fsdp(model)
    t = threading.Thread(target=lambda: enter_module(model))  # enters and never leaves, as a stale call does
    t.start()
    t.join(60)
    x = torch.randn(4, 6)
    assert torch.equal(apply(params, x), _reference(model, x))
    me = enter_module(model)  # the dead thread's entry is gone for good
    leave_module(model, me)
