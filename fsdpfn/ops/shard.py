"""``shard``: split a module's parameters over a mesh into a ``Sharded`` tree, one unit per submodule."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parameter import UninitializedTensorMixin

from fsdpfn.core import Comm, link_of
from fsdpfn.layout import ParamInfo, Sharded, build_plan, shard_tensor
from fsdpfn.messages import listing
from fsdpfn.ops.donation import donate_parameters, donated_by, guard, was_donated
from fsdpfn.ops.extension import AllGatherTransform, extension_of, shard_mesh, subclass_transform
from fsdpfn.ops.materialize import is_meta, materialize_and_shard
from fsdpfn.ops.placement import PlacementFn, placement_dim
from fsdpfn.ops.tp import TPLayout, tp_layout, unwrap
from fsdpfn.ops.units import Units, owning_unit, resolve_units
from fsdpfn.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, as_mp_policy, as_offload_policy

__all__ = ["check_initialised", "ignored_ids", "shard"]

def ignored_ids(ignored_params: Iterable[Any] | None, where: str) -> set[int]:
    """The identities of ``ignored_params`` (parameters; FSDP2 takes a set of them). A name or anything
    else that is not a tensor is refused: it would match no parameter, so nothing would be left out.

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> ignored_ids({lin.bias}, "shard") == {id(lin.bias)}
        True
    """
    if ignored_params is None:
        return set()
    if isinstance(ignored_params, (str, torch.Tensor)):
        raise TypeError(
            f"{where}: ignored_params must be a collection of parameters (a set, as FSDP2 takes), got a "
            f"{type(ignored_params).__name__}; e.g. {{model.get_parameter('head.weight')}}"
        )
    out = set()
    for p in ignored_params:
        if not isinstance(p, torch.Tensor):
            hint = f"{{model.get_parameter({p!r})}}" if isinstance(p, str) else "the nn.Parameter objects"
            raise TypeError(
                f"{where}: ignored_params holds a {type(p).__name__} ({p!r:.60}), not a parameter: it would leave "
                f"nothing out. Pass the parameters themselves, e.g. {hint}"
            )
        out.add(id(p))
    return out


def _dp_placements(mesh: Any, dim: int) -> tuple[Any, ...]:
    return (Shard(dim),) if mesh.ndim == 1 else (Replicate(), Shard(dim))


def check_initialised(module: nn.Module, kind: str, *, then: str) -> None:
    """Refuse, by name, a parameter or buffer a lazy module has not made yet (``nn.LazyLinear`` before its
    first forward: nothing to shard; ``kind`` names the caller, ``then`` what to do after a sample batch),
    and parameters an earlier ``shard`` of another module donated (a submodule two models share: their
    ``meta`` placeholders would pass for a module built on ``meta`` and be initialised anew, silently).

    Example:
        >>> check_initialised(nn.Linear(2, 2), "shard", then="shard it")    # passes: nothing lazy
    """
    gone: list[tuple[str, str]] = []
    for fqn, t in [*module.named_parameters(), *module.named_buffers()]:
        if isinstance(t, UninitializedTensorMixin):
            raise ValueError(
                f"{kind}: {fqn!r} of {type(module).__name__} is not initialised yet (a lazy module, such as "
                f"nn.LazyLinear, makes it at its first forward): run the model once on a sample batch, then {then}"
            )
        by = donated_by(t)
        if by is not None:
            gone.append((fqn, by))
    if gone:
        raise ValueError(
            f"{kind}: parameter(s) {listing([f for f, _ in gone])} of {type(module).__name__} were donated to an "
            f"earlier fsdpfn.shard of a {gone[0][1]} that shares them: their values live in that call's Sharded "
            f"tree, and {kind} would initialise new weights in their place. Shard one module holding both models "
            "(one Sharded tree), or pass donate=False to the earlier shard"
        )


def shard(
    module: nn.Module,
    mesh: Any,
    *,
    units: Units = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
    init: Callable[[nn.Module], None] | None = None,
    min_bucket_bytes: int | Literal["auto"] | None = "auto",
    donate: bool = True,
    all_gather_transforms: Mapping[str, AllGatherTransform] | None = None,
    shard_placement_fn: PlacementFn | None = None,
) -> Sharded[torch.Tensor]:
    """Shard ``module``'s parameters over ``mesh`` and return this rank's ``Sharded`` tree.

    Each unit's parameters travel in one collective per dtype; parameters outside every unit belong
    to the root unit, and a unit inside another owns its own parameters. Tied parameters (one
    ``Parameter`` under two names) are sharded once, under their first name. Buffers ride along
    unsharded.

    A real module's parameters are *donated* (``donate=True``, the default), as ``jax.jit`` donates
    buffers: once this rank's shards are copied out, every sharded parameter of ``module`` is replaced by
    a ``meta`` parameter of the same shape, and no rank keeps the full weights resident (unless the
    caller still holds the old ``Parameter`` objects). ``fsdp(module)`` needs nothing more: it swaps values in for each
    call. Ignored parameters and buffers stay where they are. Pass ``donate=False`` to keep the module's
    weights (a reference model in a test); a donated module cannot be sharded again (its weights are
    gone: shard the module once, or with ``donate=False``), and calling it directly instead of through
    ``fsdp(module)`` is refused by name. Threads that run forwards at once each take their own module.

    A module built on the ``meta`` device is materialised one unit at a time on the mesh's device
    (``reset_parameters()`` of each module that owns parameters, or ``init(module)`` when given) and
    only this rank's shards are kept, so no rank holds the whole model; the module stays on ``meta``.
    Seed every rank alike: the full parameters then do not depend on the world size. A parameter or
    buffer the initialiser leaves unwritten (its memory would be arbitrary) is refused by name.

    ``min_bucket_bytes`` fuses runs of consecutive units (in ``units`` order) until each run gathers
    at least that many bytes: a run travels in one collective per dtype and is gathered, resharded and
    reduced as a whole, so a model of many small blocks pays the per-collective latency a few times
    instead of once per block, at the price of keeping a whole run gathered while any of it runs.
    Results are the same; ``params.plan.groups`` shows the runs. ``None``: one collective per unit.
    ``"auto"`` (default) measures the mesh's all-gather latency and bandwidth once (a few small
    all-gathers, agreed over all ranks) and fills groups up to the size at which latency stops
    mattering, capped at ``max(largest unit, 1/8 of this rank's shard bytes)`` on CUDA so the gathered
    window stays within what the optimizer step holds anyway (at the largest unit on CPU, where no
    optimizer temporary leaves that room: nothing is fused there); units that are already large stay
    alone (``params.plan.bucket_bytes`` is what it chose). See ``fsdpfn.layout.autobucket``. With ``"auto"``,
    ``fsdp``'s first call may fuse further: it sees the batch, and ``fsdpfn.optim``'s ``init`` notes the
    optimizer, so the planner prices larger groups against torch's ``fully_shard`` peak for the step
    (``fsdpfn.memory.fuse_within``; docs/memory.md). Pass an int or ``None`` to fix the groups.

    Tensor-parallel modules (``parallelize_module(module, mesh["tp"], plan)``, parameters ``DTensor``s on
    a sibling sub-mesh of ``mesh``, e.g. ``mesh["dp"]``) shard each parameter's TP-local tensor over
    ``mesh``: the leaves are the local shards, ``unshard`` and ``fsdp`` gather over ``mesh`` only and hand
    the module ``DTensor``s with its TP placements, and ``params.plan.tp`` holds each one's layout
    (docs/tensor_parallel.md).

    ``all_gather_transforms`` maps parameter FQNs to ``fsdpfn.AllGatherTransform``s: such a parameter is
    all-gathered in the representation its transform's ``pre`` makes of the local shard (e.g. int8 values
    and a scale), and its full tensor is what ``post`` rebuilds from the gathered inputs; all transformed
    members of a unit travel in one ``uint8`` collective, and their gradients are reduce-scattered as
    usual (see ``fsdpfn.ops.extension``, FSDP2's ``fsdp_pre_all_gather`` in functional form). Parameters
    whose tensor subclass defines ``fsdp_pre_all_gather``/``fsdp_post_all_gather`` get theirs without asking.

    ``shard_placement_fn`` (FSDP2's): ``(parameter) -> Shard(dim) | None`` picks each parameter's shard
    dim (``None``: ``Shard(0)``; negative dims count from the end; for a TP parameter, a dim of its
    TP-local tensor). A parameter is split with ``torch.chunk`` along its dim, uneven sizes included, as
    ``distribute_tensor(x, mesh, [Shard(dim)])`` lays it out; ``params.specs[fqn].dim`` records it and
    every collective, ``to_dtensor`` (``Shard(dim)`` placements) and checkpoint follows it. It is called
    once per parameter (tied ones once), never for ignored ones.

    Example:
        >>> mesh = fsdpfn.init_mesh()                                   # doctest: +SKIP
        >>> params = fsdpfn.shard(model, mesh, units=[f"blocks.{i}" for i in range(4)])  # doctest: +SKIP
        >>> params = fsdpfn.shard(model, mesh, shard_placement_fn=lambda p: Shard(-1))  # doctest: +SKIP
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"shard: expected an nn.Module, got {type(module).__name__}")
    if was_donated(module):
        raise ValueError(
            f"shard: this {type(module).__name__}'s parameters were donated to an earlier shard() call (they are "
            "on the meta device now; sharding it again would initialise new weights). Reuse the Sharded tree that "
            "call returned (fsdpfn.save/load or to_dtensor to move it to another mesh), or pass donate=False to "
            "the first shard() to keep the weights"
        )
    if not isinstance(donate, bool):  # donate="no" would be truthy and move the weights away
        raise TypeError(f"shard: donate must be True or False, got {donate!r}")
    mp_policy = as_mp_policy(mp_policy, "shard")
    offload_policy = as_offload_policy(offload_policy, "shard")
    if isinstance(offload_policy, CPUOffloadPolicy):
        raise NotImplementedError("shard: offload_policy=CPUOffloadPolicy is not supported by the functional layer yet")
    mesh_device = getattr(mesh, "device_type", None)
    check_initialised(module, "shard", then="shard it")  # torch's own error says "load_state_dict"
    for fqn, p in module.named_parameters():  # before any group is touched: a wrong mesh fails fast
        if mesh_device is not None and p.device.type != mesh_device and not p.is_meta:
            raise ValueError(
                f"shard: parameter {fqn!r} is on {p.device} but the mesh is on {mesh_device}; "
                f"move the module with module.to({mesh_device!r}) or build the mesh for {p.device.type}"
            )
    comm = Comm(mesh)
    groups = comm.groups
    unit_names = resolve_units(module, units)
    ignored = ignored_ids(ignored_params, "shard")

    owners: dict[int, str] = {}
    aliases: dict[str, str] = {}
    names: dict[str, list[str]] = {}
    found: dict[str, nn.Parameter] = {}
    ignored_names: list[str] = []
    for fqn, p in module.named_parameters(remove_duplicate=False):
        if id(p) in ignored:
            ignored_names.append(fqn)
            continue
        if id(p) in owners:
            aliases[fqn] = owners[id(p)]
            names[owners[id(p)]].append(fqn)
            continue
        owners[id(p)] = fqn
        names[fqn] = [fqn]
        found[fqn] = p
    tp_names = [fqn for fqn, p in found.items() if isinstance(p, DTensor)]
    if tp_names and is_meta(module):
        raise NotImplementedError(
            f"shard: {type(module).__name__} is on the meta device and has tensor-parallel parameters "
            f"({', '.join(map(repr, tp_names[:3]))}); materialise it first (module.to_empty(device=...) and "
            "reset_parameters(), then parallelize_module), and shard the real module"
        )
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(
            f"shard: shard_placement_fn must be a callable (parameter) -> Shard(dim) or None, got {type(shard_placement_fn).__name__}"
        )
    where = {fqn: f"parameter {fqn!r} of {type(module).__name__}" for fqn in found}
    dims = {fqn: placement_dim(p, shard_placement_fn, where[fqn], "shard") for fqn, p in found.items()}
    tp: dict[str, TPLayout] = {}
    for fqn, p in found.items():  # tensor-parallel parameters: their TP-local tensors are what dp shards
        if isinstance(p, DTensor):
            tp[fqn] = tp_layout(p, mesh, _dp_placements(mesh, dims[fqn]), dims[fqn], where[fqn], "shard")
    infos = [
        ParamInfo(fqn, tuple(unwrap(p).shape), p.dtype, p.requires_grad, owning_unit(names[fqn], unit_names), dims[fqn])
        for fqn, p in found.items()
    ]

    transforms = _transforms(all_gather_transforms, found, aliases, mesh, module, mp_policy)
    for fqn in transforms:
        if dims[fqn] != 0 or fqn in tp:
            what = f"sharded on dim {dims[fqn]} (shard_placement_fn)" if dims[fqn] != 0 else "a tensor-parallel DTensor"
            raise NotImplementedError(
                f"shard: parameter {fqn!r} has an all-gather transform and is {what}: fsdpfn gathers transformed "
                "parameters only as plain tensors sharded on dim 0; shard it on dim 0 or drop its transform"
            )
    meta = is_meta(module)
    buffer_names = [fqn for fqn, _ in module.named_buffers()]
    policy = mp_policy or MixedPrecisionPolicy()
    plan = build_plan(
        infos,
        buffer_names,
        [""] + unit_names,
        rank=groups.rank,
        world=groups.world,
        gather_dtype=policy.gather_dtype,
        reduce_dtype=policy.grad_reduce_dtype,
        aliases=aliases,
        replicas=groups.replicas,
        mesh=mesh,
        comm=comm,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        module_type=type(module).__name__,
        ignored=tuple(ignored_names),
        transforms=transforms,
        min_bucket_bytes=min_bucket_bytes,
        tp=tp,
        link=lambda: link_of(comm),
        transient_buffers=frozenset(
            f"{prefix}.{name}" if prefix else name
            for prefix, mod in module.named_modules()
            for name in getattr(mod, "_non_persistent_buffers_set", ())
        ),
    )
    if meta:
        shards, buffers = materialize_and_shard(module, plan, groups.device, init)
        guard(module, plan, built_on_meta=True)
    else:
        shards = {f: shard_tensor(unwrap(found[f]).detach(), plan.specs[f], groups.rank) for f in plan.params}
        buffers = {fqn: b.detach().clone() for fqn, b in module.named_buffers()}
        if donate:
            donate_parameters(module, found.values())
            guard(module, plan, built_on_meta=False)
    return Sharded._from_children([shards[f] for f in plan.params] + [buffers[b] for b in plan.buffers], plan)


def _transforms(
    given: Mapping[str, AllGatherTransform] | None,
    found: Mapping[str, nn.Parameter],
    aliases: Mapping[str, str],
    mesh: Any,
    module: nn.Module,
    mp_policy: Any,
) -> dict[str, AllGatherTransform]:
    """``shard``'s all-gather transforms by owning FQN: the given ones (checked) and those of tensor
    subclasses defining FSDP2's extension."""
    out: dict[str, AllGatherTransform] = {}
    for fqn, p in found.items():
        if extension_of(p.data, f"parameter {fqn!r} of {type(module).__name__}", "shard"):
            owner = module.get_submodule(fqn.rpartition(".")[0])
            out[fqn] = subclass_transform(shard_mesh(mesh), tuple(p.shape), owner, mp_policy or MixedPrecisionPolicy())
    for fqn, t in (given or {}).items():
        name = aliases.get(fqn, fqn)
        if name not in found:
            raise ValueError(
                f"shard: all_gather_transforms names {fqn!r}, which is not a sharded parameter of this module "
                f"(parameters: {sorted(found)[:8]}{' ...' if len(found) > 8 else ''}); use the names of "
                "module.named_parameters() and leave out ignored parameters"
            )
        if not isinstance(t, AllGatherTransform):
            raise TypeError(
                f"shard: all_gather_transforms[{fqn!r}] must be a fsdpfn.AllGatherTransform(pre, post), got {type(t).__name__}"
            )
        out[name] = t
    return out
