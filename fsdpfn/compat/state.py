"""The per-call state of ``fully_shard``: one ``UnitState`` per group of modules sharded together.

A ``UnitState`` holds what ``fully_shard`` was told (mesh, policies, ``reshard_after_forward``), the
parameters it converted to ``DTensor``s and where they are registered, and the settings the
``FSDPModule.set_*`` methods change. It holds no communication: the root's ``RootContext`` turns the
states of a module tree into one plan and runs it on ``fsdpfn.transform``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fsdpfn.core.custom import CustomComms
from fsdpfn.ops.slots import set_parameter
from fsdpfn.policy import MixedPrecisionPolicy, OffloadPolicy

if TYPE_CHECKING:
    from fsdpfn.compat.root import RootContext
    from fsdpfn.compat.tp import TPParam

__all__ = ["ManagedParam", "UnitState", "drop_unsharded", "mark_sharded", "sharded_as", "state_of"]

_ATTR = "_fsdpfn_compat_state"
_SHARDED_AS = "_fsdpfn_compat_sharded_as"


@dataclass(eq=False)
class ManagedParam:
    """One parameter a ``fully_shard`` call sharded: the ``DTensor`` parameter, every
    ``(module, attribute)`` it is registered under (several when it is tied), the dim it is split on,
    the shape the all-gather rebuilds (the TP-local shape of a tensor-parallel parameter, else the full
    shape) and, for a tensor-parallel parameter, its TP layout."""

    param: nn.Parameter
    slots: list[tuple[nn.Module, str]]
    dim: int = 0
    gathered: tuple[int, ...] = ()
    tp: TPParam | None = None
    where: str = ""  # "parameter 'weight' of Linear", for messages
    extension: bool = False  # its tensor subclass defines fsdp_pre_all_gather/fsdp_post_all_gather


@dataclass(eq=False)
class UnitState:
    """What one ``fully_shard`` call (or ``replicate``) decided, plus the knobs of ``FSDPModule``."""

    modules: tuple[nn.Module, ...]
    mesh: Any
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    reshard_after_forward: bool | int | None
    placements: tuple[Any, ...]
    managed: list[ManagedParam]
    kind: str = "fully_shard"  # or "replicate"
    ignored: frozenset[int] = frozenset()  # ids of the ignored_params given (unmanaged on purpose)
    parent: UnitState | None = None  # the state of the nearest fully_shard call above (set by that call)
    # that call's state when it was on another mesh (MoE experts on their own mesh inside a block) or of
    # the other kind (replicate inside fully_shard): this state then roots a plan of its own, run inside
    # the enclosing root's forward (RootContext.nested_states)
    outer: UnitState | None = None
    # knobs (FSDPModule.set_*)
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True  # recorded only: every backward with sync on reduces fully (module.py)
    reshard_after_backward: bool = True  # False: keep the copy a backward gathered (compat/kept.py)
    divide_factor: float | None = None
    reduce_scatter_unused: bool = False
    forward_prefetch: list[UnitState] | None = None
    backward_prefetch: list[UnitState] | None = None
    post_optim_event: Any = None
    min_bucket_bytes: int | str | None = "auto"  # fsdpfn extension, read on the root (set_min_bucket_bytes)
    force_sum_reduction: bool = False
    separate_reduce_group: bool = False  # set_separate_reduce_scatter_group (root-wide, see RootContext.begin)
    reduce_group_changed: bool = False  # on the top state: some unit below changed separate_reduce_group
    custom: CustomComms | None = None  # set_custom_all_gather / _reduce_scatter / set_all_reduce_hook (compat.hooks)
    comm_box: list[Any] | None = None  # share_comm_ctx: one [Comm | None] shared by several roots
    # runtime
    root: RootContext | None = None  # the root whose plan runs this state (set by lazy init)
    name: str = ""  # this state's unit name in the root's plan
    acc: dict[str, torch.Tensor] = field(default_factory=dict)  # unreduced grads while sync is off
    unsharded: Any = None  # an explicit unshard(): (handles, full tensors or None, buckets, shard_versions)

    def top(self) -> UnitState:
        """The outermost state above this one on the same mesh (the root lazy init will pick)."""
        st = self
        while st.parent is not None:
            st = st.parent
        return st

    def fuse_key(self, is_root: bool) -> tuple[Any, ...]:
        """Units fuse only with neighbours that agree on every knob a collective group shares."""
        return (*self.plan_key(is_root), *self.sync_key())

    def sync_key(self) -> tuple[bool]:
        """The gradient-sync switch: ``fuse_key``'s part that gradient accumulation and pipeline schedules
        toggle, on every unit alike (``requires_all_reduce`` changes no reduction: see
        ``FSDPModule.set_requires_all_reduce``)."""
        return (self.requires_gradient_sync,)

    def plan_key(self, is_root: bool) -> tuple[Any, ...]:
        """``fuse_key`` without the gradient-sync switches: the knobs a planned grouping was priced with.
        Gradient accumulation toggles ``set_requires_gradient_sync`` on every unit alike, which keeps the
        groups the first forward planned (``RootContext``)."""
        return (
            self.reshards(is_root), self.mp_policy, self.divide_factor, self.reduce_scatter_unused,
            self.forward_prefetch is None, self.backward_prefetch is None, len(self.modules) == 1,
            None if self.custom is None else id(self),  # custom collectives run per unit, as in FSDP2
        )  # fmt: skip

    def reshards(self, is_root: bool) -> bool:
        """Whether this unit drops its gathered parameters after forward."""
        r = self.reshard_after_forward
        if r is None:
            return not is_root
        if isinstance(r, bool):
            return r
        return r != 1  # reshard to 1 rank = keep everything; any other factor reshards fully (docs/compat.md)


def state_of(module: nn.Module) -> UnitState | None:
    """The ``UnitState`` of a module ``fully_shard``/``replicate`` was applied to, else ``None``."""
    return module.__dict__.get(_ATTR)


def set_state(module: nn.Module, state: UnitState) -> None:
    module.__dict__[_ATTR] = state


def mark_sharded(original: nn.Parameter, managed: ManagedParam) -> None:
    """Remember on the plain parameter ``fully_shard`` replaced that ``managed`` is its sharded form: a
    later call that still finds it (tied to a module outside the earlier call) registers the same
    ``DTensor`` instead of making a second, independent one."""
    original.__dict__[_SHARDED_AS] = managed


def sharded_as(original: nn.Parameter) -> ManagedParam | None:
    """The ``ManagedParam`` an earlier ``fully_shard`` call made of ``original``, else ``None``."""
    return original.__dict__.get(_SHARDED_AS)


def drop_unsharded(state: UnitState) -> None:
    """Undo an explicit ``unshard()``: register the sharded ``DTensor`` parameters again."""
    state.unsharded = None
    for m in state.managed:
        for mod, attr in m.slots:
            set_parameter(mod, attr, m.param)
