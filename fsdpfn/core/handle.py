"""``Handle``: one in-flight collective of the communication core (see ``fsdpfn.core.comm``)."""

from __future__ import annotations

from typing import Any

import torch

from fsdpfn.core.guard import Fingerprint, Guard

__all__ = ["ColumnsHandle", "Handle"]


class Handle:
    """An in-flight collective. ``wait()`` (idempotent) orders the caller after it and returns the result."""

    __slots__ = ("_work", "_event", "_keep", "_consumed", "_finish", "_result", "_done", "_guard", "_fp", "direct", "__weakref__")

    def __init__(
        self,
        result: torch.Tensor,
        *,
        work: Any = None,
        event: Any = None,
        keep: tuple = (),
        finish: Any = None,
        guard: Guard | None = None,
        fp: Fingerprint | None = None,
        consumed: tuple = (),
    ):
        self._result = result
        self._work = work
        self._event = event
        self._keep = keep
        # CPU buffers of the core's own that nothing reads once the collective is finished (a reduce-scatter's
        # packed input): ``wait()`` frees their memory itself. Left to the references, it went whenever gloo's
        # thread let go of its work, racing this thread's next allocations (a full-size input alive or not
        # at the next unit's backward: peaks that moved by a unit's gradients from run to run).
        self._consumed = consumed
        self._finish = finish
        self._done = False
        self._guard = guard
        self._fp = fp
        self.direct = False  # a bucket gathered parameter-major (Comm.gather_bucket)

    def wait(self) -> torch.Tensor:
        """Block (CPU) or make the current stream wait (CUDA) until the collective is done."""
        if not self._done:
            self._done = True
            if self._work is not None:
                if self._guard is not None and self._fp is not None:
                    self._guard.wait(self._work, self._fp)
                else:
                    self._work.wait()
            if self._event is not None:
                torch.cuda.current_stream().wait_event(self._event)
            if self._finish is not None:
                self._result = self._finish(self._result)
            self._work = self._event = self._finish = None
            self._keep = ()
            for t in self._consumed:
                t.untyped_storage().resize_(0)
            self._consumed = ()
        return self._result

    def release(self) -> None:
        """The caller copied what it needs out of the (waited) result: free the result's memory now on CPU,
        where gloo's thread may still hold the finished work, and with it the buffer, for a while (its
        release raced this thread's next allocations). The result must not be read again; nothing on CUDA,
        whose buffers the caching allocator reuses in stream order.

        Example:
            >>> h = Handle(torch.zeros(2, 3)); _ = h.wait().clone(); h.release()
            >>> h.wait().untyped_storage().nbytes()
            0
        """
        assert self._done, "release() before wait()"
        if self._result.device.type == "cpu":
            self._result.untyped_storage().resize_(0)

    def keep_also(self, tensors: tuple) -> None:
        """Keep ``tensors`` alive until ``wait()`` as well: side-stream work of this collective reads them."""
        if not self._done:
            self._keep = (*self._keep, *tensors)

    def peek(self) -> torch.Tensor:
        """The buffer the result will be in, before ``wait()`` (only for collectives whose finishing
        step works in place, such as ``reduce_scatter``): read it only after ``wait()``."""
        return self._result

    def __del__(self) -> None:
        # A dropped handle must still order the caller after the collective before its buffers go.
        if not self._done:
            try:
                self.wait()
            except Exception:  # pragma: no cover - interpreter shutdown
                pass


class ColumnsHandle:
    """Columns ``[start, stop)`` of a rank-major ``(world, n)`` collective shared by several buckets
    (``Comm.gather_buckets``): ``wait()`` waits for the shared one and returns a view of its result, so
    the shared buffer lives as long as some part's result does.

    Example:
        >>> part = ColumnsHandle(Handle(torch.arange(6).view(2, 3)), 1, 3)
        >>> part.wait().tolist()
        [[1, 2], [4, 5]]
    """

    __slots__ = ("_whole", "_start", "_stop", "direct")

    def __init__(self, whole: Handle, start: int, stop: int):
        self._whole, self._start, self._stop = whole, start, stop
        self.direct = False  # rank-major: unpack with BucketLayout.unpack_full

    def wait(self) -> torch.Tensor:
        """Wait for the shared collective; this part's ``(world, stop - start)`` columns (a view)."""
        return self._whole.wait()[:, self._start : self._stop]
