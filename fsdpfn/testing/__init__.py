"""Test helpers for fsdpfn: run functions on every rank of a CPU/gloo process group."""

from fsdpfn.testing.pool import shutdown_pools, spmd

__all__ = ["spmd", "shutdown_pools"]
