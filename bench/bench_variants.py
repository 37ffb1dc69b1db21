"""The benchmarked training steps: ``torch`` (FSDP2), ``functional`` (fsdpfn), ``local`` (no sharding),
``compat`` (``fsdpfn.compat.fully_shard``, once it exists) and the untimed global-batch ``reference``.

Each variant owns a deep copy of the same initial model and exposes

* ``step(x, y) -> loss``: one full training step (forward, backward, reduction, AdamW update);
* ``resident()``: the tensors it keeps between steps (parameters or shards, optimizer state), which the
  memory measurement counts on top of what the step itself allocates;
* ``record(x, y) -> (loss, log)``: one real step that also logs every collective it issued;
* ``replay(log)``: the same collectives again, with fresh buffers, back to back, no compute.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

import fsdpfn
import fsdpfn.optim
from bench_models import ModelSpec, loss_fn, make_batches

__all__ = ["Coll", "Variant", "build_variant", "COMPILED", "EXTRA", "SHARDED", "ALL_VARIANTS"]

COMPILED = ("torch_compiled", "compat_compiled", "functional_compiled", "functional_traced", "functional_traced_a2a")
EXTRA = ("functional_kept", "compat_kept", "functional_fused", "compat_fused", "functional_resharded")  # measured when named in --variants
ALL_VARIANTS = ("torch", "functional", "local", "compat", *COMPILED, *EXTRA)
SHARDED = ("torch", "functional", "compat", *COMPILED, *EXTRA)
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
WINDOW = 2  # collectives in flight at once during a replay (a step overlaps about as many)


@dataclass(frozen=True)
class Coll:
    """One collective of a step: ``kind`` is ``all_gather`` or ``reduce_scatter``; sizes in elements."""

    kind: str
    in_numel: int
    out_numel: int
    dtype: torch.dtype
    group: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes of the larger (gathered / unreduced) side."""
        return max(self.in_numel, self.out_numel) * self.dtype.itemsize


