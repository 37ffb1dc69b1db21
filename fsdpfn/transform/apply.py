"""``fsdp(module)``: run a module's forward on a ``Sharded`` tree, gathering one unit at a time.

The module is used statelessly, like ``torch.func.functional_call``: for the duration of a call its
parameters are swapped for full tensors gathered from the tree (the root unit for the whole call, every
other unit only while its own forward runs) and restored afterwards, so one module serves any number of
trees. Persistent forward hooks on the unit modules do the per-unit swapping; outside an ``apply`` call
they do nothing, except during an activation-checkpoint recompute in backward, where they put the unit's
gathered values back so the recompute never sees the module's stale parameters.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from fsdpfn.core.pass_check import check_pass
from fsdpfn.layout import Sharded, ShardPlan
from fsdpfn.layout.plan import KEPT_GATHERED_MEMO
from fsdpfn.layout.schedule import Schedule, build_schedule
from fsdpfn.ops.api import reduce_scale
from fsdpfn.transform.call import Call
from fsdpfn.transform.open_call import OpenCall
from fsdpfn.transform.saved import checkpoint_region, outer_saved_hooks
from fsdpfn.transform.casting import cast_inputs, cast_output, copy_shard_views
from fsdpfn.transform.eager import caller_frame, eager, functorch_active, in_backward, on_stack, under_compile
from fsdpfn.transform.fusion import note_batch, open_calls, plan_fusion
from fsdpfn.transform.occupancy import enter_module, leave_module
from fsdpfn.transform.recompute import BackwardSwaps
from fsdpfn.transform.remat import override_forwards
from fsdpfn.transform.traced import run_traced
from fsdpfn.transform.unit_hooks import Swap, UnitHooks
from fsdpfn.transform.validate import changed_in_place, changed_in_place_error, check_module, explain_forward_error

__all__ = ["Apply", "fsdp"]



FUNCTORCH_UNDER_COMPILE = (
    "fsdpfn: torch.func transforms (grad, vjp, jvp, vmap) and torch.compile cannot both wrap an fsdpfn apply: "
    "torch.func needs fsdpfn's units as recomputed autograd Functions that dynamo cannot trace. Compile "
    "without torch.func (fsdpfn.value_and_grad, or fsdpfn.compile_step for one graph per step), or use "
    "torch.func without torch.compile (docs/compile.md)"
)




def _only_grad_transforms() -> bool:
    stack = torch._C._functorch.get_interpreter_stack() or []
    return all(i.key() == torch._C._functorch.TransformType.Grad for i in stack)


class Apply(UnitHooks):
    """The pure ``apply(params, *args, **kwargs)`` returned by ``fsdp``; see ``fsdp`` for the semantics."""

    def __init__(
        self,
        module: nn.Module,
        *,
        reshard_after_forward: bool | Callable[[str], bool],
        prefetch: int,
        reduce_op: str,
        divide_by: float | None,
    ):
        if not isinstance(module, nn.Module):
            raise TypeError(f"fsdp: expected an nn.Module, got {type(module).__name__}")
        if not isinstance(reshard_after_forward, bool) and not callable(reshard_after_forward):
            raise TypeError(
                "fsdp: reshard_after_forward must be a bool or a predicate on unit names "
                f"(unit -> bool), got {reshard_after_forward!r}"
            )
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"fsdp: prefetch must be an int >= 0 (units gathered ahead), got {prefetch!r}")
        if reduce_op not in ("avg", "sum"):
            raise ValueError(f"fsdp: reduce_op={reduce_op!r} is not a reduction fsdpfn knows; use 'avg' or 'sum'")
        self.module = module
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.reduce_op = reduce_op
        self.divide_by = divide_by
        self._forward: list[OpenCall] = []
        self._backward: weakref.WeakSet[Call] = weakref.WeakSet()
        self._hooked: set[Any] = set()
        self._unit_swaps: dict[str, list[Swap]] = {}
        self._recompute = BackwardSwaps(self)
        self._targets: dict[str, tuple[dict[str, Any], str]] = {}
        self._caches: dict[str, tuple[dict[str, Any], ...]] = {}
        self._unit_hooks: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}
        self._remat_depth = 0  # > 0 while remat runs a unit: the unit hooks stand aside
        self._calls = 0  # calls begun: their order, alike on every rank (Call.serial)

    def __repr__(self) -> str:
        reduction = f"sum / {self.divide_by}" if self.divide_by is not None else self.reduce_op
        return (
            f"fsdp({type(self.module).__name__}, reshard_after_forward={self.reshard_after_forward}, "
            f"prefetch={self.prefetch}, reduction={reduction!r})"
        )

    # --- the call ---------------------------------------------------------------------------------
    def __call__(self, params: Sharded[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        return self.run(params, self.module, args, kwargs)

    def planning(self) -> contextlib.AbstractContextManager[None]:
        """The context the first call's fusion planner runs ``module``'s forward in (on fake tensors):
        nothing here; the compat layer turns its FSDP dispatch off there."""
        return contextlib.nullcontext()

    def regrouped(self) -> None:
        """The fusion planner just changed the plan's groups (between calls): nothing to do here; compat
        drops the copies it kept gathered under the old groups' names."""

    def fusion_rules(self) -> tuple[bool | Callable[[str], bool], Callable[[str], Hashable] | None, bool | None]:
        """What the first call's fusion planner is told of the units: which are resharded after forward,
        a key that units sharing a group must agree on (``None``: any neighbours may), and whether it may
        keep the last groups gathered from their forward to their backward (``None``: where
        ``reshard_after_forward is True``, ``group_sizes_within``'s default). With a
        ``reshard_after_forward`` predicate that key is the predicate: a unit kept gathered is never fused
        with one that is not (a fused group reshards when any member does, which would drop the keep)."""
        rule = self.reshard_after_forward
        return rule, None if isinstance(rule, bool) else rule, None

    def new_call(self, params: Sharded[torch.Tensor], functorch: bool) -> Call:
        """The bookkeeping of one call on ``params`` (``torch.func`` transforms disable prefetch/reshard)."""
        plan = params.plan
        mode = params._mode
        scale = mode.scale if mode is not None and mode.scale is not None else self.scale(plan)
        if mode is not None:
            mode.scales.append(scale)
        return Call(
            params,
            scale=scale,
            schedule=self.schedule(plan, functorch=functorch),
            sink=mode.sink if mode is not None else None,
            carry=mode.carry if mode is not None else None,
            deferred=mode.deferred if mode is not None and not functorch else None,
        )

    def scale(self, plan: ShardPlan) -> float:
        """The factor this ``fsdp``'s reduction multiplies summed gradients by on ``plan``'s mesh."""
        return reduce_scale(plan, self.reduce_op, self.divide_by)

    def prepared(self, plan: ShardPlan) -> bool:
        """Whether a call on ``plan`` has run (hooks installed, module checked against the plan)."""
        return plan.memo.get(("validated", id(self.module))) is not None and all(
            u.name in self._hooked for u in plan.units if u.name
        )

    def schedule(self, plan: ShardPlan, *, functorch: bool = False) -> Schedule:
        """The schedule of a call on ``plan``: groups in the order the last call ran them (the plan's
        order at first, without forward spans), this ``fsdp``'s resharding and prefetch (neither under
        ``torch.func``)."""
        order = plan.memo.get(("order", id(self)))
        key = ("schedule", id(self), functorch)
        hit = plan.memo.get(key)
        if hit is None or hit[0] != order:
            reshard: bool | Callable[[str], bool] = self.reshard_after_forward
            if functorch:
                reshard = False
            elif not isinstance(reshard, bool):
                reshard = functools.partial(self.reshards_group, plan)
            hit = plan.memo[key] = (order, build_schedule(plan, order=order, reshard=reshard, prefetch=0 if functorch else self.prefetch))
        return hit[1]

    def reshards_unit(self, name: str) -> bool:
        """Whether unit ``name`` (not the root) is dropped after its forward and gathered again in
        backward: ``reshard_after_forward`` itself, or what the predicate says of ``name``."""
        rule = self.reshard_after_forward
        if isinstance(rule, bool):
            return rule
        got = rule(name)
        if not isinstance(got, bool):
            raise TypeError(f"fsdp: the reshard_after_forward predicate returned {got!r} for unit {name!r}; it must return a bool")
        return got

    def reshards_group(self, plan: ShardPlan, group: str) -> bool:
        """Whether collective group ``group`` reshards: units fused into one group (``min_bucket_bytes``)
        are gathered together, so the group reshards if any of them asks to (the smaller peak)."""
        return bool(group) and any(self.reshards_unit(u) for u in plan.members(group))  # (never the root)

    def kept_through_backward(self, plan: ShardPlan, functorch: bool) -> frozenset[str]:
        """The groups a call starting now keeps from its forward to its backward: the last groups the
        fusion planner chose (``KEPT_GATHERED_MEMO``), in a training forward (autograd on) run eagerly,
        when no other call on ``plan`` is in its forward or awaits its backward. A kept group still
        reshards as the schedule says (its saved tensors are packed): the call only holds its copy
        (``Call.keeps``, ``Call.held``), so a second forward before the first one's backward (DPO's pair, microbatches
        under a pipeline schedule) drops the copies the earlier calls hold, which their backward then
        gathers again: each call's kept copy pinned by its graph took four microbatches' forwards to 1.03x
        (functional) and 1.1-1.2x (compat) of the peak without them."""
        kept = plan.memo.get(KEPT_GATHERED_MEMO)
        if not kept or functorch or not torch.is_grad_enabled() or torch.is_inference_mode_enabled() or under_compile() or in_backward():
            return frozenset()
        others = open_calls(plan)
        if others:
            for call in others:
                call.drop_kept()
            return frozenset()
        return frozenset(g.name for g in plan.groups if g.name and set(plan.members(g.name)) <= kept)

    def calls_on(self, plan: ShardPlan) -> list[Call]:
        """This apply's calls on ``plan`` that are in their forward or await their backward."""
        return [o.call for o in self._forward if o.call.plan is plan] + [c for c in self._backward if c.plan is plan and c.awaiting_backward]

    def run(self, params: Sharded[torch.Tensor], fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)`` with the module's parameters taken from ``params`` (``fn`` is usually
        the module itself; any function that runs its units works)."""
        if torch.compiler.is_compiling():
            mode = getattr(params, "_mode", None)
            if mode is not None and mode.traced:  # a whole step in one graph (fsdpfn.compile_step)
                return run_traced(self, params, fn, args, kwargs)
            return self._run_compiled(params, fn, args, kwargs)
        opened, args, kwargs = self.begin(params, args, kwargs)
        try:
            out = fn(*args, **kwargs)
        except BaseException as exc:
            self.close(opened)
            explained = explain_forward_error(exc, opened.call)
            if explained is None:
                raise
            raise explained from exc
        return self.end(opened, out)

    def _run_compiled(self, params: Sharded[torch.Tensor], fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Under torch.compile the set-up and tear-down run eagerly (graph breaks) around a traced ``fn``.
        # No try block: a graph break inside one makes dynamo give up on the whole frame. A forward that
        # raises leaves its call open; the next ``begin`` closes it (see ``close_stale``).
        opened, args, kwargs = _begin_eagerly(self, params, args, kwargs, True)
        out = fn(*args, **kwargs)
        return _end_eagerly(self, opened, out)

    def begin(
        self, params: Sharded[torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any], traced: bool = False
    ) -> tuple[OpenCall, tuple[Any, ...], dict[str, Any]]:
        """Start a call: gather the root unit, swap it and the buffers in, install the unit hooks. Returns
        the open call and the (cast) arguments; ``end`` or ``close`` finishes it."""
        if not isinstance(params, Sharded):
            raise TypeError(
                f"apply: the first argument must be the fsdpfn.Sharded from fsdpfn.shard(...), got {type(params).__name__}"
            )
        me = enter_module(self.module)  # one thread at a time per module: the slots are the module's own
        try:
            plan = params.plan
            self._validate(plan)
            self.close_stale()
            self.leave_failed_backward()
            if any(o.call.plan is plan for o in self._forward):
                raise RuntimeError(
                    f"apply: called inside another apply of the same parameters ({type(self.module).__name__}); "
                    "a module cannot run inside its own sharded forward"
                )
            plan.memo.setdefault(("applies",), weakref.WeakSet()).add(self)  # what compile_step warms up
            functorch = functorch_active()
            eligible = not (functorch or traced or under_compile() or self._forward or in_backward())
            if eligible and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None:
                # a batch past the planned one, or more graphs awaiting backward beside it: asked with this check
                note_batch(plan, args, kwargs, pending=len(open_calls(plan)))
                check_pass(plan.comm)  # ranks that ran different units since the last forward: named, not mixed
            if plan.auto_fusion:
                reshard_rule, fuse_key, keep_last = self.fusion_rules()
                plan_fusion(self.module, plan, args, kwargs, prefetch=self.prefetch, reshard_after_forward=reshard_rule, fuse_key=fuse_key,
                            keep_gathered=keep_last, eligible=eligible, planning=self.planning, regrouped=self.regrouped)
            if functorch and (traced or under_compile()):
                raise RuntimeError(FUNCTORCH_UNDER_COMPILE)
            call = self.new_call(params, functorch)
            call.keeps = frozenset() if traced else self.kept_through_backward(plan, functorch)
            self._calls += 1
            call.serial = self._calls
            call.remat = self.reshard_after_forward is not False and functorch and _only_grad_transforms()
            call.released = self._recompute.leave
            call.unit_modules = self.unit_modules
            self._install_hooks(plan)
            opened = OpenCall(call, anchor=caller_frame() if traced else None, thread=me)
        except BaseException:
            leave_module(self.module, me)
            raise
        self._forward.append(opened)
        try:
            opened.overridden = override_forwards(self, call) if call.remat else []
            if call.reshard:
                call.outer_hooks = outer_saved_hooks()
                call.in_checkpoint = self.recomputes_plainly and checkpoint_region(call.outer_hooks)
                opened.hooks = torch.autograd.graph.saved_tensors_hooks(call.pack, call.unpack)
                opened.hooks.__enter__()
            if any(u.name == "" for u in plan.units):
                opened.swapped += self._swap(plan, call.gather(""), "")
            opened.swapped += self._swap_buffers(params)
            opened.swapped += self._swap_placeholders(plan)
            args, kwargs = cast_inputs(plan, args, kwargs, "")
        except BaseException:
            self.close(opened)
            raise
        return opened, args, kwargs

    def close(self, opened: OpenCall) -> None:
        """Undo what ``begin`` did (parameters, hooks, forward overrides) and end the call's forward."""
        if opened.closed:
            return
        opened.closed = True
        if opened.thread is not None:
            leave_module(self.module, opened.thread)
        try:
            if opened.hooks is not None:
                opened.hooks.__exit__(None, None, None)
            self._restore(opened.swapped)
            for mod, had, old in opened.overridden:
                if had:
                    mod.forward = old
                else:
                    del mod.forward
        finally:
            if opened in self._forward:
                self._forward.remove(opened)
            opened.call.finish_forward()

    def end(self, opened: OpenCall, out: Any) -> Any:
        """Finish a call whose forward returned ``out``: close it, keep it for backward, cast the output."""
        replaced = self._replaced_buffers(opened.call.params)
        self.close(opened)
        call = opened.call
        self._keep_replaced_buffers(call.params, replaced)
        changed = changed_in_place(call)
        if changed:  # a change autograd did not see (no graph): it would be lost, silently
            raise changed_in_place_error([], changed)
        plan = call.plan
        if not call.remat_units:  # units run through remat gather outside the call: its order lacks them
            plan.memo[("order", id(self))] = list(call.order)
        self._backward.add(call)
        if torch.is_grad_enabled() and "" in plan.group_of and not functorch_active():
            self._recompute.arm_on(call, "", out)
        out = copy_shard_views(plan, call.params.params().values(), out)
        cast = cast_output(plan, out, "")
        return out if cast is None else cast

    def close_stale(self) -> bool:
        """Close the calls whose traced forward raised (the frame that began them is gone, so they can
        never end); true if there were any."""
        stale = [o for o in self._forward if o.anchor is not None and not on_stack(o.anchor)]
        for o in reversed(stale):
            self.close(o)
        return bool(stale)

    def leave_failed_backward(self) -> None:
        """Take out of the modules' slots the values a backward that raised left there (outside a
        backward; a later call would otherwise find gathered copies where its parameters belong)."""
        if self._recompute.active and not in_backward():
            self._recompute.leave_all()

    # --- validation ---------------------------------------------------------------------------------
    def _validate(self, plan: ShardPlan) -> None:
        check_module(self.module, plan)


