"""Full (unsharded) state dicts, one unit at a time: ``full_state_dict`` and ``load_full_state_dict``.

Both stream: at any moment at most one unit's full parameters exist beside the shards (plus what rank 0
accumulates on the CPU in ``full_state_dict``), never the whole gathered model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fsdpfn.checkpoint._sync import broadcast_tensors, comm_for, is_root, root_run
from fsdpfn.checkpoint.dtensor import global_shape
from fsdpfn.checkpoint.errors import CheckpointMismatchError
from fsdpfn.layout import Sharded, ShardPlan, UnitPlan
from fsdpfn.layout.plan import ParamInfo, bucket_by_dtype
from fsdpfn.ops import unshard
from fsdpfn.ops.api import check_shards
from fsdpfn.ops.buckets import Buckets
from fsdpfn.ops.tp import unwrap

__all__ = ["full_state_dict", "load_full_state_dict"]


def _check(tree: Any, what: str) -> ShardPlan:
    if not isinstance(tree, Sharded):
        raise TypeError(f"{what}: expected a fsdpfn.Sharded (from fsdpfn.shard), got {type(tree).__name__}")
    return tree.plan


def _gather_unit(params: Sharded[torch.Tensor], unit: UnitPlan) -> dict[str, torch.Tensor]:
    """The unit's full parameters in their own dtypes: ``unshard`` unless mixed precision would gather
    them in another dtype, then an exact-dtype bucket gather (one collective per dtype)."""
    plan = params.plan
    if all(lay.dtype == plan.dtypes[f] for lay in unit.gather for f in lay.fqns):
        return unshard(params, units=[unit.name])
    key = ("checkpoint.exact_gather", unit.name)
    b = plan.memo.get(key)
    if b is None:
        infos = [ParamInfo(f, plan.specs[f].shape, plan.dtypes[f], False, unit.name) for f in unit.fqns]
        layouts = bucket_by_dtype(infos, plan.specs, lambda d: d)
        fqns = tuple(f for lay in layouts for f in lay.fqns)
        b = plan.memo[key] = Buckets(
            "gather", plan.comm, plan.rank, fqns, layouts, tuple(plan.dtypes[f] for f in fqns), label=unit.label
        )
    return dict(zip(b.fqns, b.run(check_shards(params, b.fqns))))


def _export(t: torch.Tensor, cpu: bool) -> torch.Tensor:
    t = t.detach()
    if cpu and t.device.type != "cpu":
        return t.to("cpu")
    return t.clone(memory_format=torch.contiguous_format)


def full_state_dict(
    params: Sharded[torch.Tensor], *, rank0_only: bool = True, cpu: bool = True
) -> dict[str, torch.Tensor]:
    """Full parameters and buffers keyed like ``module.state_dict()`` (tied names included), for export.

    Collective: call it on every rank. Streams one unit at a time: gather the unit (no autograd), copy
    its full tensors out (to the CPU when ``cpu``), drop the gathered buffer, go on — the extra memory
    on the device is one unit, never the model. With ``rank0_only`` (the default) only rank 0 keeps the
    copies and the other ranks return ``{}`` (rank 0 of the tree's mesh: a pipeline stage's first rank when
    the tree lives on a sub-mesh). Values are exact: under a mixed-precision policy the
    parameters are still gathered in their own dtype.

    Example:
        >>> sd = fsdpfn.checkpoint.full_state_dict(params)             # doctest: +SKIP
        >>> if torch.distributed.get_rank() == 0:                      # doctest: +SKIP
        ...     model.load_state_dict(sd); torch.save(sd, "model.pt")
    """
    plan = _check(params, "full_state_dict")
    keep = not rank0_only or is_root(comm_for([plan]))  # with TP: the dp x tp ranks' first, not each dp group's
    aliases = plan.tied
    got: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for unit in plan.units:
            full = _gather_unit(params, unit)
            for f in [f for f in unit.fqns if f in plan.tp]:  # TP-local after the dp gather: gather over tp too (every rank, in order)
                full[f] = plan.tp[f].full(unwrap(full[f]))
            if keep:
                got.update({f: _export(full[f], cpu) for f in unit.fqns})
            del full
    if not keep:
        return {}
    for fqn in plan.params:
        for alias in aliases.get(fqn, ()):
            got[alias] = got[fqn]
    for b in plan.buffers:
        if isinstance(params[b], torch.Tensor) and b not in plan.transient_buffers:  # as state_dict() does
            got[b] = _export(params[b], cpu)
    return {k: got[k] for k in _module_order(plan, got)}


def _module_order(plan: ShardPlan, names: Mapping[str, Any]) -> list[str]:
    """``names`` in ``module.state_dict()`` order, as far as the plan tells: modules depth-first (a module
    before its children, children in the order their first parameter or buffer appears), and within a
    module its parameters, then its buffers."""
    seen: dict[str, int] = {}
    for i, name in enumerate([*plan.params, *plan.buffers]):
        parts = name.split(".")[:-1]
        for d in range(len(parts) + 1):
            seen.setdefault(".".join(parts[:d]), i)
    rank = {n: i for i, n in enumerate([*plan.params, *plan.aliases, *plan.buffers])}
    buffers = set(plan.buffers)

    def key(name: str) -> tuple:
        parts = name.split(".")[:-1]
        path = tuple(seen.get(".".join(parts[:d]), len(rank)) for d in range(len(parts) + 1))
        return (path, name in buffers, rank.get(name, len(rank)))

    return sorted(names, key=key)


def _problems(state: Any, like: Sharded[Any]) -> list[str]:
    if not isinstance(state, Mapping):
        return [f"state must be a mapping of name to full tensor, got {type(state).__name__}"]
    plan = like.plan
    aliases = plan.tied
    known = set(plan.params) | set(plan.aliases) | set(plan.buffers)
    problems = [f"unexpected key {k!r}" for k in state if k not in known]
    for fqn in plan.params:
        names = [n for n in (fqn, *aliases.get(fqn, ())) if n in state]
        if not names:
            problems.append(f"missing key {fqn!r}")
        for n in names:
            v, want = state[n], global_shape(plan, fqn)
            plain = isinstance(v, torch.Tensor) and (type(v) is torch.Tensor or isinstance(v, torch.nn.Parameter))
            if not plain:
                problems.append(f"{n!r} is a {type(v).__name__}, expected a full (plain) tensor")
            elif tuple(v.shape) != want:
                problems.append(f"{n!r} has shape {tuple(v.shape)}, the model's is {want}")
    for b in plan.buffers:
        v, ref = state.get(b), like[b]
        if v is not None and isinstance(ref, torch.Tensor) and tuple(getattr(v, "shape", ())) != tuple(ref.shape):
            got = tuple(getattr(v, "shape", ()))
            problems.append(f"buffer {b!r} has shape {got}, the model's is {tuple(ref.shape)}")
    return problems


def _full_of(state: Mapping[str, Any], fqn: str, aliases: Mapping[str, tuple[str, ...]]) -> torch.Tensor:
    return next(state[n] for n in (fqn, *aliases.get(fqn, ())) if n in state)


def load_full_state_dict(
    like: Sharded[Any], state: Mapping[str, torch.Tensor] | None, *, rank0_only: bool = True
) -> Sharded[torch.Tensor]:
    """The reverse of ``full_state_dict``: this rank's shards of the full tensors in ``state``.

    Collective: call it on every rank. With ``rank0_only`` (the default) only rank 0's ``state`` is read
    (the others pass ``None`` or ``{}``) and each unit's full tensors are broadcast from rank 0 in one
    collective, unit by unit; with ``rank0_only=False`` every rank passes the full ``state`` and slices
    it locally (no communication). Parameters may be given under any tied name; buffers missing from
    ``state`` keep ``like``'s values (``state_dict()`` omits non-persistent buffers). Missing or
    unexpected names and wrong shapes raise ONE ``CheckpointMismatchError`` (on every rank). Values are
    cast to ``like``'s dtypes and placed on its devices; ``like`` itself is not modified.

    Example:
        >>> sd = torch.load("model.pt") if rank == 0 else None             # doctest: +SKIP
        >>> params = fsdpfn.checkpoint.load_full_state_dict(params, sd)    # doctest: +SKIP
    """
    plan = _check(like, "load_full_state_dict")
    comm = comm_for([plan]) if rank0_only else None  # with TP: from the dp x tp ranks' first
    local = not rank0_only or is_root(comm)

    def check() -> None:
        problems = _problems(state if state is not None else {}, like)
        if problems:
            raise CheckpointMismatchError(
                f"load_full_state_dict: the state dict does not match the model ({len(problems)} problems):\n  "
                + "\n  ".join(problems),
                problems,
            )

    if rank0_only:
        root_run(comm, lambda: check())
    else:
        check()
    aliases = plan.tied
    leaves: dict[str, Any] = {}
    device = plan.comm.groups.device if plan.comm is not None else torch.device("cpu")
    with torch.no_grad():
        for unit in plan.units:
            metas = [(global_shape(plan, f), plan.dtypes[f]) for f in unit.fqns]
            values = [_full_of(state, f, aliases) for f in unit.fqns] if local else None  # type: ignore[arg-type]
            fulls = broadcast_tensors(comm, metas, values) if rank0_only else values
            for fqn, full in zip(unit.fqns, fulls):  # type: ignore[arg-type]
                spec, ref = plan.specs[fqn], like[fqn]
                if fqn in plan.tp:  # tensor-parallel: dp shards this rank's TP slice
                    full = plan.tp[fqn].tp_local(full)
                start, stop = spec.bounds(plan.rank)
                rows = full.reshape(1) if not spec.shape else full
                shard = rows.narrow(spec.dim, start, stop - start)
                target = ref.device if isinstance(ref, torch.Tensor) else device
                shard = shard.to(device=target, dtype=plan.dtypes[fqn])
                leaves[fqn] = shard.clone(memory_format=torch.contiguous_format)
            del fulls
        bufs = [b for b in plan.buffers if isinstance(like[b], torch.Tensor)]
        metas = [(tuple(like[b].shape), like[b].dtype) for b in bufs]
        values = [state.get(b, like[b]) for b in bufs] if local else None  # type: ignore[union-attr]
        fulls = broadcast_tensors(comm, metas, values) if rank0_only else values
        for b, full in zip(bufs, fulls):  # type: ignore[arg-type]
            leaves[b] = full.to(device=like[b].device, dtype=like[b].dtype).clone()
    for k in plan.keys:
        leaves.setdefault(k, like[k])
    return Sharded(leaves, plan)
