"""Mixed-precision casts of a unit's inputs and outputs (``MixedPrecisionPolicy``), shared by both executors."""

from __future__ import annotations

from typing import Any

import torch

import fsdpfn.trees as trees
from fsdpfn.layout import ShardPlan

__all__ = ["cast_floats", "cast_inputs", "cast_output"]


def cast_floats(x: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor in the pytree ``x`` (dataclasses included: ``fsdpfn.trees``) cast to
    ``dtype`` (other leaves unchanged)."""
    return trees.map_leaves(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, x)


def cast_inputs(plan: ShardPlan, args: tuple[Any, ...], kwargs: dict[str, Any], unit: str) -> Any:
    """Unit ``unit``'s forward arguments in its ``param_dtype`` (when its policy casts inputs)."""
    policy = plan.policy(unit)
    if policy is None or policy.param_dtype is None or not policy.cast_forward_inputs:
        return (args, kwargs) if kwargs is not None else args
    return cast_floats(args, policy.param_dtype), cast_floats(kwargs, policy.param_dtype)


def cast_output(plan: ShardPlan, out: Any, unit: str) -> Any:
    """Unit ``unit``'s output in its policy's ``output_dtype``, or ``None`` when there is none to apply."""
    policy = plan.unit_policies.get(unit) if unit else plan.policy("")
    if policy is None or policy.output_dtype is None:
        return None
    return cast_floats(out, policy.output_dtype)