class Variant:
    """Base class: a model copy, its optimizer and one training step."""

    name = ""
    sharded = False
    compiled = False  # torch.compile'd (blocks, or the whole step)
    backend = "inductor"  # torch.compile backend of the compiled variants (bench/step.py --compile-backend)
    profile_peak = False  # measure the peak by the allocator's events even when eager (bench/step.py --peak)
    # torch.optim.AdamW's kernel arguments (bench/step.py --torch-foreach): {} torch's default,
    # {"foreach": True} or {"fused": True}
    torch_adamw_kernel: dict[str, bool] = {}
    compile_options: dict[str, Any] | None = None  # inductor options of the traced step (bench/step.py --compile-options)
    # CPU seconds (this thread) the last step's optimizer update took; None where the step does not
    # separate it (a traced step compiles the update in): the CPU floor (bench_measure.add_ratios) counts
    # each variant's own update, not local's
    opt_cpu_s: float | None = None

    def __init__(self, base: nn.Module, spec: ModelSpec, mesh: Any, device: torch.device, dtype: torch.dtype):
        self.spec, self.mesh, self.device, self.dtype = spec, mesh, device, dtype
        self.model = copy.deepcopy(base).to(device)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def resident(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def record(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[Coll]]:
        return self.step(x, y), []

    def replay(self, log: list[Coll]) -> None:
        _replay_dist(log, self.device)


class _ModuleVariant(Variant):
    """A plain ``nn.Module`` + ``torch.optim.AdamW`` step (``local``, ``torch``, ``compat``): torch's default
    kernel (the for-loop on CPU, foreach on CUDA), foreach with ``bench/step.py --torch-foreach true``, or the
    fused kernel with ``--torch-foreach fused``."""

    def _init_opt(self) -> None:
        self.opt = torch.optim.AdamW(self.model.parameters(), **self.torch_adamw_kernel, **ADAMW)  # type: ignore[arg-type]

    def _forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(self.spec, self.model(x), y)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self._forward_loss(x, y)
        loss.backward()
        t0 = time.thread_time()
        self.opt.step()
        self.opt.zero_grad()
        self.opt_cpu_s = time.thread_time() - t0
        return loss.detach()

    def resident(self) -> list[torch.Tensor]:
        state = [v for s in self.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return [*self.model.parameters(), *self.model.buffers(), *state]


class Local(_ModuleVariant):
    """No sharding and no communication: each rank trains its own replica on its own batch.

    With ``bf16`` the forward runs on bf16 copies of the fp32 weights (and floating inputs), as
    ``MixedPrecisionPolicy(param_dtype=bf16)`` does, so the sharded variants' losses can agree with it
    (autocast, which keeps norms and softmax in fp32, drifts apart from them within a few steps)."""

    name = "local"

    def __init__(self, *a: Any):
        super().__init__(*a)
        self._init_opt()

    def _forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.float32:
            out = self.model(x)
        else:
            cast = {k: p.to(self.dtype) for k, p in self.model.named_parameters()}
            x = x.to(self.dtype) if x.is_floating_point() else x
            out = torch.func.functional_call(self.model, cast, (x,))
        return loss_fn(self.spec, out, y)


class Reference(Local):
    """``local`` on the global batch (every rank's batch), computed redundantly on each rank. Untimed.

    The step accumulates the gradients of the per-rank batches one after another (each loss divided by
    the number of ranks) and then updates once: for a mean-reduced loss over equal per-rank batches
    that is the step on their concatenation, with one rank's activations in memory instead of all of
    them. Its loss is the mean of the per-rank losses and its gradient the mean of the per-rank
    gradients, exactly what the sharded variants compute with ``avg`` reduction, so their losses
    must agree with it."""

    name = "reference"

    def global_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One update on every rank's batch; returns the mean of the per-batch losses."""
        total = torch.zeros((), device=self.device)
        for x, y in batches:
            loss = self._forward_loss(x, y) / len(batches)
            loss.backward()
            total += loss.detach()
        self.opt.step()
        self.opt.zero_grad()
        return total


class TorchFSDP(_ModuleVariant):
    """``fully_shard`` on every block and on the root (``torch.distributed.fsdp`` or ``fsdpfn.compat``)."""

    name = "torch"
    sharded = True

    def __init__(self, *a: Any):
        super().__init__(*a)
        if self.compiled:  # torchtitan's recipe: compile every block, then shard it
            for block in self.model.blocks:  # type: ignore[union-attr]
                block.compile(backend=self.backend)
        fully_shard, mp_cls = self._api()
        mp = mp_cls(param_dtype=self.dtype, reduce_dtype=torch.float32) if self.dtype != torch.float32 else mp_cls()
        for i, block in enumerate(self.model.blocks):  # type: ignore[union-attr,arg-type]
            fully_shard(block, mesh=self.mesh, mp_policy=mp, **self._block_options(i))
        fully_shard(self.model, mesh=self.mesh, mp_policy=mp)
        self._init_opt()

    def _block_options(self, index: int) -> dict[str, Any]:
        """Extra ``fully_shard`` arguments of block ``index``."""
        return {}

    def _api(self) -> tuple[Callable[..., Any], type]:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        return fully_shard, MixedPrecisionPolicy

    def record(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[Coll]]:
        with _record_dist() as log:
            loss = self.step(x, y)
        return loss, log


class Compat(TorchFSDP):
    """``fsdpfn.compat.fully_shard``: the FSDP2-compatible shell over fsdpfn's core."""

    name = "compat"

    def __init__(self, *a: Any):
        super().__init__(*a)
        if Functional.min_bucket_bytes:  # fsdpfn's extension: fuse blocks as the functional variant does
            self.model.set_min_bucket_bytes(Functional.min_bucket_bytes)  # type: ignore[operator]

    def _api(self) -> tuple[Callable[..., Any], type]:
        from fsdpfn.compat import MixedPrecisionPolicy, fully_shard  # type: ignore[import-not-found]

        return fully_shard, MixedPrecisionPolicy

    def _root_plan(self) -> Any:
        from fsdpfn.compat.state import state_of  # type: ignore[import-not-found]

        root = state_of(self.model).root
        if root is None:
            raise RuntimeError("compat: record() before the first forward (no root yet)")
        return root.plan

    def record(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[Coll]]:
        """fsdpfn's core logs its own collectives (they need not be torch.distributed collectives)."""
        return _record_core(self._root_plan(), lambda: self.step(x, y))

    def replay(self, log: list[Coll]) -> None:
        _replay_core(self._root_plan().comm, log, self.device)


class Functional(Variant):
    """``fsdpfn.shard`` (one unit per block) + ``fsdp`` + ``value_and_grad`` + ``fsdpfn.optim.adamw``."""

    name = "functional"
    sharded = True
    traced = False  # the whole step in one graph (fsdpfn.compile_step)
    collectives = "native"  # how the traced step writes its collectives (compile_step's collectives=)
    min_bucket_bytes: int | None = None  # fuse consecutive blocks (bench/step.py --min-bucket-bytes)
    reshard_after_forward: Any = True  # fsdp's

    def __init__(self, *a: Any):
        super().__init__(*a)
        mp = fsdpfn.MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32) if self.dtype != torch.float32 else None
        units = [f"blocks.{i}" for i in range(len(self.model.blocks))]  # type: ignore[arg-type]
        if self.compiled and not self.traced:
            for block in self.model.blocks:  # type: ignore[union-attr]
                block.compile(backend=self.backend)
        self.params = fsdpfn.shard(self.model, self.mesh, units=units, mp_policy=mp, min_bucket_bytes=self.min_bucket_bytes)
        # shard() leaves a real module untouched; move it to meta so the full weights are not kept
        # alive next to the shards (apply swaps the gathered tensors in for every call anyway).
        self.model.to("meta")
        apply = fsdpfn.fsdp(self.model, reshard_after_forward=self.reshard_after_forward)
        spec = self.spec
        self.value_and_grad = fsdpfn.value_and_grad(lambda p, x, y: loss_fn(spec, apply(p, x), y))
        self.opt = fsdpfn.optim.adamw(**ADAMW)
        self.state = self.opt.init(self.params)
        if self.traced:
            self.compiled_step = fsdpfn.compile_step(lambda p, x, y: loss_fn(spec, apply(p, x), y), self.opt, backend=self.backend, options=self.compile_options, collectives=self.collectives)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.traced:
            loss, self.params, self.state = self.compiled_step(self.params, self.state, x, y)
            return loss
        loss, grads = self.value_and_grad(self.params, x, y)
        t0 = time.thread_time()
        self.params, self.state = self.opt.update(grads, self.state, self.params)
        self.opt_cpu_s = time.thread_time() - t0
        return loss

    def resident(self) -> list[torch.Tensor]:
        leaves = [*self.params.values(), *tree_leaves(self.state)]
        return [t for t in leaves if isinstance(t, torch.Tensor)]

    def record(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[Coll]]:
        if self.traced:  # the collectives are in the graph, not issued by the core: the schedule's
            return self.step(x, y), _schedule_log(self.params.plan)
        return _record_core(self.params.plan, lambda: self.step(x, y))

    def replay(self, log: list[Coll]) -> None:
        _replay_core(self.params.plan.comm, log, self.device)


class TorchCompiled(TorchFSDP):
    """``torch``, every block compiled first (``block.compile()``, then ``fully_shard``)."""

    name = "torch_compiled"
    compiled = True


class CompatCompiled(Compat):
    """``compat``, every block compiled first."""

    name = "compat_compiled"
    compiled = True


def _kept_rule(v: Variant, x: torch.Tensor, y: torch.Tensor, mp_policy: Any, min_bucket_bytes: Any) -> Any:
    """``fsdpfn.memory.keep_gathered``'s rule for ``v``'s blocks on the batch ``(x, y)``."""
    spec = v.spec
    return fsdpfn.memory.keep_gathered(
        v.model, v.mesh.size(), x, units=[f"blocks.{i}" for i in range(len(v.model.blocks))],  # type: ignore[arg-type]
        mp_policy=mp_policy, min_bucket_bytes=min_bucket_bytes, loss_fn=lambda out: loss_fn(spec, out, y),
    )


class CompatKept(Compat):
    """``compat`` with ``fully_shard(block, reshard_after_forward=rule(name))`` for the rule
    ``fsdpfn.memory.keep_gathered`` chooses (planned for the functional layer, from rank 0's first batch)."""

    name = "compat_kept"

    def _block_options(self, index: int) -> dict[str, Any]:
        if index == 0:  # before any block is sharded: the planner reads the plain module
            x, y = make_batches(self.spec, 0, 1, [0], self.device)[0][0]
            mp = fsdpfn.MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32) if self.dtype != torch.float32 else None
            self.rule = _kept_rule(self, x, y, mp, None)
        return {"reshard_after_forward": self.rule(f"blocks.{index}")}


