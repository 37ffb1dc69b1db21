"""FSDP2's API on fsdpfn's machinery: change ``from torch.distributed.fsdp import ...`` to
``from fsdpfn.compat import ...``.

``fully_shard`` turns parameters into ``nn.Parameter(DTensor)`` shards exactly as torch's does (same
placements, ``torch.chunk`` local shapes, state dicts and checkpoints interchangeable); forward and
backward run on the same units, collectives and overlap as ``fsdpfn.fsdp``. What differs, and why, is
listed in docs/compat.md.

Example:
    >>> from fsdpfn.compat import fully_shard, MixedPrecisionPolicy
    >>> for block in model.blocks:                                     # doctest: +SKIP
    ...     fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    >>> fully_shard(model)                                             # doctest: +SKIP
"""

try:
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # torch 2.11 has none: the same dataclass of our own, so dp_mesh_dims reads alike
    from fsdpfn.compat.dp_mesh_dims import DataParallelMeshDims  # type: ignore[assignment]

from fsdpfn.compat.fully_shard import fully_shard
from fsdpfn.compat.functions import register_fsdp_forward_method, share_comm_ctx
from fsdpfn.compat.module import FSDPModule, UnshardHandle
from fsdpfn.compat.replicate import ReplicateModule, replicate
from fsdpfn.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReplicateModule",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "replicate",
    "share_comm_ctx",
]
