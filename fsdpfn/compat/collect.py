"""What a compat root's module tree holds: the ``fully_shard`` states below it and each parameter's unit.

``collect_units`` finds every state under the root module (its unit name is the module's FQN relative
to the root, ``""`` for the root's own), leaves the subtrees of states on another mesh to plans of their
own (``UnitState.outer``) and refuses trees one plan cannot run (another root already initialised below,
a state on another mesh sharded after the root, ``replicate`` mixed with ``fully_shard``). ``collect_params`` walks
``named_parameters`` once: each managed parameter once under its first name (later names are aliases,
and the parameter belongs to the innermost unit holding all its names, as a tied parameter does in
``fsdpfn.shard``), the unmanaged ones ``ignored_params`` allowed, and the ``ParamInfo``s the plan is
built from. Both are rerun whenever the root re-plans (``RootContext._build``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdpfn.compat.checks import state_name
from fsdpfn.compat.state import ManagedParam, UnitState, sharded_as, state_of
from fsdpfn.compat.tp import TPParam
from fsdpfn.compat.tree import unmanaged_parameter_error
from fsdpfn.layout import ParamInfo
from fsdpfn.ops.extension import shard_mesh, subclass_transform

__all__ = ["Collected", "collect_params", "collect_units", "follow_moved"]


def collect_units(
    module: nn.Module, state: UnitState, owner: Any
) -> tuple[dict[str, UnitState], dict[str, str], dict[str, UnitState]]:
    """The states of the ``fully_shard`` calls under root ``module`` (whose own state is ``state`` and
    whose root context is ``owner``), by unit name, each module path's unit, and the states below that
    root plans of their own (``UnitState.outer``: sharded on another mesh; their subtrees are theirs).

    Example:
        >>> states, unit_at, nested = collect_units(model, state_of(model), root)   # doctest: +SKIP
        >>> list(states), list(nested)                                               # doctest: +SKIP
        (['', 'blocks.0', 'blocks.1'], ['blocks.0.experts', 'blocks.1.experts'])
    """
    states: dict[str, UnitState] = {}
    unit_at: dict[str, str] = {}  # module path -> the unit (state name) of that module's fully_shard call
    nested: dict[str, UnitState] = {}
    for fqn, mod in module.named_modules():
        if any(fqn.startswith(f"{n}.") for n in nested):
            continue
        st = state_of(mod)
        if st is None:
            continue
        if st.outer is not None and st is not state:
            nested[fqn] = st
            continue
        name = next((n for n, s in states.items() if s is st), None)
        if name is not None:
            unit_at[fqn] = name
            continue
        unit_at[fqn] = fqn
        if st.root is not None and st.root is not owner:
            who = state_name(state.kind)
            if st.root.module is not mod:  # a unit of another root: one module under two roots
                raise RuntimeError(
                    f"{who} state has already been lazily initialized for {fqn}\n{fqn!r} ({type(mod).__name__}) is "
                    f"already a unit of another root, {type(st.root.module).__name__}, whose forward ran first: a "
                    f"module shared by two {state.kind} roots (an encoder used by two models) has one set of shards "
                    f"and one gradient, so it must belong to one root: {state.kind} a module holding both models "
                    "as the root and run both through its forward"
                )
            raise RuntimeError(
                f"{who} state has already been lazily initialized for {fqn}\n{who} requires running forward "
                f"through the root module first\n{fqn!r} ({type(mod).__name__}) ran (forward or unshard) as a root "
                f"of its own before the root module {type(module).__name__}; call the root's forward first"
            )
        states[fqn] = st
    for name, st in states.items():
        if st.mesh != state.mesh:
            raise NotImplementedError(
                f"fully_shard: module {name!r} was sharded on a different mesh than the root "
                f"{type(module).__name__}, after the root's own fully_shard call: apply fully_shard to the modules "
                "inside first, then to the root (a module on its own mesh then runs as a plan of its own)"
            )
        if st.kind != state.kind:
            raise NotImplementedError(
                f"{st.kind} on {name!r} was applied after {state.kind} on the root {type(module).__name__}: apply "
                f"{st.kind} to the modules inside first, then {state.kind} to the root (inside first, it runs as a "
                "plan of its own)"
            )
    return states, unit_at, nested


@dataclass
class Collected:
    """The parameters of a root's tree, as ``collect_params`` found them."""

    managed: dict[str, ManagedParam]  # first name -> the parameter fully_shard manages
    tp: dict[str, TPParam]  # tensor-parallel parameters: how the forward must see them
    aliases: dict[str, str]  # a tied parameter's other names -> its first
    ignored: list[str]  # names left unmanaged (ignored_params)
    fqns: list[str]  # every parameter name, as the root compares after a change of the module tree
    infos: list[ParamInfo]  # what the plan is built from, one per managed parameter
    transforms: dict[str, Any]  # FSDP2 all-gather extensions: how each such subclass gathers