@eager
def _begin_eagerly(apply: Apply, params: Any, args: Any, kwargs: Any, traced: bool) -> Any:
    return apply.begin(params, args, kwargs, traced)


@eager
def _end_eagerly(apply: Apply, opened: OpenCall, out: Any) -> Any:
    return apply.end(opened, out)


def fsdp(
    module: nn.Module,
    *,
    reshard_after_forward: bool | Callable[[str], bool] = True,
    prefetch: int = 1,
    reduce_op: str = "avg",
    divide_by: float | None = None,
) -> Apply:
    """Make ``apply(params, *args, **kwargs)``: ``module``'s forward on a ``Sharded`` tree.

    Each unit is all-gathered just before its own forward (``prefetch`` units ahead are launched
    early) and, with ``reshard_after_forward``, its gathered copy is dropped when it finishes: tensors
    autograd saved from it are re-gathered in backward on first use. ``reshard_after_forward`` may be a
    predicate on unit names instead (``lambda unit: unit != "blocks.11"`` keeps the last block gathered
    until its backward, which comes right after: one gather less per step, one block more in memory);
    units fused into one collective group reshard if any of them does. The root unit stays gathered from
    the start of the forward until its gradient is reduced. Gradients reach the shards reduced as
    ``reduce_op`` says: ``"avg"`` (the mean over data-parallel ranks, DDP's convention), ``"sum"``, or
    the sum divided by ``divide_by``. ``apply`` mutates nothing outside the call (buffers updated in
    place by the module, such as running statistics, are the tree's own buffer leaves; a buffer the forward
    replaces is copied into its leaf).

    Example:
        >>> apply = fsdpfn.fsdp(model)                                       # doctest: +SKIP
        >>> loss, grads = fsdpfn.value_and_grad(lambda p, x, y: F.mse_loss(apply(p, x), y))(params, x, y)  # doctest: +SKIP
    """
    return Apply(module, reshard_after_forward=reshard_after_forward, prefetch=prefetch, reduce_op=reduce_op, divide_by=divide_by)