class FunctionalKept(Functional):
    """``functional`` with ``fsdp(reshard_after_forward=fsdpfn.memory.keep_gathered(...))``: the last blocks
    that fit under the planner's resharding peak stay gathered from forward to backward (chosen on the
    first step, from its batch and loss)."""

    name = "functional_kept"
    rule: Any = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.rule is None:
            spec, plan = self.spec, self.params.plan
            self.rule = _kept_rule(self, x, y, plan.mp_policy, plan.bucket_bytes)
            apply = fsdpfn.fsdp(self.model, reshard_after_forward=self.rule)
            self.value_and_grad = fsdpfn.value_and_grad(lambda p, x, y: loss_fn(spec, apply(p, x), y))
        return super().step(x, y)


def _fusion(base: nn.Module, spec: ModelSpec, mesh: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """``fsdpfn.memory.fuse_within``'s choice for the blocks of ``base`` on rank 0's first batch (a meta
    copy of the model: the planner reads shapes only)."""
    x, y = make_batches(spec, 0, 1, [0], device)[0][0]
    mp = fsdpfn.MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else None
    meta, units = copy.deepcopy(base).to("meta"), [f"blocks.{i}" for i in range(len(base.blocks))]  # type: ignore[arg-type]
    # memory traded for speed: up to torch's peak with foreach AdamW (sqrt(v) of every trainable shard)
    return fsdpfn.memory.fuse_within(meta, mesh.size(), x, units=units, mp_policy=mp, torch_foreach=True,  # type: ignore[union-attr]
                                     loss_fn=lambda out: loss_fn(spec, out, y.to(out.device)), device=device)


class FunctionalResharded(Functional):
    """``functional`` with every group resharded after forward (``reshard_after_forward=lambda unit: True``:
    a predicate, so the first call plans the same groups but keeps none gathered): what ``functional``
    did before the planner kept its last groups."""

    name = "functional_resharded"
    reshard_after_forward = staticmethod(lambda unit: True)


class FunctionalFused(Functional):
    """``functional`` with ``shard(min_bucket_bytes=fsdpfn.memory.fuse_within(..., budget=B).min_bucket_bytes)``,
    ``B`` torch's peak with foreach AdamW: the speed of fusion where that much memory may be spent."""

    name = "functional_fused"

    def __init__(self, base: nn.Module, spec: ModelSpec, mesh: Any, device: torch.device, dtype: torch.dtype):
        self.choice = _fusion(base, spec, mesh, device, dtype)
        self.min_bucket_bytes = self.choice.min_bucket_bytes
        super().__init__(base, spec, mesh, device, dtype)


class CompatFused(Compat):
    """``compat`` with the root's ``set_min_bucket_bytes`` given ``fuse_within``'s choice (as ``functional_fused``)."""

    name = "compat_fused"

    def __init__(self, base: nn.Module, spec: ModelSpec, mesh: Any, device: torch.device, dtype: torch.dtype):
        self.choice = _fusion(base, spec, mesh, device, dtype)
        super().__init__(base, spec, mesh, device, dtype)
        self.model.set_min_bucket_bytes(self.choice.min_bucket_bytes)  # type: ignore[operator]


class FunctionalCompiled(Functional):
    """``functional``, every block compiled (graphs break at the units, the machinery runs eagerly)."""

    name = "functional_compiled"
    compiled = True


class FunctionalTraced(Functional):
    """``fsdpfn.compile_step``: the whole step (gathers and reduce-scatters included) in compiled graphs."""

    name = "functional_traced"
    compiled = True
    traced = True


class FunctionalTracedAllToAll(FunctionalTraced):
    """``fsdpfn.compile_step(..., collectives="all_to_all")``: gloo's faster all-to-all for every collective."""

    name = "functional_traced_a2a"
    collectives = "all_to_all"


def _schedule_log(plan: Any) -> list[Coll]:
    """The collectives of one traced step, from the schedule: each group's gathers (again in backward
    where it reshards) and its reduce-scatters."""
    from fsdpfn.layout.schedule import build_schedule

    schedule = build_schedule(plan)
    world = plan.comm.world
    if world == 1:
        return []
    log = []
    for group in plan.groups:
        n = 2 if schedule.reshards(group.name) else 1
        log += [Coll("all_gather", lay.nbytes, lay.nbytes * world, torch.uint8) for lay in group.gather] * n
        log += [Coll("reduce_scatter", lay.numel * world, lay.numel, lay.dtype) for lay in group.reduce]
    return log


def _record_core(plan: Any, step: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[Coll]]:
    """A real step with fsdpfn's ``comm.stats.recording`` on; the log becomes ``Coll`` records."""
    stats = plan.comm.stats
    stats.reset()
    stats.recording = True
    try:
        loss = step()
    finally:
        stats.recording = False
    world = plan.comm.world
    log = []
    for kind, label, nbytes in stats.log:
        if kind == "all_gathers":
            log.append(Coll("all_gather", nbytes // world, nbytes, torch.uint8))
        elif kind == "reduce_scatters":
            dtype = _reduce_dtype(plan, label, nbytes, world)
            n = nbytes // dtype.itemsize
            log.append(Coll("reduce_scatter", n, n // world, dtype))
        else:
            raise RuntimeError(f"fsdpfn step issued an unexpected collective {kind!r} ({label})")
    stats.log.clear()
    return loss, log


def _replay_core(comm: Any, log: list[Coll], device: torch.device) -> None:
    """Replay through fsdpfn's own core, fresh buffers per collective, ``WINDOW`` in flight."""
    pending: deque[Any] = deque()
    for c in log:
        buf = torch.empty(c.in_numel, dtype=c.dtype, device=device)
        if c.kind == "all_gather":
            pending.append(comm.all_gather(buf))
        else:
            pending.append(comm.reduce_scatter(buf.view(comm.world, -1)))
        if len(pending) > WINDOW:
            pending.popleft().wait()
    while pending:
        pending.popleft().wait()


def _reduce_dtype(plan: Any, label: str, nbytes: int, world: int) -> torch.dtype:
    """The reduce dtype of the bucket of unit ``label`` whose full size is ``nbytes``."""
    for unit in plan.units:
        if unit.label == label or unit.name == label:
            for lay in unit.reduce:
                if world * lay.numel * lay.dtype.itemsize == nbytes:
                    return lay.dtype
    return torch.float32


@contextlib.contextmanager
def _record_dist() -> Iterator[list[Coll]]:
    """Log every ``all_gather_single``/``reduce_scatter_single`` (and their ``*_tensor`` names) issued
    through ``torch.distributed`` or through fsdpfn's core (which imports them under its own names)
    while the context is open."""
    log: list[Coll] = []
    patched: list[tuple[Any, str, Any]] = []

    def wrap(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*args: Any, **kwargs: Any) -> Any:
            out = args[0] if len(args) > 0 else kwargs.get("output_tensor", kwargs.get("output"))
            inp = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
            gpos = 2 if kind == "all_gather" else 3  # (out, in, group) / (out, in, op, group)
            group = args[gpos] if len(args) > gpos else kwargs.get("group")
            log.append(Coll(kind, inp.numel(), out.numel(), inp.dtype, group))
            return fn(*args, **kwargs)

        return inner

    kinds: dict[Any, str] = {}
    for attr, kind in (("all_gather_single", "all_gather"), ("all_gather_into_tensor", "all_gather"),
                       ("reduce_scatter_single", "reduce_scatter"), ("reduce_scatter_tensor", "reduce_scatter")):
        fn = getattr(dist, attr, None)
        if fn is not None:
            kinds[fn] = kind
            patched.append((dist, attr, fn))
    # fsdpfn's core binds the torch functions to its own names at import: patch those aliases too.
    for mod in [m for name, m in list(sys.modules.items()) if name.startswith("fsdpfn.core") and m is not None]:
        for attr, fn in list(vars(mod).items()):
            if callable(fn) and fn in kinds:
                patched.append((mod, attr, fn))
    for mod, attr, fn in patched:
        setattr(mod, attr, wrap(kinds[fn], fn))
    try:
        yield log
    finally:
        for mod, attr, fn in reversed(patched):
            setattr(mod, attr, fn)


def _replay_dist(log: list[Coll], device: torch.device) -> None:
    """Issue ``log`` with ``torch.distributed`` directly: fresh buffers per collective, ``WINDOW`` in flight."""
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    pending: deque[Any] = deque()
    for c in log:
        # Buffers are allocated per collective, as the real step (and fsdpfn's Comm) does: allocating
        # the whole step's buffers up front first-touches hundreds of MiB and doubled the time here.
        inp = torch.empty(c.in_numel, dtype=c.dtype, device=device)
        out = torch.empty(c.out_numel, dtype=c.dtype, device=device)
        if c.kind == "all_gather":
            work = ag(out, inp, group=c.group, async_op=True)
        else:
            work = rs(out, inp, op=dist.ReduceOp.SUM, group=c.group, async_op=True)
        pending.append((work, inp, out))  # the buffers live until the work is waited for
        if len(pending) > WINDOW:
            w = pending.popleft()[0]
            if w is not None:
                w.wait()
    while pending:
        w = pending.popleft()[0]
        if w is not None:
            w.wait()


def build_variant(name: str, base: nn.Module, spec: ModelSpec, mesh: Any, device: torch.device, dtype: torch.dtype) -> Variant:
    """Instantiate the variant called ``name`` on a deep copy of ``base``."""
    cls = {
        "torch": TorchFSDP, "functional": Functional, "local": Local, "compat": Compat, "reference": Reference,
        "functional_kept": FunctionalKept, "compat_kept": CompatKept, "functional_fused": FunctionalFused, "compat_fused": CompatFused, "functional_resharded": FunctionalResharded,
        "torch_compiled": TorchCompiled, "compat_compiled": CompatCompiled,
        "functional_compiled": FunctionalCompiled, "functional_traced": FunctionalTraced,
        "functional_traced_a2a": FunctionalTracedAllToAll,
    }[name]  # fmt: skip
    return cls(base, spec, mesh, device, dtype)
