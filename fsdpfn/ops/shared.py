"""Forward gathers of several collective groups sharing one collective.

Every collective costs a CPU step more than its bytes (a synchronisation of the ranks, thread wake-ups on
cores that compute), and forward has room that backward does not: its activations are still being made,
while backward starts with all of them and the first gradients. So forward may gather a run of small
groups in one flat collective (``Comm.gather_buckets``) while backward still re-gathers and reduces each
group on its own. Each group's part comes back as its own handle; its unpacking copies the group's
columns out, so every group's gathered parameters live in a buffer of their own and are dropped after
its forward as usual; the shared buffer goes when the last part is unpacked.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fsdpfn.core import Handle
from fsdpfn.ops.buckets import Buckets

__all__ = ["launch_shared", "shares_gather"]


def shares_gather(b: Buckets) -> bool:
    """Whether gather ``b`` can share one flat collective with others: it moves something (several ranks
    or a cast), in one bucket dtype, without an all-gather transform, a custom all-gather or batching,
    and would itself gather flat (not as direct exchanges between the tensors: large buckets, which
    gain nothing from sharing).

    Example:
        >>> shares_gather(gather_collective(plan, (plan.group("blocks.0"),), 1.0))   # doctest: +SKIP
        True
    """
    return (
        b.gathers_into_core_buffer and not b.batch_ndim and len(b.layouts) == 1 and b.comm.groups.world > 1
        and not b.comm.direct(b.layouts[0], gather=True)
    )  # fmt: skip


def launch_shared(buckets: Sequence[Buckets], shards: Sequence[Sequence[torch.Tensor]]) -> list[list[Handle]]:
    """Launch the gathers ``buckets`` (each ``shares_gather``, one dtype) as one collective; returns each
    one's pending handles, as ``Buckets.launch`` would (pass them as ``CallInfo.pending``). Every rank
    must launch the same buckets in the same order.

    Example:
        >>> pending = launch_shared([b0, b1], [shards0, shards1])                  # doctest: +SKIP
        >>> outs1 = b1.finish(pending[1])                                         # doctest: +SKIP
    """
    if len(buckets) != len(shards) or not all(shares_gather(b) for b in buckets):
        raise ValueError("launch_shared: every bucket must be one shares_gather accepts (a flat gather in one dtype), with one list of shards each")
    parts = buckets[0].comm.gather_buckets(
        [b.layouts[0] for b in buckets], [list(s) for s in shards], label="+".join(b.label for b in buckets)
    )
    return [[p] for p in parts]  # type: ignore[list-item]
