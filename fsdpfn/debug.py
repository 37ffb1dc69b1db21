"""Debugging switches and the errors they raise.

- ``check_collectives()`` (or ``FSDPFN_DEBUG=1``; ``0``, ``false``, ``off`` or unset leave it off, and any
  other value stops ``import fsdpfn`` with an error): before each collective the ranks compare fingerprints;
  if they diverge every rank raises ``CollectivePlanError`` naming each rank's unit and collective.
  The switch is per thread (a rank may be a thread of PyTorch's threaded test group): each rank turns it
  on at the same point of its own program; a thread that never set it follows the thread that made the
  rank's communicator (CUDA autograd's workers), then the main thread.
- In the same mode each unit's gathered parameters are copied when gathered and compared when released:
  a forward that wrote to them through ``.data`` (no version counter moves, so it is otherwise unseen; the
  write never reaches the shards) raises the in-place-change ``RuntimeError`` naming the unit.
- Waits time out after ``FSDPFN_TIMEOUT`` seconds (default 600; a number > 0) with ``CollectiveTimeout``; a collective
  whose peer died raises ``CollectiveError``. Both name the unit and the last completed collective.

Example:
    >>> import fsdpfn.debug
    >>> with fsdpfn.debug.check_collectives():
    ...     pass                                  # every collective in here is checked
"""

from fsdpfn.core.guard import (
    CollectiveError,
    CollectivePlanError,
    CollectiveTimeout,
    check_collectives,
    checking,
)

__all__ = ["CollectiveError", "CollectivePlanError", "CollectiveTimeout", "check_collectives", "checking"]
