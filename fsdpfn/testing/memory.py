"""Measuring a step's peak memory on CPU with torch's ``MemTracker``, under ``fsdpfn.fsdp`` too (used by the tests of
``fsdpfn.memory`` and of the step bound, and by the bench)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

__all__ = ["StepPeak", "measured_fsdp2_step_peak", "measured_step_peak", "memory_tracker", "saved_bytes", "settled_live_bytes"]


class StepPeak(NamedTuple):
    """``measured_step_peak``'s result: the peak bytes, the plan's collective groups (labels, in order),
    the fusion size ``shard`` chose (``plan.bucket_bytes``) and the units the first call kept gathered from
    their forward to their backward (``kept``, sorted)."""

    peak: int
    groups: tuple[str, ...]
    bucket_bytes: int | None
    kept: tuple[str, ...] = ()


def memory_tracker(*, module_peaks: bool = False) -> Any:
    """A ``torch.distributed._tools.mem_tracker.MemTracker`` that installs no gradient hooks on parameters
    and, unless ``module_peaks``, keeps only the whole run's peak (``get_tracker_snapshot("peak")``).

    ``MemTracker``'s module pre-forward hook registers a post-accumulate-grad hook on every parameter it
    finds in the module; under ``fsdpfn.fsdp`` those are the gathered (non-leaf) tensors swapped in for the
    call, and the registration raises. The hooks only label gradients as ``Grad`` instead of ``Temp``; the
    totals, and so the peak, do not depend on them. Each module's own peaks cost a pass over every module
    tracked so far at every op (a quarter of a small model's tracked step, cProfile): without
    ``module_peaks`` they stay unset, and the whole run's peak is the same.

    Example:
        >>> tracker = memory_tracker()
        >>> tracker.track_external(*params.values())                     # doctest: +SKIP
        >>> with tracker: step(params)                                    # doctest: +SKIP
        >>> tracker.get_tracker_snapshot("peak")                          # doctest: +SKIP
    """
    from torch.distributed._tools import mem_tracker

    MemTracker = mem_tracker.MemTracker
    _TOTAL = getattr(mem_tracker, "_TOTAL_KEY", "Total")

    class _NoGradHookTracker(MemTracker):
        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> tuple[int, int]:
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

        def _update_peak_stats(self, peak_state: Any) -> None:
            current, peak, peak_snap = (getattr(self, a, None) for a in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap"))
            if module_peaks or current is None or peak is None or peak_snap is None:
                return super()._update_peak_stats(peak_state)  # (or a torch whose tracker keeps them otherwise)
            for dev, dev_snap in current.items():
                if peak.get(dev, 0) < dev_snap[_TOTAL]:
                    peak[dev] = dev_snap[_TOTAL]
                    peak_snap[dev] = dict(dev_snap)  # (the counts per kind of memory: ints)

    return _NoGradHookTracker()


def settled_live_bytes(stats: Any) -> int:
    """``stats.live_gathered_bytes`` (a ``CommStats``) once it holds still for 2 ms: gloo's worker thread
    drops its hold on a finished collective's buffer (already copied out) only when it gets the GIL, a
    moment after the wait returned; what fsdpfn itself holds never goes by waiting.

    Example:
        >>> settled_live_bytes(params.plan.comm.stats)   # doctest: +SKIP
        0
    """
    import time

    for _ in range(50):
        before = stats.live_gathered_bytes
        time.sleep(0.002)
        if stats.live_gathered_bytes == before:
            break
    return int(stats.live_gathered_bytes)


def saved_bytes(model: Any, *args: Any) -> int:
    """Bytes of the distinct non-parameter tensors ``model(*args)``'s forward saves for backward
    (a real forward and backward of ``output.square().mean()`` on ``model`` as it is).

    Example:
        >>> import torch
        >>> saved_bytes(torch.nn.Linear(4, 8), torch.zeros(2, 4))   # the input (weight gradient) and output (square)
        96
    """
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: Any) -> Any:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t.detach()  # not t: a saved output would hold its own node (torch's saved_tensors_hooks warns)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args).square().mean().backward()
    return sum(seen.values())


def measured_step_peak(
    model: Any,
    x: Any,
    *,
    units: Any = None,
    min_bucket_bytes: Any = None,
    prefetch: int = 1,
    reshard_after_forward: bool | Callable[[str], bool] = True,
    lr: float = 1e-3,
    repeats: int = 2,
    mp_policy: Any = None,
) -> StepPeak:
    """The peak bytes one rank holds over a warm training step of ``model`` on its batch ``x`` (forward,
    backward of ``output.square().mean()``, ``fsdpfn.optim.adamw`` update), measured by ``MemTracker``
    with the shards, the optimizer state and ``x`` counted as resident. Call it on every rank (``spmd``);
    ``model`` is sharded here (its parameters are donated). The smallest peak of ``repeats`` steps is
    reported: gloo's thread lets go of finished work (and of the gradients a direct exchange sent from)
    at times that vary from run to run, and a late one only ever adds to a step's peak (the core frees
    the buffers of its own at the wait: ``Handle``). Also returns the collective groups, the fusion size
    ``shard`` chose and the units the first call kept gathered, so a prediction can be made for the same plan.

    Example:
        >>> spmd(2, _step, recipe)      # a module-level fn that builds the model and calls this  # doctest: +SKIP
    """
    import torch

    import fsdpfn
    import fsdpfn.optim as optim
    from fsdpfn.layout.plan import KEPT_GATHERED_MEMO

    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units, min_bucket_bytes=min_bucket_bytes, mp_policy=mp_policy)
    apply = fsdpfn.fsdp(model, prefetch=prefetch, reshard_after_forward=reshard_after_forward)
    opt = optim.adamw(lr=lr)
    state = opt.init(params)
    loss_fn = fsdpfn.value_and_grad(lambda p: apply(p, x).square().mean())
    _, grads = loss_fn(params)
    params, state = opt.update(grads, state, params)  # warm: moments and counters exist
    del grads
    peaks = []
    for _ in range(max(1, repeats)):
        tracker = memory_tracker()
        leaves = torch.utils._pytree.tree_leaves(state)
        tracker.track_external(*params.values(), *(t for t in leaves if isinstance(t, torch.Tensor)), x)
        with tracker:
            _, grads = loss_fn(params)
            params, state = opt.update(grads, state, params)
            del grads
        peaks.append(max(d.get("Total", 0) for d in tracker.get_tracker_snapshot("peak").values()))
    plan = params.plan
    kept = tuple(sorted(plan.memo.get(KEPT_GATHERED_MEMO, ())))
    return StepPeak(min(peaks), tuple(g.label for g in plan.groups), plan.bucket_bytes, kept)


def measured_fsdp2_step_peak(
    model: Any,
    x: Any,
    *,
    units: Any,
    lr: float = 1e-3,
    repeats: int = 2,
    fully_shard: Callable[..., Any] | None = None,
    unit_options: Mapping[str, Mapping[str, Any]] | None = None,
    first_input: Any = None,
) -> int:
    """The peak bytes one rank holds over a warm training step of ``model`` under torch's own
    ``fully_shard`` (each of ``units``, submodule FQNs, then the root; or the ``fully_shard`` given, e.g.
    ``fsdpfn.compat``'s) with ``torch.optim.AdamW`` as torch builds it by default, on the same loss
    (``output.square().mean()``) and counted as ``measured_step_peak`` counts fsdpfn's (parameters,
    optimizer state and ``x`` resident), so the two compare. ``unit_options[name]``: more keyword arguments
    of that unit's ``fully_shard`` (``{"reshard_after_forward": False}``). ``first_input``: the input of a
    forward before training (a shape check on a smaller batch), if any. Call it on every rank (``spmd``);
    ``model`` is sharded here.

    Example:
        >>> spmd(2, _torch_step, recipe)      # a module-level fn that builds the model and calls this  # doctest: +SKIP
    """
    import warnings

    import torch

    import fsdpfn

    if fully_shard is None:
        from torch.distributed.fsdp import fully_shard
    mesh = fsdpfn.init_mesh()
    for name in units:
        fully_shard(model.get_submodule(name), mesh=mesh, **(unit_options or {}).get(name, {}))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    if first_input is not None:
        model(first_input)
    step()  # warm: moments and counters exist
    peaks = []
    for _ in range(max(1, repeats)):
        tracker = memory_tracker()
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        tracker.track_external(*model.parameters(), *model.buffers(), *state, x)
        with tracker, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
            step()
        peaks.append(max(d.get("Total", 0) for d in tracker.get_tracker_snapshot("peak").values()))
    return min(peaks)
