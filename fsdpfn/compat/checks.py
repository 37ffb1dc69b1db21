"""Validation of ``fully_shard``/``replicate`` inputs and of a root's state at lazy initialisation, with
FSDP2's errors: for the same misuse the same exception class, and a message that starts with the text
torch 2.13 prints (code and tests that catch FSDP2's errors keep working), followed, where it adds
something, by what to do in fsdpfn. Where FSDP2's error is an accident of its implementation (an
``AttributeError`` from a mesh that is a string) it is still reproduced: callers may catch it. Where
fsdpfn.compat raised a ``ValueError`` before matching FSDP2, the error is of a class deriving from both.

Example:
    >>> from fsdpfn.compat import fully_shard
    >>> fully_shard(nn.ModuleList([nn.Linear(2, 2)]))          # doctest: +SKIP
    ValueError: fully_shard does not support containers that do not implement forward: ModuleList(...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdpfn.compat.state import state_of
from fsdpfn.messages import listing, torch_text
from fsdpfn.ops.placement import check_placement, check_placement_type
from fsdpfn.ops.units import never_called

if TYPE_CHECKING:
    from fsdpfn.compat.root import RootContext

__all__ = [
    "AppliedTwiceError",
    "EmptyModuleListError",
    "NotAMeshError",
    "NotAModuleError",
    "NotAModuleInListError",
    "check_materialized",
    "check_mesh",
    "check_modules",
    "check_not_scalar",
    "check_reshard",
    "explain_sharded_read",
    "shard_dim_of",
    "state_name",
]


# FSDP2's class first; also a ValueError, which fsdpfn.compat raised for these before matching FSDP2.
class AppliedTwiceError(AssertionError, ValueError):
    """``fully_shard``/``replicate`` applied again to a module it was applied to (FSDP2: ``AssertionError``)."""


class NotAModuleError(TypeError, ValueError):
    """``fully_shard(3)``: not a module nor an iterable of them (FSDP2: ``TypeError``)."""


class NotAModuleInListError(AttributeError, ValueError):
    """A list holding something that is not a module (FSDP2: ``AttributeError``)."""


class EmptyModuleListError(IndexError, ValueError):
    """``fully_shard([])`` (FSDP2: ``IndexError``)."""


class NotAMeshError(AttributeError, ValueError):
    """A mesh that is not a ``DeviceMesh`` (FSDP2: ``AttributeError``, reading its ``ndim``)."""


def _say(torch_text: str, advice: str = "") -> str:
    return f"{torch_text}\n{advice}" if advice else torch_text


def state_name(kind: str) -> str:
    """How FSDP2 names the state of ``kind`` in its messages ("FSDP", "Replicate")."""
    return "Replicate" if kind == "replicate" else "FSDP"


def check_modules(module: Any, kind: str) -> list[nn.Module]:
    """The modules of one ``fully_shard``/``replicate`` call (``module`` or the list of them), checked in
    FSDP2's order: the argument's type, a second application, then a container without ``forward``."""
    if isinstance(module, nn.Module):
        modules = [module]
    else:
        try:
            modules = list(module)
        except TypeError:
            raise NotAModuleError(
                _say(f"'{type(module).__name__}' object is not iterable", f"{kind} expects an nn.Module or a list of them")
            ) from None
        for m in modules:
            if not isinstance(m, nn.Module):
                raise NotAModuleInListError(
                    _say(
                        f"'{type(m).__name__}' object has no attribute 'modules'",
                        f"{kind} expects an nn.Module or a list of them; the list holds a {type(m).__name__}",
                    )
                )
        if not modules:
            raise EmptyModuleListError(_say("tuple index out of range", f"{kind} got an empty list of modules"))
    for m in modules:
        st = state_of(m)
        if st is None:
            continue
        if st.kind == kind:
            raise AppliedTwiceError(
                "Each distinct composable distributed API can only be applied to a module once. "
                f"{kind} has already been applied to the following module:\n{m}\n"
                "Apply it once per module, bottom-up: blocks first, then the root"
            )
        if kind == "replicate":
            raise RuntimeError("Cannot apply `replicate()` on a Module already managed by `fully_shard`")
        raise AssertionError(_say(f"Inserting {m} more than once.", f"{type(m).__name__} is already managed by {st.kind}"))
    if isinstance(module, nn.Module) and never_called(module):
        # FSDP2 refuses ModuleList/Dict so; it accepts ParameterList/Dict and fails at the first forward
        advice = (
            f"apply {kind} to each module in it (or pass them as a list to group them in one unit)"
            if isinstance(module, (nn.ModuleList, nn.ModuleDict))
            else f"an nn.{type(module).__name__} is never called, so its parameters would never be gathered: apply "
            f"{kind} to the module whose forward uses them (their parent), or leave them to its unit"
        )
        raise ValueError(_say(f"{kind} does not support containers that do not implement forward: {module}", advice))
    return modules


def check_mesh(mesh: Any, kind: str, dp_mesh_dims: Any) -> DeviceMesh:
    """FSDP2's mesh checks: a ``DeviceMesh`` of 1 (FSDP) or 2 named dims (HSDP); ``replicate``: 1 dim.
    With ``dp_mesh_dims`` the mesh is the whole SPMD mesh, validated as FSDP2 does (``replicate``: refused)."""
    if not hasattr(mesh, "ndim"):
        raise NotAMeshError(
            _say(
                f"'{type(mesh).__name__}' object has no attribute 'ndim'",
                f"{kind}: mesh must be a torch.distributed.device_mesh.DeviceMesh (e.g. fsdpfn.init_mesh() or "
                f"init_device_mesh), got {type(mesh).__name__}",
            )
        )
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"{kind}: mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if dp_mesh_dims is not None:
        _check_dp_mesh_dims(mesh, dp_mesh_dims)
        if kind != "fully_shard":
            raise NotImplementedError(f"{kind}: dp_mesh_dims (an SPMD mesh with data-parallel dims) is not supported")
        return mesh  # the whole SPMD mesh: fully_shard takes its data-parallel sub-mesh (compat/tp.py)
    if kind == "replicate":
        if mesh.ndim != 1:
            raise ValueError(f"replicate expects a 1D DeviceMesh but got {mesh}")
        return mesh
    if mesh.ndim not in (1, 2):
        raise ValueError(
            _say(
                f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}",
                "pass the data-parallel sub-mesh, e.g. mesh['dp'] or mesh['replicate', 'shard']",
            )
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise AssertionError(
            _say(
                "Please init the 2D mesh for HSDP with mesh_dim_names specified",
                "e.g. init_device_mesh(device, (replicas, shards), mesh_dim_names=('replicate', 'shard')) or "
                "fsdpfn.init_mesh((replicas, shards))",
            )
        )
    return mesh


def _check_dp_mesh_dims(mesh: DeviceMesh, dims: Any) -> None:
    if not (hasattr(dims, "shard") and hasattr(dims, "replicate")):
        return  # not a DataParallelMeshDims: refused as unsupported, whatever it is
    if dims.shard is None and dims.replicate is None:
        raise ValueError("At least one of shard or replicate must be set in dp_mesh_dims")
    if mesh.mesh_dim_names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
    names = [*dims.shard_names, *dims.replicate_names]
    for name in names:
        if name not in mesh.mesh_dim_names:
            raise ValueError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {mesh.mesh_dim_names}")


def check_reshard(value: Any, world: int, kind: str) -> None:
    """``reshard_after_forward``: ``None``, a bool, or an int that divides the shard group size."""
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, int):
        raise ValueError(
            f"reshard_after_forward should be a bool or an int representing the group size to reshard to, not {value}"
        )
    if value < 1 or value > world or world % value:
        raise ValueError(
            _say(
                f"If passing reshard_after_forward as an int, it should be a factor of {world}, not {value}",
                f"{kind}: an int is the number of ranks to reshard to after forward (shard mesh size {world})",
            )
        )


def check_not_scalar(name: str, param: nn.Parameter) -> None:
    """FSDP2 shards on a dim, so a 0-dim parameter has none to shard."""
    if param.ndim == 0:
        raise ValueError(f"fully_shard doesn't support scalar parameters. Change {name} to a 1D tensor with numel equal to 1.")


def shard_dim_of(
    param: nn.Parameter, attr: str, owner: nn.Module, placement_fn: Callable[[nn.Parameter], Any] | None, world: int, kind: str
) -> int:
    """The dim ``param`` is sharded on, checked in FSDP2's order: the ``shard_placement_fn`` result, a
    non-contiguous parameter, a dim out of range (negative dims count from the end)."""
    chosen = placement_fn(param) if placement_fn is not None else None
    where = f"parameter {attr!r} of {type(owner).__name__}"
    check_placement_type(chosen, where, kind)
    if not param.is_contiguous():
        raise NotImplementedError(
            _say(
                f"FSDP does not support non-contiguous parameters yet: {param.shape=} {param.stride()=}",
                f"{where}: make it contiguous before {kind} (e.g. nn.Parameter(p.contiguous()))",
            )
        )
    # Differs on purpose: FSDP2 refuses uneven splits of a dim > 0; fsdpfn shards them like
    # distribute_tensor(x, mesh, [Shard(dim)]) (docs/tensor_parallel.md)
    return check_placement(chosen, tuple(param.shape), where, kind)


def check_materialized(ctx: RootContext) -> None:
    """Before a root runs: no parameter may still be on ``meta``. Lists the first unit's (in FSDP2's
    order: the root's, then by module order) meta parameters by FQN, as FSDP2 does."""
    fqn_of: dict[int, str] = {}
    for fqn, p in ctx.module.named_parameters():
        fqn_of.setdefault(id(p), fqn)
    for st in ctx.states.values():
        owned = {id(m.param) for m in st.managed}
        names = [fqn_of[id(p)] for p in _post_order_params(st.modules) if id(p) in owned and p.is_meta and id(p) in fqn_of]
        if names:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, "
                f"but the following were still on meta device: {names}\n"
                "For example, call module.to_empty(device) to materialize to device and "
                "call module.reset_parameters() on each module to initialize values."
            )


