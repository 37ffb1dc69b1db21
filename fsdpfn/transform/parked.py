"""Gathered buffers that something outside fsdpfn still holds when their group reshards.

A resharded group's gathered copy is freed by dropping the references to it: saved tensors that alias it
are packed (``Call.pack``), so autograd holds none. Some holders are out of fsdpfn's reach: a selective
activation checkpoint whose policy saves every op keeps the views it made of the weights (``w.t()``) in its
cache until the recompute, so each unit's whole gathered buffer stayed alive from its forward to its
backward (1.14x torch's peak over a training step; FSDP2 frees the storage by resizing it to zero bytes
and gathers into the same storage again before the backward reads it).

The same here, for exactly those buffers: at the release, a storage that some tensor other than the group's
own still references is *parked*: resized to zero bytes, and remembered with where each parameter lies in
it; the group's next gather of the call (its backward's re-gather, which comes before the recompute reads
the cache) copies the values back into it (``refill``). A group whose unit returned a view of its buffer
is never parked: that view is read by what follows in the forward; nor is one that a tensor set on one of
the unit's modules views (``self.wt = self.weight.t()`` in its forward, read by a later module). A view kept
some other way (a closure, a list, another module) and read before the backward fails, as under FSDP2.

Example:
    >>> buf = torch.arange(6.0); full = {"w": buf.view(2, 3)}; cache = full["w"].t()
    >>> parked = park(full); del full
    >>> buf.untyped_storage().nbytes()
    0
    >>> full = refill(parked, {"w": torch.arange(6.0).view(2, 3)})
    >>> cache.tolist()
    [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# what every nn.Module keeps in its __dict__ (parameters, submodules, hooks): not tensors a forward left
_MODULE_STATE = frozenset(vars(nn.Module()))

__all__ = ["Parked", "Parking", "park", "refill", "repark", "tensors_on"]


class Parked(NamedTuple):
    """A gathered buffer's storage resized to zero bytes while other tensors hold it: its size, and each
    parameter's view of it (storage offset, shape, stride, dtype)."""

    storage: torch.UntypedStorage
    nbytes: int
    views: dict[str, tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]]


def _held_by_others(storage: torch.UntypedStorage, own: int) -> bool:
    # references to the storage: one per tensor that views it, one for the Python storage object
    return torch._C._storage_Use_Count(storage._cdata) > own + 1


def tensors_on(module: nn.Module) -> Iterator[torch.Tensor]:
    """The tensors set as plain attributes (or in a list, tuple or dict attribute) and the buffers of
    ``module`` and its submodules: what a forward may leave for a later module to read.

    Example:
        >>> m = nn.Linear(2, 2); m.cached = m.weight.t()
        >>> [tuple(t.shape) for t in tensors_on(m)]
        [(2, 2)]
    """
    for m in module.modules():
        attributes = [v for k, v in vars(m).items() if k not in _MODULE_STATE]
        for value in (*attributes, *m._buffers.values()):
            leaves = torch.utils._pytree.tree_leaves(value) if isinstance(value, (list, tuple, dict)) else (value,)
            for t in leaves:
                if isinstance(t, DTensor):
                    yield t._local_tensor
                elif isinstance(t, torch.Tensor):
                    yield t


def park(full: dict[str, torch.Tensor], read_on: Callable[[], Iterable[torch.Tensor]] = tuple) -> list[Parked]:
    """Resize to zero bytes each storage of ``full`` (a group's gathered tensors, about to be forgotten)
    that a tensor other than these and their bases still references, unless one of ``read_on()`` (asked
    only then: tensors that code after the release may read, ``tensors_on`` of the group's modules) views
    it; what was parked.

    Example:
        >>> full = {"w": torch.zeros(4)}; park(full)   # nobody else holds it: left to the references
        []
    """
    tensors: dict[int, dict[int, torch.Tensor]] = {}  # storage -> its tensors here (views and their bases)
    storages: dict[int, torch.UntypedStorage] = {}
    where: dict[str, int] = {}  # parameter -> its storage
    for f, t in full.items():
        if not t.numel() or type(t) is not torch.Tensor:
            continue
        s = t.untyped_storage()
        where[f] = s.data_ptr()
        mine = tensors.setdefault(s.data_ptr(), {})
        storages.setdefault(s.data_ptr(), s)
        for x in (t, t._base):
            if x is not None:
                mine[id(x)] = x
    held = [ptr for ptr, s in storages.items() if s.nbytes() and _held_by_others(s, len(tensors[ptr]))]
    if held:
        kept = {t.untyped_storage().data_ptr() for t in read_on() if type(t) is torch.Tensor and t.numel()}
        held = [ptr for ptr in held if ptr not in kept]
    parked = []
    for ptr in held:
        s = storages[ptr]
        mine = {f: t for f, t in full.items() if where.get(f) == ptr}
        views = {f: (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype) for f, t in mine.items()}
        parked.append(Parked(s, s.nbytes(), views))
        s.resize_(0)
    return parked


