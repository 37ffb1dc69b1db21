"""The state of one ``apply`` call: which units are gathered, what backward must re-gather, prefetches.

A ``Call`` lives until the backward of its forward is done: the autograd graph keeps it alive (through
the saved-tensor hooks and the gather nodes' metadata) and drops it with the graph.

With ``reshard_after_forward``, tensors that autograd saves and that alias a non-root unit's gathered
buffer are packed as ``(unit, fqn, offset, size, stride)`` instead of being kept; the first unpack in
backward re-gathers the unit (and prefetches the unit backward needs next), and the unit's re-gathered
copy is dropped as soon as its gradient reduction starts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsdpfn.core import Handle
from fsdpfn.core.guard import checking
from fsdpfn.layout import Sharded, UnitPlan
from fsdpfn.layout.plan import FUSED
from fsdpfn.layout.schedule import Schedule
from fsdpfn.ops.api import check_shards, gather_collective
from fsdpfn.ops.buckets import Buckets
from fsdpfn.ops.deferred import DeferredReductions
from fsdpfn.ops.fold import Fold, fold_each, fold_into
from fsdpfn.ops.functions import CallInfo, apply_buckets
from fsdpfn.ops.shared import launch_shared, shares_gather
from fsdpfn.transform.eager import eager, functorch_active
from fsdpfn.transform.parked import Parking, tensors_on
from fsdpfn.transform.group_copies import group_done, without_autograd
from fsdpfn.transform.saved import OuterSaved, Packed, packed_reference
from fsdpfn.transform.validate import contents_moved, versions_moved

__all__ = ["Call"]


class Call:
    """Per-call bookkeeping of ``fsdp(module)(params, ...)``.

    ``order`` records the units in the order their forward ran; backward prefetch walks it in reverse.
    """

    def __init__(
        self,
        params: Sharded[torch.Tensor],
        *,
        scale: float,
        schedule: Schedule,
        sink: dict[str, torch.Tensor] | None = None,
        carry: dict[str, torch.Tensor] | None = None,
        deferred: DeferredReductions | None = None,
    ):
        self.params = params
        self.sink = sink
        self.carry = carry
        self.deferred = deferred
        self.plan = params.plan
        # the groups this call's forward gathers, as they stand now: a replan (automatic fusion, between
        # calls) gives the plan new ones but leaves these, and the shards do not move, so a backward run
        # again through a graph kept with retain_graph=True after one still re-gathers and reduces these
        self.groups = self.plan.groups
        self.group_of = self.plan.group_of
        self.scale = scale
        self.schedule = schedule
        self.reshard = schedule.any_reshard  # saved tensors of some group must be packed
        self.order: list[str] = []
        self.gathered: dict[str, dict[str, torch.Tensor]] = {}
        self.with_grad: dict[str, bool] = {}  # per gathered group: whether autograd was on when it was gathered
        self.versions: dict[str, tuple[int, ...]] = {}  # each gathered tensor's version counter when gathered
        self.snapshots: dict[str, tuple[torch.Tensor, ...]] = {}  # debug mode: copies, for writes via .data
        self.extra_grads: dict[str, dict[str, torch.Tensor]] = {}  # group -> gradients its reduction adds
        self.changed: list[tuple[str, tuple[str, ...]]] = []  # units changed in place, found at their release
        self.regathered: dict[str, dict[str, torch.Tensor]] = {}
        self.pending: dict[str, list[Handle]] = {}
        self.pending_back: dict[str, list[Handle]] = {}
        self.storages: dict[int, tuple[str, str]] = {}
        # gathered storages something else holds at their group's release (a selective checkpoint's cache)
        self.parking = Parking()
        self.unit_modules: Callable[[str], list[torch.nn.Module]] | None = None  # (the Apply's): see _set_on_modules
        # the saved-tensor hooks around the call: what pack does not replace goes to them (autograd runs
        # only the innermost hooks, so without this the call's own would silently switch theirs off)
        self.outer_hooks: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None = None
        # every saved tensor goes to the outer hooks, an activation checkpoint's (see UnitHooks.recomputes_plainly)
        self.in_checkpoint = False
        self.serial = 0  # its place among its Apply's calls (the same on every rank)
        self.tracks_grad: dict[str, dict[str, bool]] = {}  # per group: which gathered tensors take a gradient
        self.packed_units: set[str] = set()  # units backward will have to re-gather
        self.members_done: dict[str, set[str]] = {}  # fused groups: units whose forward finished
        # groups whose gather autograd recorded and whose backward has not started: while any is, the
        # plan's groups must not change under this call (transform/fusion.py plans again only then)
        self.awaiting_backward: set[str] = set()
        # groups this call keeps from its forward to its backward (Apply.kept_through_backward), and the
        # copies it holds: a kept group reshards as scheduled (saved tensors packed, so no graph pins the
        # copy) and its backward's re-gather takes the held copy; dropped at its reduction, or earlier
        # when another forward starts (drop_kept)
        self.keeps: frozenset[str] = frozenset()
        self.held: dict[str, dict[str, torch.Tensor]] = {}
        self.in_forward = True
        self.remat = False  # units run through fsdpfn.remat (torch.func gradient transforms)
        self.remat_units: frozenset[str] = frozenset()  # the outermost units routed through it
        self.deferral_needs_leaves = True  # deferred reductions only when the shards are autograd leaves
        # told when a group's reduction starts; returns gradients to add to it (BackwardSwaps.leave)
        self.released: Callable[[Call, str], dict[str, torch.Tensor] | None] | None = None
        # Backward prefetch: on CUDA a group's re-gather starts the next one's, which overlaps its backward
        # on the side stream (as FSDP2). On CPU the next one starts when this group's reduction does: gloo
        # moves bytes on the same cores that compute, so a gather in flight during a group's backward hides
        # little (ln_mlp, world 2: 186 -> 179 ms, fused pairs 175 -> 160 ms), and the group's gradients are
        # then never alive beside a second gathered group (one group less in backward's window).
        self._prefetch_at_release = self.plan.comm.groups.device_type != "cuda"

    # --- the groups this call was planned with -----------------------------------------------
    def _group(self, name: str) -> UnitPlan:
        """The collective group ``name`` that this call's forward gathered: the plan's, or, when the plan's
        groups were planned again since (a graph kept with ``retain_graph=True`` run backward again after
        a larger batch), the one the call was planned with."""
        try:
            return self.plan.group(name)
        except KeyError:
            for g in self.groups:
                if g.name == name:
                    return g
            raise

    def members(self, group: str) -> tuple[str, ...]:
        """The units of this call's group ``group``, planned before or now: its name joins theirs
        (``ShardPlan.regroup`` maps units to groups the same way)."""
        return tuple(group.split(FUSED))

    # --- forward ----------------------------------------------------------------------------
    def _collective(self, unit: UnitPlan) -> Buckets:
        return gather_collective(self.plan, (unit,), self.scale)

    def _shards(self, b: Buckets) -> list[torch.Tensor]:
        return check_shards(self.params, b.fqns)

    def _launch(self, name: str) -> list[Handle]:
        """Start gathering unit ``name`` outside autograd (prefetch, backward re-gather)."""
        b = self._collective(self._group(name))
        if b.in_place:
            return []  # nothing to move: the gather itself aliases the shards
        return b.launch([t.detach() for t in self._shards(b)])

    def gather(self, name: str) -> dict[str, torch.Tensor]:
        """Differentiably gather group ``name`` (waiting for its prefetch if one is in flight)."""
        unit = self._group(name)
        b = self._collective(unit)
        shards = self._shards(b)
        ready = None if name in self.pending or functorch_active() else self._take_kept(name)
        if ready is None and name not in self.pending and name not in self.gathered:
            self._launch_span(name)  # the first group of a forward span (not prefetched): its span now
        info = self.info(name)
        if ready is not None:
            info.ready = [ready[f] for f in b.fqns]
        if info.deferred is not None and self.deferral_needs_leaves and any(t.grad_fn is not None for t in shards):
            info.deferred = None  # shards computed from the leaves: their gradient must flow on through autograd
        info.extra = functools.partial(self.extra_grads.pop, name, None)
        outs = apply_buckets(b, shards, info)
        grad_fn = next((o.grad_fn for o in outs if o.grad_fn is not None), None)  # (the gather's node)
        fold = self.folder(name) if grad_fn is not None and not functorch_active() else None
        if fold is not None:  # each gradient into its accumulator as it is made, not when the group's are
            outs = fold_each(outs, b.fqns, fold)
        full = dict(zip(b.fqns, outs))
        self.gathered[name] = full
        self.with_grad[name] = torch.is_grad_enabled()
        if not b.in_place and not torch.is_inference_mode_enabled():  # (inference tensors have no versions)
            self.versions[name] = tuple(t._version for t in outs)  # a change in place here would be lost
            if checking(self.plan.comm.guard.owner if self.plan.comm is not None else None):
                self.snapshots[name] = tuple(t.detach().clone() for t in outs)
        self.tracks_grad[name] = {f: o.requires_grad for f, o in full.items()}
        if name not in self.order:
            self.order.append(name)
        if grad_fn is not None:
            grad_fn.metadata["fsdpfn_call"] = self  # keeps the call alive exactly as long as the graph
            grad_fn.register_prehook(lambda _grads, _n=name: self._release(_n))
            self.awaiting_backward.add(name)
        if self.reshards(name):
            self.parking.gathered(name, b, taken=ready is not None)
            for fqn, t in full.items():
                if t.numel() and type(t) is torch.Tensor:  # a subclass (all-gather transform) has no storage to match
                    self.storages[t.untyped_storage().data_ptr()] = (name, fqn)
        self._prefetch_forward(name)
        return full

    def for_unit(self, name: str) -> dict[str, torch.Tensor]:
        """Group ``name``'s gathered values for one of its units about to run: the copy this forward holds,
        or a new gather when there is none or when ``without_autograd`` says the copy cannot serve."""
        full = self.gathered.get(name)
        if full is None:
            return self.gather(name)
        if without_autograd(self.with_grad[name], full, self.params):
            self.release(name)
            return self.gather(name)
        return full

    def info(self, name: str) -> CallInfo:
        """The per-call extras of unit ``name``'s gather: its prefetched handles, the deferral sink."""
        return CallInfo(
            pending=self.pending.pop(name, None),
            sink=self.sink,
            sink_dtypes=self.plan.reduce_dtypes if self.sink is not None else None,
            carry=self.carry,
            deferred=self.deferred if self.sink is None else None,
        )

    def folder(self, name: str) -> Fold | None:
        """Where group ``name``'s gradients go as autograd makes them, when they go to an accumulator
        rather than to a reduction (``fsdpfn/ops/fold.py``): this call's sink, or a carry that holds the
        parameter; ``None``: to the group's reduction."""
        if self.sink is None and not self.carry:
            return None
        acc = self.sink if self.sink is not None else self.carry
        return lambda f, g: fold_into(acc, f, g, self.plan.reduce_dtypes, self.sink is not None)

    def reshards(self, name: str) -> bool:
        """Whether group ``name``'s gathered copy is dropped after its forward (never the root's)."""
        return self.schedule.reshards(name)

    def forward_prefetch(self, name: str) -> Sequence[str]:
        """The groups to start gathering when group ``name`` is gathered in forward."""
        return self.schedule.forward_prefetch(name)

    def backward_prefetch(self, name: str) -> Sequence[str]:
        """The groups to start re-gathering when group ``name`` is re-gathered in backward (nearest
        first), in the order this call's forward ran."""
        return self.schedule.backward_prefetch(name, self.order)

    def _prefetch_forward(self, name: str) -> None:
        for nxt in self.forward_prefetch(name):
            if nxt not in self.pending and nxt not in self.gathered and self._kept_copy(nxt) is None and not self._launch_span(nxt):
                self.pending[nxt] = self._launch(nxt)

    def _launch_span(self, name: str) -> bool:
        """Launch the forward span group ``name`` begins (``Schedule.forward_span``) as one collective,
        when none of its groups was launched or has run in this call yet (a unit run twice gathers alone
        the second time) and each can share it; whether it did."""
        span = self.schedule.forward_span(name)
        if len(span) < 2 or not self.in_forward or any(n in self.pending or n in self.gathered or n in self.order or self._kept_copy(n) is not None for n in span):
            return False
        bs = [self._collective(self._group(n)) for n in span]
        if not all(shares_gather(b) for b in bs) or len({b.layouts[0].dtype for b in bs}) != 1:
            return False
        pending = launch_shared(bs, [[t.detach() for t in self._shards(b)] for b in bs])
        self.pending.update(zip(span, pending))
        return True

    def unit_done(self, group: str, unit: str) -> bool:
        """Note that unit ``unit`` of group ``group`` finished its forward; true once every unit of the
        group has (a fused group is dropped only then: its units share one gathered buffer)."""
        return group_done(self.members(group), self.members_done, group, unit)

    def release(self, name: str, keep: bool = False) -> None:
        """Forget unit ``name``'s gathered copy after its forward (reshard); with ``keep``, a group this call
        keeps (``keeps``) whose backward is to come is held for it instead of freed."""
        full = self.gathered.pop(name, None)
        if full is not None:
            if keep and name in self.keeps and name in self.awaiting_backward:
                self.held[name] = {f: t.detach() for f, t in full.items()}
            was = self.versions.pop(name, ())
            if versions_moved(full.values(), was) or contents_moved(full.values(), self.snapshots.pop(name, None)):
                self.changed.append((name, tuple(full)))
            for t in full.values():
                if t.numel() and type(t) is torch.Tensor:
                    self.storages.pop(t.untyped_storage().data_ptr(), None)
            if name not in self.held:
                self.parking.release(name, full, functools.partial(self._set_on_modules, name))

    def _set_on_modules(self, group: str) -> list[torch.Tensor]:
        # tensors the group's forward may have left on its modules for a later module to read: its units'
        # own modules only (its values exist only inside their forwards), so a step scans each module once
        if self.unit_modules is None:
            return []
        return [t for unit in self.members(group) for m in self.unit_modules(unit) for t in tensors_on(m)]

    def note_outputs(self, out: Any) -> None:
        """A unit's forward returned ``out``: a group whose gathered buffer some tensor of it views is read on
        by what follows in the forward, so its storage is never parked at its release."""
        if self.storages:
            self.parking.returned(self.storages, out)

    def drop_kept(self) -> None:
        """Free the copies this call holds for its backward and keep no more: another forward on the plan
        started before that backward (its re-gathers then move the bytes again, as a resharded group's)."""
        self.keeps = frozenset()
        self.held.clear()

    def finish_forward(self) -> None:
        """End of the forward: drop every gathered copy but what autograd saved; cancel stray prefetches."""
        self.in_forward = False
        for name in list(self.gathered):
            if self.reshards(name):
                self.release(name, keep=True)
            else:  # kept for backward as detached aliases (same storage, same version counter): the
                # graph holds this call (its gather nodes' metadata and hooks), so the call holding graph
                # tensors would be a cycle through autograd's C++ nodes that Python's gc never frees, and
                # a forward whose backward never reaches the gather (no backward, an early exit,
                # retain_graph) would leak the call, its gathered units and the graph's activations
                self.gathered[name] = {f: t.detach() for f, t in self.gathered[name].items()}
        for handles in self.pending.values():
            for h in handles:
                h.wait()
        self.pending.clear()

    # --- saved-tensor hooks (eager even inside a compiled call: their state is per call) ---------
    @eager
    def pack(self, t: torch.Tensor) -> Any:
        """Replace a saved tensor that aliases a resharded unit's buffer by a ``Packed`` reference (a
        ``DTensor``, as tensor-parallel modules save, by one to its local tensor); any other goes to the
        saved-tensor hooks that were active around the call, if any (``OuterSaved``), or is kept as a
        detached alias: the tensor itself would hold its ``grad_fn``, and a saved output (tanh saves its
        result) would then hold the node that holds it, a cycle that only a backward through the node
        breaks (torch's ``saved_tensors_hooks`` warns of it): a forward whose graph is dropped without one
        (an evaluation in grad mode, an early exit, ``retain_graph``) would leak its activations."""
        got = None if self.in_checkpoint else self._pack_own(t)
        if got is not None:
            return got
        if self.outer_hooks is not None:
            return OuterSaved(self.outer_hooks[0](t))
        return t.detach()

    def _pack_own(self, t: torch.Tensor) -> Packed | None:
        got = packed_reference(self.storages, t) if self.storages else None
        if got is not None:
            self.packed_units.add(got.unit)
        return got

    @eager
    def unpack(self, x: Any) -> torch.Tensor:
        """Re-gather a packed tensor's unit on first use in backward (``OuterSaved``: the outer hooks' unpack)."""
        if not isinstance(x, Packed):
            return self.outer_hooks[1](x.value) if isinstance(x, OuterSaved) and self.outer_hooks is not None else x
        base = self.regather(x.unit)[x.fqn]
        local = base.as_strided(x.size, x.stride, x.offset)
        return local if x.spec is None else DTensor(local, x.spec, requires_grad=False)

    # --- backward --------------------------------------------------------------------------------
    def regather(self, name: str) -> dict[str, torch.Tensor]:
        """Unit ``name``'s full parameters again (no autograd), prefetching the unit backward needs next."""
        full = self.regathered.get(name)
        if full is None:
            self._finish_deferred_reductions()
            full = self.held.pop(name, None)  # kept from this call's forward: nothing to move
            if full is not None:
                self._gathered_again(name, full)  # (as a re-gather's result: compat may keep it after backward)
            else:
                full = self._kept_copy(name)
            if full is None:
                b = self._collective(self._group(name))
                if b.in_place:
                    outs = b.run_in_place([t.detach() for t in self._shards(b)])
                else:
                    outs = b.finish(self.pending_back.pop(name, None) or self._launch(name), release=True)
                full = self.parking.refilled(name, dict(zip(b.fqns, outs)))
                self._gathered_again(name, full)
            else:  # what holds the group's parked storages reads them in this backward: the values go back in
                full = self.parking.refilled(name, full)
            self.regathered[name] = full
            if not self._prefetch_at_release:
                self._prefetch_backward(name)
        return full

    def _finish_deferred_reductions(self) -> None:
        # On CPU a unit's backward starts only after the reduction still in flight is done: that frees its
        # full-size input before this unit's gradients are made, so the peak is never a unit's gradients
        # plus another's reduction (torch's CPU FSDP2 reduces synchronously: that is its peak). On CUDA
        # the overlap stays, as in FSDP2.
        if self.deferred is not None and self.deferred.handles and self.plan.comm.groups.device_type != "cuda":
            self.deferred.wait()

    def _prefetch_backward(self, name: str) -> None:
        for prev in self.backward_prefetch(name):
            if prev in self.packed_units and prev not in self.regathered and prev not in self.pending_back and prev not in self.held and self._kept_copy(prev) is None:
                self.pending_back[prev] = self._launch(prev)

    def _kept_copy(self, name: str) -> dict[str, torch.Tensor] | None:
        """Group ``name``'s parameters if they are kept gathered outside this call (compat's
        ``fsdpfn/compat/kept.py``): its gather, in forward or backward, then moves nothing."""
        return None

    def _gathered_again(self, name: str, full: dict[str, torch.Tensor]) -> None:
        """Group ``name`` was just re-gathered for backward (compat may keep the copy)."""

    def _take_kept(self, name: str) -> dict[str, torch.Tensor] | None:
        """Group ``name``'s copy kept gathered outside this call, handed to this forward's gather (which
        then owns it), or ``None``."""
        return None

    def _release(self, name: str) -> None:
        # The unit's gradient reduction is starting: every use of its parameters in backward is done.
        self.awaiting_backward.discard(name)
        self.regathered.pop(name, None)
        self.held.pop(name, None)
        self.gathered.pop(name, None)
        self._swap_out(name)
        self._repark(name)
        if self._prefetch_at_release:
            self._prefetch_backward(name)

    def _repark(self, name: str) -> None:
        # Group name's backward is done with its parked storages: zero bytes again until a backward of the
        # same graph (retain_graph) re-gathers it. Not while a copy is kept gathered from them (compat's
        # reshard_after_backward=False), and not for a group with frozen parameters: a backward node that
        # reads a frozen one gives the reduction no gradient, so it may still run after it.
        if name in self.parking and self._kept_copy(name) is None and all(self.tracks_grad.get(name, {}).values()):
            self.parking.repark(name)

    def _swap_out(self, name: str) -> None:
        """Tell the owner that group ``name``'s reduction starts (its backward-time swaps come out); the
        gradients a reentrant checkpoint inside the unit left on them ride the forward gather's reduction
        (``CallInfo.extra``)."""
        extra = self.released(self, name) if self.released is not None else None
        if extra:
            kept = self.extra_grads.setdefault(name, {})
            for f, g in extra.items():
                kept[f] = g if f not in kept else kept[f] + g

    def gather_for_reentrant(self, name: str) -> dict[str, torch.Tensor]:
        """Group ``name`` gathered again, differentiably, for a reentrant checkpoint's recompute. That
        checkpoint differentiates its recompute in a backward of its own, so the values it reads must lead
        back to the shards through a gather whose backward is the group's reduction (the forward ran the
        region under ``no_grad``, or its gradients never reach the forward's gather). Reductions add up:
        one here and one through the forward's gather, when both carry gradients, give their sum."""
        b = self._collective(self._group(name))
        shards = self._shards(b)
        with torch.enable_grad():
            outs = apply_buckets(b, shards, self.info(name))
        grad_fn = next((o.grad_fn for o in outs if o.grad_fn is not None), None)
        if grad_fn is not None:
            grad_fn.register_prehook(lambda _grads: self._swap_out(name))  # its reduction starts: swap it out
        return dict(zip(b.fqns, outs))

    def values_for_recompute(self, name: str) -> dict[str, torch.Tensor]:
        """Unit values for an activation-checkpoint recompute in backward (same requires_grad as forward)."""
        full = (None if name in self.parking else self.gathered.get(name)) or self.regather(name)
        grad = self.tracks_grad.get(name, {})
        return {f: t.detach().requires_grad_(grad.get(f, False)) for f, t in full.items()}
