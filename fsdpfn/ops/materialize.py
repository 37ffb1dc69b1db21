"""Meta-device initialisation: materialise a module one unit at a time, keeping only local shards.

A model built under ``torch.device("meta")`` holds no memory. ``shard`` then walks the units in plan
order; for each it allocates the parameters of the modules that own the unit's parameters
(``to_empty(recurse=False)``), initialises them (``reset_parameters()`` or the user's ``init(module)``),
keeps this rank's shards, and returns those modules to ``meta`` as soon as none of their parameters
waits for a later unit. No rank ever holds more than about one unit's full parameters. With the same
seed on every rank, the full parameters do not depend on the world size: the initialisation order is
the plan's, the same for any world.

``to_empty`` leaves whatever the allocator held, so a parameter or buffer the initialiser skips (a gain
``reset_parameters()`` forgot, a causal-mask buffer computed in ``__init__``) would train on garbage.
Each freshly allocated tensor is filled with a marker first (NaN for floating point) and checked after
the initialiser; one left unwritten is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

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
    """Run ``init(mod)`` (or ``mod.reset_parameters()``) on freshly allocated direct tensors, then refuse
    any of them it left unwritten."""
    if init is not None:
        run = lambda: init(mod)  # noqa: E731
    else:
        reset = getattr(mod, "reset_parameters", None)
        if not callable(reset):
            raise ValueError(
                f"shard: module {name or '<root>'!r} ({type(mod).__name__}) was built on the meta device but has no "
                "reset_parameters(); pass init=callable(module) to shard(...) to initialise it"
            )
        run = reset
    unset = unwritten(mod, run)
    if unset:
        how = f"init({type(mod).__name__})" if init is not None else f"{type(mod).__name__}.reset_parameters()"
        raise ValueError(
            f"shard: module {name or '<root>'!r} was built on the meta device and {how} left "
            f"{', '.join(unset)} uninitialised (to_empty's memory holds arbitrary values, and the value computed "
            "in __init__ is gone on meta). Initialise every direct parameter and buffer of the module there, "
            "or pass init=callable(module) to shard(...) that does"
        )


def _markers(t: torch.Tensor) -> tuple[Any, Any]:
    """Two fill values for an allocated tensor: an initialiser that writes it changes at least one
    element away from both (floating point: NaN, which no initialiser leaves)."""
    if t.is_floating_point() or t.is_complex():
        return float("nan"), None
    if t.dtype == torch.bool:
        return True, False
    try:
        info = torch.iinfo(t.dtype)
    except TypeError:  # a quantized or other exotic dtype: its second marker is never tried
        return 0, None
    return info.max - 3, info.min + 3


def unwritten(mod: nn.Module, run: Callable[[], Any]) -> list[str]:
    """Run ``run()`` (an initialiser of ``mod``) with ``mod``'s allocated direct parameters and buffers
    pre-filled with markers; the names of those it left unwritten (``"parameter 'gain'"``).

    A tensor replaced by another object was written; a floating one still holding a NaN was not (nor
    fully). A non-floating one whose version counter did not move and which still equals its first
    marker everywhere is filled with its second and the initialiser runs again from the same random
    state (the other tensors get the same values again): equal to that too, it was never written
    (``.data`` writes move no version counter, so the values decide).
    """

    def direct() -> dict[str, tuple[str, torch.Tensor]]:
        out = {n: ("parameter", t) for n, t in mod.named_parameters(recurse=False) if not t.is_meta}
        out.update((n, ("buffer", t)) for n, t in mod.named_buffers(recurse=False) if not t.is_meta)
        return out

    def fill(which: int, names: Iterable[str]) -> dict[str, tuple[torch.Tensor, int, Any]]:
        now, marks = direct(), {}
        with torch.no_grad():
            for n in names:
                t = now[n][1]
                marker = _markers(t)[which]
                try:
                    t.fill_(marker)
                except (RuntimeError, TypeError):  # a dtype without that value (a float8 without NaN): unchecked
                    continue
                marks[n] = (t, t._version, marker)
        return marks

    def unchanged(now: dict[str, tuple[str, torch.Tensor]], n: str, mark: tuple[torch.Tensor, int, Any]) -> bool:
        t, version, marker = mark
        if n not in now or now[n][1] is not t or t.numel() == 0:
            return False
        try:
            if marker != marker:  # NaN
                return bool(t.isnan().any())
            return t._version == version and bool((t == marker).all())
        except RuntimeError:  # no comparison for this dtype: unchecked
            return False

    tensors = direct()
    devices = sorted({t.device for _, t in tensors.values() if t.device.type != "cpu"}, key=str)
    before = _rng_states(devices)
    marks = fill(0, tensors)
    run()
    now = direct()
    left = {n for n, mark in marks.items() if unchanged(now, n, mark)}
    again = [n for n in left if _markers(tensors[n][1])[1] is not None]
    if again:
        after = _rng_states(devices)
        _set_rng_states(before)
        marks = fill(1, again)
        run()
        now = direct()
        left -= {n for n in again if not unchanged(now, n, marks[n])}
        _set_rng_states(after)  # the caller's random stream moves on as if the initialiser ran once
    return [f"{tensors[n][0]} {n!r}" for n in tensors if n in left]


def _rng_states(devices: list[torch.device]) -> list[tuple[torch.device | None, torch.Tensor]]:
    out: list[tuple[torch.device | None, torch.Tensor]] = [(None, torch.get_rng_state())]
    for d in devices:
        out.append((d, torch.get_device_module(d.type).get_rng_state(d)))
    return out


def _set_rng_states(states: list[tuple[torch.device | None, torch.Tensor]]) -> None:
    for d, s in states:
        if d is None:
            torch.set_rng_state(s)
        else:
            torch.get_device_module(d.type).set_rng_state(s, d)


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