def explain_sharded_read(exc: BaseException, ctx: RootContext, call: Any) -> RuntimeError | None:
    """The error to raise instead of DTensor's "got mixed torch.Tensor and DTensor" from a root's forward:
    torch's message, then what usually causes it under fully_shard (a unit's parameter read outside that
    unit's forward, where it is this rank's shard) and the units not gathered at that point. ``None``:
    ``exc`` is something else."""
    text = torch_text(exc)
    if not isinstance(exc, RuntimeError) or "got mixed torch.Tensor and DTensor" not in text:
        return None
    gathered = set(call.gathered) | set(call.regathered)
    idle = [u.name for u in call.plan.units if u.name and call.plan.group_of.get(u.name, u.name) not in gathered]
    shown = listing(idle)
    kind = ctx.state.kind
    return RuntimeError(_say(
        text,
        f"Under {kind}, a module's parameters are full tensors only while its own {kind} module runs; "
        "elsewhere they are this rank's shards (DTensors). Code that reads a unit's parameter from another "
        "module's forward (a head computing x @ self.embed.weight.t() while embed has its own fully_shard) "
        f"meets the shard there, as with torch's {kind} (whose reshard_after_forward=False keeps the full "
        "parameters registered until the unit's backward; fsdpfn registers the shards again when the unit's "
        "forward returns, docs/compat.md). Use the parameter inside its module's forward, or "
        f"shard both modules in one call ({kind}([model.embed, model.head])) or only their parent. Units "
        f"not gathered at that point: {shown or 'none'}",
    ))


def _post_order_params(modules: tuple[nn.Module, ...]) -> list[torch.Tensor]:
    """The parameters of ``modules`` outside nested ``fully_shard`` modules, children before parents
    (the order FSDP2 collects them in)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()

    def visit(mod: nn.Module, top: bool) -> None:
        if id(mod) in seen or (not top and state_of(mod) is not None and mod not in modules):
            return
        seen.add(id(mod))
        for child in mod.children():
            visit(child, False)
        out.extend(p for p in mod._parameters.values() if p is not None)

    for m in modules:
        visit(m, True)
    return out
