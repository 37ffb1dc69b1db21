"""Exceptions of ``fsdpfn.checkpoint``."""

from __future__ import annotations

import pickle

__all__ = ["CheckpointError", "CheckpointMismatchError", "UnsafeCheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, unfinished or damaged; the message names the missing piece.

    Example:
        >>> try:                                                       # doctest: +SKIP
        ...     fsdpfn.checkpoint.load("ckpt/.ckpt.tmp-1a2b", like)
        ... except fsdpfn.checkpoint.CheckpointError as e:
        ...     print(e)   # "... no completion marker ...: the save did not finish"
    """


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint's names or global shapes do not match ``like``; ``problems`` lists every one.

    Example:
        >>> try:                                                       # doctest: +SKIP
        ...     fsdpfn.checkpoint.load(path, {"model": other_params})
        ... except fsdpfn.checkpoint.CheckpointMismatchError as e:
        ...     print(e.problems)
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems: list[str] = list(problems or [])

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.problems))


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """A checkpoint file asked to unpickle something other than DCP metadata; nothing was executed.

    Example:
        >>> try:                                                       # doctest: +SKIP
        ...     fsdpfn.checkpoint.load(untrusted_path, like)
        ... except fsdpfn.checkpoint.UnsafeCheckpointError as e:
        ...     print(e)   # names the refused global, e.g. "posix.system"
    """
