"""The unit hooks of ``fsdp``: swapping a unit's gathered values into its module for its forward.

Persistent forward hooks on each unit's module put the unit's full parameters (views of its gathered
buffer) in the module's ``_parameters`` just before the unit's forward and restore what was there after
it. Outside an ``apply`` call they do nothing, except during an activation-checkpoint recompute in
backward, where they put back the values the forward used. ``Apply`` extends ``UnitHooks``; the compat
layer overrides ``unit_modules`` and ``release_after_module``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fsdpfn.layout import Sharded, ShardPlan
from fsdpfn.ops.placeholder import Placeholder
from fsdpfn.ops.slots import PARAMETER_CACHES, parameter_cache
from fsdpfn.transform.casting import cast_inputs, cast_output
from fsdpfn.transform.eager import eager, eager_frame, functorch_active, in_backward, stable_graph_choice, uncompiled_forward
from fsdpfn.transform.traced import enter_unit, exit_unit

if TYPE_CHECKING:
    import weakref

    from fsdpfn.transform.call import Call
    from fsdpfn.transform.open_call import OpenCall
    from fsdpfn.transform.recompute import BackwardSwaps

__all__ = ["Swap", "UnitHooks"]

Swap = list[tuple[dict[str, Any], str, Any]]  # (table, name, old value) per swapped entry: the undo list


class UnitHooks:
    """Parameter swapping and the per-unit forward hooks of an ``Apply`` (whose ``__init__`` sets the
    state below)."""

    module: nn.Module
    _forward: list[OpenCall]
    _backward: weakref.WeakSet[Call]
    _hooked: set[Any]
    _unit_swaps: dict[str, list[Swap]]
    _recompute: BackwardSwaps
    _targets: dict[str, tuple[dict[str, Any], str]]
    _caches: dict[str, tuple[dict[str, Any], ...]]
    _unit_hooks: dict[str, tuple[Callable[..., Any], Callable[..., Any]]]
    _remat_depth: int
    placeholders = True  # _swap_placeholders: the compat layer's modules keep FSDP2's sharded DTensors instead
    # A call begun inside an activation checkpoint's region is recomputed in backward as a plain forward
    # (the compat layer: its units' values swapped in, no call), not as the call again (``checkpoint(apply,
    # params, x)``): the checkpoint matches the saved tensors of both one by one, so such a call packs none
    # of its own and hands them all to the checkpoint, which holds none (``Call.in_checkpoint``).
    recomputes_plainly = False
    # Each call's tree is fresh views of the same shards (the compat layer's DTensor parameters): two
    # forwards awaiting backward read the same values. A functional tree is the user's: only the very
    # same leaves are (a tree updated in place since holds other values under the same memory).
    fresh_views = False

    # --- swapping --------------------------------------------------------------------------------
    def _target(self, fqn: str, kind: str) -> tuple[dict[str, Any], str]:
        key = f"{kind}:{fqn}"
        hit = self._targets.get(key)
        if hit is None:
            path, _, name = fqn.rpartition(".")
            owner = self.module.get_submodule(path)
            hit = self._targets[key] = (owner._parameters if kind == "p" else owner._buffers, name)
        return hit

    @staticmethod
    def _unit_slots(plan: ShardPlan, unit: str) -> list[tuple[str, str]]:
        """``(name, owner)`` for every parameter name of unit ``unit`` (tied aliases included), once per plan."""
        names = plan.memo.get(("swap", unit))
        if names is None:
            names = plan.memo[("swap", unit)] = [(a, o) for o in plan.unit(unit).fqns for a in plan.names(o)]
        return names

    def _swap(self, plan: ShardPlan, full: dict[str, torch.Tensor], unit: str) -> Swap:
        names = self._unit_slots(plan, unit)
        if plan.tp:  # tensor-parallel parameters: the module sees DTensors on its TP mesh
            full = {f: plan.tp[f].tp.wrap(t) if f in plan.tp else t for f, t in full.items()}
        return self._swap_names(names, full)

    def _swap_names(self, names: list[tuple[str, str]], full: dict[str, torch.Tensor]) -> Swap:
        """Register ``full[owner]`` as parameter ``name`` for each ``(name, owner)``; returns the undo list,
        which also puts back the parameter caches of the modules swapped (``_parameter_caches``): the
        slots are written directly, past ``set_parameter``, so that the undo restores exactly what was there."""
        out: Swap = []
        cached: set[int] = set()
        for name, owner in names:
            table, attr = self._target(name, "p")
            for cache in self._parameter_caches(name):
                if id(cache) not in cached:
                    cached.add(id(cache))
                    out.extend((cache, c, cache[c]) for c in PARAMETER_CACHES)
            out.append((table, attr, table[attr]))
            table[attr] = full[owner]
        return out

    def _parameter_caches(self, fqn: str) -> tuple[dict[str, Any], ...]:
        """The ``__dict__`` of parameter ``fqn``'s module if that module keeps its parameters in a cache of
        its own (torch's RNNs: ``_flat_weights``, refreshed by their forward when the parameters change):
        after the swap is undone the cache would hold the gathered tensors, and so the gathered buffer,
        until that module's next forward (a whole unit's full weights between steps, and through the
        backward: 1.2x torch's peak on stacked LSTMs). The undo puts back the cache of before the swap."""
        hit = self._caches.get(fqn)
        if hit is None:
            cache = parameter_cache(self.module.get_submodule(fqn.rpartition(".")[0]))
            hit = self._caches[fqn] = () if cache is None else (cache,)
        return hit

    def _swap_placeholders(self, plan: ShardPlan) -> Swap:
        """Put a ``Placeholder`` (same shape and dtype, refusing every operation by name) in every unit
        parameter's slot for the call: code that bypasses a unit's forward (a child of the unit called
        directly, a unit's weight used by another module) then fails naming the parameter, instead of
        computing with the module's stale weights (``shard(..., donate=False)``) or with a donated ``meta``
        tensor (torch's CPU matmul takes one and returns uninitialised memory). The unit hooks swap the
        gathered values over the placeholder and put it back; the call's end restores the module's own."""
        out: Swap = []
        if not self.placeholders:
            return out
        for unit in plan.units:
            if not unit.name:
                continue
            for name, _ in self._unit_slots(plan, unit.name):
                table, attr = self._target(name, "p")
                cur = table[attr]
                if type(cur) not in (torch.Tensor, nn.Parameter):
                    continue  # a tensor subclass (TP's DTensors) this does not mimic
                key = ("placeholder", name, tuple(cur.shape), cur.dtype)
                stand_in = plan.memo.get(key)
                if stand_in is None:  # no requires_grad_: torch.func transforms refuse it inside their function
                    stand_in = plan.memo[key] = Placeholder(cur.shape, cur.dtype, name, unit.name)
                out.append((table, attr, cur))
                table[attr] = stand_in
        return out

    def _swap_buffers(self, params: Sharded[torch.Tensor]) -> Swap:
        out: Swap = []
        for fqn in params.plan.buffers:
            table, attr = self._target(fqn, "b")
            out.append((table, attr, table[attr]))
            table[attr] = params[fqn]
        return out

    def _replaced_buffers(self, params: Sharded[torch.Tensor]) -> list[tuple[str, Any]]:
        """``(fqn, value)`` for each buffer the forward replaced (``self.count = self.count + 1``, an EMA
        computed out of place) instead of updating the tree's leaf in place: read before the call restores
        the module, written by ``_keep_replaced_buffers`` after it."""
        out = []
        for fqn in params.plan.buffers:
            table, attr = self._target(fqn, "b")
            new = table.get(attr)
            if new is not params[fqn]:
                out.append((fqn, new))
        return out

    def _keep_replaced_buffers(
        self, params: Sharded[torch.Tensor], replaced: list[tuple[str, Any]], traced: bool = False
    ) -> None:
        """Copy into the tree's leaves the values the forward assigned to buffers (``_replaced_buffers``):
        the module's own buffers would keep them, so the tree keeps them too (else they were lost when the
        call restored the module). Shape and device must stay (a ``Sharded`` tree's leaves are fixed by its
        plan); the dtype is the leaf's. A non-persistent buffer that no longer fits (a cache rebuilt for a
        longer sequence) is left to be rebuilt by the next call, as before. ``traced``: inside a whole-step
        trace (the copy is an input mutation the compiled step applies)."""
        batched = torch._C._functorch.is_batchedtensor
        for fqn, new in replaced:
            leaf = params[fqn]
            fits = isinstance(new, torch.Tensor) and new.shape == leaf.shape and new.device == leaf.device and (
                traced or not batched(new) or batched(leaf))
            if not fits and fqn in params.plan.transient_buffers:
                continue  # a non-persistent buffer (a cache the forward rebuilds, e.g. for a longer sequence)
            if not isinstance(new, torch.Tensor) or new.shape != leaf.shape or new.device != leaf.device:
                what = f"{type(new).__name__}" if not isinstance(new, torch.Tensor) else (
                    f"a tensor of shape {tuple(new.shape)} on {new.device}")
                raise RuntimeError(self._kept_buffer_error(fqn, leaf, what))
            if not fits:
                raise RuntimeError(self._kept_buffer_error(fqn, leaf, "a per-example value (under torch.func.vmap)"))
            with torch.no_grad():
                leaf.copy_(new)

    def _kept_buffer_error(self, fqn: str, leaf: torch.Tensor, what: str) -> str:
        return (
            f"apply: the forward of {type(self.module).__name__} replaced buffer {fqn!r} (shape {tuple(leaf.shape)} "
            f"on {leaf.device}) by {what}; the Sharded tree keeps one value of each buffer's shape and device "
            "from fsdpfn.shard, so the new value cannot be kept. Keep the buffer's shape (assign or copy_ a value "
            "of the same shape; under torch.func.vmap, update buffers in eval mode or outside vmap only), or hold "
            "such state outside the model"
        )

    @staticmethod
    def _restore(swapped: Swap) -> None:
        for table, attr, old in reversed(swapped):
            table[attr] = old
        swapped.clear()

    # --- unit hooks ------------------------------------------------------------------------------
    def _install_hooks(self, plan: ShardPlan) -> None:
        for unit in plan.units:
            if unit.name and unit.name not in self._hooked:
                stable_graph_choice()
                for mod in self.unit_modules(unit.name):
                    pre, post = self.unit_hooks(unit.name)
                    mod.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)  # before the module's own (as FSDP2)
                    mod.register_forward_hook(post, always_call=True)
                self._hooked.add(unit.name)

    def unit_modules(self, name: str) -> list[nn.Module]:
        """The modules whose forward runs unit ``name`` (its own submodule)."""
        return [self.module.get_submodule(name)]

    def release_after_module(self, name: str) -> bool:
        """Whether a resharding unit is dropped as soon as one of its modules' forward returns (else at
        the end of the whole forward: a unit of several modules is gathered once for all of them)."""
        return True

    def unit_hooks(self, name: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """Unit ``name``'s ``(pre, post)`` forward hooks (made once; both run eagerly under compile)."""
        got = self._unit_hooks.get(name)
        if got is None:
            got = self._unit_hooks[name] = (self._pre_hook(name), self._post_hook(name))
        return got

    def _pre_hook(self, name: str) -> Callable[..., Any]:
        @eager  # the eager executor: compiled code breaks around it
        def eager_pre(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            uncompiled_forward(mod)  # every time: torch._dynamo.reset() forgets the mark
            if self._remat_depth or (self._forward and name in self._forward[-1].call.remat_units):
                self._unit_swaps.setdefault(name, []).append([])  # remat gathers and swaps itself
                return None
            if self._forward:
                call = self._forward[-1].call
                if name not in call.plan.memo.setdefault(("unit_names",), {u.name for u in call.plan.units}):
                    self._unit_swaps.setdefault(name, []).append([])
                    return None
                group = call.group_of[name]
                full = call.for_unit(group)
                self._unit_swaps.setdefault(name, []).append(self._swap(call.plan, full, name))
                return cast_inputs(call.plan, args, kwargs, name)
            if in_backward():
                found = self._swap_for_recompute(name)
                if found is not None:
                    call, swapped = found
                    self._unit_swaps.setdefault(name, []).append(swapped)
                    return cast_inputs(call.plan, args, kwargs, name)
            self._unit_swaps.setdefault(name, []).append([])
            return None

        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if self._forward and self._forward[-1].traced:
                return enter_unit(self, self._forward[-1].call, name, args, kwargs)
            return eager_pre(mod, args, kwargs)

        return eager_frame(hook)

    def _post_hook(self, name: str) -> Callable[..., Any]:
        @eager  # the eager executor: compiled code breaks around it
        def eager_post(_mod: nn.Module, _args: Any, out: Any) -> Any:
            stack = self._unit_swaps.get(name)
            if stack:
                self._restore(stack.pop())
            if self._forward:
                call = self._forward[-1].call
                group = call.group_of.get(name, name)
                call.note_outputs(out)
                if call.reshards(group) and group in call.gathered and self.release_after_module(name):
                    if call.unit_done(group, name):
                        call.release(group, keep=True)
                if torch.is_grad_enabled() and not functorch_active():  # torch.func: remat recomputes
                    self._recompute.arm_on(call, name, out)
                if call.plan.unit_policies:
                    return cast_output(call.plan, out, name)
            return None

        def hook(mod: nn.Module, args: Any, out: Any) -> Any:
            if self._forward and self._forward[-1].traced:
                return exit_unit(self, self._forward[-1].call, name, out)
            return eager_post(mod, args, out)

        return eager_frame(hook)

    def run_recomputed_root(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)``, the root's forward re-run by an activation-checkpoint recompute in backward
        (the compat layer: a root called inside a checkpointed region, e.g. MoE experts on their own mesh
        inside a checkpointed block), with the root unit's values of the call awaiting backward in its
        slots and its inputs and output cast as that call's were. The recompute can come before the
        backward reaches the call's output (a product saves the root's output and the recompute makes it),
        so the values cannot wait for that (``BackwardSwaps._enter``)."""
        found = self._swap_for_recompute("")
        if found is None:
            return fn(*args, **kwargs)
        call, swapped = found
        try:
            args, kwargs = cast_inputs(call.plan, args, kwargs, "")
            out = fn(*args, **kwargs)
        finally:
            self._restore(swapped)
        cast = cast_output(call.plan, out, "")
        return out if cast is None else cast

    def _swap_for_recompute(self, name: str) -> tuple[Call, Swap] | None:
        """For a recompute of unit ``name`` in backward: the call whose values it uses and their swap into
        the unit's slots (``None``: no call awaiting backward holds the unit)."""
        call = self._recompute.current.get(name) or self._recompute_call(name)
        if call is None:
            return None
        return call, self._swap(call.plan, self._recompute.values(call, call.group_of[name], name), name)

    def _recompute_call(self, name: str) -> Call | None:
        """The call whose values a recompute of unit ``name`` uses when its backward has not started yet
        (a checkpoint region around the whole call). Several forwards awaiting backward (DPO's two) must
        hold the same values; the one whose group is still gathered is taken, else the first: alike on
        every rank (``serial``, not the weak set's order), so every rank gathers alike."""
        calls = sorted((c for c in self._backward if any(u.name == name for u in c.plan.units)), key=lambda c: c.serial)
        if not calls:
            return None
        first = calls[0]
        same = _same_tensor if self.fresh_views else (lambda a, b: a is b)
        for c in calls[1:]:
            if any(not same(c.params[k], first.params[k]) for k in first.plan.params):
                raise RuntimeError(
                    f"apply: unit {name!r} is being recomputed (activation checkpointing) while several forwards "
                    "over different parameter trees await backward; run backward before the next forward"
                )
        group = first.group_of[name]
        return next((c for c in calls if group in c.gathered or group in c.regathered), first)


def _same_tensor(a: Any, b: Any) -> bool:
    """Whether two compat calls' leaves are one parameter's shard: the same object, or the same view of
    one tensor (each compat forward takes fresh views of the parameters' local shards; by identity of the
    viewed tensor, so an empty shard, whose memory has no address, is one too)."""
    if a is b:
        return True
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    base_a = a._base if a._base is not None else a
    base_b = b._base if b._base is not None else b
    return base_a is base_b and a.storage_offset() == b.storage_offset() and a.shape == b.shape and a.stride() == b.stride()
