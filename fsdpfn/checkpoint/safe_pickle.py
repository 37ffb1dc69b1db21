"""Reading DCP's ``.metadata`` pickle without trusting it.

``torch.distributed.checkpoint``'s ``FileSystemReader.read_metadata`` calls ``pickle.load`` on the
checkpoint's ``.metadata`` file, which would run any callable a crafted file names. fsdpfn reads it with
``SafeUnpickler`` instead (the pure-Python ``pickle`` machine, restricted):

- ``find_class`` resolves only an allow-list of globals — the DCP metadata dataclasses, ``torch.Size``,
  dtypes, layouts and memory formats, ``pathlib`` paths and plain containers — and raises
  ``UnsafeCheckpointError`` naming anything else before it is called. So ``REDUCE``/``NEWOBJ`` can only
  call those inert constructors.
- ``BUILD`` (``__setstate__`` / attribute updates) is allowed only on *instances* of the metadata classes,
  never on a class or module-level object, so a file cannot patch anything global.
- persistent ids are refused.

Tensor data (``*.distcp``) is read by DCP with ``torch.load(..., weights_only=True)``. The one remaining
``torch.load(weights_only=False)`` in DCP is ``DefaultLoadPlanner.load_bytes``, used for non-tensor
entries; fsdpfn never writes such entries, refuses checkpoints whose requested keys are stored that way
(``load`` compares the metadata first), and ``SafeLoadPlanner.load_bytes`` raises as a second guard.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as _md

from fsdpfn.checkpoint.errors import CheckpointError, UnsafeCheckpointError

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "SafeUnpickler", "read_metadata"]

METADATA_FILE = ".metadata"

_MD_CLASSES = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "TensorProperties",
    "ChunkStorageMetadata",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
)
_ALLOWED: dict[tuple[str, str], Any] = {
    ("builtins", n): getattr(__import__("builtins"), n) for n in ("dict", "list", "tuple", "set", "frozenset")
}
_ALLOWED[("collections", "OrderedDict")] = __import__("collections").OrderedDict
_ALLOWED.update({("torch.distributed.checkpoint.metadata", n): getattr(_md, n) for n in _MD_CLASSES if hasattr(_md, n)})
_PATHS = ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
_ALLOWED.update({("pathlib", n): getattr(pathlib, n) for n in _PATHS})
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # layout by name (a dict lookup)


def _storage_info() -> Any:
    from torch.distributed.checkpoint import filesystem

    return filesystem._StorageInfo


_BUILDABLE = tuple(getattr(_md, n) for n in _MD_CLASSES if hasattr(_md, n) and n != "_MEM_FORMAT_ENCODING")


class SafeUnpickler(pickle._Unpickler):  # the pure-Python machine: its dispatch table can be restricted
    """A ``pickle.Unpickler`` that resolves only DCP metadata classes and inert torch/builtin types.

    Example:
        >>> import pickle, io
        >>> SafeUnpickler(io.BytesIO(pickle.dumps(torch.Size([2, 3])))).load()
        torch.Size([2, 3])
        >>> SafeUnpickler(io.BytesIO(pickle.dumps(print))).load()
        Traceback (most recent call last):
        ...
        fsdpfn.checkpoint.errors.UnsafeCheckpointError: refused to unpickle builtins.print ...
    """

    def __init__(self, file: Any, *, source: str = "<pickle>") -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        """Return the allowed global ``module.name`` or raise ``UnsafeCheckpointError`` (nothing is called)."""
        obj = _ALLOWED.get((module, name))
        if obj is not None:
            return obj
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        if (module, name) == ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
            return _storage_info()
        raise UnsafeCheckpointError(
            f"refused to unpickle {module}.{name} from {self._source}: DCP metadata only holds "
            f"torch.distributed.checkpoint metadata classes, torch.Size, dtypes and containers. The file "
            f"is damaged or was crafted to run code; nothing from it was executed."
        )

    def persistent_load(self, pid: Any) -> Any:
        """Refuse persistent ids: DCP metadata never contains them."""
        raise UnsafeCheckpointError(f"refused a persistent id in {self._source}: DCP metadata never contains one")

    def _load_build(self) -> None:
        inst = self.stack[-2] if len(self.stack) >= 2 else None
        if isinstance(inst, type) or not isinstance(inst, _BUILDABLE + (_storage_info(),)):
            raise UnsafeCheckpointError(
                f"refused to set the state of a {type(inst).__name__} in {self._source}: only DCP metadata "
                f"objects carry state. The file is damaged or crafted; nothing from it was executed."
            )
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
    dispatch[pickle.BUILD[0]] = _load_build


def read_metadata(path: str | os.PathLike[str], filename: str = METADATA_FILE) -> Any:
    """Read ``<path>/.metadata`` with ``SafeUnpickler`` and return DCP's ``Metadata``.

    Raises ``CheckpointError`` when the file is missing or not DCP metadata and
    ``UnsafeCheckpointError`` when it names a global outside the allow-list.

    Example:
        >>> md = read_metadata("ckpt")                                          # doctest: +SKIP
        >>> md.state_dict_metadata["model.0.weight"].size                       # doctest: +SKIP
        torch.Size([5, 3])
    """
    file = os.path.join(os.fspath(path), filename)
    try:
        with open(file, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(
            f"no DCP metadata file {file!r}: the save did not finish or this is not a checkpoint"
        ) from None
    try:
        md = SafeUnpickler(io.BytesIO(data), source=file).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"the DCP metadata file {file!r} is damaged: {type(exc).__name__}: {exc}") from exc
    if not isinstance(md, _md.Metadata):
        raise CheckpointError(f"{file!r} holds a {type(md).__name__}, not DCP Metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses ``SafeUnpickler`` (torch 2.11 and 2.13 layouts).

    Example:
        >>> dcp.load(state, storage_reader=SafeFileSystemReader("ckpt"), planner=SafeLoadPlanner())  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str], metadata: Any = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._fsdpfn_metadata = metadata  # already read (and checked) by the caller: parse it once

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """DCP's ``Metadata`` (global, or ``__<rank>.metadata`` when DCP asks for a rank's own file)."""
        rank = kwargs.get("rank")
        if rank is None and self._fsdpfn_metadata is not None:
            md = self._fsdpfn_metadata
        else:
            md = read_metadata(self.path, METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
        if getattr(md, "storage_meta", None) is None and hasattr(_md, "StorageMeta"):
            md.storage_meta = _md.StorageMeta()
        if getattr(md, "storage_meta", None) is not None and hasattr(self, "load_id"):
            md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that refuses non-tensor (pickled) entries instead of ``torch.load``-ing them.

    Example:
        >>> dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())   # doctest: +SKIP
    """

    def load_bytes(self, read_item: Any, value: Any) -> None:
        """Always raises: fsdpfn never unpickles checkpoint entries."""
        raise UnsafeCheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; fsdpfn does not unpickle "
            f"checkpoint entries (save python scalars with fsdpfn.checkpoint.save instead)"
        )
