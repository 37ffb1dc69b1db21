"""Meta-device initialisation: materialise a module one unit at a time, keeping only local shards.

A model built under ``torch.device("meta")`` holds no memory. ``shard`` then walks the units in plan
order; for each it allocates the parameters of the modules that own the unit's parameters
(``to_empty(recurse=False)``), initialises them (``reset_parameters()`` or the user's ``init(module)``),
keeps this rank's shards, and returns those modules to ``meta`` as soon as none of their parameters
waits for a later unit. No rank ever holds more than about one unit's full parameters. With the same
seed on every rank, the full parameters do not depend on the world size: the initialisation order is
the plan's, the same for any world.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fsdpfn.layout import ShardPlan, shard_tensor

__all__ = ["is_meta", "materialize_and_shard"]


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lives on the ``meta`` device."""
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def _owner_module(module: nn.Module, fqn: str) -> nn.Module:
    return module.get_submodule(fqn.rpartition(".")[0])


def _initialise(mod: nn.Module, name: str, init: Callable[[nn.Module], None] | None) -> None:
    if init is not None:
        init(mod)
        return
    reset = getattr(mod, "reset_parameters", None)
    if not callable(reset):
        raise ValueError(
            f"shard: module {name or '<root>'!r} ({type(mod).__name__}) was built on the meta device but has no "
            "reset_parameters(); pass init=callable(module) to shard(...) to initialise it"
        )
    reset()


def materialize_and_shard(
    module: nn.Module,
    plan: ShardPlan,
    device: torch.device,
    init: Callable[[nn.Module], None] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This rank's shards of every parameter (and the buffers), materialising one unit at a time."""
    names = {m: n for n, m in module.named_modules()}
    all_names = {f: plan.names(f) for f in plan.params}
    pending: dict[nn.Module, set[str]] = {}  # module -> its direct parameters not yet sharded
    for fqn in plan.params:
        for name in all_names[fqn]:
            pending.setdefault(_owner_module(module, name), set()).add(fqn)
    shards: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    live: set[nn.Module] = set()
    for unit in plan.units:
        for fqn in unit.fqns:
            for name in all_names[fqn]:
                mod = _owner_module(module, name)
                if mod not in live and any(t.is_meta for t in mod.parameters(recurse=False)):
                    mod.to_empty(device=device, recurse=False)
                    _initialise(mod, names[mod], init)
                    live.add(mod)
        for fqn in unit.fqns:
            full = module.get_parameter(fqn).detach()
            shards[fqn] = shard_tensor(full, plan.specs[fqn], plan.rank)
            for name in all_names[fqn]:
                pending[_owner_module(module, name)].discard(fqn)
        for mod in [m for m in live if not pending.get(m)]:
            _keep_buffers(mod, names[mod], buffers)
            mod.to_empty(device="meta", recurse=False)  # drop the full tensors (this module only)
            live.discard(mod)
    # modules that own buffers but no parameters are materialised last
    for name, mod in module.named_modules():
        own = [f"{name}.{b}" if name else b for b, _ in mod.named_buffers(recurse=False)]
        if own and not all(b in buffers for b in own) and any(b.is_meta for b in mod.buffers(recurse=False)):
            mod.to_empty(device=device, recurse=False)
            _initialise(mod, name, init)
            _keep_buffers(mod, name, buffers)
            mod.to_empty(device="meta", recurse=False)
    return shards, {b: buffers[b] for b in plan.buffers}


def _keep_buffers(mod: nn.Module, name: str, out: dict[str, torch.Tensor]) -> None:
    for bname, buf in mod.named_buffers(recurse=False):
        if not buf.is_meta:
            out[f"{name}.{bname}" if name else bname] = buf.detach().clone()