def collect_params(
    module: nn.Module,
    state: UnitState,
    states: dict[str, UnitState],
    unit_at: dict[str, str],
    allowed: frozenset[str],
    nested: Iterable[str] = (),
) -> Collected:
    """Every parameter of root ``module``'s tree with its unit. ``allowed``: names an earlier plan of this
    root left unmanaged (their ``ignored_params`` may be gone from the tree's states since); ``nested``:
    the module paths whose parameters plans of their own manage (``collect_units``).

    Example:
        >>> found = collect_params(model, root_state, states, unit_at, frozenset())   # doctest: +SKIP
        >>> found.infos[0].unit                                                       # doctest: +SKIP
        'blocks.0'
    """
    follow_moved(module, states.values())
    slot_of = {}
    for name, st in states.items():
        for m in st.managed:
            for mod, attr in m.slots:
                slot_of[(id(mod), attr)] = (name, m)
    found = Collected({}, {}, {}, [], [], [], {})
    ignored_ids = state.ignored.union(*(st.ignored for st in states.values()))
    owner_name: dict[int, str] = {}
    units_of: dict[int, list[str]] = {}  # per ManagedParam: the units enclosing all its names, outermost first
    inside = tuple(f"{n}." for n in nested)
    for fqn, p in module.named_parameters(remove_duplicate=False):
        found.fqns.append(fqn)
        if fqn.startswith(inside):
            continue
        path, _, attr = fqn.rpartition(".")
        mod = module.get_submodule(path)
        hit = slot_of.get((id(mod), attr))
        if hit is None:
            _check_not_managed_elsewhere(fqn, p, type(module).__name__)
            if id(p) not in ignored_ids and fqn not in allowed:
                raise unmanaged_parameter_error(fqn, p, mod, state.kind)
            found.ignored.append(fqn)
            continue
        m = hit[1]
        enclosing = _enclosing_units(path, unit_at)
        if id(m) in owner_name:
            found.aliases[fqn] = owner_name[id(m)]
            units_of[id(m)] = [u for u in units_of[id(m)] if u in enclosing]
            continue
        owner_name[id(m)] = fqn
        units_of[id(m)] = enclosing
        found.managed[fqn] = m
        if m.tp is not None:
            found.tp[fqn] = m.tp
    for fqn, m in found.managed.items():
        # A tied parameter belongs to the innermost unit holding all its names (as in fsdpfn.shard):
        # gathered wherever any of them runs, one gradient summed over every use.
        unit = units_of[id(m)][-1]
        local = m.param.to_local()
        found.infos.append(ParamInfo(fqn, m.gathered or tuple(m.param.shape), local.dtype, m.param.requires_grad, unit, m.dim))
        if m.extension:  # FSDP2's all-gather extension: the subclass gathers in its own representation
            owner = states.get(unit, state)
            found.transforms[fqn] = subclass_transform(
                shard_mesh(state.mesh), tuple(m.param.shape), m.slots[0][0], owner.mp_policy, fallback=_local_of(m)
            )
    return found


def follow_moved(root: nn.Module, states: Iterable[UnitState]) -> None:
    """Point each managed parameter's slots at where ``root``'s tree holds it now. A parametrization
    registered on a unit's weight after ``fully_shard`` (``torch.nn.utils.parametrize``, the
    ``parametrizations.weight_norm`` family) moves the parameter to ``parametrizations.weight.original``
    of the same unit: it stays the same ``DTensor``, gathered and reduced where it is now.

    Example:
        >>> parametrize.register_parametrization(model.blocks[0], "weight", Sym())   # doctest: +SKIP
        >>> follow_moved(model, states.values())     # now ...parametrizations.weight.original   # doctest: +SKIP
    """
    by_id = {id(m.param): m for st in states for m in st.managed}
    now: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in root.modules():
        for attr, p in mod._parameters.items():
            if p is not None and id(p) in by_id:
                now.setdefault(id(p), []).append((mod, attr))
    for key, slots in now.items():
        m = by_id[key]
        kept = [(mod, attr) for mod, attr in m.slots if mod._parameters.get(attr) is m.param]
        if len(kept) != len(m.slots) or len(slots) != len(kept):
            seen = {(id(mod), attr) for mod, attr in kept}
            m.slots[:] = kept + [(mod, attr) for mod, attr in slots if (id(mod), attr) not in seen]


def _enclosing_units(module_path: str, unit_at: dict[str, str]) -> list[str]:
    """The units whose modules contain the module at ``module_path``, outermost first (the root's
    unit ``""`` always)."""
    parts = module_path.split(".") if module_path else []
    found = [unit_at[pre] for pre in (".".join(parts[:i]) for i in range(len(parts) + 1)) if pre in unit_at]
    return found if found and found[0] == "" else ["", *found]


def _check_not_managed_elsewhere(fqn: str, param: Any, root: str) -> None:
    earlier = sharded_as(param)
    if earlier is not None and earlier.param is param:
        mod, attr = earlier.slots[0]
        raise ValueError(
            f"Parameter {fqn!r} is shared with a parameter already managed by another FSDP group: it is tied to "
            f"{attr!r} of {type(mod).__name__}, which fully_shard placed under another root than {root}. fsdpfn "
            "runs a tied parameter with the innermost fully_shard module holding all its uses: apply fully_shard "
            "to a module containing both (e.g. the model) and run forward through it"
        )


def _local_of(m: Any) -> Callable[[], torch.Tensor]:
    return lambda: m.param._local_tensor
