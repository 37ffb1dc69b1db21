"""``replicate``: data parallelism without sharding (DDP semantics) on the same machinery.

Parameters become ``nn.Parameter(DTensor)`` with ``(Replicate(),)`` placements; the root's plan is a
world of one shard per rank with the mesh as replicas, so nothing is gathered and each gradient is
all-reduced and averaged over the ranks.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from fsdpfn.compat.fully_shard import _shard
from fsdpfn.compat.module import FSDPModule
from fsdpfn.policy import MixedPrecisionPolicy, OffloadPolicy

__all__ = ["ReplicateModule", "replicate"]


class ReplicateModule(FSDPModule):
    """The mixin ``replicate`` adds (class name ``Replicate<Original>``); the ``FSDPModule`` methods apply."""

    _orig_cls_mro_index: int = 4  # Replicate<Original>, this class, FSDPModule, torch's, Original

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Not applicable: ``replicate`` never shards, so there is nothing to reshard."""
        raise ValueError("set_reshard_after_forward: a replicate()d module keeps its whole parameters; nothing to reshard")


def replicate(
    module: Any,
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: Any = MixedPrecisionPolicy(),
    offload_policy: Any = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
) -> Any:
    """Replicate ``module`` over a 1-D ``mesh``: every rank keeps the whole parameters (``(Replicate(),)``
    DTensors) and gradients are averaged over the ranks by one all-reduce per unit. Same signature as
    ``torch.distributed._composable.replicate_with_fsdp.replicate`` (torch 2.13).

    Example:
        >>> from fsdpfn.compat import replicate
        >>> replicate(model, mesh=fsdpfn.init_mesh())            # doctest: +SKIP
        >>> model(x).sum().backward()     # .grad: the mean over ranks, (Replicate(),)  # doctest: +SKIP
    """
    return _shard(
        module,
        kind="replicate",
        mesh=mesh,
        reshard_after_forward=False,
        shard_placement_fn=None,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        dp_mesh_dims=dp_mesh_dims,
        placements=(Replicate(),),
        wrapper=ReplicateModule,
        prefix="Replicate",
    )
