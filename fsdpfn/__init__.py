"""fsdpfn: fully sharded data parallelism for PyTorch, the JAX way.

Parameters live in an explicit sharded pytree (``Sharded``); ``unshard`` (all-gather), ``reshard``
(drop the gathered copy) and ``reduce`` (reduce-scatter) are pure, differentiable functions.

Example:
    >>> import fsdpfn, torch
    >>> mesh = fsdpfn.init_mesh()                      # world of one under plain python  # doctest: +SKIP
    >>> params = fsdpfn.shard(torch.nn.Linear(4, 3), mesh)                               # doctest: +SKIP
    >>> full = fsdpfn.unshard(params)                  # {'weight': ..., 'bias': ...}     # doctest: +SKIP
"""

from fsdpfn.checkpoint import from_dtensor, full_state_dict, load, load_full_state_dict, save, to_dtensor
from fsdpfn.core import init_mesh
from fsdpfn.layout import Sharded, ShardSpec, Unreduced, freeze, shard_tensor, unfreeze, unshard_tensors
from fsdpfn.ops import AllGatherTransform, accumulate, reduce, reshard, shard, unshard
from fsdpfn.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdpfn.transform import compile_step, fsdp, grad, remat, value_and_grad
from fsdpfn import debug, memory, optim
from fsdpfn.optim import clip_grad_norm

__version__ = "0.1.0"

__all__ = [
    "AllGatherTransform",
    "CPUOffloadPolicy",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ShardSpec",
    "Sharded",
    "Unreduced",
    "accumulate",
    "clip_grad_norm",
    "compile_step",
    "debug",
    "freeze",
    "fsdp",
    "from_dtensor",
    "full_state_dict",
    "grad",
    "init_mesh",
    "load",
    "load_full_state_dict",
    "memory",
    "optim",
    "reduce",
    "remat",
    "reshard",
    "save",
    "shard",
    "shard_tensor",
    "to_dtensor",
    "unfreeze",
    "unshard",
    "unshard_tensors",
    "value_and_grad",
]
