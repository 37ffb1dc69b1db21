"""``save`` / ``load`` of any pytree of tensors, ``Sharded`` trees and python scalars, in DCP format.

Keys follow DCP's own flattening (``torch.distributed.checkpoint``'s ``flatten_state_dict``): the path
to a leaf joined with ``"."`` — dict keys as ``str(key)``, list/tuple positions as their index, named
tuple fields by name, and a ``Sharded`` contributes its parameter FQNs. So ``{"model": params}`` is
stored under ``model.<fqn>``, exactly what ``dcp.save({"model": fsdp2_model.state_dict()})`` writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as tp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdpfn.checkpoint._dcp import dcp_load, dcp_save
from fsdpfn.checkpoint._sync import comm_for, dcp_group
from fsdpfn.checkpoint.atomic import verify, write_atomically
from fsdpfn.checkpoint.dtensor import global_shape, leaf_kind, param_dtensor, zero_d_values
from fsdpfn.checkpoint.errors import CheckpointMismatchError
from fsdpfn.layout import Sharded, ShardPlan

__all__ = ["load", "save"]

SCALAR_TYPES = (bool, int, float, str)


@dataclass(eq=False)
class _Leaf:
    key: str
    kind: str  # "shard" | "zero_d" | "tensor" | "scalar" | "none"
    value: Any
    names: tuple[str, ...] = ()  # DCP keys carrying it: the key, then tied aliases
    plan: ShardPlan | None = None
    fqn: str = ""
    src: str | None = None  # load: the checkpoint key it is read from

    @property
    def global_shape(self) -> tuple[int, ...]:
        if self.kind in ("shard", "zero_d"):
            return global_shape(self.plan, self.fqn)  # type: ignore[arg-type]
        return tuple(self.value.shape)


def _entry_name(entry: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _plain_kind(key: str, value: Any, what: str) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, SCALAR_TYPES):
        return "scalar"
    if value is None:
        return "none"
    raise TypeError(
        f"{what}: leaf {key!r} is a {type(value).__module__}.{type(value).__qualname__}; checkpoints hold "
        f"tensors, fsdpfn.Sharded trees and int/float/bool/str scalars (never pickled objects)"
    )


def _flatten(tree: Any, what: str) -> tuple[list[Any], Any, list[_Leaf], set[str] | None]:
    """``(nodes, treespec, leaves, scope)``: each node is a ``_Leaf`` or ``(Sharded, [_Leaf per key])``."""
    pairs, spec = tp.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, Sharded))
    nodes: list[Any] = []
    leaves: list[_Leaf] = []
    for path, value in pairs:
        prefix = ".".join(_entry_name(e) for e in path)
        if isinstance(value, Sharded):
            plan = value.plan
            aliases = plan.tied
            sub = []
            for fqn, v in value.items():
                key = _join(prefix, fqn)
                try:
                    kind = leaf_kind(plan, fqn, v)
                except ValueError as exc:
                    raise ValueError(f"{what}: {key!r}: {exc}") from None
                if kind == "other":
                    kind = _plain_kind(key, v, what)
                names = (key, *(_join(prefix, a) for a in aliases.get(fqn, ()))) if kind != "scalar" else (key,)
                sub.append(_Leaf(key, kind, v, names, plan, fqn))
            nodes.append((value, sub))
            leaves.extend(sub)
        else:
            if not path:
                raise TypeError(
                    f"{what}: the tree must be a container (dict, list, tuple ...) or a Sharded, "
                    f"got {type(value).__name__}"
                )
            leaf = _Leaf(prefix, _plain_kind(prefix, value, what), value, (prefix,))
            nodes.append(leaf)
            leaves.append(leaf)
    scope = None if isinstance(tree, Sharded) else {_entry_name(path[0]) for path, _ in pairs if path}
    return nodes, spec, leaves, scope


def _plans(leaves: list[_Leaf]) -> list[Any]:
    """The plans of the ``Sharded`` trees among ``leaves``, each once, in order."""
    return list({id(leaf.plan): leaf.plan for leaf in leaves if leaf.plan is not None}.values())


def save(path: str | os.PathLike[str], tree: Any) -> None:
    """Save ``tree`` to the directory ``path`` in ``torch.distributed.checkpoint`` format, atomically.

    Collective: call it on every rank of ``tree``'s mesh (only those: docs/checkpoints.md). ``tree`` is
    any pytree (dicts, lists, tuples, named tuples ...) whose leaves are tensors, ``fsdpfn.Sharded`` trees
    (parameters, gradients, optimizer state) and ``int``/``float``/``bool``/``str`` scalars (``None`` is
    kept by the structure). Parameter shards are written as DTensor chunks (``Shard(0)``), so the
    checkpoint loads at any world size and into FSDP2 models; tied parameters are written under every
    name, as ``module.state_dict()`` does.

    Plain tensors (and a ``Sharded``'s replicated leaves, like buffers or Adam's step counters) are
    taken as replicated: rank 0's value is written. Values that differ per rank (e.g. each rank's
    ``torch.get_rng_state()``) therefore keep only rank 0's. Scalars go to a JSON sidecar written by
    rank 0 — nothing is pickled. Keys: the pytree path joined with ``"."`` (see the module docstring).

    The checkpoint is written into a hidden sibling directory and swapped into ``path`` only when
    complete; an interrupted save leaves the previous checkpoint at ``path`` intact. An existing
    ``path`` must be a checkpoint or empty.

    Example:
        >>> fsdpfn.checkpoint.save("ckpt/step-100", {"model": params, "opt": opt_state, "step": 100,
        ...                                           "rng": torch.get_rng_state()})    # doctest: +SKIP
    """
    _, _, leaves, _ = _flatten(tree, "save")
    seen: dict[str, int] = {}
    for leaf in leaves:
        for name in leaf.names:
            seen[name] = seen.get(name, 0) + 1
    dup = [k for k, n in seen.items() if n > 1]
    if dup:
        raise ValueError(f"save: several leaves map to the checkpoint keys {dup}; rename them (paths join with '.')")
    plans = _plans(leaves)
    comm = comm_for(plans)
    zero: dict[int, torch.Tensor] = {}
    for plan in plans:
        group = [leaf for leaf in leaves if leaf.kind == "zero_d" and leaf.plan is plan]
        zero.update(zip(map(id, group), zero_d_values(plan, [leaf.value for leaf in group])))
    state: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    for leaf in leaves:
        if leaf.kind == "scalar":
            scalars[leaf.key] = leaf.value
            continue
        if leaf.kind == "shard":
            plan = leaf.plan
            assert plan is not None
            value: Any = param_dtensor(plan, leaf.fqn, leaf.value.detach())
        elif leaf.kind == "zero_d":
            value = zero[id(leaf)]
        elif leaf.kind == "tensor":
            value = leaf.value.detach()
        else:
            continue
        for name in leaf.names:
            state[name] = value

    write_atomically(os.fspath(path), comm, lambda tmp: dcp_save(state, tmp, dcp_group(comm)), scalars)


def _match(leaves: list[_Leaf], md: Any, scalars: dict[str, Any], scope: set[str] | None, strict: bool) -> list[str]:
    sd = md.state_dict_metadata
    missing, other = [], []
    requested: set[str] = set()
    for leaf in leaves:
        if leaf.kind == "none":
            continue
        requested.update(leaf.names)
        if leaf.kind == "scalar":
            if leaf.key in scalars:
                leaf.src = leaf.key
            elif leaf.key in sd:
                other.append(f"{leaf.key!r}: the checkpoint holds a tensor, like has a {type(leaf.value).__name__}")
            else:
                missing.append(leaf.key)
            continue
        hit = next((n for n in leaf.names if n in sd), None)
        if hit is None:
            if leaf.key in scalars:
                held = type(scalars[leaf.key]).__name__
                other.append(f"{leaf.key!r}: the checkpoint holds a {held}, like has a tensor")
            elif leaf.plan is None or leaf.fqn not in leaf.plan.buffers:  # buffers may be absent: kept
                missing.append(leaf.key)
            continue
        m = sd[hit]
        if not isinstance(m, TensorStorageMetadata):
            other.append(f"{hit!r}: stored as a pickled object, not a tensor (fsdpfn never unpickles entries)")
        elif tuple(m.size) != leaf.global_shape:
            other.append(f"{hit!r}: shape {tuple(m.size)} in the checkpoint, {leaf.global_shape} in like")
        else:
            leaf.src = hit

    def in_scope(k: str) -> bool:
        return scope is None or any(k == s or k.startswith(s + ".") for s in scope)

    unexpected = [k for k in [*sd, *scalars] if k not in requested and in_scope(k)]
    if not strict:
        missing, unexpected = [], []
    problems = [f"missing from the checkpoint: {k!r}" for k in missing]
    problems += [f"unexpected in the checkpoint: {k!r}" for k in unexpected]
    return problems + other


def load(path: str | os.PathLike[str], like: Any, *, strict: bool = True) -> Any:
    """Load the checkpoint at ``path`` into a tree shaped like ``like`` (which is not modified).

    Collective: call it on every rank of ``like``'s mesh. ``like`` gives the structure, the target world
    size and plan (its ``Sharded`` trees, built with ``fsdpfn.shard`` at *this* run's world size), dtypes
    and devices; its values are not used. DCP reshards by chunk metadata, so a checkpoint written at any world size
    (or by FSDP2 with ``dcp.save({"model": model.state_dict()})``) loads. ``like``'s top-level entries
    select what is read; within them, names and global shapes must match: every missing key, unexpected
    key and shape difference is reported in ONE ``CheckpointMismatchError`` before anything is read.
    ``strict=False`` keeps ``like``'s value for missing keys and ignores unexpected ones (shapes must still
    match). A ``Sharded``'s buffers may be absent (``module.state_dict()`` omits non-persistent ones): they
    keep ``like``'s values. Tensors are cast to ``like``'s dtypes.

    The checkpoint is validated first: an fsdpfn checkpoint needs its completion marker and every file it
    lists (a ``CheckpointError`` names the missing piece); DCP's ``.metadata`` pickle is read with an
    allow-list unpickler (``UnsafeCheckpointError``, nothing executed) and tensor data with
    ``weights_only`` loads.

    Example:
        >>> params = fsdpfn.shard(model, mesh, units=units)             # any world size  # doctest: +SKIP
        >>> like = {"model": params, "opt": opt.init(params), "step": 0, "rng": torch.get_rng_state()}  # doctest: +SKIP
        >>> ckpt = fsdpfn.checkpoint.load("ckpt/step-100", like)        # doctest: +SKIP
        >>> params, opt_state, step = ckpt["model"], ckpt["opt"], ckpt["step"]   # doctest: +SKIP
    """
    nodes, spec, leaves, scope = _flatten(like, "load")
    path = os.fspath(path)
    md, scalars = verify(path)
    problems = _match(leaves, md, scalars, scope, strict)
    if problems:
        hint = ""
        if all(p.startswith("unexpected in the checkpoint:") for p in problems):
            # nothing like needs is missing: state this run does not keep (an optimizer state written by an
            # fsdpfn that kept more, such as sgd's step counters for undampened momentum, dropped in 0.1.0)
            hint = ("\nEvery problem is a key like does not have: nothing it needs is missing. If that state is "
                    "not needed here, load with strict=False to skip it")
        raise CheckpointMismatchError(
            f"load: the checkpoint at {path!r} does not match like ({len(problems)} problems):\n  "
            + "\n  ".join(problems) + hint,
            problems,
        )
    state: dict[str, Any] = {}
    result: dict[int, Any] = {}
    for leaf in leaves:
        v = leaf.value
        if leaf.kind == "none" or leaf.src is None:
            result[id(leaf)] = v
        elif leaf.kind == "scalar":
            result[id(leaf)] = scalars[leaf.src]
        elif leaf.kind == "shard":
            local = torch.empty(v.shape, dtype=v.dtype, device=v.device)
            plan = leaf.plan
            assert plan is not None
            state[leaf.src] = param_dtensor(plan, leaf.fqn, local)
            result[id(leaf)] = local
        elif leaf.kind == "zero_d":
            state[leaf.src] = result[id(leaf)] = torch.empty((), dtype=v.dtype, device=v.device)
        else:
            state[leaf.src] = result[id(leaf)] = torch.empty_like(v, memory_format=torch.contiguous_format)
    if state:
        dcp_load(state, path, md, dcp_group(comm_for(_plans(leaves))))
    for leaf in leaves:
        if leaf.kind == "zero_d" and leaf.src is not None:
            full = result[id(leaf)].reshape(1)
            result[id(leaf)] = full if leaf.plan.rank == 0 else full[:0].clone()  # type: ignore[union-attr]
    flat = []
    for node in nodes:
        if isinstance(node, _Leaf):
            flat.append(result[id(node)])
        else:
            tree, sub = node
            flat.append(Sharded({leaf.fqn: result[id(leaf)] for leaf in sub}, tree.plan))
    return tp.tree_unflatten(flat, spec)
