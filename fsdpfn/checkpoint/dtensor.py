"""``Sharded`` <-> ``DTensor`` state dicts: ``to_dtensor`` and ``from_dtensor``.

A parameter shard becomes a ``DTensor`` over the tree's mesh with placements ``(Shard(0),)`` on a 1-D
mesh and ``(Replicate(), Shard(0))`` on a 2-D (HSDP) mesh. ``ShardSpec`` splits with ``torch.chunk``
semantics, exactly as DTensor's ``Shard`` does, so the local tensor is this rank's shard as is (no copy).

0-d parameters: DTensor cannot shard a 0-d tensor and FSDP2 rejects them, while ``ShardSpec`` stores one
as a 1-element shard on shard-rank 0 and empty shards elsewhere. fsdpfn exports a 0-d parameter as a
plain, replicated 0-d tensor (what ``module.state_dict()`` holds), broadcast from the mesh's first rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdpfn.checkpoint._sync import broadcast_tensors
from fsdpfn.checkpoint.errors import CheckpointMismatchError
from fsdpfn.layout import Sharded, ShardPlan, ShardSpec, contiguous_stride, shard_tensor

__all__ = ["from_dtensor", "global_shape", "leaf_kind", "param_dtensor", "placements", "shard_as_dtensor", "to_dtensor"]


def placements(mesh: Any, dim: int = 0) -> tuple[Any, ...]:
    """DTensor placements of a parameter shard: ``(Shard(dim),)`` (1-D) or ``(Replicate(), Shard(dim))``.

    Example:
        >>> placements(fsdpfn.init_mesh((2, 2)))          # doctest: +SKIP
        (Replicate(), Shard(dim=0))
    """
    return (Shard(dim),) if mesh.ndim == 1 else (Replicate(), Shard(dim))


def shard_as_dtensor(local: torch.Tensor, spec: ShardSpec, mesh: Any) -> DTensor:
    """Wrap this rank's shard ``local`` (shape ``spec.local_shape(rank)``) as a DTensor of global shape
    ``spec.shape``; shares ``local``'s storage.

    Example:
        >>> dt = shard_as_dtensor(params["0.weight"], params.specs["0.weight"], params.mesh)  # doctest: +SKIP
    """
    return DTensor.from_local(
        local,
        device_mesh=mesh,
        placements=placements(mesh, spec.dim),
        run_check=False,
        shape=torch.Size(spec.shape),
        stride=contiguous_stride(spec.shape),
    )


def param_dtensor(plan: ShardPlan, fqn: str, local: torch.Tensor) -> DTensor:
    """Parameter ``fqn``'s shard ``local`` as the global ``DTensor`` FSDP2 holds: ``shard_as_dtensor``, or for
    a tensor-parallel parameter a ``DTensor`` on the dp + tp mesh with FSDP2's placements
    (``(_StridedShard(0, sf=tp), Shard(0))`` for a colwise weight; docs/tensor_parallel.md).

    Example:
        >>> param_dtensor(params.plan, "0.weight", params["0.weight"]).placements    # doctest: +SKIP
        (Shard(dim=0),)
    """
    lay = plan.tp.get(fqn)
    if lay is not None:
        return lay.dtensor(local)
    return shard_as_dtensor(local, plan.specs[fqn], plan.mesh)


def global_shape(plan: ShardPlan, fqn: str) -> tuple[int, ...]:
    """Parameter ``fqn``'s global shape (a tensor-parallel one's spec is of its TP-local tensor).

    Example:
        >>> global_shape(params.plan, "0.weight")                     # doctest: +SKIP
        (16, 8)
    """
    lay = plan.tp.get(fqn)
    return tuple(lay.shape) if lay is not None else plan.specs[fqn].shape


def leaf_kind(plan: ShardPlan, fqn: str, leaf: Any) -> str:
    """How a leaf of a ``Sharded`` is stored: ``"shard"``, ``"zero_d"`` (a shard of a 0-d parameter),
    ``"tensor"`` (replicated: buffers, per-parameter 0-d step counters ...), ``"none"`` or ``"other"``.

    A tensor at a parameter's name is a shard when its number of dims and its non-sharded sizes are
    those of the parameter's shard: a rank-independent rule, so every rank decides the same. Its rows
    must then be this rank's; otherwise ``ValueError`` names the leaf.

    Example:
        >>> leaf_kind(params.plan, "0.weight", params["0.weight"])     # doctest: +SKIP
        'shard'
        >>> leaf_kind(params.plan, "0.weight", state.step["0.weight"])  # a 0-d step  # doctest: +SKIP
        'tensor'
    """
    if leaf is None:
        return "none"
    if not isinstance(leaf, torch.Tensor):
        return "other"
    spec = plan.specs.get(fqn)
    if spec is None or isinstance(leaf, DTensor):
        return "tensor"
    want = spec.local_shape(plan.rank)
    if leaf.dim() != len(want) or tuple(s for i, s in enumerate(leaf.shape) if i != spec.dim) != spec.other_dims:
        return "tensor"
    if tuple(leaf.shape) != want:
        raise ValueError(
            f"leaf {fqn!r} has shape {tuple(leaf.shape)}, but rank {plan.rank}'s shard of {fqn!r} "
            f"{spec.shape} is {want}: it is not a shard of this plan (another world size or model?)"
        )
    return "zero_d" if not spec.shape else "shard"


def zero_d_values(plan: ShardPlan, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """The full 0-d values of 0-d parameter shards (broadcast from the mesh's first rank, which holds
    them), on each leaf's device."""
    if not leaves:
        return []
    metas = [((), t.dtype) for t in leaves]
    values = [t.reshape(()) for t in leaves] if all(t.numel() == 1 for t in leaves) else None
    full = broadcast_tensors(plan.comm, metas, values)
    return [f.to(t.device).clone() for f, t in zip(full, leaves)]


