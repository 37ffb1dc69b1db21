"""What a model's forward saves for backward, counted on fake tensors: no real weights, no collective.

The forward runs once under ``torch._subclasses.FakeTensorMode``: parameters and buffers are fake
tensors of their (full, gathered) shapes and compute dtype, so a model built on ``meta`` works and nothing
the size of the model is allocated. ``saved_tensors_hooks`` see every tensor autograd keeps for backward;
the distinct storages among them that are not parameters are the activations a step holds between its
forward and its backward. The backward then runs on the same fake tensors, and what is alive while it
reaches each unit (``fsdpfn.memory.live.LiveBytes``) prices the step's backward moments.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import fsdpfn.trees as trees
from fsdpfn.memory.live import LiveBytes
from fsdpfn.ops.slots import caches_restored

__all__ = ["ForwardCost", "forward_cost"]


class ForwardCost(NamedTuple):
    """One forward on one rank's batch: ``saved`` bytes (distinct non-parameter storages autograd keeps
    for backward), ``output`` bytes (the forward's result), and ``last_unit_before``: for every parameter
    the last unit whose forward had started when it was first used (``None``: before any), which says
    when backward makes its gradient; ``saved_params``: the parameters autograd saves
    (a unit none of whose parameters are saved is not re-gathered in backward); ``saved_before[u]``: the
    bytes saved when unit ``u``'s forward started (backward frees them in reverse); ``output_grad``: the
    most bytes alive at once while backward makes the gradient of the output (the loss's backward and its
    temporaries, measured on the fake tensors when a ``loss_fn`` is given, else one output-sized tensor);
    ``boundary[u]``: the bytes of unit ``u``'s differentiable inputs and outputs (the most over its calls),
    i.e. the gradient its backward receives beside the one it makes for the unit before; ``working[u]``: the
    most bytes the forward had made and still held at once while unit ``u``'s forward ran (saved or not:
    a frozen or ``no_grad`` unit saves nothing, yet its intermediates exist while it runs);
    ``backward_peaks``: the backward, run on the fake tensors too, as ``(unit, bytes)`` in the order it
    reached each unit (the gradient of the unit's output ready): the most bytes of activations and
    gradients alive from then until the backward reached the next unit (saved tensors still to be used,
    the gradients flowing, those waiting for a later unit, as a skip connection's, a recompute's, the
    backward's temporaries), the parameters' gradients made meanwhile counted from where each was made and
    then all taken off (the step's model adds them per group: ``LiveBytes.peaks_between``); empty where
    that backward could not run."""

    saved: int
    output: int
    last_unit_before: dict[str, str | None]
    saved_params: frozenset[str] = frozenset()
    saved_before: dict[str, int] = {}
    output_grad: int = 0
    boundary: dict[str, int] = {}
    working: dict[str, int] = {}
    backward_peaks: tuple[tuple[str, int], ...] = ()


def forward_cost(
    module: nn.Module,
    batch: Any,
    *,
    device: torch.device,
    param_dtype: Callable[[torch.dtype], torch.dtype],
    cast_inputs: torch.dtype | None,
    loss_fn: Callable[[Any], Any] | None = None,
    units: Sequence[str] = (),
) -> ForwardCost:
    """Run ``module`` on ``batch`` under fake tensors and count what autograd saves.

    ``batch`` is a tensor, a tuple of positional arguments, or a dict of keyword arguments (real, fake or
    meta tensors: only shapes and dtypes are read). ``param_dtype`` maps a parameter's dtype to the dtype it
    computes in (mixed precision); ``cast_inputs`` casts floating inputs. ``loss_fn(output)`` runs too, so
    what the loss saves is counted, and so does its backward down to the output (``output_grad``).

    Example:
        >>> forward_cost(nn.Linear(4, 8), torch.zeros(2, 4), device=torch.device("cpu"),
        ...              param_dtype=lambda d: d, cast_inputs=None).saved   # the input, saved for the weight grad
        32
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    args, kwargs = _split(batch)
    # compiled blocks run eagerly here: compiling them for fake inputs would fill (and evict) their caches
    with torch.compiler.set_stance("force_eager"), FakeTensorMode(allow_non_fake_inputs=True) as mode, _RealWhereReal() as real:
        values: dict[str, torch.Tensor] = {}
        params: dict[int, str] = {}
        for fqn, p in module.named_parameters(remove_duplicate=False):
            dtype = param_dtype(p.dtype)
            t = torch.empty(p.shape, dtype=dtype, device=device).requires_grad_(p.requires_grad and _differentiable(dtype))
            values[fqn] = t
            params[t.untyped_storage()._cdata] = fqn
        for fqn, b in module.named_buffers(remove_duplicate=False):
            values[fqn] = torch.empty(b.shape, dtype=b.dtype, device=device)
        fake = lambda x: _fake(mode, x, device, cast_inputs)  # noqa: E731
        seen: dict[int, int] = {}
        args, kwargs = trees.map_leaves(fake, args), trees.map_leaves(fake, kwargs)
        saved_params: set[str] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage._cdata in params:
                saved_params.add(params[storage._cdata])
            else:
                seen[storage._cdata] = storage.nbytes()
            return t.detach()  # not t: a saved output would hold its own node (a cycle: this graph never runs backward)

        watched = {id(t): f for f, t in values.items()}
        started: list[str | None] = [None]
        first_use: dict[str, str | None] = {}
        saved_before: dict[str, int] = {}

        live = LiveBytes({t.untyped_storage()._cdata for t in trees.leaves((values, args, kwargs)) if isinstance(t, torch.Tensor)})

        def start(unit: str) -> None:
            started.append(unit)
            saved_before.setdefault(unit, sum(seen.values()))
            live.enter(unit)

        boundary: dict[str, int] = {}
        starts: list[tuple[str, int]] = []  # (unit, the moment on live's timeline) as the backward reaches each unit

        def finish(unit: str, args: Any, kwargs: Any, out: Any) -> None:
            grads = [t for t in trees.leaves((args, kwargs, out)) if isinstance(t, torch.Tensor) and t.requires_grad]
            boundary[unit] = max(boundary.get(unit, 0), sum(t.untyped_storage().nbytes() for t in grads))
            live.leave(unit)
            for t in trees.leaves(out):  # the gradient of an output ready: the unit's backward starts
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda _grad, _u=unit: live.mark(_u, starts))

        hooks = [module.get_submodule(u).register_forward_pre_hook(lambda *_, _u=u: start(_u)) for u in units if u]
        hooks += [module.get_submodule(u).register_forward_hook(lambda _m, a, k, o, _u=u: finish(_u, a, k, o), with_kwargs=True)
                  for u in units if u]

        class _Uses(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                # reading metadata (w.dtype, w.shape, w.is_meta) is no use; a getter that makes a tensor (w.T) is
                if getattr(func, "__name__", None) == "__get__" and not isinstance(out, torch.Tensor):
                    return out
                for t in pytree.tree_leaves((args, kwargs or {})):
                    f = watched.get(id(t))
                    if f is not None and f not in first_use:
                        first_use[f] = started[-1]
                return out

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _Uses(), live, caches_restored(module), \
                    _without_backward_hooks(module):
                out = functional_call(module, values, tuple(args), kwargs, tie_weights=False)
        finally:
            for h in hooks:
                h.remove()
        outs = [t for t in trees.leaves(out) if isinstance(t, torch.Tensor)]
        output = sum(t.untyped_storage().nbytes() for t in outs)
        output_grad = output
        differentiable = [t for t in outs if t.requires_grad]
        with live:  # the loss and the backward make tensors too
            out_grads: list[torch.Tensor | None] = []
            if loss_fn is not None:
                model_saved = sum(seen.values())
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss_peak, out_grads = _loss_peak(loss_fn, out, differentiable)
                # what the loss's forward and backward hold at most, beyond what the loss saves (counted
                # with the activations): the gradient of the output and the backward's temporaries
                output_grad = output if loss_peak is None else max(0, loss_peak - (sum(seen.values()) - model_saved))
            elif differentiable:  # a loss unseen: one output-sized gradient each
                out_grads = [torch.empty_like(t) for t in differentiable]
            # the backward's root: each output's gradient is then held by the graph alone, freed once used
            # (what it saves kept from any saved-tensor hooks around the call: a user's checkpoint region
            # the first call plans in would count it as its own)
            with torch.autograd.graph.saved_tensors_hooks(_detached, _detached):
                terms = [(t * g).sum() for t, g in zip(differentiable, out_grads) if g is not None]
            del out, outs, differentiable, out_grads  # a step holds the output only as long as its loss does
            live.record()
            real.on = False  # the backward's ops all touch fake tensors: no per-op walk over their arguments
            # the values stay in the module through the backward, so a recompute (activation checkpointing)
            # reads them, as the runtime puts a unit's values back when its backward starts
            with _reparametrize_module(module, values, tie_weights=False):
                finished = _run_backward(sum(terms[1:], terms[0]), values, live) if terms else False
            del terms
            backward = live.peaks_between(starts) if finished else ()
    return ForwardCost(sum(seen.values()), output, first_use, frozenset(saved_params), saved_before, output_grad, boundary, live.peaks,
                       backward)


def _loss_peak(loss_fn: Callable[[Any], Any], out: Any, outs: list[torch.Tensor]) -> tuple[int | None, list[torch.Tensor | None]]:
    """The most bytes alive at once (fake tensors) while ``loss_fn(out)`` runs and autograd takes the loss
    back to ``outs``: what the loss saves, freed as its backward goes, the output's gradient and the
    backward's temporaries (a cross-entropy's softmax gradient, ...); and the gradients of ``outs``
    (``None`` for one the loss does not use). ``(None, [])`` when nothing is differentiable."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        loss = loss_fn(out)
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad or not outs:
            return None, []
        grads = torch.autograd.grad(loss.sum() if loss.dim() else loss, outs, allow_unused=True)
    peaks = tracker.get_tracker_snapshot("peak")
    return max((d.get("Total", 0) for d in peaks.values()), default=0), list(grads)


def _run_backward(root: torch.Tensor, values: dict[str, torch.Tensor], live: LiveBytes) -> bool:
    """Run the forward's backward from ``root`` (a scalar whose gradient is each output's), the parameters'
    gradients dropped as soon as they are made (the step's model prices them per group); whether it ran
    to the end. A backward the fake tensors cannot run (an op without a fake kernel for its gradient, a
    complex output, ...) leaves the estimate to the forward's counts."""
    def drop(p: torch.Tensor) -> None:
        live.uncount(p.grad)  # (from when it was made)
        p.grad = None

    # what reaches a parameter, and the copy autograd may make of it to match the parameter's strides
    drops = [v.register_hook(lambda g: live.uncount(g, made=True)) for v in values.values() if v.requires_grad]
    drops += [v.register_post_accumulate_grad_hook(drop) for v in values.values() if v.requires_grad]
    try:
        root.backward()
    except Exception:  # noqa: BLE001 - any failure: the forward's counts stand in (see docstring)
        return False
    finally:
        for h in drops:
            h.remove()
    return True


@contextlib.contextmanager
def _without_backward_hooks(module: nn.Module) -> Iterator[None]:
    """The modules' backward hooks (the user's: logging gradient norms, ...) left out of the fake graph,
    whose backward would hand them fake gradients; the forward sets them up, so they are off while it
    runs. (torch's global module hooks stay: other threads, ranks of a threaded group, may be running.)"""
    mods = list(module.modules())
    saved = [(m._backward_hooks, m._backward_pre_hooks) for m in mods]
    try:
        for m in mods:
            m._backward_hooks, m._backward_pre_hooks = OrderedDict(), OrderedDict()
        yield
    finally:
        for m, (post, pre) in zip(mods, saved):
            m._backward_hooks, m._backward_pre_hooks = post, pre


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _split(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def _differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


class _RealWhereReal(TorchDispatchMode):
    """Inside the fake mode: an op whose tensors are all real runs for real (every mode off), so the
    forward's data-dependent checks on its integer inputs see values (Hugging Face models test
    ``torch.all(attention_mask == 1)``: a fake mask cannot answer, and the whole plan fell back); any op
    touching a fake tensor, and every factory (``torch.zeros(...)``), stays fake."""

    on = True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.on:
            return func(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) or t.is_meta for t in tensors):
            with _disable_current_modes():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _fake(mode: Any, x: Any, device: torch.device, cast: torch.dtype | None) -> Any:
    """A forward input for the fake run: integer and boolean tensors on ``device`` keep their values (a
    real copy: the forward may test them), anything else becomes a fake tensor of its shape."""
    if not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, FakeTensor) and not x.is_meta and not (x.dtype.is_floating_point or x.dtype.is_complex):
        with _disable_current_modes():
            return x.to(device, copy=True)  # (the device the forward is counted on: this machine has it)
    dtype = cast if cast is not None and x.dtype.is_floating_point else x.dtype
    return torch.empty_strided(x.shape, x.stride(), dtype=dtype, device=device)
