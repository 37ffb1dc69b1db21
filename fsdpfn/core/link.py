"""Measuring a mesh's all-gather cost once, for ``min_bucket_bytes="auto"``.

Two all-gather sizes, the fastest of a few repetitions each, give the latency and the bandwidth of the path the core
really takes for small buckets (``Comm.all_gather``: launch, gloo's thread or the side stream, wait). Every
rank must build the same plan, so the timings are averaged over the whole mesh before they are used: a
rank that measured differently never ends up with different fused groups (a hang).
"""

from __future__ import annotations

import time

import torch

from fsdpfn.core.comm import Comm
from fsdpfn.layout.autobucket import LinkCost

__all__ = ["link_of", "measure_link"]

SMALL_BYTES = 1 << 10  # gathered bytes of the latency probe
# gathered bytes of the bandwidth probe: at 1 MiB its time differed from the small probe's by less than the
# scheduler's noise on a loaded 2-core machine, and two of three measurements gave ~1e15 bytes/s
LARGE_BYTES = 4 << 20


def link_of(comm: Comm) -> LinkCost:
    """``comm``'s all-gather cost, measured (``measure_link``) on the first call and kept on ``comm``: a
    collective the first time, so every rank of the mesh must call it then.

    Example:
        >>> comm = Comm(fsdpfn.init_mesh())                       # doctest: +SKIP
        >>> link_of(comm) is link_of(comm)                        # doctest: +SKIP
        True
    """
    if comm._link_cost is None:
        comm._link_cost = measure_link(comm)
    return comm._link_cost


def measure_link(comm: Comm, *, repeats: int = 5) -> LinkCost:
    """Measure ``comm``'s all-gather cost (a collective: every rank of the mesh must call it).

    A shard group of one rank gathers nothing: latency 0 and infinite bandwidth. The probes leave no
    trace in ``comm.stats`` or in the collective numbering of ``comm.guard`` (what a step issues stays
    what the user counts), though with ``FSDPFN_DEBUG=1`` they are checked across ranks like any other.

    Example:
        >>> link = measure_link(Comm(fsdpfn.init_mesh()))      # doctest: +SKIP
        >>> link.seconds(1 << 20)                                # doctest: +SKIP
        0.0009
    """
    if comm.world == 1:
        return LinkCost(0.0, float("inf"))
    with comm.untracked():
        return _measure(comm, repeats)


def _measure(comm: Comm, repeats: int) -> LinkCost:
    device = comm.groups.device
    cuda = device.type == "cuda"
    fastest = []
    for nbytes in (SMALL_BYTES, LARGE_BYTES):
        x = torch.zeros(nbytes // comm.world, dtype=torch.uint8, device=device)
        comm.all_gather(x, label="fsdpfn:link probe").wait()  # warm-up: first use of the group and the buffers
        samples = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            comm.all_gather(x, label="fsdpfn:link probe").wait()
            if cuda:
                torch.cuda.synchronize(device)
            samples.append(time.perf_counter() - start)
        fastest.append(min(samples))  # the least disturbed repetition: noise only ever adds time
    agreed = torch.tensor(fastest, dtype=torch.float64, device=device)
    comm.all_reduce_sum(agreed, label="fsdpfn:link probe").wait()
    small, large = (agreed / (1 if comm.groups.simulated else comm.dp_world)).tolist()  # a fake group's sum is ours
    bytes_per_s = (LARGE_BYTES - SMALL_BYTES) / max(large - small, 1e-9)
    return LinkCost(latency_s=max(small - SMALL_BYTES / bytes_per_s, 0.0), bytes_per_s=bytes_per_s)
