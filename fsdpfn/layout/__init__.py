"""Pure layout arithmetic: shard specs, bucket layouts, shard plans and the ``Sharded`` pytree.

Nothing in this package communicates or imports ``torch.distributed``; it imports nothing else of fsdpfn.
"""

from fsdpfn.layout.bucket import BucketLayout
from fsdpfn.layout.plan import ParamInfo, ShardPlan, UnitPlan, build_plan
from fsdpfn.layout.sharded import DonatedError, Sharded
from fsdpfn.layout.trainable import freeze, unfreeze
from fsdpfn.layout.spec import ShardSpec, contiguous_stride, shard_tensor, unshard_tensors
from fsdpfn.layout.unreduced import Unreduced

__all__ = [
    "BucketLayout",
    "DonatedError",
    "ParamInfo",
    "ShardPlan",
    "ShardSpec",
    "Sharded",
    "UnitPlan",
    "Unreduced",
    "build_plan",
    "contiguous_stride",
    "freeze",
    "shard_tensor",
    "unfreeze",
    "unshard_tensors",
]
