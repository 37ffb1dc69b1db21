"""``clip_grad_norm``: clip sharded gradients by their global norm (one all-reduce over the mesh)."""

from __future__ import annotations

import math
from typing import Any

import torch

from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fsdpfn.layout import Sharded
from fsdpfn.ops.api import is_positive_number

__all__ = ["clip_grad_norm"]


def clip_grad_norm(
    grads: Sharded[Any], max_norm: float, norm_type: float = 2.0
) -> tuple[Sharded[Any], torch.Tensor]:
    """Scale ``grads`` so that their global ``norm_type``-norm is at most ``max_norm``, like
    ``torch.nn.utils.clip_grad_norm_`` on the full gradients.

    The norm is over every rank's shards: each rank sums ``|g|**p`` over its (unpadded) local shards and
    one all-reduce adds the sums over the mesh (on an HSDP mesh every shard is held by ``replicas``
    ranks, so the sum is divided by ``replicas``); ``norm_type=inf`` takes the maximum instead, through
    the same single all-reduce. Every rank must call it (it is a collective), and gets the same norm.
    Gradients are multiplied in place by ``min(1, max_norm / (total_norm + 1e-6))``; ``None`` leaves pass
    through. Returns ``(grads, total_norm)``: the same gradient tensors in a new ``Sharded`` container,
    and the norm before clipping as a 0-d tensor on the gradients' device, in float32 (float64 when a
    gradient is float64 or complex128). Non-finite gradients give a non-finite norm (no error is raised).
    A negative ``max_norm`` is refused (torch's would flip the gradients' sign).

    Example:
        >>> loss, grads = fsdpfn.value_and_grad(loss_fn)(params, batch)      # doctest: +SKIP
        >>> grads, norm = fsdpfn.optim.clip_grad_norm(grads, max_norm=1.0)   # doctest: +SKIP
        >>> params, state = opt.update(grads, state, params)                 # doctest: +SKIP
    """
    what = "fsdpfn.optim.clip_grad_norm"
    if not isinstance(grads, Sharded):
        raise TypeError(f"{what}: grads must be a fsdpfn.Sharded, got {type(grads).__name__}")
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or math.isnan(max_norm):
        raise TypeError(f"{what}: max_norm must be a number, got {max_norm!r}")
    if max_norm < 0:  # torch's clip_grad_norm_ takes it and flips every gradient's sign
        raise ValueError(f"{what}: max_norm={max_norm!r} must be >= 0 (a negative bound would flip the gradients' sign)")
    if not is_positive_number(norm_type):
        raise ValueError(f"{what}: norm_type={norm_type!r} must be a positive number or math.inf")
    p = float(norm_type)
    plan = grads.plan
    tensors: list[torch.Tensor] = []
    tp_split: list[tuple[str, torch.Tensor]] = []
    for fqn in plan.params:
        g = grads[fqn]
        if g is None:
            continue
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"{what}: grads leaf {fqn!r} is {type(g).__name__}, expected a Tensor or None")
        want = plan.specs[fqn].local_shape(plan.rank)
        if tuple(g.shape) != want:
            raise ValueError(
                f"{what}: grads leaf {fqn!r} has shape {tuple(g.shape)} but rank {plan.rank} of its plan holds {want}"
            )
        if not (g.is_floating_point() or g.is_complex()):
            raise TypeError(f"{what}: grads leaf {fqn!r} has dtype {g.dtype}; gradients must be floating or complex")
        if fqn in plan.tp and any(isinstance(pl, Shard) for pl in plan.tp[fqn].tp.placements):
            tp_split.append((fqn, g))  # its squares must be summed over the TP ranks that hold other slices
        else:
            tensors.append(g)  # TP-replicated gradients count once: every TP rank holds the same values
    everything = tensors + [g for _, g in tp_split]

    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in tensors:
        groups.setdefault((g.device, g.dtype), []).append(g)
    wide = any(g.dtype in (torch.float64, torch.complex128) for g in everything)
    acc_dtype = torch.float64 if wide else torch.float32
    if everything:
        device = everything[0].device
    elif plan.comm is not None:
        device = plan.comm.groups.device
    else:
        device = torch.device("cpu")
    dp = plan.world * plan.replicas
    if dp > 1 and plan.comm is None:
        raise ValueError(f"{what}: the grads' plan has no communicator, but spans {dp} ranks")

    with torch.no_grad():
        # empty shards (trailing ranks) add nothing, and the inf-norm of an empty tensor is undefined;
        # low-precision shards are normed in float32 (or float64) so their partial norms are not rounded
        norms = []
        for (_, dtype), ts in groups.items():
            ts = [t for t in ts if t.numel()]
            if ts:
                wide_dtype = None if dtype.is_complex else acc_dtype
                norms += [n.to(device, acc_dtype) for n in torch._foreach_norm(ts, p, dtype=wide_dtype)]
        local = torch.stack(norms) if norms else torch.zeros(1, dtype=acc_dtype, device=device)
        if tp_split:  # TP-sharded gradients: this rank's part of their norm, combined over the TP dims first
            tp_part = _over_tensor_parallel(plan, tp_split, p, acc_dtype, device)
            local = torch.cat([local.pow(p) if not math.isinf(p) else local, tp_part.reshape(1)])
            local = local if math.isinf(p) else local.pow(1.0 / p)
        if math.isinf(p):
            # Max over ranks through the one sum-all-reduce the core offers: each rank writes its local
            # max into its own slot of a zero vector; replicas of a shard add the same value to a slot.
            slots = torch.zeros(plan.world, dtype=acc_dtype, device=device)
            slots[plan.rank] = local.max()
            if dp > 1:
                slots = plan.comm.all_reduce_sum(slots, label="clip_grad_norm").wait()
            total = slots.max() / plan.replicas
        else:
            total = local.pow(p).sum()
            if dp > 1:
                total = plan.comm.all_reduce_sum(total, label="clip_grad_norm").wait()
            total = (total / plan.replicas).pow(1.0 / p)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for (dev, _), ts in groups.items():
            torch._foreach_mul_(ts, coef.to(dev))
        for _, g in tp_split:
            g.mul_(coef.to(g.device))
    return grads.replace({}), total


def _over_tensor_parallel(plan: Any, grads: list[tuple[str, torch.Tensor]], p: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ``p``-th power sum (the max for ``p=inf``) of TP-sharded gradients' local shards, summed (maxed)
    over the TP mesh dims that shard each of them: as a ``Partial`` DTensor made ``Replicate`` (DTensor's
    all-reduce over those dims). Each rank then holds its dp shard's part of all TP slices, which the dp
    all-reduce completes."""
    inf = math.isinf(p)
    parts: dict[tuple[Any, tuple[Any, ...]], torch.Tensor] = {}
    for fqn, g in grads:
        tp = plan.tp[fqn].tp
        key = (tp.mesh, tuple(Partial("max" if inf else "sum") if isinstance(pl, Shard) else Replicate() for pl in tp.placements))
        if g.numel():
            x = g.detach().abs().max().to(device, dtype) if inf else torch.linalg.vector_norm(g.detach(), p, dtype=dtype if not g.is_complex() else None).to(device, dtype).pow(p)
        else:
            x = torch.zeros((), dtype=dtype, device=device)
        prev = parts.get(key)
        parts[key] = x if prev is None else (torch.maximum(prev, x) if inf else prev + x)
    total = torch.zeros((), dtype=dtype, device=device)
    for (mesh, placements), x in parts.items():
        reduced = DTensor.from_local(x, mesh, placements, run_check=False).redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
        total = torch.maximum(total, reduced) if inf else total + reduced
    return total
