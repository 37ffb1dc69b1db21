"""The torch.distributed entry points fsdpfn uses, picked for the installed torch.

torch >= 2.13 names the single-tensor collectives ``*_single`` (and deprecates ``*_tensor``); the GPU
machines run torch 2.11, which only has ``all_gather_into_tensor`` / ``reduce_scatter_tensor``.
"""

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
