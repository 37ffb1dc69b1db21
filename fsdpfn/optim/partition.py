"""``partition``: a different optimizer, or other hyper-parameters, for each group of parameters, as
``torch.optim`` parameter groups give (optax's ``multi_transform``).

Layer-wise learning-rate decay, a head trained ten times faster than its backbone, SGD for embeddings
and AdamW for the rest: each label's optimizer sees a tree on a plan where only that label's parameters
train (``fsdpfn.layout.trainable``), so its state holds tensors for those parameters alone (two optimizers
over masked gradients would hold state for every parameter twice). Frozen parameters, and parameters a
later ``fsdpfn.unfreeze`` makes trainable, follow ``fsdpfn.freeze`` / ``unfreeze`` as every ``fsdpfn.optim``
state does.

Example:
    >>> opt = fsdpfn.optim.partition(                                                    # doctest: +SKIP
    ...     {"head": fsdpfn.optim.adamw(lr=1e-3), "body": fsdpfn.optim.adamw(lr=1e-4)},
    ...     lambda fqn, shape: "head" if fqn.startswith("head.") else "body")
    >>> state = opt.init(params)                                                         # doctest: +SKIP
    >>> params, state = opt.update(grads, state, params)                                 # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Union

import torch

from fsdpfn.layout import Sharded, ShardPlan
from fsdpfn.layout.plan import OPTIMIZER_MEMO
from fsdpfn.layout.trainable import with_requires_grad
from fsdpfn.optim._common import GradientTransformation, check_grads, check_params

__all__ = ["Labels", "PartitionState", "partition"]

Labels = Union[Callable[[str, tuple[int, ...]], str], Mapping[str, str]]
"""Each parameter's label: a function ``(fqn, full shape) -> label`` or a mapping ``fqn -> label``
naming every parameter."""

# fsdpfn.optim's OPTIMIZER_MEMO values, by how much state each keeps
_STATE_RANK = {"sgd": 0, "sgd_momentum": 1, "adamw": 2}


class PartitionState(NamedTuple):
    """State of ``partition``: each label's optimizer state, keyed by label (a pytree)."""

    inner: dict[str, Any]


def partition(transforms: Mapping[str, GradientTransformation], labels: Labels) -> GradientTransformation:
    """``transforms[label]`` updates the parameters ``labels`` gives that label; its state holds only
    theirs. Every update calls every label's optimizer (its update count, and so its ``lr`` schedule,
    advances with the others'). The parameters are updated in place when the labels' optimizers are (the
    default), and ``params`` is then donated, as their own updates donate it.

    Example:
        >>> layer_lr = lambda fqn, shape: "decayed" if fqn.startswith("layers.0.") else "rest"   # doctest: +SKIP
        >>> opt = partition({"decayed": adamw(lr=1e-4), "rest": adamw(lr=1e-3)}, layer_lr)       # doctest: +SKIP
    """
    what = "fsdpfn.optim.partition"
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError(f"{what}: transforms must be a non-empty mapping label -> optimizer, got {transforms!r}")
    for label, t in transforms.items():
        if not callable(getattr(t, "init", None)) or not callable(getattr(t, "update", None)):
            raise TypeError(
                f"{what}: transforms[{label!r}] must be an fsdpfn.optim transformation, got {type(t).__name__}"
            )
    if not callable(labels) and not isinstance(labels, Mapping):
        raise TypeError(
            f"{what}: labels must be a function (fqn, shape) -> label or a mapping fqn -> label, "
            f"got {type(labels).__name__}"
        )

    def label_of(plan: ShardPlan, where: str) -> dict[str, str]:
        if isinstance(labels, Mapping):
            unknown = [k for k in labels if k not in plan.specs]
            if unknown:
                raise ValueError(f"{where}: labels names {unknown[0]!r}, which is not a parameter of this tree")
        out = {}
        for fqn in plan.params:
            if isinstance(labels, Mapping) and fqn not in labels:
                raise ValueError(f"{where}: labels gives parameter {fqn!r} no label; name every parameter")
            label = labels[fqn] if isinstance(labels, Mapping) else labels(fqn, tuple(plan.specs[fqn].shape))
            if label not in transforms:
                raise ValueError(
                    f"{where}: parameter {fqn!r} is labelled {label!r}, which names no optimizer; the labels are "
                    f"{sorted(transforms)}"
                )
            out[fqn] = label
        return out

    def part(tree: Sharded[Any], label: str, of: Mapping[str, str], keep: bool) -> Sharded[Any]:
        """``tree`` on the plan where only ``label``'s trainable parameters train; ``keep``: all its leaves
        (parameters), else ``None`` outside what trains there (gradients)."""
        plan = tree.plan
        sub = with_requires_grad(plan, {f: plan.requires_grad[f] and of[f] == label for f in plan.params})
        trains = sub.requires_grad
        return Sharded({k: tree[k] if keep or trains.get(k, False) else None for k in plan.keys}, sub)

    def init(params: Sharded[torch.Tensor]) -> PartitionState:
        """Each label's optimizer state, for that label's parameters only.

        Example:
            >>> state = opt.init(params)   # doctest: +SKIP
        """
        plan = check_params(params, f"{what}.init")
        of = label_of(plan, f"{what}.init")
        parts = {label: part(params, label, of, keep=True) for label in transforms}
        inner = {label: transforms[label].init(tree) for label, tree in parts.items()}
        used = [u for u in (tree.plan.memo.get(OPTIMIZER_MEMO) for tree in parts.values()) if u in _STATE_RANK]
        if used:  # what the first call plans the step's memory for: the optimizer with the most state
            plan.memo[OPTIMIZER_MEMO] = max(used, key=_STATE_RANK.__getitem__)
        return PartitionState(inner)

    def update(
        grads: Sharded[Any], state: PartitionState, params: Sharded[torch.Tensor]
    ) -> tuple[Sharded[torch.Tensor], PartitionState]:
        """Each label's update on its parameters; returns ``(new_params, new_state)``.

        Example:
            >>> params, state = opt.update(grads, state, params)   # doctest: +SKIP
        """
        where = f"{what}.update"
        plan = check_params(params, where)
        check_grads(grads, params, where)
        if not isinstance(state, PartitionState) or set(state.inner) != set(transforms):
            raise TypeError(
                f"{where}: state must be the PartitionState init(params) returned, with labels {sorted(transforms)}"
            )
        of = label_of(plan, where)
        leaves, inner, in_place = dict(params.items()), {}, False
        for label, t in transforms.items():
            mine = part(params, label, of, keep=True)
            new, inner[label] = t.update(part(grads, label, of, keep=False), state.inner[label], mine)
            in_place = in_place or mine._donated is not None
            leaves.update((f, new[f]) for f, lab in of.items() if lab == label)
        if in_place:
            params.donate(where)  # its shards were updated in place: reading the old tree raises
        return Sharded(leaves, plan), PartitionState(inner)

    return GradientTransformation(init, update)
