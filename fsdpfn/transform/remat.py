"""``remat``: reshard-after-forward for ``torch.func`` transforms, by recomputation.

``torch.func.grad``/``vjp`` refuse ``saved_tensors_hooks``, so under them ``apply`` cannot pack a unit's
saved tensors away. Instead each non-root unit's forward runs inside ``remat``, an ``autograd.Function``
(``setup_context`` style): its forward gathers the unit, runs the unit without recording a graph and
drops the gathered copy, saving only the unit's shards and inputs; its backward gathers the unit again,
recomputes just that unit with a graph, and returns the input gradients and the reduced shard gradients.
The recomputation sees the random state the forward saw (CPU and the inputs' devices, as
``torch.utils.checkpoint`` restores it), so dropout draws the same masks.
``apply`` uses it automatically when every active ``torch.func`` transform is a gradient transform
(``grad``, ``vjp``, ``grad_and_value``): ``override_forwards`` routes the units' forwards through it for
one call. Under ``jvp``/``vmap`` the units simply stay gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import DefaultDeviceType, get_device_states, set_device_states

import fsdpfn.trees as trees
from fsdpfn.ops.api import check_shards, gather_collective
from fsdpfn.ops.buckets import Buckets
from fsdpfn.ops.functions import apply_buckets
from fsdpfn.transform.casting import cast_inputs
from fsdpfn.transform.eager import eager
from fsdpfn.transform.validate import changed_in_place_error, versions_moved

if TYPE_CHECKING:
    from fsdpfn.transform.apply import Apply
    from fsdpfn.transform.call import Call

__all__ = ["RematSpec", "override_forwards", "remat"]


@dataclass(eq=False)
class RematSpec:
    """One invocation of a unit under ``remat``.

    ``run(full, tensors)`` runs the unit's forward with the full parameters ``full`` and the input
    tensors ``tensors`` (the non-tensor inputs are baked in); ``gather`` is the unit's gather collective
    (its ``adjoint`` reduces the parameter gradients); ``trainable`` marks which members take gradients.
    """

    gather: Buckets
    run: Callable[[dict[str, torch.Tensor], Sequence[torch.Tensor]], Any]
    trainable: tuple[bool, ...]
    n_shards: int
    out_tree: Any = None
    out_consts: dict[int, Any] = field(default_factory=dict)
    rng: tuple[Any, ...] = ()  # (CPU state, device ids, device states) when the forward ran
    name: str = ""  # the unit's, for errors


def _flatten_out(spec: RematSpec, out: Any) -> tuple[torch.Tensor, ...]:
    leaves, spec.out_tree = trees.flatten(out)
    spec.out_consts = {i: v for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor)}
    return tuple(v for v in leaves if isinstance(v, torch.Tensor))


def unflatten_out(spec: RematSpec, tensors: Sequence[torch.Tensor]) -> Any:
    """Rebuild the unit's output structure from ``remat``'s tensor outputs."""
    it = iter(tensors)
    n = len(spec.out_consts) + len(tensors)
    leaves = [spec.out_consts[i] if i in spec.out_consts else next(it) for i in range(n)]
    return trees.unflatten(leaves, spec.out_tree)


class remat(torch.autograd.Function):  # noqa: N801 - public name from the design
    """Gather, run and forget a unit in forward; gather, recompute and reduce in backward.

    ``remat.apply(spec, *shards, *input_tensors)`` returns the unit's output tensors (rebuild the
    structure with ``unflatten_out``). Used by ``apply`` under ``torch.func`` gradient transforms.
    """

    @staticmethod
    def forward(spec: RematSpec, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        shards, inputs = tensors[: spec.n_shards], tensors[spec.n_shards :]
        spec.rng = (torch.get_rng_state(), *get_device_states(*tensors))
        full = dict(zip(spec.gather.fqns, spec.gather.run(shards)))
        versions = None if spec.gather.in_place else [t._version for t in full.values()]
        with torch.no_grad():
            out = spec.run(full, inputs)
        if versions is not None and versions_moved(full.values(), versions):
            raise changed_in_place_error([], [(spec.name, tuple(full))])
        return tuple(t.clone() if any(t is i for i in inputs) else t for t in _flatten_out(spec, out))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.spec = inputs[0]
        ctx.save_for_backward(*inputs[1:])

    @staticmethod
    def backward(ctx: Any, *grad_outs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        spec: RematSpec = ctx.spec
        saved = ctx.saved_tensors
        shards, inputs = saved[: spec.n_shards], saved[spec.n_shards :]
        needs = [n and x.is_floating_point() for n, x in zip(ctx.needs_input_grad[1 + spec.n_shards :], inputs)]
        full = dict(zip(spec.gather.fqns, apply_buckets(spec.gather, shards)))  # differentiable: grad-of-grad
        train = [f for f, t in zip(spec.gather.fqns, spec.trainable) if t]
        fixed = {f: v for f, v in full.items() if f not in train}

        # recompute the unit under torch.func.vjp (autograd-style recomputation is not allowed inside
        # a torch.func transform): differentiate w.r.t. the trainable full parameters and the inputs
        def unit(params: dict[str, torch.Tensor], diff_inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
            it = iter(diff_inputs)
            ins = [next(it) if need else x for x, need in zip(inputs, needs)]
            return _flatten_out(spec, spec.run({**fixed, **params}, ins))

        cpu_state, devices, device_states = spec.rng
        device_type = DefaultDeviceType.get_device_type()
        with torch.random.fork_rng(devices=devices, device_type=device_type):  # dropout: the forward's masks
            torch.set_rng_state(cpu_state)
            set_device_states(devices, device_states, device_type=device_type)
            outs, pullback = torch.func.vjp(unit, {f: full[f] for f in train}, [x for x, n in zip(inputs, needs) if n])
        cot = tuple(g if g is not None else torch.zeros_like(o) for o, g in zip(outs, grad_outs))
        param_grads, input_grads = pullback(cot)
        reduce = spec.gather.adjoint
        assert reduce is not None
        # through the autograd Function, so the collective sees plain tensors, not torch.func's wrappers
        reduced = dict(zip(reduce.fqns, apply_buckets(reduce, [param_grads.get(f) for f in reduce.fqns])))
        it = iter(input_grads)
        return (None, *(reduced.get(f) for f in spec.gather.fqns), *(next(it) if n else None for n in needs))


def override_forwards(apply: Apply, call: Call) -> list[tuple[nn.Module, bool, Any]]:
    """Route the forward of every outermost resharding unit through ``remat`` for this call (units
    nested in it run inside it); units ``apply`` keeps gathered run through their hooks."""
    plan = call.plan
    names = [u.name for u in plan.units if u.name]
    wants = [n for n in names if apply.reshards_unit(n)]
    outer = [n for n in wants if not any(n.startswith(o + ".") for o in wants if o != n)]
    call.remat_units = frozenset(outer)
    done = []
    for name in outer:
        mod = apply.module.get_submodule(name)
        had = "forward" in mod.__dict__
        old = mod.__dict__.get("forward")
        inner = tuple(plan.unit(n) for n in names if n == name or n.startswith(name + "."))
        mod.forward = _remat_forward(apply, call, name, inner, mod.forward)
        done.append((mod, had, old))
    return done


def _remat_forward(apply: Apply, call: Call, name: str, units: tuple[Any, ...], orig: Callable[..., Any]) -> Callable[..., Any]:
    plan = call.plan

    @eager  # a compiled unit under torch.func runs eagerly: dynamo cannot trace remat under functorch
    def forward(*args: Any, **kwargs: Any) -> Any:
        b = gather_collective(plan, units, call.scale)
        shards = check_shards(call.params, b.fqns)
        flat, in_tree = trees.flatten((args, kwargs))
        where = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]

        def run(full: dict[str, torch.Tensor], tensors: Any) -> Any:
            leaves = list(flat)
            for i, t in zip(where, tensors):
                leaves[i] = t
            a, kw = cast_inputs(plan, *trees.unflatten(leaves, in_tree), name)
            swapped = [s for u in units for s in apply._swap(plan, full, u.name)]
            apply._remat_depth += 1
            try:
                return orig(*a, **kw)
            finally:
                apply._remat_depth -= 1
                apply._restore(swapped)

        spec = RematSpec(b, run, tuple(plan.requires_grad[f] for f in b.fqns), len(shards), name=name)
        return unflatten_out(spec, remat.apply(spec, *shards, *(flat[i] for i in where)))

    return forward
