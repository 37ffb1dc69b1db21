"""Checks on the gradients that reach a unit's collectives in backward, each an error that names the
parameters or units and says what to do.

``UsedElsewhere``: parameters without a gradient on this rank but with one on another. ``second_order_error``:
a path through two averaging reductions in one backward (MAML with ``op="avg"``). ``check_dense``: sparse
gradients.

Example:
    >>> check_dense(["emb.weight"], [torch.zeros(3, 2)])   # dense: nothing raised  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fsdpfn.messages import listing

if TYPE_CHECKING:
    from fsdpfn.core.guard import Guard
    from fsdpfn.ops.buckets import Buckets

__all__ = ["UsedElsewhere", "check_dense", "second_order_error"]


class UsedElsewhere:
    """The check behind ``keep_none``: members that got no gradient on this rank, with their reduced shard
    gradients. All zero: no rank used them, and ``None`` is the answer (FSDP2's). Not all zero: another
    rank's gradient was reduced in (a mixture of experts, a branch taken on some ranks), and ``None`` here
    would leave this rank's shards un-updated while the other ranks update theirs: refused by name. It sits
    in a deferred-reduction list after the reduction's own handles and runs when the list is drained.

    Example:
        >>> UsedElsewhere({"experts.1.weight": reduced_shard}).wait()   # doctest: +SKIP
    """

    def __init__(self, reduced: dict[str, torch.Tensor], guard: Guard | None = None):
        self.reduced = reduced
        self.guard = guard  # the Comm's Guard: its next pass check makes every rank stop together

    def wait(self) -> None:
        names = list(self.reduced)
        used = torch.stack([t.ne(0).any() for t in self.reduced.values()]).tolist()  # one host sync
        elsewhere = [n for n, u in zip(names, used) if u]
        if not elsewhere:
            return
        listed = listing(elsewhere)
        error = RuntimeError(
            f"parameter(s) {listed} got no gradient on this rank but a gradient on another (their reduced "
            "gradient is not zero): the forward used them on some ranks only (a mixture of experts, a branch "
            "taken on some ranks). Leaving them None here would update their shards on some ranks only. Call "
            "set_reduce_scatter_unused_params(True) on the fully_shard module (FSDP2's switch for this; "
            "FSDP2 itself fails here with mismatched reduce-scatters) so every rank gets the reduced "
            "gradient, zeros where no rank used a parameter"
        )
        if torch._C._current_graph_task_id() == -1:  # drained outside a backward
            raise error
        if self.guard is not None:
            # raised at the pass check that ends this backward (compat: LocalShards), where every rank
            # learns that one refused and stops with it (core/pass_check.py); its reductions all ran
            self.guard.refusal = error
            return

        def fail() -> None:
            raise error

        # at the end of this backward: its remaining reductions still run on every rank, so the peers
        # are not left waiting in one while this rank unwinds
        torch.autograd.Variable._execution_engine.queue_callback(fail)


def second_order_error(b: Buckets) -> RuntimeError:
    """The error for a path through two scaled reductions in one backward (``op="avg"``).

    The average is the gradient of the mean over ranks of each rank's loss: each gather's backward
    applies the ``1/world`` once. The fast weights of a MAML step are gathered again after a gradient
    taken with ``create_graph=True``: the path from the outer loss crosses that gather's backward, the
    inner gradient's reduction and the inner gather's backward, and the mean is taken twice, so the
    second-order terms come out ``world`` times too small, with no error. With ``op="sum"`` every
    reduction is the exact adjoint of its gather and derivatives of any order are exact; the mean is then
    the user's to take."""
    where = f" of unit(s) {b.label}" if b.label else ""
    return RuntimeError(
        f"fsdpfn: a backward differentiates gradients{where} that an earlier backward reduced with "
        f"reduce_op='avg' (scale {b.scale:g}), after reducing with the average itself: weights made from a "
        "gradient taken with create_graph=True (a MAML inner step) were gathered again, so this path would take "
        "the mean over ranks twice and its second-order terms would be wrong. Reduce with op='sum' instead and "
        "divide each loss by the number of data-parallel ranks yourself: fsdpfn.fsdp(module, reduce_op='sum') "
        "(and value_and_grad(..., reduce_op='sum')); with fully_shard, module.set_gradient_divide_factor(1.0) on "
        "every fully_shard module. Every reduction is then the exact adjoint of its gather, and derivatives of any "
        "order are exact"
    )


def check_dense(fqns: Sequence[str], grads: Sequence[torch.Tensor | None]) -> None:
    """Raise naming the parameters whose gradient is sparse (``nn.Embedding(sparse=True)``): a reduction
    moves dense buckets (torch's ``fully_shard`` fails there too, deep inside its copy-in)."""
    sparse = [f for f, g in zip(fqns, grads) if g is not None and g.layout != torch.strided]
    if sparse:
        raise RuntimeError(
            f"fsdpfn: parameter(s) {', '.join(repr(f) for f in sparse)} got a sparse gradient (e.g. "
            "nn.Embedding(..., sparse=True)); sharded gradients are reduced as dense tensors: build the "
            "layer with sparse=False (its gradient is then a dense tensor of the weight's shape)"
        )
