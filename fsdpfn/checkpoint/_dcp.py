"""The two calls into ``torch.distributed.checkpoint``: one save, one (guarded) load."""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from collections.abc import Iterator
from typing import Any

from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fsdpfn.checkpoint._sync import dist_ready
from fsdpfn.checkpoint.errors import CheckpointError
from fsdpfn.checkpoint.safe_pickle import SafeFileSystemReader, SafeLoadPlanner

__all__ = ["dcp_load", "dcp_save"]


@contextlib.contextmanager
def _dcp_errors(what: str) -> Iterator[None]:
    """DCP raises ``CheckpointException`` (a ``BaseException``) on every rank when any rank failed:
    re-raise it as a ``CheckpointError`` naming the failing ranks and the first failure."""
    try:
        with warnings.catch_warnings():
            if not dist_ready():  # a single process is fine: say nothing
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    except CheckpointException as exc:
        failures = dict(getattr(exc, "failures", {}) or {})
        first = next(iter(failures.values()), exc)
        if isinstance(first, tuple) and first:  # (exception, traceback summary)
            first = first[0]
        detail = f"{type(first).__name__}: {first}" if isinstance(first, BaseException) else str(first)
        ranks = sorted(failures)
        raise CheckpointError(f"{what}: torch.distributed.checkpoint failed on rank(s) {ranks}: {detail}") from exc


def _save_planner() -> Any:
    # replicated (plain) tensors are written by the lowest rank: "rank 0's value is saved"
    if "dedup_save_to_lowest_rank" in inspect.signature(dcp.DefaultSavePlanner.__init__).parameters:
        return dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    return dcp.DefaultSavePlanner()  # pragma: no cover - older torch


def dcp_save(state: dict[str, Any], directory: str | os.PathLike[str], group: Any = None) -> None:
    """``dcp.save`` of a flat state dict into ``directory``: collective over ``group`` (the ranks holding
    the saved trees, ``fsdpfn.checkpoint._sync.dcp_group``; ``None``: the default group)."""
    with _dcp_errors("save"):
        writer = dcp.FileSystemWriter(directory)
        dcp.save(state, storage_writer=writer, planner=_save_planner(), process_group=group, no_dist=not dist_ready())


def dcp_load(state: dict[str, Any], directory: str | os.PathLike[str], metadata: Any = None, group: Any = None) -> None:
    """``dcp.load`` into a flat state dict over ``group`` (as ``dcp_save``), reading metadata with the
    allow-list unpickler (or using ``metadata``, already read that way) and refusing pickled entries."""
    with _dcp_errors("load"):
        reader = SafeFileSystemReader(directory, metadata)
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group, no_dist=not dist_ready())
