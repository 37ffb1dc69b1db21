"""``fully_shard``: FSDP2's entry point, sharding a module's parameters into ``DTensor``s in place.

Nothing is communicated here: every rank holds the full parameters (or ``meta`` tensors; the TP-local
tensors of tensor-parallel ones, see ``tp.py``) and keeps its ``torch.chunk`` slice along the shard dim
(0 unless ``shard_placement_fn`` says otherwise). The module's class becomes ``FSDP<Original>`` (with the
``FSDPModule`` methods), and its forward runs through the root's plan (see ``root.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, overload

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdpfn.compat.anomaly import allow_anomaly_checks
from fsdpfn.compat.checks import check_mesh, check_modules, check_not_scalar, check_reshard, shard_dim_of
from fsdpfn.compat.explicit_unshard import discard_unshard
from fsdpfn.compat.module import FSDPModule, _unimplemented_deepcopy
from fsdpfn.compat.pipelining import register_pipeline_state
from fsdpfn.compat.replaced_params import watch_optimizer_steps
from fsdpfn.compat.state import ManagedParam, UnitState, mark_sharded, set_state, sharded_as, state_of
from fsdpfn.compat.tp import SpmdMesh, spmd_layout, tp_param
from fsdpfn.core import default_mesh, mesh_groups
from fsdpfn.layout import ShardSpec, contiguous_stride, shard_tensor
from fsdpfn.ops.extension import extension_of
from fsdpfn.ops.shard import check_initialised, ignored_ids
from fsdpfn.ops.slots import set_parameter
from fsdpfn.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, as_mp_policy, as_offload_policy

__all__ = ["fully_shard"]

_CLASSES: dict[tuple[type, type, str], type] = {}  # FSDP<Original> per class: shared by every rank, holds no rank state


@overload
def fully_shard(module: nn.Module, **kwargs: Any) -> FSDPModule: ...
@overload
def fully_shard(module: list[nn.Module], **kwargs: Any) -> list[FSDPModule]: ...


def fully_shard(
    module: Any,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: Any = MixedPrecisionPolicy(),
    offload_policy: Any = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
) -> Any:
    """Shard ``module``'s parameters (those not already sharded by a call on a submodule) over ``mesh``
    as ``nn.Parameter(DTensor)`` with ``(Shard(0),)`` placements (``(Replicate(), Shard(0))`` on a 2-D
    HSDP mesh; ``Shard(d)`` where ``shard_placement_fn`` says so); one collective group per call.
    Tensor-parallel ``DTensor`` parameters on a sibling sub-mesh (``mesh["tp"]`` beside ``mesh["dp"]``), or
    on the whole mesh with ``dp_mesh_dims``, get FSDP2's dp + tp layout (docs/tensor_parallel.md). Same
    signature and behaviour as ``torch.distributed.fsdp.fully_shard`` (torch 2.13); differences are
    listed in docs/compat.md.

    Example:
        >>> from fsdpfn.compat import fully_shard
        >>> for block in model.blocks:                            # doctest: +SKIP
        ...     fully_shard(block)
        >>> fully_shard(model)                                    # doctest: +SKIP
        >>> model(x).sum().backward()     # .grad are DTensors, averaged over ranks   # doctest: +SKIP
    """
    return _shard(
        module,
        kind="fully_shard",
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        dp_mesh_dims=dp_mesh_dims,
    )


def _shard(
    module: Any,
    *,
    kind: str,
    mesh: DeviceMesh | None,
    reshard_after_forward: bool | int | None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    mp_policy: Any,
    offload_policy: Any,
    ignored_params: Iterable[nn.Parameter] | None,
    dp_mesh_dims: Any,
    placements: tuple[Any, ...] | None = None,
    wrapper: type = FSDPModule,
    prefix: str = "FSDP",
) -> Any:
    modules = check_modules(module, kind)
    mesh = check_mesh(default_mesh() if mesh is None else mesh, kind, dp_mesh_dims)  # torch's default, made per call
    spmd = None
    if dp_mesh_dims is not None:  # parameters are DTensors on the whole mesh; fsdpfn communicates over its dp dims
        spmd = SpmdMesh.of(mesh, dp_mesh_dims, kind)
        mesh = spmd.dp_mesh
    mp = _policy(mp_policy, kind)
    offload = _offload(offload_policy, mesh, kind)
    groups = mesh_groups(mesh, replicate_only=kind == "replicate")
    check_reshard(reshard_after_forward, groups.world, kind)
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(
            f"{kind}: shard_placement_fn must be a callable (parameter) -> Shard(dim) or None, got {type(shard_placement_fn).__name__}"
        )
    if placements is None:
        placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
    device = groups.device
    ignored = ignored_ids(ignored_params, kind)

    inner = _inner_states(modules)
    taken = {id(m.param) for st in inner for m in st.managed}
    for root in modules:
        check_initialised(root, kind, then=f"call {kind}")  # FSDP2 fails in a tensor method, naming nothing
    for root in modules:  # FSDP2 checks every parameter's rank before any other
        for mod in root.modules():
            for attr, p in mod._parameters.items():
                if p is not None and id(p) not in ignored and id(p) not in taken:
                    check_not_scalar(attr, p)
    managed: list[ManagedParam] = []
    by_id: dict[int, ManagedParam] = {}
    joins: list[tuple[ManagedParam, nn.Module, str]] = []
    for root in modules:
        for mod in root.modules():
            for attr, p in list(mod._parameters.items()):
                if p is None or id(p) in ignored or id(p) in taken:
                    continue
                if id(p) in by_id:
                    by_id[id(p)].slots.append((mod, attr))
                    continue
                earlier = sharded_as(p)
                if earlier is not None:  # tied to a parameter an earlier call sharded: one parameter
                    if p is not earlier.param:  # the plain original, still registered here
                        joins.append((earlier, mod, attr))
                    continue
                where = f"parameter {attr!r} of {type(mod).__name__}"
                extension = extension_of(p._local_tensor if isinstance(p, DTensor) else p.data, where, kind)
                dim = shard_dim_of(p, attr, mod, shard_placement_fn, groups.world, kind)
                if extension and (dim != 0 or isinstance(p, DTensor) or spmd is not None):
                    raise NotImplementedError(
                        f"{kind}: {where} is a {type(p.data).__name__} with fsdp_pre_all_gather/fsdp_post_all_gather: "
                        "fsdpfn.compat gathers such parameters only as plain tensors sharded on dim 0 (no "
                        "shard_placement_fn dim other than 0, no tensor-parallel DTensor); shard it on dim 0"
                    )
                by_id[id(p)] = ManagedParam(p, [(mod, attr)], dim, where=where, extension=extension)
                managed.append(by_id[id(p)])
    if managed:
        watch_optimizer_steps()  # an optimizer still holding the parameters replaced below is refused at step()
        allow_anomaly_checks()  # torch.autograd.detect_anomaly checks the DTensor gradients LocalShards returns
    hooked: dict[int, nn.Module] = {}
    for earlier, mod, attr in joins:
        earlier.slots.append((mod, attr))
        set_parameter(mod, attr, earlier.param)
    for m in managed:
        mark_sharded(m.param, m)
        m.param = _to_dtensor(m, mesh, placements, groups, device, kind, spmd)
        mark_sharded(m.param, m)
        for mod, attr in m.slots:
            set_parameter(mod, attr, m.param)
            if id(mod) not in hooked:
                hooked[id(mod)] = mod
                mod.register_load_state_dict_pre_hook(_refuse_plain_tensors)
    if device.type != "meta":
        for root in modules:
            for mod in root.modules():
                for name, b in list(mod._buffers.items()):
                    if b is not None and not b.is_meta and b.device != device:
                        mod._buffers[name] = b.to(device)

    state = UnitState(
        modules=tuple(modules),
        mesh=mesh,
        mp_policy=mp,
        offload_policy=offload,
        reshard_after_forward=reshard_after_forward,
        placements=placements,
        managed=managed,
        kind=kind,
        ignored=frozenset(ignored),
    )
    for mod in hooked.values():  # as FSDP2's: a state dict holds the sharded parameters
        mod.register_state_dict_pre_hook(functools.partial(_sharded_for_state_dict, state))
        mod.register_load_state_dict_pre_hook(functools.partial(_sharded_for_state_dict, state))
    for st in inner:
        if st.parent is None and st.outer is None:
            if st.mesh == state.mesh and st.kind == state.kind:
                st.parent = state
            else:  # its own plan on its own mesh (or replicate in fully_shard), nested in this one's root
                st.outer = state
    for mod in modules:
        set_state(mod, state)
        cls = type(mod)
        key = (cls, wrapper, prefix)
        new_cls = _CLASSES.get(key)
        if new_cls is None:
            made = type(f"{prefix}{cls.__name__}", (wrapper, cls), {"__deepcopy__": _unimplemented_deepcopy})
            new_cls = _CLASSES.setdefault(key, made)  # rank-threads racing here all get the same class
        mod.__class__ = new_cls
        register_pipeline_state(mod)  # what torch.distributed.pipelining reads of FSDP2's state
    return module


def _sharded_for_state_dict(state: UnitState, *_: Any) -> None:
    """``state_dict``/``load_state_dict`` pre-hook, as FSDP2's: the modules hold their sharded ``DTensor``
    parameters, not the full tensors of an explicit ``unshard()`` nor those a backward that raised left
    registered (a run whose last step failed, then saved)."""
    discard_unshard(state)
    if state.root is not None:
        state.root.apply.leave_failed_backward()


def _refuse_plain_tensors(module: nn.Module, state_dict: Any, prefix: str, *_: Any) -> None:
    """load_state_dict: a sharded parameter takes a DTensor; a plain full tensor would fail deep in
    DTensor's dispatch (or, with ``assign=True``, silently unshard the parameter)."""
    for attr, p in module._parameters.items():
        value = state_dict.get(prefix + attr)
        if isinstance(p, DTensor) and value is not None and not isinstance(value, DTensor):
            raise ValueError(
                f"load_state_dict: {prefix + attr!r} is a plain {type(value).__name__} of shape {tuple(value.shape)}, "
                f"but the parameter is sharded (a DTensor with placements {p.placements}). Load a sharded state dict "
                "(model.state_dict() of a model sharded the same way, or torch.distributed.checkpoint.load), or make "
                "the value a DTensor with torch.distributed.tensor.distribute_tensor(value, mesh, placements)"
            )


