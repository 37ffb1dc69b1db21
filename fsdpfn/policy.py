"""Mixed-precision and offload policies, shared by the functional layer and ``fsdpfn.compat``.

Same fields and meaning as ``torch.distributed.fsdp``'s classes of the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy", "as_mp_policy", "as_offload_policy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for the all-gather/compute (``param_dtype``), the gradient reduction (``reduce_dtype``) and
    the forward output (``output_dtype``); ``None`` keeps the parameter's own dtype.

    ``reduce_dtype=None`` with a ``param_dtype`` reduces in ``param_dtype`` (as FSDP2 does).
    ``cast_forward_inputs`` casts floating-point forward inputs to ``param_dtype``.

    Example:
        >>> MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=None, cast_forward_inputs=True)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(
                    f"MixedPrecisionPolicy: {name}={value!r} is not a floating-point torch.dtype; use e.g. "
                    f"torch.bfloat16, torch.float16 or torch.float32, or None to keep the parameter's own dtype"
                )
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(f"MixedPrecisionPolicy: cast_forward_inputs must be a bool, got {self.cast_forward_inputs!r}")

    def gather_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a parameter of ``dtype`` is all-gathered and computed in."""
        if self.param_dtype is not None and dtype.is_floating_point:
            return self.param_dtype
        return dtype

    def grad_reduce_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients of a parameter of ``dtype`` are reduced in."""
        if not (dtype.is_floating_point or dtype.is_complex):
            return dtype
        if self.reduce_dtype is not None and not dtype.is_complex:
            return self.reduce_dtype
        return self.gather_dtype(dtype)


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: shards stay on the mesh's device (the default)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep shards and gradients in CPU memory (``pin_memory`` for faster host-device copies).

    Example:
        >>> CPUOffloadPolicy(pin_memory=False)
        CPUOffloadPolicy(pin_memory=False)
    """

    pin_memory: bool = True


_MP_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


def as_mp_policy(policy: Any, where: str) -> MixedPrecisionPolicy | None:
    """``policy`` as fsdpfn's ``MixedPrecisionPolicy``: ``None`` and fsdpfn's own pass through, and
    ``torch.distributed.fsdp.MixedPrecisionPolicy`` (code moving from FSDP2 keeps its import) is
    converted field by field; anything else is refused, naming ``where``.

    Example:
        >>> from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        >>> as_mp_policy(TorchPolicy(param_dtype=torch.bfloat16), "shard").param_dtype
        torch.bfloat16
    """
    if policy is None or isinstance(policy, MixedPrecisionPolicy):
        return policy
    if type(policy).__name__ == "MixedPrecisionPolicy" and all(hasattr(policy, f) for f in _MP_FIELDS):
        return MixedPrecisionPolicy(**{f: getattr(policy, f) for f in _MP_FIELDS})
    raise TypeError(
        f"{where}: mp_policy must be a MixedPrecisionPolicy (fsdpfn's or torch.distributed.fsdp's), got "
        f"{type(policy).__name__}; e.g. fsdpfn.MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
    )


def as_offload_policy(policy: Any, where: str) -> OffloadPolicy | None:
    """``policy`` as fsdpfn's ``OffloadPolicy``/``CPUOffloadPolicy`` (torch's classes of those names are
    converted); anything else is refused, naming ``where``.

    Example:
        >>> as_offload_policy(CPUOffloadPolicy(pin_memory=False), "shard")
        CPUOffloadPolicy(pin_memory=False)
    """
    if policy is None or isinstance(policy, OffloadPolicy):
        return policy
    name = type(policy).__name__
    if name == "CPUOffloadPolicy":
        return CPUOffloadPolicy(pin_memory=getattr(policy, "pin_memory", True))
    if name == "OffloadPolicy":
        return OffloadPolicy()
    raise TypeError(f"{where}: offload_policy must be an OffloadPolicy or CPUOffloadPolicy, got {name}")
