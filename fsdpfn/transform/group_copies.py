"""Rules the eager and the traced executor share about a group's gathered copy: when a fused group's
forward is over (``group_done``), and when a copy made without autograd cannot serve a unit that trains
(``without_autograd``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from fsdpfn.layout import Sharded

__all__ = ["group_done", "without_autograd"]


def without_autograd(gathered_with_grad: bool, fqns: Iterable[str], params: Sharded[torch.Tensor]) -> bool:
    """Whether a group's gathered copy was made without autograd (its unit ran under ``torch.no_grad()``:
    a teacher or a target network inside the forward) while the unit about to use it runs with autograd
    and trains some of its parameters. Kept gathered (``reshard_after_forward=False``, world 1, or a fused
    group whose other unit comes next), that copy would give the unit values no gradient leads back from
    through the gather (at world 1 they are views of the shards, outside it): the shards would silently
    get none. The caller gathers again, differentiably."""
    return not gathered_with_grad and torch.is_grad_enabled() and any(params[f].requires_grad for f in fqns)


def group_done(members: Sequence[str], members_done: dict[str, set[str]], group: str, unit: str) -> bool:
    """Record in ``members_done`` that ``unit`` of ``group`` (whose units are ``members``) finished its
    forward; true once all of them have (and the record is cleared for the group's next use)."""
    if len(members) == 1:
        return True
    done = members_done.setdefault(group, set())
    done.add(unit)
    if len(done) < len(members):
        return False
    del members_done[group]
    return True