def _inner_states(modules: list[nn.Module]) -> list[UnitState]:
    found: list[UnitState] = []
    for root in modules:
        for mod in root.modules():
            st = state_of(mod)
            if st is not None and all(st is not s for s in found):
                found.append(st)
    return found


def _policy(policy: Any, kind: str) -> MixedPrecisionPolicy:
    return as_mp_policy(policy, kind) or MixedPrecisionPolicy()


def _offload(policy: Any, mesh: DeviceMesh, kind: str) -> OffloadPolicy:
    policy = as_offload_policy(policy, kind)
    if isinstance(policy, CPUOffloadPolicy) and mesh.device_type != "cpu":
        raise NotImplementedError(
            f"{kind}: CPUOffloadPolicy on a {mesh.device_type} mesh (shards in host memory, gathered to the "
            "device) is not supported by fsdpfn.compat yet"
        )
    return policy or OffloadPolicy()


def _to_dtensor(
    m: ManagedParam, mesh: DeviceMesh, placements: tuple[Any, ...], groups: Any, device: torch.device, kind: str, spmd: SpmdMesh | None
) -> nn.Parameter:
    """``m.param`` as this rank's shard: a ``DTensor`` on ``mesh`` (on the dp + TP mesh for a TP parameter,
    on the whole mesh with ``dp_mesh_dims``; see ``tp.py``), split with ``torch.chunk`` along ``m.dim``."""
    p = m.param
    placements = tuple(Shard(m.dim) if isinstance(pl, Shard) else pl for pl in placements)
    sharded = any(isinstance(pl, Shard) for pl in placements)
    if spmd is not None:
        m.tp, out_placements = spmd.layout(p, m.dim, m.where, kind)
        out_mesh, data = spmd.mesh, p._local_tensor
    elif isinstance(p, DTensor):
        out_mesh, out_placements = spmd_layout(p, mesh, placements, m.dim, m.where, kind)
        m.tp = tp_param(p)
        data = p._local_tensor
    else:
        out_mesh, out_placements, data = mesh, placements, p
    m.gathered = tuple(data.shape)
    spec = ShardSpec(m.gathered, groups.world, m.dim)
    if data.is_meta:
        local = torch.empty(spec.local_shape(groups.rank) if sharded else data.shape, dtype=data.dtype, device="meta")
    else:
        full = data.detach().to(device)
        local = shard_tensor(full, spec, groups.rank) if sharded else full.clone()
    local = local.contiguous()
    dt = DTensor.from_local(local, out_mesh, out_placements, run_check=False, shape=p.shape, stride=contiguous_stride(p.shape))
    return nn.Parameter(dt, requires_grad=p.requires_grad)