def to_dtensor(params: Sharded[Any]) -> dict[str, torch.Tensor]:
    """This rank's view of ``params`` as a state dict of DTensors, keyed by FQN (tied aliases included).

    Parameter shards become DTensors over ``params.mesh`` (``Shard(0)``; ``(Replicate(), Shard(0))`` on
    an HSDP mesh) that share the shards' storage; buffers and other replicated tensors stay plain
    tensors; 0-d parameters become plain 0-d tensors (a collective: call it on every rank); ``None``
    leaves are skipped. The result is what ``model.state_dict()`` of an FSDP2 model holds, so
    ``torch.distributed.checkpoint`` and FSDP2 read it directly.

    Example:
        >>> sd = fsdpfn.checkpoint.to_dtensor(params)                  # doctest: +SKIP
        >>> sd["0.weight"].placements, sd["0.weight"].shape            # doctest: +SKIP
        ((Shard(dim=0),), torch.Size([5, 3]))
        >>> torch.distributed.checkpoint.save({"model": sd}, checkpoint_id="ckpt")  # doctest: +SKIP
    """
    if not isinstance(params, Sharded):
        raise TypeError(f"to_dtensor: expected a fsdpfn.Sharded, got {type(params).__name__}")
    plan = params.plan
    kinds = {k: leaf_kind(plan, k, v) for k, v in params.items()}
    bad = [k for k, kind in kinds.items() if kind == "other"]
    if bad:
        raise TypeError(f"to_dtensor: leaves {bad} are not tensors or None")
    zero = [k for k, kind in kinds.items() if kind == "zero_d"]
    zero_full = dict(zip(zero, zero_d_values(plan, [params[k] for k in zero])))
    aliases = plan.tied
    out: dict[str, torch.Tensor] = {}
    for k, v in params.items():
        kind = kinds[k]
        if kind == "none":
            continue
        if kind == "shard":
            out[k] = param_dtensor(plan, k, v.detach())
        else:
            out[k] = zero_full[k] if kind == "zero_d" else v.detach()
        for alias in aliases.get(k, ()):
            out[alias] = out[k]
    return out


def _same_mesh(a: Any, b: Any) -> bool:
    return a is b or (a.device_type == b.device_type and a.mesh.tolist() == b.mesh.tolist())


