"""Which submodules are units: ``resolve_units`` reads a unit plan (names, module types or a predicate) and
refuses what could never be gathered; ``recompute_reads_values`` says whether a unit's values must be put
back for an activation-checkpoint recompute."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Sequence
from typing import Union

from torch import nn

__all__ = ["Units", "never_called", "owning_unit", "recompute_reads_values", "resolve_units"]

Units = Union[None, Sequence[str], type, tuple, Callable[[str, nn.Module], bool]]
"""A unit plan: submodule FQNs, module type(s), or a predicate ``(fqn, module) -> bool``."""


def recompute_reads_values(modules: Sequence[nn.Module], owners: Iterable[nn.Module]) -> bool:
    """Whether an activation-checkpoint recompute in backward could read a unit's parameters without the
    unit's own hooks running, so its values must be put back (gathered again) when its backward starts:
    not when the unit's ``modules`` are all torch.nn built-ins owning its parameters directly (``owners``,
    each parameter's module): a Linear or an Embedding checkpoints nothing inside its forward. The
    runtime (``fsdpfn.transform.recompute``) and the memory planner decide with this.

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> recompute_reads_values([lin], [lin, lin]), recompute_reads_values([nn.Sequential(lin)], [lin])
        (False, True)
    """
    ids = {id(m) for m in modules}
    builtin = all(getattr(type(m).forward, "__module__", "").startswith("torch.nn.") for m in modules)
    return not (builtin and all(id(o) in ids for o in owners))


def resolve_units(module: nn.Module, units: Units) -> list[str]:
    """The FQNs of the submodules that ``units`` selects, in module order (the root is implicit).

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> resolve_units(model, nn.Linear)
        ['0', '2']
    """
    named = dict(module.named_modules())
    if units is None:
        return []
    if isinstance(units, type) or (isinstance(units, tuple) and units and all(isinstance(u, type) for u in units)):
        return [fqn for fqn, m in named.items() if fqn and isinstance(m, units)]
    if callable(units):
        return [fqn for fqn, m in named.items() if fqn and units(fqn, m)]
    if isinstance(units, str):
        units = [units]
    if not isinstance(units, Iterable):
        raise TypeError(
            f"units must be a list of submodule names, a module type (or tuple of types) or a predicate "
            f"(fqn, module) -> bool; got {type(units).__name__}"
        )
    chosen = []
    for name in units:
        if not isinstance(name, str):
            raise TypeError(f"units: {name!r} is not a submodule name (str)")
        if name not in named:
            owner, _, leaf = name.rpartition(".")
            if owner in named and (leaf in named[owner]._parameters or leaf in named[owner]._buffers):
                what = f"name the module that owns it, {owner!r}" if owner else (
                    "it is the root module's own, and the root unit already holds every parameter outside the units"
                )
                raise ValueError(
                    f"units: {name!r} is a tensor of {type(module).__name__}, not a submodule: a unit is a module "
                    f"(gathered as a whole); {what}"
                )
            close = difflib.get_close_matches(name, [n for n in named if n], n=5, cutoff=0.5)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"units: {type(module).__name__} has no submodule {name!r}{hint}")
        if name in chosen:
            raise ValueError(
                f"units: {name!r} is named twice; each unit is one collective group, so list every submodule "
                "once (to put several submodules in one collective, use min_bucket_bytes)"
            )
        if name:
            chosen.append(name)
    order = {fqn: i for i, fqn in enumerate(named)}
    chosen = sorted(chosen, key=order.__getitem__)  # each name once: a repeat raised above
    _refuse_containers(module, chosen)
    return chosen


def never_called(module: nn.Module) -> bool:
    """Whether ``module`` is a container without a forward of its own (``nn.ModuleList``, ``ModuleDict``,
    ``ParameterList``, ``ParameterDict``): nothing ever calls it, so no forward hook of it ever runs.

    Example:
        >>> never_called(nn.ModuleList([nn.Linear(2, 2)])), never_called(nn.Sequential())
        (True, False)
    """
    containers = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
    return isinstance(module, containers) and type(module).forward is nn.Module.forward


def _refuse_containers(module: nn.Module, chosen: Sequence[str]) -> None:
    """A unit is gathered by its module's forward; a container without one (``nn.ModuleList``,
    ``nn.ParameterList`` ...) is never called, so the parameters it would hold could never be gathered
    (the first call would fail). Refused here, by name, unless nested units take every parameter in it
    (an empty unit: harmless)."""
    for name in chosen:
        sub = module.get_submodule(name)
        if not never_called(sub):
            continue
        inner = [u for u in chosen if u.startswith(name + ".")]
        held = [f"{name}.{k}" for k, _ in sub.named_parameters(remove_duplicate=False)]
        held = [f for f in held if not any(f.startswith(u + ".") for u in inner)]
        if held:
            kind = type(sub).__name__
            if isinstance(sub, (nn.ModuleList, nn.ModuleDict)):
                each = ", ".join(repr(f"{name}.{k}") for k in list(sub._modules)[:2])
                what = f"make each module in it a unit ({each}, ...; or pass their type) or name their parent"
            else:
                what = "name the module whose forward uses them (their parent), or leave them to the root"
            raise ValueError(
                f"units: {name!r} is an nn.{kind}, a container without a forward of its own: it is never called, so "
                f"its parameters ({held[0]!r}{' ...' if len(held) > 1 else ''}) would never be gathered; {what}"
            )


def owning_unit(names: Sequence[str], unit_names: Sequence[str]) -> str:
    """The innermost unit whose module contains every one of ``names`` (all names of a tied parameter); the
    root unit, ``""``, when none does.

    Example:
        >>> owning_unit(["blocks.0.fc.weight"], ["blocks", "blocks.0"]), owning_unit(["head.weight"], ["blocks.0"])
        ('blocks.0', '')
    """
    paths = [n.rpartition(".")[0] for n in names]
    best = ""
    for u in unit_names:
        if len(u) > len(best) and all(p == u or p.startswith(u + ".") for p in paths):
            best = u
    return best
