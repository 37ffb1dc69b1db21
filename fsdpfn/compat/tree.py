"""Has the module tree under a ``fully_shard`` root changed since the root was built?

``fully_shard`` turns the parameters it finds into ``DTensor`` shards and reduces their gradients. A
parameter that appears later (a submodule replaced, ``model.head.weight = nn.Parameter(...)``, LoRA
adapters injected after wrapping) is a plain tensor nobody shards or reduces: each rank would train its
own copy on its own batch and the ranks would drift apart with no error (torch's ``fully_shard`` does
exactly that for a replaced submodule). ``ModuleTree`` remembers the tree's shape as the root saw it and
checks it with identity tests only (a few microseconds per hundred modules), on every root forward.

Example:
    >>> tree = ModuleTree(model)                       # doctest: +SKIP
    >>> tree.changed()                                 # doctest: +SKIP
    False
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from fsdpfn.compat.state import UnitState

__all__ = ["ModuleTree", "check_managed", "unmanaged_parameter_error"]


class ModuleTree:
    """The submodules and parameter counts of ``root`` as they are now; ``changed()`` says whether any
    submodule was replaced, added or removed, or a module's parameters were added or removed, since."""

    def __init__(self, root: nn.Module):
        self._edges: list[tuple[dict[str, nn.Module | None], str, nn.Module | None]] = []
        self._sizes: list[tuple[dict, int, dict, int]] = []
        for mod in root.modules():
            self._sizes.append((mod._modules, len(mod._modules), mod._parameters, len(mod._parameters)))
            self._edges.extend((mod._modules, name, child) for name, child in mod._modules.items())

    def changed(self) -> bool:
        """Whether the tree differs from the one this was made from (identity checks only)."""
        for children, name, child in self._edges:
            if children.get(name) is not child:
                return True
        for children, n_children, params, n_params in self._sizes:
            if len(children) != n_children or len(params) != n_params:
                return True
        return False


def unmanaged_parameter_error(fqn: str, param: object, module: nn.Module, kind: str) -> ValueError:
    """The error for parameter ``fqn`` of ``module`` that ``kind`` (``fully_shard``/``replicate``) did not
    make: it would train on each rank alone."""
    what = "None (deleted)" if param is None else f"a plain {type(param).__name__}"
    if isinstance(param, DTensor):  # e.g. made from a sharded one (weight_norm's original0/1)
        what = f"a DTensor that {kind} did not make"
    if isinstance(param, torch.Tensor) and not isinstance(param, nn.Parameter):  # a value swapped in for a call
        return ValueError(
            f"{kind}: parameter {fqn!r} of {type(module).__name__} holds a plain tensor, not the sharded DTensor "
            f"{kind} manages (torch.func.functional_call or a stateless swap with plain tensors?). Swap in DTensors "
            "laid out like the parameters instead (e.g. {n: p * 2 for n, p in model.named_parameters()}): fsdpfn "
            "gathers them and differentiates through them; or run an unsharded copy of the model"
        )
    return ValueError(
        f"{kind}: parameter {fqn!r} of {type(module).__name__} is {what}, not a parameter {kind} manages: it was "
        f"replaced or added after {kind} (a submodule swapped, a new nn.Parameter assigned, adapters injected). "
        "Its gradient would never be reduced, so each rank would train its own copy and the ranks would drift "
        f"apart. Change the model before calling {kind}, list the parameter in ignored_params if each rank "
        "should keep its own, or change values in place (with torch.no_grad(): param.copy_(...)) on the "
        "DTensor parameters"
    )


def check_managed(root: nn.Module, states: Iterable[UnitState], ignored: frozenset[str], kind: str) -> list[str]:
    """Raise ``unmanaged_parameter_error`` for the first parameter of ``root`` (by FQN, duplicates
    included) that no state in ``states`` manages in that slot and that is not ignored (``ignored``: the
    FQNs left unmanaged on purpose). A slot holding the full parameters of an explicit ``unshard()`` is
    managed. Returns every parameter's FQN, in ``named_parameters(remove_duplicate=False)`` order."""
    slots = {(id(mod), attr): (m, st) for st in states for m in st.managed for mod, attr in m.slots}
    fqns: list[str] = []
    for path, mod in root.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            fqn = f"{path}.{attr}" if path else attr
            hit = slots.get((id(mod), attr))
            if hit is None:
                ok = p is None or fqn in ignored
            else:
                ok = p is hit[0].param or hit[1].unsharded is not None
            if not ok:
                raise unmanaged_parameter_error(fqn, p, mod, kind)
            if p is not None:
                fqns.append(fqn)
    return fqns