def _local_shard(value: torch.Tensor, spec: ShardSpec, like: Sharded[Any], fqn: str) -> torch.Tensor:
    plan = like.plan
    lay = plan.tp.get(fqn)
    if lay is not None:  # tensor-parallel: this rank's dp shard of its TP slice
        if isinstance(value, DTensor) and _same_mesh(value.device_mesh, lay.mesh) and tuple(value.placements) == lay.placements:
            return value.to_local()
        return shard_tensor(lay.tp_local(_full(value)), spec, plan.rank)
    if not isinstance(value, DTensor):
        return shard_tensor(value.detach(), spec, plan.rank)
    want = placements(like.mesh, spec.dim)
    if value.device_mesh is not like.mesh:
        value = DTensor.from_local(
            value.to_local(), like.mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    if tuple(value.placements) != want:
        value = value.redistribute(like.mesh, want)
    return value.to_local()


def _full(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor):
        return value.to_local() if all(p.is_replicate() for p in value.placements) else value.full_tensor()
    return value.detach()


def from_dtensor(state: Mapping[str, Any], like: Sharded[Any]) -> Sharded[Any]:
    """The reverse of ``to_dtensor``: a ``Sharded`` like ``like`` from a state dict of DTensors.

    Each parameter is read under its FQN or any tied alias. A DTensor with ``like``'s placements gives
    its local shard as is (it may share storage); other placements are redistributed first (a
    collective); a plain tensor is taken as the full value and sliced. Results get ``like``'s dtypes and
    devices; ``None`` leaves of ``like`` stay ``None``; buffers absent from ``state`` (non-persistent ones)
    keep ``like``'s values. Missing or unexpected names, global shape differences and DTensors on another
    mesh are all reported in ONE ``CheckpointMismatchError``.

    Example:
        >>> sd = fsdp2_model.state_dict()                              # doctest: +SKIP
        >>> params = fsdpfn.checkpoint.from_dtensor(sd, like=params)   # doctest: +SKIP
    """
    if not isinstance(like, Sharded):
        raise TypeError(f"from_dtensor: like must be a fsdpfn.Sharded, got {type(like).__name__}")
    if not isinstance(state, Mapping):
        raise TypeError(f"from_dtensor: state must be a mapping of name to tensor, got {type(state).__name__}")
    plan = like.plan
    names = {k: plan.names(k) for k in plan.keys}
    known = {n for ns in names.values() for n in ns}
    problems = [f"unexpected key {k!r}" for k in state if k not in known]
    picked: dict[str, tuple[str, Any]] = {}
    for k, leaf in like.items():
        if leaf is None:
            continue
        hit = next((n for n in names[k] if n in state), None)
        if hit is None:
            if k in plan.buffers:  # state_dict() omits non-persistent buffers: keep like's
                picked[k] = ("like", leaf)
            else:
                problems.append(f"missing key {k!r}")
            continue
        value = state[hit]
        if not isinstance(value, torch.Tensor):
            problems.append(f"{hit!r} is a {type(value).__name__}, not a tensor")
            continue
        kind = leaf_kind(plan, k, leaf)
        if kind == "other":
            raise TypeError(f"from_dtensor: like's leaf {k!r} is a {type(leaf).__name__}, not a tensor or None")
        want = global_shape(plan, k) if kind in ("shard", "zero_d") else tuple(leaf.shape)
        if tuple(value.shape) != want:
            problems.append(f"{hit!r} has global shape {tuple(value.shape)}, like has {want}")
        elif isinstance(value, DTensor) and kind == "shard" and k in plan.tp:
            picked[k] = (kind, value)  # any mesh: gathered to the full tensor unless it is exactly like's layout
        elif isinstance(value, DTensor) and kind == "shard" and not _same_mesh(value.device_mesh, like.mesh):
            problems.append(f"{hit!r} is a DTensor on mesh {value.device_mesh}, not on like's mesh {like.mesh}")
        else:
            picked[k] = (kind, value)
    if problems:
        raise CheckpointMismatchError(
            f"from_dtensor: the state dict does not match like ({len(problems)} problems):\n  " + "\n  ".join(problems),
            problems,
        )
    leaves: dict[str, Any] = {k: None for k in plan.keys}
    for k, (kind, value) in picked.items():
        leaf = like[k]
        if kind == "like":
            leaves[k] = leaf
            continue
        if kind == "shard":
            local = _local_shard(value, plan.specs[k], like, k)
        elif kind == "zero_d":
            full = _full(value).reshape(1)
            local = full if plan.rank == 0 else full[:0]
        else:
            local = _full(value)
        leaves[k] = local.to(device=leaf.device, dtype=leaf.dtype)
    return Sharded(leaves, plan)
