"""A compat root's executor: ``fsdpfn.transform``'s ``Apply`` and ``Call`` with the knobs of the
``FSDPModule`` units read live (resharding, gradient sync, explicit prefetch, ``unshard()`` already in
flight), units that span several modules, and ``LocalShards``, the one autograd node that turns the
``DTensor`` parameters into the local shards the transform differentiates."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.distributed.tensor import DTensor

from fsdpfn.compat.explicit_unshard import stale_unshards
from fsdpfn.compat.stranded import reduce_stranded
from fsdpfn.core.pass_check import start_pass_check
from fsdpfn.layout import Sharded, ShardPlan
from fsdpfn.layout.schedule import Schedule, build_schedule
from fsdpfn.ops.buckets import Buckets
from fsdpfn.ops.deferred import DeferredReductions
from fsdpfn.ops.fold import Fold, fold_into
from fsdpfn.ops.functions import CallInfo, add_by_name
from fsdpfn.transform.apply import Apply
from fsdpfn.transform.call import Call
from fsdpfn.transform.eager import eager_frame
from fsdpfn.transform.fusion import note_accumulation

if TYPE_CHECKING:
    from fsdpfn.compat.root import RootContext

__all__ = ["CompatApply", "CompatCall", "LocalShards", "accumulate_finished", "dtensor_gradient"]


class LocalShards(torch.autograd.Function):
    """The local shards of ``DTensor`` parameters, differentiably: one autograd node for all of them
    (``DTensor.to_local`` costs an autograd node and a ``from_local`` in backward per parameter). The
    backward waits for the reductions its units' backward left in flight, adds their results (kept out of
    autograd, ``fsdpfn.ops.deferred``) and wraps each shard gradient in a ``DTensor`` with its parameter's
    spec."""

    @staticmethod
    def forward(ctx: Any, specs: tuple[Any, ...], fqns: tuple[str, ...], deferred: DeferredReductions, root: RootContext,
                *params: DTensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.specs = specs
        ctx.root = root
        ctx.fqns = fqns
        ctx.deferred = deferred
        ctx.set_materialize_grads(False)
        # fresh tensor objects: autograd metadata must not land on the DTensors' own local tensors
        out = tuple(p._local_tensor.view_as(p._local_tensor) for p in params)
        ctx.mark_non_differentiable(*(o for o, p in zip(out, params) if not p.requires_grad))
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        deferred: DeferredReductions = ctx.deferred
        root: RootContext = ctx.root
        deferred.wait()  # the units' reduce-scatters, left in flight by their backward; then their results
        # every rank reduced the same units (else they were mixed): known before any use of the gradients. A
        # root nested in another's forward reads the verdict at the end of the backward (its backward is
        # one unit's), so the rest of the backward need not wait for the other ranks here
        verdict = start_pass_check(root.comm)
        if verdict is not None:
            if root.state.outer is not None:
                torch.autograd.Variable._execution_engine.queue_callback(verdict)
            else:
                verdict()
        grads = tuple(deferred.add_to(f, g) for f, g in zip(ctx.fqns, grads))
        # copies kept gathered for units that reshard after backward go on every rank, whether or not the
        # unit's backward ran here (FSDP2's final callback reshards every group): a forward's gathers
        # then do not depend on which units a rank's loss reached
        root.kept.drop_resharded(root)
        # accumulated gradients of units this backward did not run (compat/stranded.py)
        grads = add_by_name(ctx.fqns, grads, reduce_stranded(root))
        if root.acc and _capturing(root):
            # torch.autograd.grad with gradient sync off (a pipeline schedule's weight pass): the gradients
            # wait unreduced in the accumulator for the next sync, which adds them to .grad; the call gets
            # zeros for them (adding those to .grad, as the schedule does, changes nothing)
            grads = tuple(
                torch.zeros_like(root.managed[f].param._local_tensor) if g is None and f in root.acc else g
                for f, g in zip(ctx.fqns, grads)
            )
        graph = torch.is_grad_enabled()  # create_graph: the DTensor gradients stay differentiable (a MAML step)
        return (None, None, None, None, *(None if g is None else dtensor_gradient(g, s, graph) for g, s in zip(grads, ctx.specs)))


def _capturing(root: RootContext) -> bool:
    """Whether the running backward is ``torch.autograd.grad`` (it returns gradients instead of accumulating
    them into ``.grad``), asked of a trainable parameter's gradient accumulator: autograd refuses to say
    whether it will run one there."""
    param = next((m.param for m in root.managed.values() if m.param.requires_grad), None)
    if param is None:
        return False
    with torch.enable_grad():
        node = get_gradient_edge(param).node
    try:
        torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return True
    return False


def accumulate_finished(root: RootContext, deferred: DeferredReductions) -> None:
    """Add the finished reductions' results into the ``.grad`` they accumulate into, in place, as FSDP2's
    post-backward does for each group (``grad._local_tensor += new``), instead of holding every group's
    result to the end of the backward: a second backward before the step (gradient accumulation with sync
    on) held one more shard gradient per parameter there, 1.07x torch's peak (8 LayerNorm-MLP blocks, 16
    rows, 4 microbatches, world 2). Only where that is what autograd would do: a parameter with a ``.grad``
    of the result's shape and dtype, no hooks on its gradient (they see it through autograd), in a backward
    that accumulates (not ``torch.autograd.grad``) and builds no graph (``create_graph``)."""
    if torch.is_grad_enabled() or not deferred.grads or _capturing(root):
        return
    for fqn in list(deferred.grads):
        managed = root.managed.get(fqn)
        param = managed.param if managed is not None else None
        grad = param.grad if param is not None else None
        if not isinstance(grad, DTensor) or param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None):  # type: ignore[union-attr]
            continue
        deferred.fold(fqn, grad._local_tensor)


def dtensor_gradient(g: torch.Tensor, spec: Any, graph: bool) -> DTensor:
    """Shard gradient ``g`` as the ``DTensor`` gradient of the parameter whose spec is ``spec``; ``graph``:
    differentiable (a backward with ``create_graph=True``).

    Example:
        >>> p.grad = dtensor_gradient(local_grad, p._spec, False)      # doctest: +SKIP
    """
    if graph:
        return DTensor.from_local(g.contiguous(), spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)
    return DTensor(g.contiguous(), spec, requires_grad=False)


class CompatCall(Call):
    """One forward of a compat root: the unit knobs come from the ``UnitState``s."""

    def __init__(self, ctx: RootContext, params: Sharded[torch.Tensor], schedule: Schedule):
        self.ctx = ctx
        super().__init__(params, scale=1.0, schedule=schedule, deferred=ctx.deferred)
        self.deferral_needs_leaves = False  # the shards come from LocalShards, whose backward drains
        self.accumulating: bool | None = None  # whether a .grad existed when its backward began (read once)

    def _collective(self, unit: Any) -> Buckets:
        return self.ctx.collective(unit)

    # --- copies kept gathered between forwards and backwards (compat/kept.py) ---------------------------
    def gather(self, name: str) -> dict[str, torch.Tensor]:
        full = super().gather(name)
        self.ctx.kept.drop({name})  # gathered anew (a prefetch was in flight) or taken: one copy at a time
        return full

    def _gathered_again(self, name: str, full: dict[str, torch.Tensor]) -> None:
        self._keep(name, full)

    def _keep(self, name: str, full: dict[str, torch.Tensor]) -> None:
        # a group planned before the plan's current groups (a kept graph's backward run again) is never
        # gathered under its name again: nothing to keep it for
        if self.group_of is self.plan.group_of:
            self.ctx.kept.keep(self.ctx, name, full)

    def _kept_copy(self, name: str) -> dict[str, torch.Tensor] | None:
        return self.ctx.kept.get(self.ctx, name)

    def _take_kept(self, name: str) -> dict[str, torch.Tensor] | None:
        return self.ctx.kept.take(self.ctx, name)

    def finish_forward(self) -> None:
        super().finish_forward()
        for name, full in self.gathered.items():  # not resharded after forward: FSDP2 keeps these unsharded
            self.ctx.kept.hold(self.ctx, name, full)  # until a backward reshards them; the next forward's too

    def _release(self, name: str) -> None:
        if name not in self.regathered and name in self.gathered:  # its forward's copy served the backward
            self._keep(name, self.gathered[name])
        super()._release(name)

    def info(self, name: str) -> CallInfo:
        return CallInfo(pending=self.pending.pop(name, None), resolve=functools.partial(self._reduction, name))

    def _finish_deferred_reductions(self) -> None:
        super()._finish_deferred_reductions()
        if self.deferred is None or not self.deferred.grads or self.deferred.handles:
            return  # nothing kept, or a result not final yet
        if self.accumulating is None:  # (a backward adds its results to .grad only at its end: stable within it)
            self.accumulating = any(m.param.grad is not None for m in self.ctx.managed.values())
            if self.accumulating:  # the planner priced one backward per step: plan for this one's too
                note_accumulation(self.plan, "accumulating")
        if self.accumulating:
            accumulate_finished(self.ctx, self.deferred)

    def folder(self, name: str) -> Fold | None:
        """Group ``name``'s gradients go to its accumulator as they are made (``fsdpfn/ops/fold.py``) when,
        at its forward, gradient sync is off or the accumulator holds gradients (the syncing backward carries
        them into its reduction); each fold asks again when its gradient arrives, as ``_reduction`` does."""
        st = self.ctx.knobs(name)
        if not (self.ctx.defers(name) or st.acc):
            return None
        return functools.partial(self._fold, name)

    def _fold(self, name: str, fqn: str, grad: torch.Tensor) -> bool:
        return fold_into(self.ctx.knobs(name).acc, fqn, grad, self.plan.reduce_dtypes, self.ctx.defers(name))

    def _reduction(self, name: str) -> CallInfo:
        """How unit or group ``name``'s backward reduces, from its knobs when that backward runs (FSDP2
        reads gradient sync in its post-backward): sync off keeps the full gradients in the accumulator."""
        st = self.ctx.knobs(name)
        keep_none = not st.reduce_scatter_unused
        if self.ctx.defers(name):
            self.ctx.accumulating = True
            note_accumulation(self.plan, "deferring")  # the planner priced backwards that reduce: plan for this one
            return CallInfo(sink=st.acc, sink_dtypes=self.plan.reduce_dtypes, keep_none=keep_none)
        return CallInfo(carry=st.acc if st.acc else None, keep_none=keep_none, deferred=self.deferred)


class CompatApply(Apply):
    """``Apply`` whose calls are ``CompatCall``s and whose units may span several modules."""

    placeholders = False  # outside its forward a unit's parameters stay FSDP2's sharded DTensors
    recomputes_plainly = True  # a root called inside a checkpointed region (compat/dispatch.py)
    fresh_views = True  # each forward's tree: LocalShards' views of the DTensor parameters' local shards

    def __init__(self, ctx: RootContext):
        super().__init__(ctx.module, reshard_after_forward=True, prefetch=1, reduce_op="avg", divide_by=None)
        self.ctx = ctx

    def new_call(self, params: Sharded[torch.Tensor], functorch: bool) -> Call:
        call = CompatCall(self.ctx, params, self.schedule(params.plan, functorch=functorch))
        if functorch:  # torch.func transforms: no deferred reductions
            call.deferred = None
        stale = stale_unshards(self.ctx)  # gathered by unshard() before an update changed the shards: again
        launched = {n: st for n, st in self.ctx.states.items() if st.unsharded is not None and n not in stale}
        plan = self.ctx.plan
        for group in {plan.group_of.get(n, n) for n in launched}:  # an explicit unshard() launched the gather
            if group in launched:  # a unit of its own: its forward waits for that gather
                call.pending[group] = launched[group].unsharded[0]  # type: ignore[index]  # launched: set
            elif all(u in launched for u in plan.members(group)):
                # a fused group whose every unit was unshard()ed (a pipeline schedule's UNSHARD action): its
                # forward takes their results as a kept copy instead of gathering the group again
                full: dict[str, torch.Tensor] = {}
                for u in plan.members(group):
                    handles, done, b, _ = launched[u].unsharded  # type: ignore[misc]  # launched: set
                    full.update(done if done is not None else zip(b.fqns, b.finish(handles)))
                self.ctx.kept.hold(self.ctx, group, full)
        return call

    def _validate(self, plan: Any) -> None:
        pass  # RootContext.params checks every DTensor parameter before each call

    def fusion_rules(self) -> tuple[Callable[[str], bool], Callable[[str], Hashable], bool]:
        """Each unit's own ``reshard_after_forward``, and its ``UnitState.fuse_key``: units with different
        settings never share a group. Where every unit below the root reshards after forward (FSDP2's
        default), the planner may keep the last groups gathered through a training forward: their
        backward comes next (``Apply.kept_through_backward``)."""
        keys = self.ctx.fuse_keys()
        return self.ctx.reshards, keys.__getitem__, all(self.ctx.reshards(u.name) for u in self.ctx.plan.units if u.name)

    @contextlib.contextmanager
    def planning(self) -> Iterator[None]:
        """The first forward's fusion planner calls the root's forward on fake tensors: every
        ``FSDPModule`` under this root then runs as a plain module (no root call, no gathers)."""
        self.ctx.planning = True
        try:
            yield
        finally:
            self.ctx.planning = False

    def regrouped(self) -> None:
        """The root's first forwards planned new groups: the copies kept gathered under the old groups'
        names would never be taken again (a fused group's name is its members'), so they go."""
        self.ctx.kept.drop()

    def schedule(self, plan: ShardPlan, *, functorch: bool = False) -> Schedule:
        """The schedule of a call: resharding and explicit prefetch lists from the units' knobs, read
        at every call (``set_reshard_after_forward`` & co. apply from the next forward)."""
        if functorch:  # torch.func transforms: no prefetch, no packing of saved tensors
            return build_schedule(plan, reshard=False, prefetch=0)
        ctx = self.ctx
        order = plan.memo.get(("order", id(self)))
        knobs = [(g.name, ctx.knobs(g.name)) for g in plan.groups]
        key = (order, [(g, ctx.reshards(g), st.forward_prefetch, st.backward_prefetch) for g, st in knobs])
        hit = plan.memo.get(("schedule", id(self)))
        if hit is None or hit[0] != key:
            schedule = build_schedule(
                plan,
                order=order,
                reshard=ctx.reshards,
                prefetch=1,
                forward_prefetch={g: ctx.names_of(st.forward_prefetch) for g, st in knobs if st.forward_prefetch is not None},
                backward_prefetch={g: ctx.names_of(st.backward_prefetch) for g, st in knobs if st.backward_prefetch is not None},
            )
            hit = plan.memo[("schedule", id(self))] = (key, schedule)
        return hit[1]

    def unit_modules(self, name: str) -> list[nn.Module]:
        return list(self.ctx.states[name].modules)

    def _pre_hook(self, name: str) -> Callable[..., Any]:
        gather = super()._pre_hook(name)
        st = self.ctx.states.get(name)

        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            got = gather(mod, args, kwargs)
            if st is not None and st.forward_prefetch and self._forward and not torch.compiler.is_compiling():
                self.ctx.nested_prefetch(name)  # roots on other meshes in its prefetch list
            return got

        return eager_frame(hook)

    def _swap_names(self, names: list[tuple[str, str]], full: dict[str, torch.Tensor]) -> Any:
        tp = self.ctx.tp
        if tp:  # the gathered TP-local tensors, seen by the TP modules as DTensors on their TP mesh
            full = {o: tp[o].wrap(full[o]) if o in tp else full[o] for _, o in names}
        return super()._swap_names(names, full)

    def release_after_module(self, name: str) -> bool:
        return len(self.ctx.states[name].modules) == 1  # fully_shard([a, b]): gathered once per forward

    def run_unit(self, name: str, module: nn.Module, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn`` (a method of ``module``) as if it were the unit's forward: gathered around it."""
        pre, post = self.unit_hooks(name)
        got = pre(module, args, kwargs)
        if got is not None:
            args, kwargs = got
        if torch.compiler.is_compiling():  # no try block around traced code (see Apply._run_traced)
            out = fn(*args, **kwargs)
            cast = post(module, args, out)
            return out if cast is None else cast
        out = None
        try:
            out = fn(*args, **kwargs)
        finally:
            cast = post(module, args, out)
        return out if cast is None else cast
