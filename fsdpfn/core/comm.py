"""The communication core: bucket all-gathers, reduce-scatters and replicate all-reduces.

Every collective fsdpfn issues goes through a ``Comm``. Each call launches the collective and returns a
``Handle``; ``Handle.wait()`` makes the caller's stream (CUDA) or thread (CPU) wait for it and returns the
result. On CPU the collective is gloo async work running on gloo's own thread, so Python can compute
while it is in flight. On CUDA it runs on a side stream: the side stream first waits for the current
stream (inputs ready), the result is handed back through an event, and the input buffer is kept alive by
the handle until the waiting stream is ordered after the event — no ``record_stream``. A bucket's copy-in
(``gather_bucket``: packing the shards, with their cast) runs on that side stream too, straight into
this rank's row of the result (in place, as FSDP2 gathers: no send buffer beside it), allocated on the
current stream; the handle keeps the shards alive as well.

All-gathers move raw bytes (any dtype, bool and complex included). Reduce-scatters sum in the buffer's
dtype and scale afterwards, since gloo has no ``PREMUL_SUM``: NCCL's reduce-scatter (complex as pairs of
reals) on CUDA; on CPU with gloo point-to-point exchanges followed by a local sum, which is faster than
gloo's. The exchanges are a gloo optimisation only: on any other CPU backend (PyTorch's threaded test
group, where ranks are threads of one process and ``isend`` does not exist) every collective is the plain
one the group implements (``all_gather_single``, ``reduce_scatter_single``, ``all_reduce``, ``broadcast``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from fsdpfn.core.bucket_collectives import BucketCollectives
from fsdpfn.core.c10d import all_gather_single, reduce_scatter_single
from fsdpfn.core.custom import CustomComms, gather_buffers, reduce_custom
from fsdpfn.core.exchange import Exchange
from fsdpfn.core.guard import CollectiveError, Fingerprint, Guard
from fsdpfn.core.handle import Handle
from fsdpfn.core.mesh import MeshGroups, mesh_groups
from fsdpfn.core.stats import CommStats

__all__ = ["Comm", "CommStats", "EXCHANGE_MIN_BYTES", "Handle"]

# From this many gathered bytes, CPU buckets move as point-to-point exchanges straight between the
# tensors (no packed buffer, no unpacking copy). In isolation gloo's all_gather wins below ~4 MiB
# (512 KiB: 0.8 ms against 1.9 ms; 8 MiB: 4.5 ms against 3.5 ms, world 2), but in a training step the
# packing and unpacking copies it needs cost more: on 3.5 MiB units (bench ln_mlp, run15) 1 MiB gave
# 47 ms of communication CPU per step against 62-77 ms at 4 MiB, a lower peak, and no loss on 48 small
# fused units. Reduce-scatters are exchanges at every size: gloo's reduce_scatter is slower still, and an
# all-to-all would need one more full-size buffer. Groups of other backends never use exchanges (see
# ``has_point_to_point``).
EXCHANGE_MIN_BYTES = 1 << 20


class Comm(BucketCollectives):
    """Collectives of one mesh, with their streams (CUDA) and counters.

    Example:
        >>> comm = Comm(fsdpfn.init_mesh())                     # doctest: +SKIP
        >>> full = comm.all_gather(torch.ones(3)).wait()        # (world, 3)  # doctest: +SKIP
    """

    def __init__(self, mesh: Any, *, replicate_only: bool = False):
        self.mesh = mesh
        self.replicate_only = replicate_only
        self.groups: MeshGroups = mesh_groups(mesh, replicate_only=replicate_only)
        self.stats = CommStats()
        self.guard = Guard(self.groups.rank)
        self._streams: dict[str, Any] = {}
        self._link_cost: Any = None  # the all-gather cost, measured once by fsdpfn.core.link.link_of
        shard_group = self.groups.shard_group
        # None: the shard group's backend has no point-to-point sends (e.g. the threaded test group)
        self.exchange: Exchange | None = (
            Exchange(shard_group, self.groups.rank, self.groups.world)
            if shard_group is not None and has_point_to_point(shard_group)
            else None
        )
        self.exchange_min_bytes = EXCHANGE_MIN_BYTES  # CPU: exchanges from this size (tests lower it)
        # the autograd graph task in which a gather's backward last reduced with a scale (ops/functions.py)
        self.scaled_backward_task = -1
        # reduce-scatters run here: the shard group, or a second group over its ranks (separate_reduce_group)
        self.reduce_group = shard_group
        self.reduce_exchange = self.exchange
        self._separate: tuple[Any, Exchange | None] | None = None

    def separate_reduce_group(self, enable: bool) -> None:
        """Run reduce-scatters on a process group of their own over the shard ranks (``True``), so they
        can progress alongside all-gathers, or on the shard group again (``False``). The first ``True``
        creates the group: collective over the shard ranks, so every rank must call it at the same point."""
        shard_group = self.groups.shard_group
        if not enable or shard_group is None or self.groups.world == 1:
            self.reduce_group, self.reduce_exchange = shard_group, self.exchange
            return
        if self._separate is None:
            group = dist.new_group(dist.get_process_group_ranks(shard_group), use_local_synchronization=True)
            exchange = Exchange(group, self.groups.rank, self.groups.world) if has_point_to_point(group) else None
            self._separate = (group, exchange)
        self.reduce_group, self.reduce_exchange = self._separate

    @property
    def world(self) -> int:
        """Ranks in the shard group."""
        return self.groups.world

    @property
    def rank(self) -> int:
        """This process's rank in the shard group."""
        return self.groups.rank

    @property
    def dp_world(self) -> int:
        """Data-parallel ranks: shard group size times replicas."""
        return self.groups.world * self.groups.replicas

    @contextlib.contextmanager
    def untracked(self) -> Iterator[None]:
        """Collectives issued inside leave no trace in ``stats`` or in the guard's collective numbering
        (``measure_link``'s probes, ``agree``'s sums: what a step issues stays what the user counts); the
        guard's timeout still applies, and with ``FSDPFN_DEBUG=1`` they are checked like any other.

        Example:
            >>> with comm.untracked():                         # doctest: +SKIP
            ...     comm.all_reduce_sum(t).wait()
        """
        saved = self.stats, self.guard
        self.stats, self.guard = CommStats(), Guard(self.groups.rank, timeout=saved[1].timeout)
        # a timeout in here still says how far the step got (passes, the last unit collective done)
        self.guard.steps, self.guard.last_done = saved[1].steps, saved[1].last_done
        try:
            yield
        finally:
            self.stats, self.guard = saved

    def _stream(self, name: str) -> Any:
        stream = self._streams.get(name)
        if stream is None:
            stream = self._streams[name] = torch.cuda.Stream(priority=-1)
        return stream

    def _launch(
        self, name: str, fn: Any, *, keep: tuple, result: torch.Tensor, fp: Fingerprint, finish: Any = None,
        consumed: tuple = (),
    ) -> Handle:
        """Run ``fn(async_op)`` on gloo's thread (CPU) or on the side stream ``name`` (CUDA). ``keep`` stays
        alive until the collective is done; ``consumed`` (the core's own buffers among them, read by
        nothing once it is finished) is freed by the handle's ``wait()`` on CPU."""
        try:
            return self._launch_unguarded(name, fn, keep=keep, result=result, fp=fp, finish=finish, consumed=consumed)
        except RuntimeError as e:
            if isinstance(e, CollectiveError):
                raise
            raise CollectiveError(f"collective {fp.describe()} on rank {self.groups.rank} could not start: {e}") from e

    def _launch_unguarded(
        self, name: str, fn: Any, *, keep: tuple, result: torch.Tensor, fp: Fingerprint, finish: Any, consumed: tuple
    ) -> Handle:
        if result.device.type == "cuda":
            current = torch.cuda.current_stream()
            stream = self._stream(name)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                fn(False)
                if finish is not None:
                    result = finish(result)
                event = stream.record_event()
            return Handle(result, event=event, keep=keep)
        work = fn(True)
        handle = Handle(result, work=work, keep=keep, finish=finish, guard=self.guard, fp=fp, consumed=consumed)
        if keep and work is not None:
            _free_inputs_when_done(handle, work)
        return handle

    def all_gather(self, flat: torch.Tensor, *, label: str = "", custom: CustomComms | None = None) -> Handle:
        """All-gather ``flat`` (``(*batch, n)``, any dtype) over the shard group into ``(world, *batch, n)``
        (with ``custom.all_gather``, the user's all-gather does it: see ``fsdpfn.core.custom``)."""
        world = self.groups.world
        if world == 1:
            return Handle(flat.unsqueeze(0))
        flat = flat.contiguous()
        if custom is not None and custom.all_gather is not None:
            fn, out = gather_buffers(custom.all_gather, flat, world, self.groups.rank, self.groups.shard_group)
            self.stats.track(out)
            self.stats._note("all_gathers", label, out.numel() * out.element_size())
            fp = self.guard.begin("all_gather", label, flat, self.groups.shard_group)
            return self._launch("gather", fn, keep=(flat,), result=out, fp=fp)
        out = flat.new_empty((world, *flat.shape))
        return self._all_gather_into(out, flat, label=label, keep=(flat,))

    def _all_gather_into(self, out: torch.Tensor, flat: torch.Tensor, *, label: str, keep: tuple) -> Handle:
        """All-gather ``flat`` into ``out`` (``(world, *flat.shape)``); ``flat`` may be ``out[rank]`` itself
        (in place: no send buffer beside the result, as FSDP2 gathers)."""
        world = self.groups.world
        self.stats.track(out)
        self.stats._note("all_gathers", label, out.numel() * out.element_size())
        if flat.numel() == 0:
            return Handle(out)
        group = self.groups.shard_group
        fp = self.guard.begin("all_gather", label, flat, group)
        send, recv = _as_bytes(flat), _as_bytes(out)
        if self.exchange is not None and flat.device.type != "cuda" and out.nbytes >= self.exchange_min_bytes:
            fn = self.exchange.gather_flat(send, recv.view(world, -1))
            return self._launch("gather", fn, keep=keep, result=out, fp=fp)
        return self._launch(
            "gather", lambda a: all_gather_single(recv, send, group=group, async_op=a), keep=keep, result=out, fp=fp
        )

    def reduce_scatter(
        self, full: torch.Tensor, *, scale: float = 1.0, label: str = "", custom: CustomComms | None = None
    ) -> Handle:
        """Sum ``full`` (``(world, *batch, n)``) over the shard group, keep this rank's ``(*batch, n)``,
        all-reduce it over the replicate group (HSDP), then multiply by ``scale``. With ``custom``, the
        user's reduce-scatter and all-reduce hook take part as in FSDP2 (see ``fsdpfn.core.custom``).
        ``full`` is consumed: at world 1 the result is ``full[0]`` itself, scaled in place (no copy)."""
        groups = self.groups
        if full.shape[0] != groups.world:
            raise ValueError(f"reduce_scatter: leading dim {full.shape[0]} != shard world {groups.world}")
        full = full.contiguous()
        if custom is not None and custom.reduces:
            return reduce_custom(self, full, scale, custom, label)

        def finish(out: torch.Tensor) -> torch.Tensor:
            self._all_reduce_replicas(out, label)
            if scale != 1.0:
                out.mul_(scale)
            return out

        if groups.world == 1:
            out = full[0]  # our own packed buffer: finishing in place is safe
            return Handle(finish(out))
        out = full.new_empty(full.shape[1:])
        self.stats._note("reduce_scatters", label, full.numel() * full.element_size())
        if out.numel() == 0:
            return Handle(out)
        group = self.reduce_group
        fp = self.guard.begin("reduce_scatter", label, full, group)
        if self.reduce_exchange is not None and full.device.type != "cuda":
            fn, add = self.reduce_exchange.reduce_flat(full, out, lambda work: self.guard.wait(work, fp))
            return self._launch("reduce", fn, keep=(full,), result=out, fp=fp, finish=_then(add, finish), consumed=(full,))
        send, recv = _as_reals(full).reshape(-1), _as_reals(out).reshape(-1)
        return self._launch(
            "reduce",
            lambda a: reduce_scatter_single(recv, send, op=dist.ReduceOp.SUM, group=group, async_op=a),
            keep=(full,),
            result=out,
            fp=fp,
            finish=finish,
            consumed=(full,),
        )

    def _all_reduce_replicas(self, out: torch.Tensor, label: str) -> None:
        """Sum ``out`` in place over the replicate group (HSDP); nothing without one."""
        replicate = self.groups.replicate_group
        if replicate is not None and out.numel():
            self.stats._note("all_reduces", label, out.numel() * out.element_size())
            fp2 = self.guard.begin("all_reduce", label, out, replicate)
            work = dist.all_reduce(_as_reals(out), group=replicate, async_op=out.device.type != "cuda")
            if work is not None:
                self.guard.wait(work, fp2)

    def all_reduce_sum(self, t: torch.Tensor, *, label: str = "") -> Handle:
        """Sum ``t`` over every rank of the mesh (shard and replicate groups); ``t`` is updated in place."""
        t_real = _as_reals(t)
        self.stats._note("all_reduces", label, t.numel() * t.element_size())
        groups = self.groups
        fp = self.guard.begin("all_reduce", label, t, groups.shard_group if groups.shard_group is not None else groups.replicate_group)

        def fn(a: bool) -> Any:
            work = None
            if groups.shard_group is not None:  # None: replicate-only, the world of one sums to itself
                work = dist.all_reduce(t_real, group=groups.shard_group, async_op=a)
            if groups.replicate_group is not None:
                if work is not None:
                    self.guard.wait(work, fp)
                fp2 = self.guard.begin("all_reduce", label, t, groups.replicate_group)
                work = dist.all_reduce(t_real, group=groups.replicate_group, async_op=a)
                if work is not None and not a:
                    self.guard.wait(work, fp2)
            return work

        return self._launch("reduce", fn, keep=(), result=t, fp=fp)

    def wait_event(self, event: Any) -> None:
        """Order every later collective of this mesh after ``event`` (a CUDA event, e.g. recorded after
        the optimizer step); on CPU, where collectives run on gloo's thread in program order, nothing to do."""
        if event is None or self.groups.device_type != "cuda":
            return
        torch.cuda.current_stream().wait_event(event)  # each launch orders its side stream after this one

    def broadcast(self, t: torch.Tensor, *, label: str = "") -> Handle:
        """Overwrite contiguous ``t`` (any dtype, raw bytes) in place on every rank of the mesh with its
        value on the mesh's first rank (coordinate 0 in every dim): over the replicate group, then the
        shard group."""
        groups = self.groups
        if self.dp_world == 1 or t.numel() == 0:
            return Handle(t)
        if not t.is_contiguous():
            raise ValueError("broadcast: the tensor must be contiguous (it is overwritten in place)")
        data = _as_bytes(t)
        stages = [g for g, n in ((groups.replicate_group, groups.replicas), (groups.shard_group, groups.world)) if n > 1]
        fp = self.guard.begin("broadcast", label, t, stages[0])

        def fn(a: bool) -> Any:
            work = dist.broadcast(data, src=dist.get_global_rank(stages[0], 0), group=stages[0], async_op=a)
            if len(stages) > 1:
                if work is not None:
                    self.guard.wait(work, fp)
                fp2 = self.guard.begin("broadcast", label, t, stages[1])
                work = dist.broadcast(data, src=dist.get_global_rank(stages[1], 0), group=stages[1], async_op=a)
                if work is not None and not a:
                    self.guard.wait(work, fp2)
            return work

        return self._launch("gather", fn, keep=(), result=t, fp=fp)


def has_point_to_point(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` runs CPU tensors on gloo, whose ``send``/``recv`` the exchanges use. Other
    backends (PyTorch's threaded test group among them) get the plain collectives instead."""
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # pragma: no cover - a group c10d does not know
        return False
    return backend == "gloo" or "cpu:gloo" in backend.split(",")


def _then(first: Any, then: Any) -> Any:
    def both(result: torch.Tensor) -> torch.Tensor:
        first(result)
        return then(result)

    return both


def _free_inputs_when_done(handle: Handle, work: Any) -> None:
    """Drop the handle's input buffers as soon as gloo completes the work (its thread runs the
    callback), not when somebody waits: a reduction waited for late must not pin its full-size input."""
    try:
        future = work.get_future()
    except (RuntimeError, AttributeError):  # pragma: no cover - a backend without futures
        return
    ref = weakref.ref(handle)

    def done(_fut: Any) -> None:
        h = ref()
        if h is not None:
            h._keep = ()

    future.add_done_callback(done)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _as_reals(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t
