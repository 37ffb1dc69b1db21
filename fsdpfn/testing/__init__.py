"""Test helpers for fsdpfn, public so users can property-test their own sharded code.

- ``spmd(world_size, fn, *args)`` runs ``fn(*args)`` on every rank of a persistent CPU/gloo pool.
- ``strategies``: hypothesis strategies for shapes, dtypes, ``ShardSpec``s, world sizes and small models
  (needs the ``test`` extra: ``pip install fsdpfn[test]``).
- ``models``: picklable, seedable model recipes (``ModelRecipe``, ``ParamTree``).
- ``fsdp2_has(name)``/``fsdp2_lacks(name)``/``torch_version()``: what this torch's FSDP2 offers, for tests
  that compare with it on every supported torch (2.11 lacks some of FSDP2's newer API);
  ``fsdp2_all_gathers()`` counts torch's FSDP2 all-gathers, to compare collective counts with it.
- ``decided_together(calls)``: runs each call in a thread, deciding together at every step, as ranks that
  plan together do (the single-process reference for ``group_sizes_within(everywhere=...)``).
"""

from fsdpfn.testing import models, strategies
from fsdpfn.testing.pool import SpmdError, SpmdTimeout, shutdown_pools, spmd
from fsdpfn.testing.together import decided_together
from fsdpfn.testing.torch_api import GatherCount, fsdp2_all_gathers, fsdp2_has, fsdp2_lacks, torch_version

__all__ = ["GatherCount", "SpmdError", "SpmdTimeout", "decided_together", "fsdp2_all_gathers", "fsdp2_has", "fsdp2_lacks", "models", "shutdown_pools", "spmd", "strategies", "torch_version"]
