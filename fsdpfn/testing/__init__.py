"""Test helpers for fsdpfn, public so users can property-test their own sharded code.

- ``spmd(world_size, fn, *args)`` runs ``fn(*args)`` on every rank of a persistent CPU/gloo pool.
- ``strategies``: hypothesis strategies for shapes, dtypes, ``ShardSpec``s, world sizes and small models
  (needs the ``test`` extra: ``pip install fsdpfn[test]``).
- ``models``: picklable, seedable model recipes (``ModelRecipe``, ``ParamTree``).
"""

from fsdpfn.testing import models, strategies
from fsdpfn.testing.pool import SpmdError, SpmdTimeout, shutdown_pools, spmd

__all__ = ["SpmdError", "SpmdTimeout", "models", "shutdown_pools", "spmd", "strategies"]
