"""Pieces of error messages that several layers write alike.

Example:
    >>> listing(["a.weight", "b.weight"])
    "'a.weight', 'b.weight'"
    >>> listing([f"w{i}" for i in range(6)])
    "'w0', 'w1', 'w2', 'w3' and 2 more"
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import torch

__all__ = ["listing", "torch_text", "user_stacklevel"]


def listing(names: Sequence[str], limit: int = 4) -> str:
    """``names`` quoted and comma-separated, the first ``limit`` of them, then how many more."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more


def torch_text(exc: BaseException) -> str:
    r"""``exc``'s message without the C++ stack trace torch appends to it where ``TORCH_SHOW_CPP_STACKTRACES=1``
    (torch's distributed test harness sets it): an error that quotes torch's message and then says what
    to do would otherwise bury the advice under a page of C++ frames.

    Example:
        >>> torch_text(RuntimeError("bad op\nException raised from f at x.cpp:1 (most recent call first):\n#0 f"))
        'bad op'
    """
    return str(exc).split("\nException raised from ", 1)[0]


_OWN = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called by this function's caller that points at the first frame
    outside fsdpfn and torch (the user's ``model(x)``, not the hook that noticed).

    Example:
        >>> user_stacklevel() >= 1
        True
    """
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_OWN):
        frame, level = frame.f_back, level + 1
    return level
