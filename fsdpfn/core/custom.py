"""A user's collectives in place of the core's: FSDP2's custom all-gather / reduce-scatter objects and
its all-reduce hook, adapted to ``Comm``'s launch-then-wait interface.

The objects follow torch's ``AllGather`` / ``ReduceScatter`` protocol (``allocate(size, *, dtype,
device)`` and ``__call__``), and are called exactly as FSDP2 calls them: the all-gather writes into a
flat ``(world * n,)`` buffer the object allocated, from a view of that buffer at ``rank * n`` holding this
rank's packed shards, with ``async_op=False``; the reduce-scatter reads a flat ``(world * n,)`` buffer
(rank-major, possibly pre-divided) into an ``(n,)`` buffer, both from ``allocate``, with the reduce op
FSDP2 would pass. The all-reduce hook sees the flat reduced ``(n,)`` gradient after the replicate
all-reduce (HSDP) or the reduce-scatter (1-D), scaled as FSDP2 scales it at that point, and may change it
in place. ``reduce_steps`` is where those scalings come from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fsdpfn.core.handle import Handle

__all__ = ["CustomComms", "ReduceSteps", "gather_buffers", "reduce_buffers", "reduce_custom", "reduce_steps", "run_hook"]


@dataclass(frozen=True, eq=False)
class CustomComms:
    """What a unit's collectives use instead of the core's own (``None``: the core's).

    ``divide_factor`` (an explicit gradient divide factor, ``None`` for the mean) and ``force_sum``
    decide, as in FSDP2, which reduce op the custom reduce-scatter gets and how the hook's input is
    scaled. Identity-hashed: a cache key for the collectives built with it.

    Example:
        >>> seen = []
        >>> comms = CustomComms(all_reduce_hook=seen.append)
        >>> comms.reduces, comms.gathers
        (True, False)
    """

    all_gather: Any = None
    reduce_scatter: Any = None
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None
    hook_stream: Any = None
    divide_factor: float | None = None
    force_sum: bool = False

    @property
    def gathers(self) -> bool:
        """Whether the all-gather is the user's."""
        return self.all_gather is not None

    @property
    def reduces(self) -> bool:
        """Whether the reduction is the user's or has a hook (then it leaves the core's fast paths)."""
        return self.reduce_scatter is not None or self.all_reduce_hook is not None

    @property
    def active(self) -> bool:
        """Whether anything is customised at all."""
        return self.gathers or self.reduces


@dataclass(frozen=True)
class ReduceSteps:
    """FSDP2's gradient scaling around a reduction: divide the input by ``pre``, reduce-scatter with
    ``op`` (which multiplies the sum by ``op_scale``), all-reduce over replicas, run the hook, then
    divide by ``post``. The hook therefore sees the sum divided by ``factor / post``.

    Example:
        >>> reduce_steps(2, 1, torch.float32, None, False).op == dist.ReduceOp.AVG
        True
    """

    pre: float
    op: Any
    op_scale: float
    post: float


def reduce_steps(world: int, replicas: int, dtype: torch.dtype, divide_factor: float | None, force_sum: bool) -> ReduceSteps:
    """The steps FSDP2 (torch 2.13) takes for a ``dtype`` gradient over ``world`` shard ranks and
    ``replicas`` replicas: fp32/bf16 reduce with AVG (or PREMUL_SUM for an explicit factor) and divide
    nothing afterwards; other dtypes, or ``force_sum``, sum, dividing by about sqrt(factor) before and
    the rest after (to keep fp16 in range).

    Example:
        >>> s = reduce_steps(4, 1, torch.float16, None, False)
        >>> s.pre, s.post
        (2, 2.0)
    """
    dp = world * replicas
    if dtype in (torch.float32, torch.bfloat16) and not force_sum:
        if divide_factor is None:
            op = dist.ReduceOp.SUM if dp == 1 else dist.ReduceOp.AVG
            return ReduceSteps(1, op, 1.0 / world if dp > 1 else 1.0, 1.0)
        if divide_factor == world:
            return ReduceSteps(1, dist.ReduceOp.AVG, 1.0 / world, 1.0)
        return ReduceSteps(1, dist.ReduceOp.PREMUL_SUM(1.0 / divide_factor), 1.0 / divide_factor, 1.0)
    factor = float(dp) if divide_factor is None else divide_factor
    if dtype in (torch.float32, torch.bfloat16):  # force_sum: everything after
        return ReduceSteps(1, dist.ReduceOp.SUM, 1.0, factor)
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return ReduceSteps(pre, dist.ReduceOp.SUM, 1.0, factor / pre)


def _allocate(user: Any, numel: int, like: torch.Tensor, what: str) -> torch.Tensor:
    buf = user.allocate((numel,), dtype=like.dtype, device=like.device)
    if not isinstance(buf, torch.Tensor) or buf.numel() != numel or buf.dtype != like.dtype or buf.device != like.device:
        got = f"{tuple(buf.shape)} {buf.dtype} on {buf.device}" if isinstance(buf, torch.Tensor) else type(buf).__name__
        raise ValueError(
            f"{what}: {type(user).__name__}.allocate(({numel},), dtype={like.dtype}, device={like.device}) returned {got}; "
            "it must return a tensor of that many elements, dtype and device"
        )
    return buf.view(-1) if buf.is_contiguous() else buf.reshape(-1)


def gather_buffers(user: Any, flat: torch.Tensor, world: int, rank: int, group: Any) -> tuple[Callable[[bool], Any], torch.Tensor]:
    """The user's all-gather of ``flat`` (this rank's packed shards): ``(fn, out)`` where ``fn(async_op)``
    runs it (FSDP2 passes ``async_op=False``; so do we) and ``out`` is the ``(world, *flat.shape)`` result."""
    n = flat.numel()
    out = _allocate(user, world * n, flat, "set_custom_all_gather")
    inp = out.narrow(0, rank * n, n)

    def fn(_async_op: bool) -> Any:
        inp.copy_(flat.reshape(-1))  # the copy-in, on the collective's stream (flat is kept until the wait)
        return user(output_tensor=out, input_tensor=inp, group=group, async_op=False)

    return fn, out.view(world, *flat.shape)


def reduce_buffers(
    user: Any, full: torch.Tensor, steps: ReduceSteps, group: Any
) -> tuple[Callable[[bool], Any], torch.Tensor, torch.Tensor]:
    """The user's reduce-scatter of ``full`` (``(world, *batch, n)``, rank-major): ``(fn, inp, out)``
    where ``fn(async_op)`` runs it (no ``async_op`` passed, as in FSDP2) from ``inp`` (the user's
    buffer, divided by ``steps.pre``) into ``out`` (``(*batch, n)``)."""
    world = full.shape[0]
    inp = _allocate(user, full.numel(), full, "set_custom_reduce_scatter")
    inp.copy_(full.reshape(-1))
    if steps.pre != 1:
        inp.div_(steps.pre)
    out = _allocate(user, full.numel() // world, full, "set_custom_reduce_scatter")

    def fn(_async_op: bool) -> Any:
        return user(output_tensor=out, input_tensor=inp, group=group, op=steps.op)

    return fn, inp, out.view(full.shape[1:])


def run_hook(custom: CustomComms, out: torch.Tensor) -> None:
    """Call the all-reduce hook on ``out`` (on its stream, when one was given and this is CUDA)."""
    hook = custom.all_reduce_hook
    if hook is None:
        return
    stream = custom.hook_stream
    if stream is None or out.device.type != "cuda":
        hook(out)
        return
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        hook(out)
    current.wait_stream(stream)


def reduce_custom(comm: Any, full: torch.Tensor, scale: float, custom: CustomComms, label: str) -> Handle:
    """``comm.reduce_scatter`` of ``full`` (contiguous ``(world, *batch, n)``) with the user's
    reduce-scatter (world > 1) and/or all-reduce hook, in FSDP2's order and scaling (``reduce_steps``),
    ending at the same ``scale`` overall; in place on the result buffer like the core's own."""
    groups = comm.groups
    steps = reduce_steps(groups.world, groups.replicas, full.dtype, custom.divide_factor, custom.force_sum)
    user = custom.reduce_scatter if groups.world > 1 else None
    # the hook sees sum * scale * post; before it the buffer holds sum * op_scale / pre (the user's
    # reduce-scatter) or the plain sum (the core's)
    before = scale * steps.post * (steps.pre / steps.op_scale if user is not None else 1.0)

    def finish(out: torch.Tensor, all_reduce: bool = True) -> torch.Tensor:
        if all_reduce:
            comm._all_reduce_replicas(out, label)
        if before != 1.0:
            out.mul_(before)
        run_hook(custom, out)
        if steps.post != 1.0:
            out.div_(steps.post)
        return out

    if user is None:
        if groups.world == 1:
            return Handle(finish(full[0]))  # the caller's packed buffer: finishing in place is safe
        handle = comm.reduce_scatter(full, label=label)  # the core's, with its replicate all-reduce
        inner = handle._finish
        handle._finish = (lambda out: finish(out, False)) if inner is None else (lambda out: finish(inner(out), False))
        return handle
    fn, inp, out = reduce_buffers(user, full, steps, comm.reduce_group)
    comm.stats._note("reduce_scatters", label, full.numel() * full.element_size())
    fp = comm.guard.begin("reduce_scatter", label, full, comm.reduce_group)
    return comm._launch("reduce", fn, keep=(inp,), result=out, fp=fp, finish=finish)
