"""Checkpoints: DCP-format ``save``/``load`` of any pytree, DTensor state dicts, full state dicts.

- ``save(path, tree)`` / ``load(path, like)``: ``torch.distributed.checkpoint`` directories, written
  atomically, loadable at any world size and by FSDP2 (``dcp.load({"model": model.state_dict()}, ...)``),
  read without unpickling anything but DCP's metadata classes.
- ``to_dtensor(params)`` / ``from_dtensor(state, like)``: ``Sharded`` <-> FSDP2-style DTensor state dicts.
- ``full_state_dict(params)`` / ``load_full_state_dict(like, state)``: full tensors for export and import,
  streamed one unit at a time.

Example:
    >>> from fsdpfn import checkpoint                                               # doctest: +SKIP
    >>> checkpoint.save("ckpt", {"model": params, "opt": opt_state, "step": 100})   # doctest: +SKIP
    >>> like = {"model": params, "opt": opt.init(params), "step": 0}                # doctest: +SKIP
    >>> restored = checkpoint.load("ckpt", like)                                    # doctest: +SKIP
"""

from fsdpfn.checkpoint.dtensor import from_dtensor, to_dtensor
from fsdpfn.checkpoint.errors import CheckpointError, CheckpointMismatchError, UnsafeCheckpointError
from fsdpfn.checkpoint.full import full_state_dict, load_full_state_dict
from fsdpfn.checkpoint.io import load, save

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "UnsafeCheckpointError",
    "from_dtensor",
    "full_state_dict",
    "load",
    "load_full_state_dict",
    "save",
    "to_dtensor",
]
