"""Folding each parameter's gradient into an accumulator as soon as autograd makes it.

A gathered group's backward node receives all its members' gradients at once: autograd holds each one
made earlier (the second Linear's while the first's are computed) until the last arrives. Where the
gradients go into an accumulator instead of a reduction (gradient sync off; ``value_and_grad(into=...)``),
FSDP2's ``AccumulateGrad`` adds each parameter's as it is made; so do the per-parameter nodes here: each
gathered parameter passes through one (``fold_each``), whose backward hands its gradient to ``fold`` and,
where that took it, passes none on (the group's node then sees ``None`` for it). Measured without them:
1.7-2.4% over torch's peak on LayerNorm-MLP blocks of 64/256 and 128/512 with sync off (bench/RESULTS.md run48).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["Fold", "fold_each", "fold_gradient", "fold_into"]

Fold = Callable[[str, torch.Tensor], bool]  # (fqn, gradient) -> whether it took the gradient


def fold_gradient(acc: dict[str, torch.Tensor], fqn: str, grad: torch.Tensor, dtype: torch.dtype) -> None:
    """Add ``grad`` into ``acc[fqn]`` in place (in ``dtype``); the first one into a copy of its own
    (autograd's gradient may be shared with another node or expanded).

    Example:
        >>> acc = {}
        >>> fold_gradient(acc, "w", torch.ones(2), torch.float32); fold_gradient(acc, "w", torch.ones(2), torch.float32)
        >>> acc["w"]
        tensor([2., 2.])
    """
    have = acc.get(fqn)
    if have is None:
        acc[fqn] = grad.to(dtype, copy=True)
    else:
        have.add_(grad)


def fold_into(acc: dict[str, torch.Tensor] | None, fqn: str, grad: torch.Tensor, dtypes: Mapping[str, torch.dtype], sink: bool) -> bool:
    """Whether ``grad`` went into accumulator ``acc``: with ``sink`` (a backward that defers its reduction),
    every member ``dtypes`` names (in that dtype: ``fold_gradient``); else (a carry, which the syncing
    backward reduces with its own) where ``acc`` holds the member already, in place.

    Example:
        >>> acc, dtypes = {"w": torch.zeros(2)}, {"w": torch.float32, "b": torch.float32}
        >>> fold_into(acc, "w", torch.ones(2), dtypes, False), fold_into(acc, "b", torch.ones(2), dtypes, False)
        (True, False)
        >>> fold_into(acc, "b", torch.ones(2), dtypes, True), acc["w"], acc["b"]
        (True, tensor([1., 1.]), tensor([1., 1.]))
    """
    if acc is None:
        return False
    if sink:
        if fqn not in dtypes:
            return False
        fold_gradient(acc, fqn, grad, dtypes[fqn])
        return True
    have = acc.get(fqn)
    if have is None:
        return False
    have.add_(grad)
    return True


class _FoldFunction(torch.autograd.Function):
    """The identity forward; a backward that offers the gradient to ``fold`` first."""

    @staticmethod
    def forward(x: torch.Tensor, fqn: str, fold: Fold) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.fqn, ctx.fold = inputs[1], inputs[2]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None]:
        # a backward that builds a graph keeps its sums differentiable: the group's node adds out of place
        if grad is not None and not torch.is_grad_enabled() and ctx.fold(ctx.fqn, grad):
            return None, None, None
        return grad, None, None


# Members smaller than this (biases, norms' weights) wait in the group's node as before: a node each costs
# more step time than their bytes are worth (a GPT's 4-microbatch accumulation: 3-4% slower folding all)
FOLD_MIN_BYTES = 16 << 10


def fold_each(outs: Sequence[torch.Tensor], fqns: Sequence[str], fold: Fold) -> list[torch.Tensor]:
    """``outs`` (gathered parameters named ``fqns``), each that takes a gradient and has at least
    ``FOLD_MIN_BYTES`` through its own fold node.

    Example:
        >>> acc = {}
        >>> w = torch.ones(4096, requires_grad=True)
        >>> (v,) = fold_each([w * 1], ["w"], lambda f, g: fold_gradient(acc, f, g, g.dtype) or True)
        >>> (v * 3).sum().backward(); acc["w"][:2], w.grad
        (tensor([3., 3.]), None)
    """
    return [_FoldFunction.apply(o, f, fold) if o.requires_grad and o.numel() * o.element_size() >= FOLD_MIN_BYTES else o
            for o, f in zip(outs, fqns)]
