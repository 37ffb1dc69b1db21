"""``check_module``: is this module the one a ``Sharded`` tree was built from, as it was then? And
``explain_meta_error`` / ``explain_inplace_error``: what a forward that met a unit's placeholder, or that
changed a gathered parameter in place, did wrong."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from fsdpfn.layout import ShardPlan
from fsdpfn.messages import listing, torch_text

__all__ = [
    "changed_in_place", "changed_in_place_error", "check_module", "contents_moved", "explain_forward_error",
    "explain_inplace_error", "explain_meta_error", "versions_moved",
]


def explain_meta_error(exc: BaseException, call: Any) -> RuntimeError | None:
    """The error to raise instead of ``exc`` when the forward of an ``apply`` call failed on a tensor on
    the meta device: outside its own module's forward a unit's parameters are meta (donated, or the
    call's placeholders), so code that bypassed the forward (a child of the unit called directly, a
    unit's weight read by another module) met them. ``None``: ``exc`` is something else."""
    # "meta" as a word: torch says "device meta", "meta and cpu", "meta tensor"; not an error about "metadata"
    if not isinstance(exc, (RuntimeError, NotImplementedError, ValueError, TypeError)):
        return None
    if not re.search(r"\bmeta\b", str(exc)):
        return None
    plan = call.plan
    idle = [u.name for u in plan.units if u.name and plan.group_of.get(u.name, u.name) not in call.order]
    shown = listing(idle)
    return RuntimeError(
        f"apply: the forward used a tensor on the meta device ({torch_text(exc)}). Outside its own module's forward a "
        "unit's parameters are meta: fsdp gathers them only while the unit's module runs (its forward hooks). "
        "Code that calls a child of a unit directly (model.layers[0].mlp(x) where 'layers.0' is the unit) or "
        "uses a unit's weight from another module bypasses that: call the unit's module itself, or make the "
        f"child a unit of its own (shard(..., units=[...])). Units not gathered yet in this call: {shown or 'none'}"
    )


_INPLACE = re.compile(r"Output (\d+) of UnshardFunction(?:Backward)? is a view and its base or another view of its base has been modified inplace")


def explain_inplace_error(exc: BaseException, call: Any) -> RuntimeError | None:
    """The error to raise instead of autograd's when the forward changed a gathered parameter in place
    (``nn.Embedding(max_norm=...)`` renormalises its weight in place; ``weight.mul_(...)``; not a change
    through ``.data``, which autograd does not see): inside the
    forward a unit's parameters are views of its gathered buffer, and a change there would never reach the
    shards (torch's ``fully_shard`` lets it through and its ranks' weights drift apart from a single
    process). Names the parameter(s) it can be. ``None``: ``exc`` is something else."""
    found = _INPLACE.search(str(exc)) if isinstance(exc, RuntimeError) else None
    if found is None:
        return None
    k = int(found.group(1))  # autograd names the output's index in its unit's gather
    units = changed_in_place(call) or [(u, tuple(full)) for u, full in reversed(list(call.gathered.items()))]
    return changed_in_place_error([fqns[k] for _, fqns in units if len(fqns) > k])


def contents_moved(tensors: Iterable[torch.Tensor], snapshot: Sequence[torch.Tensor] | None) -> bool:
    """Whether any of ``tensors`` differs, bit for bit, from its copy in ``snapshot`` (debug mode: a write
    through ``.data`` moves no version counter). ``None``: no snapshot was taken.

    Example:
        >>> x = torch.zeros(2)
        >>> snap = [x.clone()]
        >>> contents_moved([x], snap), (x.data.add_(1), contents_moved([x], snap))[1]
        (False, True)
    """
    if snapshot is None:
        return False
    bits = lambda t: t.detach().reshape(-1).view(torch.uint8)  # noqa: E731 - NaN equals itself here
    return any(not torch.equal(bits(t), bits(s)) for t, s in zip(tensors, snapshot))


def versions_moved(tensors: Iterable[torch.Tensor], versions: Iterable[int]) -> bool:
    """Whether any of ``tensors`` was changed in place since its version counter read ``versions``.

    Example:
        >>> x = torch.zeros(2)
        >>> was = [x._version]
        >>> versions_moved([x], was), (x.add_(1), versions_moved([x], was))[1]
        (False, True)
    """
    return any(t._version != v for t, v in zip(tensors, versions))


def changed_in_place(call: Any) -> list[tuple[str, tuple[str, ...]]]:
    """The units (name, parameter FQNs) whose gathered parameters ``call``'s forward changed in place so
    far: their version counter moved since the gather (a unit's parameters are views of one buffer and
    share it; units already released were checked then)."""
    return call.changed + [
        (name, tuple(full)) for name, full in call.gathered.items()
        if versions_moved(full.values(), call.versions.get(name, ()))
        or contents_moved(full.values(), call.snapshots.get(name))
    ]  # fmt: skip


def changed_in_place_error(names: list[str], units: list[tuple[str, tuple[str, ...]]] = ()) -> RuntimeError:
    """What ``apply`` raises when its forward changed gathered parameters in place: ``names`` when known,
    else one of the parameters of ``units`` (under ``torch.no_grad()`` nothing but the version counters
    notices: an evaluation with ``nn.Embedding(max_norm=...)``; with a graph autograd does, naming the
    parameter, see ``explain_inplace_error``)."""
    if names:
        which = " or ".join(repr(n) for n in dict.fromkeys(names))
    else:
        which = "a parameter of " + " or ".join(
            f"unit {u or '<root>'!r} ({listing(list(fqns))})" for u, fqns in units
        ) if units else "a unit's parameter"
    return RuntimeError(
        f"apply: the forward changed {which} in place (nn.Embedding(max_norm=...) renormalises its weight in "
        "place; so does weight.mul_(...), or a write through weight.data, which debug mode finds). Inside the forward a unit's parameters are gathered copies: a "
        "change there never reaches the shards, so it would be lost. Compute it out of place, or change the "
        "parameters themselves between steps (the Sharded tree's shards; with fully_shard, the DTensor "
        "parameters under torch.no_grad())"
    )


def explain_forward_error(exc: BaseException, call: Any) -> RuntimeError | None:
    """What ``apply`` raises instead of ``exc`` from its forward (``None``: ``exc`` itself)."""
    return explain_meta_error(exc, call) or explain_inplace_error(exc, call)


def check_module(module: nn.Module, plan: ShardPlan) -> None:
    """Raise if ``module``'s parameters and buffers are not those ``plan`` was built from (names,
    shapes, dtypes). Re-checked whenever the module's parameters change (replaced, reshaped, recast)
    since the last check; otherwise free.

    Example:
        >>> check_module(model, params.plan)   # doctest: +SKIP
    """
    signature = tuple((id(p), p.shape, p.dtype, p.requires_grad) for p in module.parameters())
    key = ("validated", id(module))
    if plan.memo.get(key) == signature:
        return
    module_params = dict(module.named_parameters(remove_duplicate=False))
    for fqn in plan.params:
        p = module_params.get(fqn)
        if p is None:
            raise ValueError(
                f"apply: params has leaf {fqn!r} but {type(module).__name__} has no such parameter; "
                f"the Sharded was built from another module ({plan.module_type})"
            )
        shape = tuple(plan.tp[fqn].shape) if fqn in plan.tp else plan.specs[fqn].shape  # TP: global shape
        # a gathered copy an enclosing call or its backward swapped in (a plain tensor) is in the compute dtype
        # and takes the gradient flag of the call
        own = isinstance(p, nn.Parameter)
        if tuple(p.shape) != shape or (p.dtype != plan.dtypes[fqn] and own):
            how = (
                " (module.to / .double() / .half() after shard: the tree's dtypes are its plan's; compute in another "
                "dtype with shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=...)), or convert the module back)"
                if tuple(p.shape) == shape else ""
            )
            raise ValueError(
                f"apply: leaf {fqn!r} was sharded as {shape} {plan.dtypes[fqn]} but the module's "
                f"parameter is now {tuple(p.shape)} {p.dtype}; the plan is stale: call fsdpfn.shard again{how}"
            )
        if own:
            _check_requires_grad(fqn, p.requires_grad, plan)
    known = set(plan.params) | set(plan.aliases) | set(plan.ignored)
    extra = [n for n in module_params if n not in known]
    if extra:
        raise ValueError(f"apply: module parameters {extra} are not in params; was it sharded from another module?")
    _check_ties(module_params, plan, type(module).__name__)
    module_buffers = dict(module.named_buffers())
    missing = [b for b in plan.buffers if b not in module_buffers]
    if missing:
        raise ValueError(f"apply: params has buffers {missing} that the module does not have")
    plan.memo[key] = signature


def _check_requires_grad(fqn: str, flag: bool, plan: ShardPlan) -> None:
    """The module's ``requires_grad`` must be what ``shard`` saw or what ``params`` say now: a flag set
    on the module afterwards would change nothing (the tree's plan says which parameters train)."""
    said = plan.requires_grad[fqn]
    if flag == said or flag == (plan.origin or plan).requires_grad[fqn]:
        return
    fix = "fsdpfn.freeze" if not flag else "fsdpfn.unfreeze"
    raise ValueError(
        f"apply: parameter {fqn!r} of the module was set requires_grad={flag} after fsdpfn.shard, but params "
        f"{'train' if said else 'freeze'} it: the Sharded tree, not the module, says which parameters train, so "
        f"the flag would change nothing. Use params = {fix}(params, [{fqn!r}]) (a module name selects all of its "
        "parameters; optimizer state carries over), or set the flag back"
    )


def _check_ties(module_params: dict[str, Any], plan: ShardPlan, module_type: str) -> None:
    """The module must tie exactly the names ``plan`` ties (one leaf and its aliases). A tie made after
    ``shard`` (``model.head.weight = model.embed.weight``) would otherwise train two leaves apart while
    the user's model shares one; a tie undone after ``shard`` would train one leaf for two weights."""
    names_of: dict[int, list[str]] = {}
    for fqn, p in module_params.items():
        names_of.setdefault(id(p), []).append(fqn)
    owner_of = {fqn: plan.aliases.get(fqn, fqn) for fqn in module_params}
    for names in names_of.values():
        owners = list(dict.fromkeys(owner_of[n] for n in names))
        if len(owners) > 1:
            raise ValueError(
                f"apply: {module_type} ties {' and '.join(repr(n) for n in names)} (one parameter), but params "
                f"holds {' and '.join(repr(o) for o in owners)} as separate leaves: the tie was made after "
                "fsdpfn.shard, so training would keep them apart. Tie the weights before calling fsdpfn.shard "
                "(then both names share one leaf)"
            )
    for alias, owner in plan.aliases.items():
        a, o = module_params.get(alias), module_params.get(owner)
        if a is not None and o is not None and a is not o:
            raise ValueError(
                f"apply: params ties {alias!r} to {owner!r} (one leaf), but {module_type} now holds them as two "
                "parameters: the tie was undone after fsdpfn.shard. Shard the module as it is now (fsdpfn.shard "
                "again), or tie them back"
            )
