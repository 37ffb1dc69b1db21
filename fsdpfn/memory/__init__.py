"""Memory planning: a training step's per-rank peak under fsdpfn, predicted before launch.

``estimate(model, world, batch, ...)`` builds the plan ``shard`` would build, counts the activations of
one forward and its backward on fake tensors and walks the step's phases (forward, backward, optimizer step) to predict
each rank's peak with a breakdown, without allocating the model or communicating; ``keep_gathered``
uses it to choose the units ``fsdp`` may keep gathered after their forward without raising that peak,
``fuse_within`` the largest even fusion of units (``min_bucket_bytes``) within torch's ``fully_shard``
peak, ``group_sizes_within`` groups of uneven sizes (what ``fsdp``'s first call makes).
See docs/memory.md.

Example:
    >>> import torch, fsdpfn
    >>> with torch.device("meta"):
    ...     model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    >>> [e.state for e in fsdpfn.memory.estimate(model, [1, 8], torch.zeros(4, 512))]   # shards + moments
    [25214976, 3151872]
"""

from fsdpfn.memory.activations import ForwardCost, forward_cost
from fsdpfn.memory.estimate import OPTIMIZERS, estimate
from fsdpfn.memory.fuse import FusionChoice, GroupSizes, fuse_within, group_sizes_within
from fsdpfn.memory.keep import ReshardRule, keep_gathered
from fsdpfn.memory.phases import GroupBytes, phase_peaks
from fsdpfn.memory.result import PHASES, Breakdown, MemoryEstimate

__all__ = [
    "OPTIMIZERS", "PHASES", "Breakdown", "ForwardCost", "FusionChoice", "GroupBytes", "GroupSizes", "MemoryEstimate",
    "ReshardRule", "estimate", "forward_cost", "fuse_within", "group_sizes_within", "keep_gathered", "phase_peaks",
]
