"""Differentiable collectives over a ``Sharded`` tree (``unshard``, ``reshard``, ``reduce``) and ``shard``."""

from fsdpfn.ops.api import accumulate, reduce, reduce_scale, reshard, unshard
from fsdpfn.ops.extension import AllGatherTransform
from fsdpfn.ops.functions import ReduceFunction, UnshardFunction
from fsdpfn.ops.shard import shard
from fsdpfn.ops.units import resolve_units

__all__ = ["AllGatherTransform", "ReduceFunction", "accumulate", "UnshardFunction", "reduce", "reduce_scale", "reshard", "resolve_units", "shard", "unshard"]
