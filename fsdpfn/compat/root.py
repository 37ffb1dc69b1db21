"""The root of a ``fully_shard`` tree: one plan over all its units, run by ``fsdpfn.transform``.

Lazy initialisation (the first forward, ``unshard`` or ``state_dict``-free call that needs it) makes
the module whose forward runs first the root: every ``fully_shard`` state below it becomes a unit of
one ``ShardPlan`` (unit name = the state's module FQN relative to the root, ``""`` for the root's own
parameters) sharing one ``Comm``. Each forward builds the ``Sharded`` tree from the ``DTensor``
parameters' local shards (``to_local()``, so autograd carries the reduced shard gradients back into the
parameters' ``.grad``) and runs the module through ``Apply.run``. The per-unit knobs of ``FSDPModule``
(resharding, gradient sync, divide factor, explicit prefetch) are read live by its executor
(``fsdpfn.compat.executor``). What the tree holds is collected by ``fsdpfn.compat.collect``; the root
plans again when it changes (dtypes, which parameters require a gradient, the module tree).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpfn.compat.checks import check_materialized, explain_sharded_read, state_name
from fsdpfn.compat.collect import collect_params, collect_units, follow_moved
from fsdpfn.compat.executor import CompatApply, LocalShards
from fsdpfn.compat.kept import KeptCopies
from fsdpfn.compat.planned import PlannedGroups, plans_groups
from fsdpfn.compat.replaced_params import note_replacement
from fsdpfn.compat.state import UnitState, drop_unsharded
from fsdpfn.compat.tree import ModuleTree, check_managed, unmanaged_parameter_error
from fsdpfn.compat.unreduced_step import watch_unreduced
from fsdpfn.core import Comm, link_of
from fsdpfn.layout import Sharded, ShardPlan, build_plan
from fsdpfn.layout.autobucket import LinkCost
from fsdpfn.layout.plan import FUSED
from fsdpfn.ops.api import gather_collective
from fsdpfn.ops.buckets import Buckets
from fsdpfn.ops.deferred import DeferredReductions
from fsdpfn.ops.slots import set_parameter
from fsdpfn.transform.apply import OpenCall
from fsdpfn.transform.eager import eager
from fsdpfn.transform.validate import explain_inplace_error

__all__ = ["RootContext", "lazy_root"]


class RootContext:
    """The plan, ``Apply`` and parameter bookkeeping of one root module."""

    def __init__(self, module: nn.Module, state: UnitState):
        self.module = module
        self.state = state
        self.running = False
        self.opened: OpenCall | None = None  # the running call
        self.deferred = DeferredReductions()
        self.comm: Comm | None = None
        self.states: dict[str, UnitState] = {}
        self.nested_states: dict[str, UnitState] = {}  # roots of their own below this one (another mesh)
        self.acc: dict[str, torch.Tensor] = {}  # unreduced grads of every unit (fqns are unique)
        # a forward ran with some unit's sync off since the last backward that looked for stranded gradients
        # (compat/stranded.py); set by user switches alike on every rank, so every rank looks at the same point
        self.accumulating = False
        self._fusion: Any = None  # what the plan's groups were built from
        self.planned = PlannedGroups()  # the groups the first forward plans (compat/planned.py)
        self.planning = False  # the first forward's fusion planner is running the module on fake tensors
        self.ignored: frozenset[str] = frozenset()  # FQNs of the parameters left unmanaged (ignored_params)
        self._plan_for_grads: dict[tuple[bool, ...], ShardPlan] = {}  # see _replan_for_grads
        self.kept = KeptCopies()  # gathered copies kept between gathers (compat/kept.py)
        self._build()
        self.apply = CompatApply(self)
        watch_unreduced(self)  # an optimizer step before the accumulated gradients are reduced is refused

    # --- set-up -----------------------------------------------------------------------------------
    def _build(self) -> None:
        """Collect the states below the root and make one plan over them."""
        self.planned.note(getattr(self, "plan", None))
        self.kept.drop()  # kept by the old plan's group names
        if len(self.state.modules) > 1:
            raise RuntimeError(
                f"{state_name(self.state.kind)} requires a single root module but got {self.state.modules}\n"
                f"these modules were passed to one {self.state.kind} call; apply {self.state.kind} to a module "
                "holding them all (e.g. the model) and run forward through it"
            )
        states, unit_at, nested = collect_units(self.module, self.state, self)
        found = collect_params(self.module, self.state, states, unit_at, self.ignored, nested)
        self.managed, self.tp = found.managed, found.tp
        mesh = self.state.mesh
        if self.comm is None:
            box = self.state.comm_box  # share_comm_ctx: the first root to build makes the shared Comm
            shared = box[0] if box is not None else None
            replicate_only = self.state.kind == "replicate"
            if shared is not None and shared.mesh == mesh and shared.replicate_only == replicate_only:
                self.comm = shared
            else:
                self.comm = Comm(mesh, replicate_only=replicate_only)
                if box is not None and shared is None:
                    box[0] = self.comm
        groups = self.comm.groups
        unit_names = list(states)
        if "" not in states:
            unit_names.insert(0, "")
        first = self._fusion is None
        self._fusion = self._fusion_inputs(states)
        min_bytes, keys = self._fusion
        self.plan = build_plan(
            found.infos,
            [],
            unit_names,
            min_bucket_bytes=min_bytes,
            fuse_key=keys.__getitem__,
            link=self._link,
            rank=groups.rank,
            world=groups.world,
            aliases=found.aliases,
            unit_dtypes={n: (s.mp_policy.gather_dtype, s.mp_policy.grad_reduce_dtype) for n, s in states.items()},
            unit_policies={n: s.mp_policy for n, s in states.items()},
            replicas=groups.replicas,
            mesh=mesh,
            comm=self.comm,
            mp_policy=self.state.mp_policy,
            module_type=type(self.module).__name__,
            ignored=tuple(found.ignored),
            transforms=found.transforms,
        )
        if first and plans_groups(self.state, states):
            object.__setattr__(self.plan, "auto_fusion", True)  # the first forward may regroup (transform/fusion.py)
            self.planned.start(self.state, states)
        elif not first:
            self.planned.reapply(self.plan, self.state, states, keys)
        for name, st in states.items():
            st.root, st.name = self, name
            if st.acc is not self.acc:  # one accumulator for all units: regrouping never strands a gradient
                self.acc.update(st.acc)
                st.acc = self.acc
        self.states = states
        self.nested_states = nested
        self.ignored = frozenset(found.ignored)
        self.fqns = found.fqns
        self.managed_fqns = tuple(self.managed)  # LocalShards' outputs, in order: where deferred results go
        self.tree = ModuleTree(self.module)
        self._plan_for_grads[self._grad_pattern()] = self.plan

    def _grad_pattern(self) -> tuple[bool, ...]:
        return tuple(m.param.requires_grad for m in self.managed.values())

    def _replan_for_grads(self) -> None:
        """Freezing or unfreezing parameters changes which buckets reduce: one plan per ``requires_grad``
        pattern, kept until something else changes (a GAN freezes its discriminator for every generator
        step; a rebuild costs tens of milliseconds on a large model)."""
        plan = self._plan_for_grads.get(self._grad_pattern())
        if plan is None:
            self._build()
        else:
            self.plan = plan

    def _explicitly_unsharded(self, m: Any) -> bool:
        return any(st.unsharded is not None and any(x is m for x in st.managed) for st in self.states.values())

    def _link(self) -> LinkCost:
        """The mesh's all-gather cost, measured on first need (``min_bucket_bytes="auto"``) and kept."""
        assert self.comm is not None
        return link_of(self.comm)

    def fuse_keys(self) -> dict[str, Any]:
        """Each unit's key as the current plan was built with (``UnitState.fuse_key``, less the sync
        switches when every unit has the same): units fuse only where their keys agree."""
        assert self._fusion is not None
        return self._fusion[1]

    def _fusion_inputs(self, states: dict[str, UnitState]) -> tuple[int | None, dict[str, Any]]:
        # Units that sync gradients differently never share a group. When all sync alike (gradient
        # accumulation and pipeline schedules toggle every unit at once) the switches separate nothing:
        # left out, toggling them keeps the plan (and the kept gathered copies) instead of rebuilding.
        keys = {n: st.plan_key(self.is_root(st)) for n, st in states.items()}
        if len({st.sync_key() for st in states.values()}) > 1:
            keys = {n: (*k, *states[n].sync_key()) for n, k in keys.items()}
        return self.state.min_bucket_bytes, keys

    def is_root(self, st: UnitState) -> bool:
        """Whether ``st`` is FSDP's root: this root's own state, unless this root is nested in another
        one's forward (``UnitState.outer``), where its state behaves as any unit's (resharding by default)."""
        return st is self.state and self.state.outer is None

    def family(self) -> list[RootContext]:
        """This root and the roots initialised below it on other meshes (``UnitState.outer``), at any
        depth: what the root module's ``zero_grad`` and ``reset_iter_state`` reach."""
        found = [self]
        for st in self.nested_states.values():
            if st.root is not None and st.root is not self:
                found.extend(st.root.family())
        return found

    def unit_state(self, name: str) -> UnitState | None:
        """The state of unit ``name``, or of the first unit of fused group ``name`` (fused units share
        every knob, see ``UnitState.fuse_key``); ``None`` for a root without a state of its own."""
        st = self.states.get(name)
        if st is None and FUSED in name:  # (by its name, not the plan: a call's group may be one planned before)
            st = self.states[name.split(FUSED)[0]]
        return st

    def knobs(self, name: str) -> UnitState:
        """The state whose ``FSDPModule`` settings unit or group ``name`` follows (the root's when the
        root owns no state of its own)."""
        return self.unit_state(name) or self.state

    def names_of(self, states: Sequence[UnitState]) -> list[str]:
        """The unit names of ``states`` (explicit prefetch lists); units without parameters drop out, and
        so do the nested roots' states (``nested_prefetch`` starts those)."""
        units = {u.name for u in self.plan.units}
        states = [st for st in states if not self._nested(st)]
        for st in states:
            if st.root is not self:
                raise ValueError(
                    "set_modules_to_forward/backward_prefetch: a module in the list is not a fully_shard unit of "
                    f"this root ({type(self.module).__name__})"
                )
        groups = [self.plan.group_of[st.name] for st in states if st.name in units]
        return list(dict.fromkeys(groups))

    def _nested(self, st: UnitState) -> bool:
        return any(st is n for n in self.nested_states.values())

    def nested_prefetch(self, name: str) -> None:
        """Start the gathers of the nested roots in unit ``name``'s forward prefetch list (torchtitan lists
        the next block's experts, on their own mesh, beside the block) as their explicit ``unshard()``:
        their forward then finds them in flight."""
        st = self.states.get(name)
        listed = st.forward_prefetch if st is not None else None
        for other in listed or ():
            if self._nested(other) and other.unsharded is None:
                other.modules[0].unshard(async_op=True)

    # --- knobs, read per call -----------------------------------------------------------------------
    def reshards(self, name: str) -> bool:
        st = self.unit_state(name)
        return st is not None and st.reshards(is_root=self.is_root(st))

    def defers(self, name: str) -> bool:
        """Whether unit or group ``name``'s backward keeps its gradients unreduced (``acc``) for now:
        gradient sync off. (HSDP's all-reduce over replicas off does not defer: see
        ``FSDPModule.set_requires_all_reduce``.)"""
        st = self.knobs(name)
        return not st.requires_gradient_sync

    def scale(self, name: str) -> float:
        st = self.knobs(name)
        if st.divide_factor is not None:
            return 1.0 / st.divide_factor
        return 1.0 / (self.plan.world * self.plan.replicas)

    def collective(self, unit: Any) -> Buckets:
        """The gather (and, as its backward, reduce) of ``unit`` with its knobs: divide factor and the
        user's collectives and all-reduce hook."""
        st = self.unit_state(unit.name)  # (scale() inlined: this runs for every unit of every call)
        knobs = st or self.state
        scale = 1.0 / knobs.divide_factor if knobs.divide_factor is not None else 1.0 / (self.plan.world * self.plan.replicas)
        return gather_collective(self.plan, (unit,), scale, None if st is None else st.custom)

    # --- calls ------------------------------------------------------------------------------------
    def params(self, deferred: DeferredReductions | None = None) -> Sharded[torch.Tensor]:
        """This call's tree: the local shards of the registered ``DTensor`` parameters."""
        stale = meta = regrad = False
        moved = self.tree.changed()
        if moved:  # e.g. a parametrization registered after fully_shard moved a weight: follow it
            follow_moved(self.module, self.states.values())
        for fqn, m in self.managed.items():
            mod, attr = m.slots[0]
            current = mod._parameters.get(attr)
            if current is not m.param:
                if not isinstance(current, DTensor):
                    if self._explicitly_unsharded(m):
                        continue  # FSDPModule.unshard() registered the full parameters until this forward ends
                    raise unmanaged_parameter_error(fqn, current, mod, self.state.kind)
                _check_replacement(fqn, m.param, current)
                for mo, at in m.slots:
                    set_parameter(mo, at, current)
                m.param = current
                note_replacement()  # an optimizer holding the earlier one is refused at its next step
            stale = stale or m.param.dtype != self.plan.dtypes[fqn]  # model.to(dtype)
            regrad = regrad or m.param.requires_grad != self.plan.requires_grad[fqn]  # frozen or unfrozen
            meta = meta or m.param.is_meta
        if meta:
            check_materialized(self)
        if moved:
            states = [*self.states.values(), *self.nested_states.values()]
            fqns = check_managed(self.module, states, self.ignored, self.state.kind)
            if fqns == self.fqns:
                self.tree = ModuleTree(self.module)  # a parameter-free module swapped: nothing to plan again
            else:
                stale = True  # a unit moved (its parameters' names changed): plan the tree as it is
        fusing = self._fusion[0] or self.state.min_bucket_bytes
        if stale or (fusing and self._fusion != self._fusion_inputs(self.states)):
            self._plan_for_grads.clear()
            self._build()  # e.g. model.to(dtype): same units, new dtypes; or a knob that splits a fused group
        elif regrad:
            self._replan_for_grads()
        params = [m.param for m in self.managed.values()]
        local = LocalShards.apply(
            tuple(p._spec for p in params), self.managed_fqns, deferred if deferred is not None else DeferredReductions(),
            self, *params,
        )  # fmt: skip
        return Sharded._from_children(list(local), self.plan)

    def run(self, inside: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``inside(*args, **kwargs)`` (the root's forward, or a child's forward or method) with the
        units gathered: the root unit for the whole call, the others by their hooks."""
        if torch.compiler.is_compiling():  # no try block around traced code: see Apply._run_traced
            opened, args, kwargs = _begin_eagerly(self, args, kwargs)
            out = inside(*args, **kwargs)
            return _end_eagerly(self, opened, out)
        opened, args, kwargs = self.begin(args, kwargs)
        try:
            out = inside(*args, **kwargs)
        except BaseException as exc:
            self.close(opened)
            explained = explain_inplace_error(exc, opened.call) or explain_sharded_read(exc, self, opened.call)
            if explained is None:
                raise
            raise explained from exc
        return self.end(opened, out)

    def begin(self, args: tuple[Any, ...], kwargs: dict[str, Any], traced: bool = False) -> tuple[OpenCall, Any, Any]:
        """Start a root call (see ``Apply.begin``); ``end`` or ``close`` finishes it."""
        event = self.state.post_optim_event
        if event is not None:
            self.comm.wait_event(event)
            self.state.post_optim_event = None
        if self.state.reduce_group_changed:  # set_separate_reduce_scatter_group since the last forward
            self.state.reduce_group_changed = False
            # every rank reaches this point together: where a separate reduce-scatter group is created
            self.comm.separate_reduce_group(any(st.separate_reduce_group for st in self.states.values()))
        self.deferred = DeferredReductions()  # this forward's reductions; its LocalShards backward adds them
        params = self.params(self.deferred)
        opened, args, kwargs = self.apply.begin(params, args, kwargs, traced)
        self.opened = opened
        self.running = True
        return opened, args, kwargs

    def close(self, opened: OpenCall) -> None:
        """End a root call whose forward raised."""
        try:
            self.apply.close(opened)
        finally:
            self._finish()

    def end(self, opened: OpenCall, out: Any) -> Any:
        """End a root call whose forward returned ``out``."""
        try:
            return self.apply.end(opened, out)
        finally:
            self._finish()

    def close_stale(self) -> None:
        """Close the running call if its traced forward raised (its caller's frame is gone), and take out
        the gathered values a backward that raised left registered (before, the next forward refused them
        as parameters replaced by plain tensors, even after ``reset_iter_state()``)."""
        if self.opened is not None and self.apply.close_stale():
            self._finish()
        self.apply.leave_failed_backward()

    def _finish(self) -> None:
        self.running = False
        self.opened = None
        for st in self.states.values():  # an explicit unshard() lasts until the next forward used it
            if st.unsharded is not None:
                drop_unsharded(st)


@eager
def _begin_eagerly(ctx: RootContext, args: Any, kwargs: Any) -> Any:
    return ctx.begin(args, kwargs, traced=True)


@eager
def _end_eagerly(ctx: RootContext, opened: OpenCall, out: Any) -> Any:
    return ctx.end(opened, out)


def _check_replacement(fqn: str, old: DTensor, new: DTensor) -> None:
    if new.shape != old.shape or new.placements != old.placements or new.device_mesh != old.device_mesh:
        raise ValueError(
            f"parameter {fqn!r} was replaced by a DTensor of shape {tuple(new.shape)} with placements "
            f"{new.placements}, but fully_shard sharded it as {tuple(old.shape)} {old.placements}; load a state dict "
            "from a model sharded the same way (or reshard it with torch.distributed.checkpoint)"
        )


def lazy_root(state: UnitState, module: nn.Module) -> RootContext:
    """The root context ``state`` runs under, initialising ``module`` as a root when none exists yet."""
    if state.root is None:
        RootContext(module, state)
    assert state.root is not None
    return state.root
