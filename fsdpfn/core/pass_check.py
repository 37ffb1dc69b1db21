"""Whether every rank ran the same collectives since the last check, without ``FSDPFN_DEBUG``.

Ranks that run different units (a layer dropped at random with per-rank randomness, a branch taken on
some ranks) issue different collectives. When the counts differ, a wait times out naming the unit; when
they match, collectives of equal size pair up across units and the ranks silently exchange the wrong
units' weights and gradients (the gradients of block 2 averaged with block 1's). Each ``Guard`` folds the
fingerprint of every collective into a digest; ``check_pass`` sums ``(d, d*d)`` over the mesh (one
all-reduce of a few integers, at the end of each backward and at the start of a forward that follows other
collectives): all digests are equal exactly when
``W * sum(d*d) == sum(d)**2``, which every rank reads from the same sums, so all raise together. A third
sum counts the ranks that found an error only they can see (``Guard.refusal``: a parameter used on some
ranks only): the others raise with them instead of waiting in their next collective. The last two
compare, the same way, the digests of compat's parameters that got no gradient (``Guard.missing``): a
parameter used on some ranks only, even with a reduced gradient of zeros, would be ``None`` on some ranks
and zeros on others, so their optimizers would update the shards differently. The last sum counts the
ranks that ask for the fused groups to be planned again (``Guard.replan_asked``): a decision every rank
then reads alike (``Guard.replans``) at no collective of its own. On CUDA
the sums are read at the next check, from pinned memory, so no step waits for the device (a divergence is
then named one pass later).

Example:
    >>> check_pass(params.plan.comm)        # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fsdpfn.core.comm import Comm
from fsdpfn.core.guard import CollectivePlanError
from fsdpfn.messages import listing

__all__ = ["check_pass", "start_pass_check"]

_LABEL = "fsdpfn:check that ranks ran the same collectives"


def check_pass(comm: Comm) -> None:
    """Compare the digest of ``comm``'s collectives since the last call across its mesh (a collective:
    every rank calls it at the same point) and raise ``CollectivePlanError`` on every rank if they differ."""
    finish = start_pass_check(comm)
    if finish is not None:
        finish()


def start_pass_check(comm: Comm) -> Callable[[], None] | None:
    """``check_pass`` in two halves: launch the comparison now and return what reads its verdict (and
    raises), or ``None`` when there is nothing to read (no collective since the last check; on CUDA, where
    the verdict is read at the next check anyway). A root nested in another's forward reads it at the end of
    the backward (``queue_callback``), so its backward need not wait for the other ranks there.

    Example:
        >>> finish = start_pass_check(params.plan.comm)     # doctest: +SKIP
        >>> if finish is not None: finish()                 # doctest: +SKIP
    """
    guard = comm.guard
    if comm.dp_world == 1 or comm.groups.simulated:
        guard.digest = guard.missing = 0
        guard.missing_names = []
        refusal, guard.refusal = guard.refusal, None
        guard.replans += guard.replan_asked  # this rank is every rank
        guard.replan_asked = False
        if refusal is not None:
            raise refusal
        return None
    digest, guard.digest = guard.digest, 0
    refusal, guard.refusal = guard.refusal, None
    missing, guard.missing = guard.missing, 0
    names, guard.missing_names = guard.missing_names, []
    previous, guard.pending_check = guard.pending_check, None
    if previous is not None:  # CUDA: the last check's sums, copied to the host since
        event, host = previous
        event.synchronize()
        _verdict(comm, host.tolist(), None, [])
    if digest == 0 and refusal is None:
        return None  # no collective since the last check (on every rank, unless they diverged before it)
    asked, guard.replan_asked = guard.replan_asked, False  # (else it waits for a check that runs)
    with comm.untracked():
        values = [digest, digest * digest, refusal is not None, missing, missing * missing, asked]
        sums = torch.tensor(values, dtype=torch.int64, device=comm.groups.device)
        handle = comm.all_reduce_sum(sums, label=_LABEL)
    if sums.device.type == "cuda":
        handle.wait()  # the current stream waits, the host does not
        host = torch.empty(len(values), dtype=torch.int64, pin_memory=True)
        host.copy_(sums, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        guard.pending_check = (event, host)
        if refusal is not None:  # this rank knows now; the others at their next check
            raise refusal
        return None

    def finish() -> None:
        handle.wait()
        _verdict(comm, sums.tolist(), refusal, names)

    return finish


def _verdict(comm: Comm, sums: list[int], refusal: BaseException | None, names: list[str]) -> None:
    total, squares, refusing, missing, missing_squares, asking = sums
    comm.guard.replans += asking > 0
    if refusal is not None:
        raise refusal
    if refusing:
        raise RuntimeError(
            f"{refusing} other rank(s) refused this backward (their error names the parameters and what to do: "
            "a parameter used on some ranks only, see docs/errors.md 'compat-used-on-some-ranks'); this rank stops "
            "with them rather than wait for them in its next collective"
        )
    if comm.dp_world * squares == total * total and comm.dp_world * missing_squares == missing * missing:
        return
    if comm.dp_world * squares == total * total:
        mine = listing(list(dict.fromkeys(names))) if names else "none"
        raise RuntimeError(
            "parameters got a gradient on some ranks and none on others in this backward (a mixture of experts, a "
            "branch taken on some ranks): their gradient would be None on some ranks only, and the ranks would "
            "update their shards differently (an optimizer skips a None gradient: no step, no weight decay). "
            f"Parameters without a gradient on this rank: {mine}. Call set_reduce_scatter_unused_params(True) on "
            "the fully_shard module (FSDP2's switch for this) so every rank gets the reduced gradient, zeros where "
            "no rank used a parameter"
        )
    raise CollectivePlanError(
        f"ranks ran different collectives since the last check (after {comm.guard.steps} completed passes): some "
        "ranks ran units the others did not, and collectives of equal size paired up across units, so ranks "
        "exchanged the wrong units' weights or gradients. A unit ran on some ranks only: a layer dropped at "
        "random with randomness that differs per rank (seed it the same on every rank), a branch on data that "
        "differs per rank, an exception caught on one rank. Make every rank run the same units in the same "
        "order; FSDPFN_DEBUG=1 names each rank's collective where they part"
    )
