"""Pieces of error messages that several layers write alike.

Example:
    >>> listing(["a.weight", "b.weight"])
    "'a.weight', 'b.weight'"
    >>> listing([f"w{i}" for i in range(6)])
    "'w0', 'w1', 'w2', 'w3' and 2 more"
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["listing"]


def listing(names: Sequence[str], limit: int = 4) -> str:
    """``names`` quoted and comma-separated, the first ``limit`` of them, then how many more."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more
