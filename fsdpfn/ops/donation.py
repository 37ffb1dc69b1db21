"""A module after ``shard``: its sharded parameters live in the ``Sharded`` tree, and its own slots hold
``meta`` tensors (donated, ``shard``'s default, or built on ``meta``). Used directly, such a module would
compute with nothing, or worse: torch's CPU matmul takes a ``meta`` weight beside real tensors and returns
uninitialised memory, and ``state_dict()`` / ``load_state_dict()`` work on ``meta`` tensors without a
word (a checkpoint with no values; weights loaded into nothing). ``guard`` makes each of those an error
that says what to do.

Example:
    >>> params = fsdpfn.shard(model, mesh)            # doctest: +SKIP
    >>> model.state_dict()                            # doctest: +SKIP
    RuntimeError: state_dict: Net's parameters were donated to fsdpfn.shard ...
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpfn.ops.placeholder import Placeholder
from fsdpfn.ops.slots import set_parameter

__all__ = ["donate_parameters", "donated_by", "guard", "was_donated"]

_DONATED = "_fsdpfn_donated"  # set on a module whose parameters shard() moved to meta
_DONATED_BY = "_fsdpfn_donated_by"  # set on each meta parameter left in their place: the sharded module's type
_FAKE = torch._C._TorchDispatchModeKey.FAKE


def donate_parameters(module: nn.Module, params: Iterable[nn.Parameter]) -> None:
    """Replace ``params`` (this module's sharded parameters) by ``meta`` parameters of the same shape,
    dtype and ``requires_grad`` under every name they have: their storage is released unless the caller
    still holds the old ``Parameter`` objects."""
    ids = {id(p) for p in params}
    new: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for attr, p in list(mod._parameters.items()):
            if p is not None and id(p) in ids:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(_meta_like(p), requires_grad=p.requires_grad)
                    setattr(new[id(p)], _DONATED_BY, type(module).__name__)
                set_parameter(mod, attr, new[id(p)])
    setattr(module, _DONATED, True)


def _refuse_direct_calls(module: nn.Module, plan: Any, where: str) -> None:
    """Forward pre-hooks on ``module`` and on each submodule owning a sharded parameter that name the
    mistake when one is called directly instead of through ``fsdp(module)``: its weights live in the
    ``Sharded`` tree, and what torch does with the ``meta`` tensors left in its slots is no help: an
    error about "Tensor on device meta" at best, and for a ``Conv2d`` or a ``Linear`` without bias on the
    CPU none at all (its kernel takes the ``meta`` weight and returns uninitialised memory). Each hook
    probes one of its module's own parameters: ``apply`` swaps gathered values in before a module runs
    (and ``torch.func.functional_call`` swaps values in), so the probe is ``meta`` only in a direct call;
    inside ``apply`` a unit's module bypassed by the forward holds ``Placeholder``s, whose own error
    names the parameter. Planning runs (fake tensors) and compiled code pass untouched."""
    probes: dict[str, tuple[str, str]] = {}  # module path -> (attr probed, an FQN for the message)
    for fqn in plan.params:
        path, _, attr = fqn.rpartition(".")
        probes.setdefault(path, (attr, fqn))
    root = next((u for u in plan.units if not u.name), None)
    if root is None or not root.fqns:
        probes.pop("", None)  # every parameter in units: the root has none of its own to probe
    else:
        path, _, attr = root.fqns[0].rpartition(".")
        probes[""] = (attr, root.fqns[0])  # the root's probe: a root-unit parameter, wherever it lives
        owner_of_root_probe = module.get_submodule(path)
    for path, (attr, fqn) in probes.items():
        mod = module.get_submodule(path)
        owner = owner_of_root_probe if path == "" else mod
        if path == "":
            what = f"{type(module).__name__} was called directly"
        else:
            what = f"{type(mod).__name__} {path!r} of {type(module).__name__} was called directly (outside apply)"
        mod.register_forward_pre_hook(_direct_call_check(owner, attr, what, where, fqn))


def _direct_call_check(owner: nn.Module, attr: str, what: str, where: str, fqn: str) -> Any:
    def check(_module: nn.Module, _args: Any) -> None:
        # planning runs and compiled code first, before the probe is touched (a planner watches reads)
        if torch.compiler.is_compiling() or torch._C._get_dispatch_mode(_FAKE) is not None:
            return
        probe = owner._parameters.get(attr)
        if probe is None or not probe.is_meta or isinstance(probe, Placeholder):
            return  # (a Placeholder: inside apply; its own error names the parameter when it is used)
        raise RuntimeError(
            f"{what}, but {where} (e.g. {fqn!r}): run it through apply = fsdpfn.fsdp(model) as "
            "apply(params, ...) with the Sharded tree shard returned, or pass donate=False to shard to keep the "
            "module's own weights usable"
        )

    return check


def _meta_like(p: torch.Tensor) -> torch.Tensor:
    """A ``meta`` tensor standing for ``p``: a TP ``DTensor`` keeps its mesh, placements and global shape
    (the module's TP plan still describes it) over a ``meta`` local tensor."""
    if isinstance(p, DTensor):
        local = torch.empty_like(p._local_tensor, device="meta")
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return torch.empty_like(p, device="meta")


def donated_by(param: torch.Tensor) -> str | None:
    """The type name of the module whose ``shard`` donated the parameter ``param`` stands in for (``None``:
    not a donated placeholder). A submodule shared by two models keeps the placeholder after the first
    model is sharded: the second model's ``shard`` must not take it for a module built on ``meta``."""
    return getattr(param, _DONATED_BY, None)


def was_donated(module: nn.Module) -> bool:
    """Whether an earlier ``shard`` donated ``module``'s parameters."""
    return bool(getattr(module, _DONATED, False))


def guard(module: nn.Module, plan: Any, built_on_meta: bool) -> None:
    """Make direct use of ``module`` (donated, or built on ``meta``) an error: a direct call of it or of a
    submodule owning a sharded parameter, ``state_dict()`` and ``load_state_dict()``."""
    where = ("built on the meta device, its parameters exist only as the shards" if built_on_meta else
             "its parameters were donated to fsdpfn.shard (they are meta now)")
    _refuse_direct_calls(module, plan, where)
    how = "exist only as shards (built on the meta device)" if built_on_meta else "were donated to fsdpfn.shard"
    _refuse_state_dicts(module, plan, how)


def _refuse_state_dicts(module: nn.Module, plan: Any, how: str) -> None:
    """``state_dict()`` would return ``meta`` tensors (saved, a checkpoint without values) and
    ``load_state_dict()`` would copy into them (the values never reach the tree): both raise, from any
    module holding a sharded parameter (a child's own ``state_dict()`` too)."""
    owners = {fqn.rpartition(".")[0] for fqn in plan.params}

    def saving(mod: nn.Module, prefix: str, keep_vars: bool) -> None:
        raise RuntimeError(
            f"state_dict: the parameters of {type(mod).__name__} {how}: its state_dict would hold meta tensors, "
            "not the trained values. Save the Sharded tree instead: fsdpfn.save(path, params) (a "
            "torch.distributed.checkpoint any world size can load), or fsdpfn.full_state_dict(params) for a "
            "dict of full tensors keyed like module.state_dict()"
        )

    def loading(mod: nn.Module, state_dict: Any, prefix: str, *_: Any) -> None:
        raise RuntimeError(
            f"load_state_dict: the parameters of {type(mod).__name__} {how}: values loaded into it would never "
            "reach the Sharded tree. Load into the tree: params = fsdpfn.load(path, params); or load "
            "the weights into the module before calling fsdpfn.shard"
        )

    for path in sorted(owners | {""}):
        mod = module.get_submodule(path)
        mod.register_state_dict_pre_hook(saving)
        mod.register_load_state_dict_pre_hook(loading)
