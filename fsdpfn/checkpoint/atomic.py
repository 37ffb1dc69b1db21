"""Atomic checkpoint directories: write beside, mark complete, swap in; and the checks ``load`` makes.

A save writes into a hidden sibling ``.<name>.tmp-<token>`` that starts with an in-progress marker
(``fsdpfn_in_progress``). Only after every rank's data and DCP's ``.metadata`` are on disk does the root
rank write the scalars sidecar (``fsdpfn_scalars.json``) and the completion marker
(``fsdpfn_complete.json``, listing every file and its size), drop the in-progress marker, and swap the
directory into place: the old checkpoint is renamed to ``.<name>.old-<token>``, the new one renamed to
``<name>``, the old one deleted. A crash before the swap leaves the previous checkpoint untouched; a crash
between the two renames leaves it complete under ``.<name>.old-<token>`` (``load`` says so).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Callable
from typing import Any

from fsdpfn.checkpoint._sync import root_run
from fsdpfn.checkpoint.errors import CheckpointError
from fsdpfn.checkpoint.safe_pickle import METADATA_FILE, read_metadata
from fsdpfn.core import Comm

__all__ = ["COMPLETE", "IN_PROGRESS", "SCALARS", "verify", "write_atomically"]

COMPLETE = "fsdpfn_complete.json"
IN_PROGRESS = "fsdpfn_in_progress"
SCALARS = "fsdpfn_scalars.json"
FORMAT = "fsdpfn.checkpoint"
VERSION = 1


def _sibling(path: str, what: str, token: int) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.{what}-{token:016x}")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".part"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _looks_like_checkpoint(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in (COMPLETE, METADATA_FILE))


def _prepare(path: str) -> int:
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise NotADirectoryError(f"save: {path!r} exists and is not a directory; refusing to replace it")
        if os.listdir(path) and not _looks_like_checkpoint(path):
            raise FileExistsError(
                f"save: {path!r} exists and is not a checkpoint (no {COMPLETE} or {METADATA_FILE}); "
                f"refusing to replace it: pick another path or remove it"
            )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    token = secrets.randbits(62)
    tmp = _sibling(path, "tmp", token)
    os.mkdir(tmp)
    _write_json(os.path.join(tmp, IN_PROGRESS), {"format": FORMAT, "target": os.path.basename(path)})
    _fsync_dir(os.path.dirname(path))
    return token


def _finish(path: str, token: int, scalars: dict[str, Any]) -> None:
    tmp = _sibling(path, "tmp", token)
    if not os.path.exists(os.path.join(tmp, METADATA_FILE)):
        raise CheckpointError(f"save: DCP wrote no {METADATA_FILE} into {tmp!r}")
    _write_json(os.path.join(tmp, SCALARS), {"format": FORMAT, "values": scalars})
    skip = {COMPLETE, IN_PROGRESS}
    files = {n: os.path.getsize(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp)) if n not in skip}
    _write_json(os.path.join(tmp, COMPLETE), {"format": FORMAT, "version": VERSION, "files": files})
    os.remove(os.path.join(tmp, IN_PROGRESS))
    _fsync_dir(tmp)
    backup = _sibling(path, "old", token)
    had_old = os.path.lexists(path)
    if had_old:
        os.rename(path, backup)
    os.rename(tmp, path)
    parent = os.path.dirname(path)
    _fsync_dir(parent)
    if had_old:
        shutil.rmtree(backup, ignore_errors=True)
    leftover = re.compile(rf"\.{re.escape(os.path.basename(path))}\.(tmp|old)-[0-9a-f]{{16}}")
    for name in os.listdir(parent):  # leftovers of interrupted saves: `path` is complete again
        if leftover.fullmatch(name):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def write_atomically(path: str, comm: Comm | None, write: Callable[[str], None], scalars: dict[str, Any]) -> None:
    """Collective: every rank calls it; ``write(tmp_dir)`` runs DCP's save on every rank, the root rank
    does the file-system steps around it. Errors on the root are raised on every rank."""
    path = os.path.abspath(os.fspath(path))
    token = root_run(comm, lambda: _prepare(path))
    write(_sibling(path, "tmp", token))  # DCP raises on every rank if any rank failed
    root_run(comm, lambda: _finish(path, token, scalars))


def _interrupted_hint(path: str) -> str:
    parent, name = os.path.split(path)
    try:
        found = [n for n in os.listdir(parent) if n.startswith(f".{name}.")]
    except OSError:
        return ""
    done = [n for n in found if os.path.exists(os.path.join(parent, n, COMPLETE))]
    if done:
        where = os.path.join(parent, done[0])
        return f"; a complete checkpoint from an interrupted save is at {where!r}: rename it to {path!r}"
    return ""


def verify(path: str) -> tuple[Any, dict[str, Any]]:
    """Check that ``path`` is a finished checkpoint; return DCP's metadata (read safely) and the scalars.

    fsdpfn checkpoints need their completion marker and every file it lists, at its size; directories
    written by ``torch.distributed.checkpoint.save`` itself (no fsdpfn markers) are accepted when their
    ``.metadata`` (which DCP writes last, atomically) and every data file it references exist.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint directory at {path!r}{_interrupted_hint(os.path.abspath(path))}")
    scalars: dict[str, Any] = {}
    marker = os.path.join(path, COMPLETE)
    if os.path.exists(marker):
        try:
            with open(marker) as f:
                info = json.load(f)
            files = dict(info["files"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"the completion marker {marker!r} is damaged: {exc}") from exc
        problems = []
        for name, size in files.items():
            file = os.path.join(path, name)
            if not os.path.exists(file):
                problems.append(f"missing shard file {name!r}")
            elif os.path.getsize(file) != size:
                problems.append(f"file {name!r} has {os.path.getsize(file)} bytes, the marker says {size} (truncated?)")
        if problems:
            raise CheckpointError(f"checkpoint {path!r} is damaged: " + "; ".join(problems))
        try:
            with open(os.path.join(path, SCALARS)) as f:
                scalars = dict(json.load(f)["values"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"the scalars file {SCALARS!r} of {path!r} is damaged: {exc}") from exc
    elif os.path.exists(os.path.join(path, IN_PROGRESS)):
        raise CheckpointError(
            f"{path!r} has no completion marker {COMPLETE!r}: the save did not finish (this is the partial "
            f"directory of an interrupted fsdpfn.checkpoint.save; the previous checkpoint is untouched)"
        )
    md = read_metadata(path)
    missing = []
    for info in md.storage_data.values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or os.path.isabs(rel) or os.path.normpath(rel).startswith(".."):
            raise CheckpointError(f"checkpoint {path!r} references a data file outside it: {rel!r}")
        if not os.path.exists(os.path.join(path, rel)) and rel not in missing:
            missing.append(rel)
    if missing:
        raise CheckpointError(f"checkpoint {path!r} is damaged: missing shard file(s) {missing}")
    return md, scalars