def refill(parked: list[Parked], full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The group gathered again (``full``), copied into its parked storages (resized back): their
    holders read the values again. Returns ``full`` with each parked parameter a view of its storage, in
    the layout of the forward (packed saved tensors unpack by storage offset)."""
    out = dict(full)
    for p in parked:
        if p.storage.nbytes() != p.nbytes:
            p.storage.resize_(p.nbytes)
        for f, (offset, shape, stride, dtype) in p.views.items():
            view = torch.empty(0, dtype=dtype, device=p.storage.device).set_(p.storage, offset, shape, stride)
            view.copy_(full[f])
            out[f] = view
    return out


def repark(parked: list[Parked]) -> None:
    """The group's backward is done: resize its parked storages to zero bytes again (their holders read
    them only in a later backward of the same graph, whose re-gather refills them first)."""
    for p in parked:
        p.storage.resize_(0)


class Parking:
    """One call's parked groups, and what it knows to decide: which groups were gathered into buffers of the
    core's own (only those are parked: at world 1 the gathered values are the shards; an all-gather
    extension or a custom all-gather owns its buffers; a copy kept gathered outside the call is not the call's
    own either) and which units returned a view of their buffer.

    Example:
        >>> parking = Parking(); parking.release("blocks.0", {"w": torch.zeros(4)}, tuple)   # not gathered here
        >>> "blocks.0" in parking
        False
    """

    def __init__(self) -> None:
        self._parked: dict[str, list[Parked]] = {}
        self._own: set[str] = set()  # resharded groups gathered into the core's own buffers
        self._escaped: set[str] = set()  # groups whose unit returned a view of their buffer

    def __contains__(self, group: str) -> bool:
        return group in self._parked

    def gathered(self, group: str, buckets: Any, *, taken: bool = False) -> None:
        """Resharded group ``group`` was gathered by ``buckets`` (its ``Buckets``); ``taken``: its values are
        a copy kept gathered outside this call (compat's ``reshard_after_backward=False``) and handed to it,
        which is never parked here: the call that gathered it may still read it in a backward of its own
        (a pipeline schedule's weight-gradient pass runs after the next microbatch's forward)."""
        if buckets.gathers_into_core_buffer and not taken:
            self._own.add(group)
        else:
            self._own.discard(group)

    def returned(self, storages: dict[int, tuple[str, str]], out: Any) -> None:
        """A unit's forward returned ``out``; ``storages``: the resharded groups' gathered storages (by data
        pointer: group, parameter). A group some tensor of ``out`` views is never parked."""
        for t in torch.utils._pytree.tree_leaves(out):
            local = t._local_tensor if isinstance(t, DTensor) else t
            if type(local) is torch.Tensor and local.numel():
                hit = storages.get(local.untyped_storage().data_ptr())
                if hit is not None:
                    self._escaped.add(hit[0])

    def release(self, group: str, full: dict[str, torch.Tensor], read_on: Callable[[], Iterable[torch.Tensor]]) -> None:
        """Group ``group``'s gathered copy ``full`` is being forgotten: park what is held elsewhere (``park``)."""
        if group in self._own and group not in self._escaped:
            parked = park(full, read_on)
            if parked:
                self._parked.setdefault(group, []).extend(parked)

    def refilled(self, group: str, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Group ``group`` gathered again (``full``): its values back into its parked storages, if any."""
        parked = self._parked.get(group)
        return refill(parked, full) if parked else full

    def repark(self, group: str) -> None:
        """Group ``group``'s backward is done with its parked storages (``repark``)."""
        repark(self._parked.get(group, []))
