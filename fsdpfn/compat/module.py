"""``FSDPModule``: the class ``fully_shard`` mixes into a module, with FSDP2's methods.

Calling an ``FSDPModule`` routes the forward through its root's ``RootContext`` (lazy initialisation
makes the first module called the root); the ``set_*`` methods change the knobs of the module's
``UnitState``, which the next forward/backward reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, NoReturn

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from fsdpfn.compat.hooks import check_all_gather, check_reduce_scatter, update_custom
from fsdpfn.compat.dispatch import dispatch, unit_state
from fsdpfn.compat.root import lazy_root
from fsdpfn.compat.explicit_unshard import UnshardHandle, launch_unshard
from fsdpfn.compat.replaced_params import note_replacement
from fsdpfn.compat.state import UnitState, drop_unsharded, state_of
from fsdpfn.layout.plan import is_byte_count
from fsdpfn.ops.api import is_positive_number
from fsdpfn.ops.slots import set_parameter

__all__ = ["FSDPModule", "UnshardHandle"]


def _fsdp_modules(module: nn.Module, recurse: bool) -> list[nn.Module]:
    mods = list(module.modules()) if recurse else [module]
    return [m for m in mods if state_of(m) is not None]


def _check_bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be a bool, got {value!r}")
    return value


def _unimplemented_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError(
        "FSDP does not support deepcopy. Please use state dict for serialization. For a second copy of the "
        "model (an EMA or a teacher; torch.optim.swa_utils.AveragedModel deep-copies its model), make it "
        "before fully_shard and shard both the same way (AveragedModel(model) first, then fully_shard on "
        "model and on averaged.module), or build the copy again, shard it alike and load this model's "
        "state_dict() into it"
    )


class FSDPModule(TorchFSDPModule):
    """The mixin ``fully_shard`` adds (class name ``FSDP<Original>``): FSDP2's ``FSDPModule`` API.

    It derives from torch's ``FSDPModule``, so torch code that asks whether a module is FSDP-sharded (a
    pipeline schedule: ``fsdpfn/compat/pipelining.py``) sees it as one; every method is fsdpfn's own.

    Example:
        >>> model = fully_shard(model)                            # doctest: +SKIP
        >>> isinstance(model, FSDPModule), type(model).__name__   # (True, 'FSDPTransformer')  # doctest: +SKIP
        >>> model.set_requires_gradient_sync(False)                # gradient accumulation  # doctest: +SKIP
    """

    _orig_cls_mro_index: int = 3  # FSDP<Original>, this class, torch's FSDPModule, Original

    def _get_fsdp_state(self) -> NoReturn:
        raise NotImplementedError(
            f"{type(self).__name__} is sharded by fsdpfn.compat.fully_shard, which keeps no torch FSDP2 state: "
            "torch code that reads FSDP2's internals (torch.distributed._tools.FSDPMemTracker) does not apply to "
            "it; use torch.distributed._tools.mem_tracker.MemTracker"
        )

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Containers that build a new instance of their own class (Sequential slicing) get the original.
        orig = cls.__mro__[cls._orig_cls_mro_index]
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return dispatch(self, None, args, kwargs)  # type: ignore[arg-type]

    # --- unshard / reshard ------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (not recursive) and register the full tensors on it.

        ``async_op=True`` returns an ``UnshardHandle``; the module's next forward waits for it itself.
        """
        st = unit_state(self)
        top = st.top()
        handle = launch_unshard(lazy_root(top, top.modules[0]), st)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Drop the unsharded parameters (of an explicit ``unshard``, or kept gathered since a forward or
        backward: ``fsdpfn/compat/kept.py``) and register the sharded ones again (not recursive)."""
        st = unit_state(self)
        if st.unsharded is not None:
            drop_unsharded(st)
        if st.root is not None and getattr(st.root, "plan", None) is not None:
            st.root.kept.drop({st.root.plan.group_of.get(st.name, st.name)})

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward: forget the iteration's in-flight state (explicit
        unshards, gradients accumulated while sync was off). Call it on the root module."""
        st = unit_state(self)
        if st.root is not None and st.root.state is not st:
            raise RuntimeError(
                f"reset_iter_state must be called on the root FSDP module\nthe root is {type(st.root.module).__name__}, "
                f"not this {type(self).__name__}"
            )
        roots = st.root.family() if st.root is not None else []  # with the roots nested on other meshes
        for s in [s for root in roots for s in root.states.values()] if roots else [st]:
            if s.unsharded is not None:
                drop_unsharded(s)
            s.acc.clear()
        for root in roots:
            root.running = False
            root.kept.drop()
            root.apply.leave_failed_backward()  # gathered values a backward that raised left registered

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, and also forget the gradients this module's parameters accumulated
        unreduced while gradient sync was off (``set_requires_gradient_sync(False)``): a microbatch dropped
        with ``model.zero_grad()`` must not reach the next reduction. (FSDP2 keeps them: the dropped
        microbatch is silently part of the next step's gradient. ``optimizer.zero_grad()`` cannot reach
        them: it sees only the sharded parameters; use ``model.zero_grad()``.)"""
        super().zero_grad(set_to_none)  # type: ignore[misc]
        st = unit_state(self)
        if st.root is None:
            return
        roots = st.root.family()  # with the roots nested on other meshes below
        if st.root.state is st:
            for root in roots:
                root.acc.clear()
            return
        mine = {id(p) for p in self.parameters()}
        for root in roots:
            for fqn, m in root.managed.items():
                if id(m.param) in mine:
                    root.acc.pop(fqn, None)

    # --- gradient knobs -----------------------------------------------------------------------------
    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for compatibility: fsdpfn finishes every reduction inside backward, so there is no
        pending work the last backward would have to wait for."""
        _check_bool(is_last_backward, "is_last_backward")

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: backward communicates nothing and accumulates full gradients (in the reduce dtype)
        on each rank; the next backward with ``True`` reduces them together with its own.

        Example:
            >>> model.set_requires_gradient_sync(False); model(x1).sum().backward()   # doctest: +SKIP
            >>> model.set_requires_gradient_sync(True); model(x2).sum().backward()    # doctest: +SKIP
        """
        value = _check_bool(requires_gradient_sync, "requires_gradient_sync")
        for m in _fsdp_modules(self, recurse):  # type: ignore[arg-type]
            unit_state(m).requires_gradient_sync = value

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False`` lets FSDP2 skip the all-reduce over replicas in the backwards of all but the last
        microbatch, keeping their reduce-scattered (shard-size) gradients. fsdpfn reduces every such backward
        fully (reduce-scatter and all-reduce) into ``.grad``, which holds as little (the same gradients after
        the last microbatch; one all-reduce of a shard per unit and microbatch more): see docs/compat.md."""
        value = _check_bool(requires_all_reduce, "requires_all_reduce")
        for m in _fsdp_modules(self, recurse):  # type: ignore[arg-type]
            unit_state(m).requires_all_reduce = value

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the module drops its gathered parameters after forward (re-gathering in backward)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for m in _fsdp_modules(self, recurse):  # type: ignore[arg-type]
            unit_state(m).reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False``: a unit keeps the parameters its backward gathered, and its next backward (another
        microbatch's, as a pipeline schedule runs them) gathers nothing; ``True`` frees them (see
        ``fsdpfn/compat/kept.py``)."""
        value = _check_bool(reshard_after_backward, "reshard_after_backward")
        for m in _fsdp_modules(self, recurse):  # type: ignore[arg-type]
            st = unit_state(m)
            st.reshard_after_backward = value
            if value and st.root is not None:
                st.root.kept.drop()

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Accepted for compatibility: fsdpfn re-gathers a unit in backward only when a saved tensor
        needs it, which is what ``False`` asks for where it is safe."""
        _check_bool(unshard_in_backward, "unshard_in_backward")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Gradients become the sum over data-parallel ranks divided by ``factor`` (instead of the mean).

        Example:
            >>> model.set_gradient_divide_factor(1.0)   # sum, not mean   # doctest: +SKIP
        """
        if not is_positive_number(factor):
            raise ValueError(f"set_gradient_divide_factor: factor must be a positive number, got {factor!r}")
        st = unit_state(self)
        st.divide_factor = float(factor)
        if st.custom is not None:
            update_custom(st)  # the custom reduce-scatter's op depends on it

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated alias of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """fsdpfn's own collectives always sum and scale afterwards, so for them this changes nothing; a
        custom reduce-scatter then gets ``SUM`` and the all-reduce hook the unscaled sum, as in FSDP2."""
        st = unit_state(self)
        st.force_sum_reduction = _check_bool(enable, "enable")
        if st.custom is not None:
            update_custom(st)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """``True``: parameters that got no gradient on this rank still receive the reduced gradient
        (zeros where no rank had one) instead of ``None``. Needed when ranks use different parameters (a
        mixture of experts): left off, a rank whose reduced gradient for a parameter it did not use is
        not zero raises at the end of its backward, rather than leave that shard un-updated.

        Example:
            >>> model.set_reduce_scatter_unused_params(True)   # doctest: +SKIP
        """
        value = _check_bool(reduce_scatter_unused_params, "reduce_scatter_unused_params")
        for m in _fsdp_modules(self, recurse):  # type: ignore[arg-type]
            unit_state(m).reduce_scatter_unused = value

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Accepted for compatibility: fsdpfn holds one reduce-scatter input per unit, freed when it ends."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")

    # --- prefetch and events ----------------------------------------------------------------------
    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these modules' parameters as soon as this module's are gathered in forward."""
        unit_state(self).forward_prefetch = [_state_of_listed(m) for m in _listed(modules, "set_modules_to_forward_prefetch")]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Re-gather these modules' parameters as soon as this module's are re-gathered in backward."""
        unit_state(self).backward_prefetch = [_state_of_listed(m) for m in _listed(modules, "set_modules_to_backward_prefetch")]

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next forward's all-gathers wait for ``event`` (recorded after the optimizer step) instead
        of the whole current stream. On CPU there is nothing to order."""
        if not isinstance(event, (torch.Event, torch.cuda.Event)):
            raise TypeError(
                f"set_post_optim_event: event must be a torch.Event (or torch.cuda.Event) recorded after the "
                f"optimizer step, got {type(event).__name__}"
            )
        unit_state(self).post_optim_event = event

    # --- fsdpfn extensions ----------------------------------------------------------------------------
    def set_min_bucket_bytes(self, min_bucket_bytes: int | Literal["auto"] | None) -> None:
        """fsdpfn only (FSDP2 has no such knob): fuse runs of consecutive ``fully_shard`` units below this
        root into collective groups of at least ``min_bucket_bytes`` gathered bytes, as
        ``fsdpfn.shard(..., min_bucket_bytes=)`` does. Call it on the root module (the one whose forward
        you call); it applies from the next forward. Units fuse only with neighbours whose settings
        agree (reshard, mixed precision, gradient sync and divide factor, no explicit prefetch lists,
        no custom collectives or all-reduce hook); changing a unit's setting later splits its group
        again at the next forward. ``None``: off.
        ``"auto"``: sizes chosen from the mesh's measured all-gather cost, as ``fsdpfn.shard``'s default
        (see ``fsdpfn.layout.autobucket``).

        Example:
            >>> for block in model.blocks: fully_shard(block)                  # doctest: +SKIP
            >>> fully_shard(model).set_min_bucket_bytes(1 << 20)               # doctest: +SKIP
        """
        if min_bucket_bytes not in (None, "auto") and not is_byte_count(min_bucket_bytes):
            raise ValueError(
                f"set_min_bucket_bytes: min_bucket_bytes must be an int >= 0 (bytes), 'auto' or None, got {min_bucket_bytes!r}"
            )
        unit_state(self).min_bucket_bytes = min_bucket_bytes or None

    # --- communication customisation (stored here, run by fsdpfn.core.custom) --------------------------
    def set_custom_all_gather(self, comm: Any) -> None:
        """Gather this module's parameters with ``comm`` (torch's ``AllGather`` protocol) instead of the
        built-in all-gather: FSDP2's calls, ``comm.allocate((world * n,), dtype=, device=)`` then
        ``comm(output_tensor=, input_tensor=<view of the output at rank * n>, group=, async_op=False)``.

        Example:
            >>> model.layers[0].set_custom_all_gather(MyAllGather())   # doctest: +SKIP
        """
        check_all_gather(comm)
        update_custom(unit_state(self), all_gather=comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce-scatter this module's gradients with ``comm`` (torch's ``ReduceScatter`` protocol):
        ``comm.allocate`` for the flat input and output, then ``comm(output_tensor=, input_tensor=,
        group=, op=)`` with FSDP2's op (``AVG`` for fp32/bf16, ``SUM`` for fp16 or forced sums).

        Example:
            >>> model.layers[0].set_custom_reduce_scatter(MyReduceScatter())   # doctest: +SKIP
        """
        check_reduce_scatter(comm)
        update_custom(unit_state(self), reduce_scatter=comm)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call ``hook(reduce_output)`` on this module's flat reduced gradient every time it is reduced:
        after the replicate all-reduce with HSDP, after the reduce-scatter on a 1-D mesh (e.g. to
        all-reduce over a group of your own). The hook may change the tensor in place. ``stream`` (CUDA,
        1-D meshes only, as in FSDP2) is the stream it runs on; on CPU it is accepted and unused.

        Example:
            >>> model.layers[0].set_all_reduce_hook(my_all_reduce_over_my_group)   # doctest: +SKIP
        """
        st = unit_state(self)
        if stream is not None and st.kind == "fully_shard" and len(st.placements) > 1:  # (Replicate(), Shard(0)): HSDP
            raise ValueError("stream cannot be set when using native HSDP")
        if hook is not None and not callable(hook):
            raise TypeError(f"set_all_reduce_hook: hook must be callable (reduce_output: Tensor) -> None, got {hook!r}")
        update_custom(st, hook=hook, **({} if stream is None else {"stream": stream}))

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Run gradient reduce-scatters on a process group of their own over the shard ranks, so they can
        progress alongside all-gathers. **Differs**: one switch per root (its ``Comm``): reductions of
        all its units move when any of them asks, from the next forward, which creates the group
        (collective: call it on every rank)."""
        value = _check_bool(enable, "enable")
        for m in _fsdp_modules(self, recurse):  # type: ignore[arg-type]
            st = unit_state(m)
            st.separate_reduce_group = value
            (st.root.state if st.root is not None else st.top()).reduce_group_changed = True

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """``True`` on a CPU mesh: accepted and changes nothing, as in FSDP2 on gloo (which cannot
        allocate, so FSDP2 falls back to plain ``torch.empty``). On a CUDA mesh ``True`` raises
        ``NotImplementedError``: fsdpfn's buffers come from the caching allocator. Like FSDP2, refused
        (``AssertionError``) after ``set_custom_all_gather``/``set_custom_reduce_scatter``."""
        st = unit_state(self)
        custom = st.custom
        if custom is not None and (custom.all_gather is not None or custom.reduce_scatter is not None):
            which = "all gather" if custom.all_gather is not None else "reduce scatter"
            obj = custom.all_gather if custom.all_gather is not None else custom.reduce_scatter
            raise AssertionError(
                f"cannot call set_allocate_memory_from_process_group() when {which} comm is custom: {type(obj).__name__}"
            )
        if _check_bool(enable, "enable") and st.mesh.device_type != "cpu":
            raise NotImplementedError(
                "set_allocate_memory_from_process_group_for_comm(True): allocating collective buffers from the process "
                f"group is not supported by fsdpfn.compat on a {st.mesh.device_type} mesh; leave it off"
            )

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """Not supported: raises ``NotImplementedError`` (FSDP2 needs NCCL symmetric memory for it and
        raises ``RuntimeError`` on CPU/gloo; fsdpfn has no symmetric-memory buffers on any device)."""
        raise NotImplementedError(
            "set_symm_mem_for_comm: symmetric-memory collectives are not supported by fsdpfn.compat; leave it off"
        )

    # --- nn.Module integration ----------------------------------------------------------------------
    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # module.to(...) & co.: register the sharded parameters first, then follow the converted ones.
        st = unit_state(self)
        if st.unsharded is not None:
            drop_unsharded(st)
        out = super(TorchFSDPModule, self)._apply(*args, **kwargs)  # the module's own (past torch's FSDP2 one)
        for m in st.managed:
            mod, attr = m.slots[0]
            current = mod._parameters.get(attr)
            if current is not None and current is not m.param:
                m.param = current
                note_replacement()
                for mo, at in m.slots:
                    set_parameter(mo, at, current)
        return out


def _listed(modules: Any, what: str) -> list[Any]:
    if not isinstance(modules, Iterable):  # FSDP2 fails iterating it; the same error, with the fix
        raise TypeError(f"{type(modules).__name__!r} object is not iterable\n{what}: modules must be a list of FSDPModules; wrap one module in a list")
    return list(modules)


def _state_of_listed(module: Any) -> UnitState:
    st = state_of(module) if isinstance(module, nn.Module) else None
    if st is None:
        raise ValueError(f"Expects FSDPModule but got {type(module)}: {module}")
    return st
