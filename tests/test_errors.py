"""Every row of docs/errors.md has a test: rows marked `errors:<id>` are triggered here (all in one spmd
call, each error caught inside the worker, so the pool is not restarted); the others name a test."""

import pathlib
import re
from typing import NamedTuple

import torch
from torch import nn

import fsdpfn
from fsdpfn.testing import spmd

ROOT = pathlib.Path(__file__).resolve().parents[1]


class _TwoLayer(nn.Module):
    def __init__(self, out=2):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(3, 4), nn.Linear(4, out)])

    def forward(self, x):
        return self.blocks[1](torch.tanh(self.blocks[0](x)))


def _setup():
    model = _TwoLayer()
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["blocks.1"], donate=False)
    return model, params, fsdpfn.fsdp(model)


def _inference_shards(model):
    """``fsdpfn.shard`` called under ``torch.inference_mode()``: its leaves are inference tensors."""
    with torch.inference_mode():
        params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["blocks.1"], donate=False)
    apply = fsdpfn.fsdp(model)
    return fsdpfn.value_and_grad(lambda t: apply(t, torch.ones(2, 3)).sum())(params)


def _meta_module():
    with torch.device("meta"):
        m = nn.Module()
        m.w = nn.Parameter(torch.empty(2, 2))
    return m


class _ForgetfulGain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.gain = nn.Parameter(torch.ones(2))
        self.register_buffer("mask", torch.ones(2, 2, dtype=torch.bool).tril())

    def reset_parameters(self):
        pass  # forgets gain and mask: to_empty left arbitrary memory in both


def _meta_forgetful():
    with torch.device("meta"):
        return nn.Sequential(_ForgetfulGain())


def _changed(model):
    model.blocks[1] = nn.Linear(4, 3)
    return model


class _Tied(nn.Module):
    def __init__(self, tied):
        super().__init__()
        self.embed, self.head = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)))


def _tie_changed(tied_before):
    """Tie (or untie) ``head.weight`` after ``shard``, then run a step."""
    model = _Tied(tied_before)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["head"])
    if tied_before:
        model.head.weight = nn.Parameter(torch.empty(3, 3, device="meta"))
    else:
        model.head.weight = model.embed.weight
    fsdpfn.fsdp(model)(params, torch.ones(1, 3))


def _shared_after_donation():
    """A submodule shared by two models, the first sharded (donating its weights), then the second."""
    first = _TwoLayer()
    second = nn.Sequential()
    second.blocks = first.blocks
    fsdpfn.shard(first, fsdpfn.init_mesh())
    return fsdpfn.shard(second, fsdpfn.init_mesh())


def _donated():
    model = _TwoLayer()
    fsdpfn.shard(model, fsdpfn.init_mesh())
    return model


def _cuda_mesh():
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cuda", list(range(torch.distributed.get_world_size())), _init_backend=False)


class _Bypass(nn.Module):
    """Calls ``body.0`` (a child of unit ``body``) directly: ``body``'s forward, which gathers it, never runs."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4))

    def forward(self, x):
        return self.body[0](x)


def _bypass(donate):
    model = _Bypass()
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["body"], donate=donate)
    return fsdpfn.fsdp(model)(params, torch.ones(1, 3))  # with donate=False it once ran on the module's own weights


class _TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.body = nn.Embedding(5, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.body(self.embed(x)) @ self.embed.weight.t()  # 'embed' is a unit: not gathered here


def _weight_elsewhere():
    """A unit's weight used by the root's forward: torch's CPU matmul took the donated meta tensor and
    returned uninitialised memory (gradients of 1e29, no error)."""
    model = _TiedHead()
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["embed"])
    fsdpfn.fsdp(model)(params, torch.tensor([[1, 2]]))


def _nested(model, params, apply):
    class Inner(nn.Module):
        def forward(self, x):
            return apply(params, x)

    outer = nn.Sequential(Inner())
    hook = model.blocks[0].register_forward_hook(lambda m, a, o: outer(torch.ones(1, 3)) and None)
    try:
        apply(params, torch.ones(1, 3))
    finally:
        hook.remove()


def _grads(model, params, apply, **kw):
    return fsdpfn.value_and_grad(lambda p: apply(p, torch.ones(2, 3)).sum(), **kw)(params)[1]


class _Embeds(nn.Module):
    """An embedding (root unit) before a Linear unit: ``sparse`` gradients, or ``max_norm``'s in-place renorm."""

    def __init__(self, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.body = nn.Embedding(10, 4, **kw), nn.Linear(4, 2)

    def forward(self, ids):
        return self.body(self.emb(ids)).sum()


def _embeds_functional(**kw):
    model = _Embeds(**kw)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["body"])
    apply = fsdpfn.fsdp(model)
    return fsdpfn.value_and_grad(lambda p: apply(p, torch.arange(6).view(2, 3)))(params)


def _embeds_compat(**kw):
    from fsdpfn.compat import fully_shard

    model = _Embeds(**kw)
    fully_shard(model.body)
    fully_shard(model)
    model(torch.arange(6).view(2, 3)).backward()


def _embeds_no_grad(layer):
    """An evaluation under ``torch.no_grad()`` (autograd sees no change) of ``_Embeds(max_norm=0.5)``."""
    model = _Embeds(max_norm=0.5)
    ids = torch.arange(6).view(2, 3)
    if layer == "compat":
        from fsdpfn.compat import fully_shard

        fully_shard(model.body)
        fully_shard(model)
        with torch.no_grad():
            return model(ids)
    apply = fsdpfn.fsdp(model)
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["emb", "body"] if layer == "remat" else ["body"])
    if layer == "remat":  # torch.func.grad runs resharded units through remat, under no_grad in forward
        return torch.func.grad(lambda p: apply(p, ids))(params)
    with torch.no_grad():
        return apply(params, ids)


# id -> (trigger(model, params, apply), exception type, message regex)
TRIGGERS = {
    "spec-dim": (lambda m, p, a: fsdpfn.ShardSpec((3, 4), 2, dim=2), ValueError, r"dim=2 is out of range for shape \(3, 4\)"),
    "spec-world": (lambda m, p, a: fsdpfn.ShardSpec((3,), 0), ValueError, r"world must be an int >= 1"),
    "spec-shape": (lambda m, p, a: fsdpfn.ShardSpec((-1, 2), 2), ValueError, r"negative size"),
    "spec-rank": (lambda m, p, a: fsdpfn.ShardSpec((4,), 2).bounds(2), ValueError, r"rank 2 is not in \[0, 2\)"),
    "shard-tensor-shape": (lambda m, p, a: fsdpfn.shard_tensor(torch.zeros(5), fsdpfn.ShardSpec((4,), 2), 0), ValueError, r"does not match spec shape"),
    "unshard-tensors-count": (lambda m, p, a: fsdpfn.unshard_tensors([torch.zeros(2)], fsdpfn.ShardSpec((4,), 2)), ValueError, r"got 1 shards"),
    "mesh-type": (lambda m, p, a: fsdpfn.shard(m, "cpu"), TypeError, r"expected a torch.distributed.device_mesh.DeviceMesh"),
    "mesh-shape": (lambda m, p, a: fsdpfn.init_mesh((3,)), ValueError, r"covers 3 ranks but the world has 2"),
    "mesh-device": (lambda m, p, a: fsdpfn.init_mesh(device="xla"), ValueError, r"device 'xla' is not supported"),
    "mesh-no-gpu": (lambda m, p, a: fsdpfn.init_mesh(device="cuda"), ValueError, r"no GPU is visible"),
    "param-device": (lambda m, p, a: fsdpfn.shard(m, _cuda_mesh(), donate=False), ValueError, r"parameter 'blocks.0.weight' is on cpu but the mesh is on cuda; move the module"),
    "shard-module": (lambda m, p, a: fsdpfn.shard(torch.zeros(2), fsdpfn.init_mesh()), TypeError, r"expected an nn.Module"),
    "units-missing": (lambda m, p, a: fsdpfn.shard(m, fsdpfn.init_mesh(), units=["block.1"], donate=False), ValueError, r"no submodule 'block.1'; did you mean 'blocks.1'"),
    "grad-unreduced-direct": (
        lambda m, p, a: fsdpfn.value_and_grad(lambda q, x: a(q, x).sum() + sum(q[k].pow(2).sum() for k in q.keys()), reduce=False)(p, torch.ones(1, 3)),
        ValueError,
        r"value_and_grad\(reduce=False\): fn's value depends on the shards of 'blocks.0.weight', 'blocks.0.bias', 'blocks.1.weight', 'blocks.1.bias' directly.*would be lost. Add that term's gradient after fsdpfn.reduce",
    ),
    "grad-reduce-op": (lambda m, p, a: fsdpfn.value_and_grad(lambda q: q, reduce_op="mean"), ValueError, r"value_and_grad: reduce_op='mean' is not a reduction fsdpfn knows; use 'avg', 'sum' or None"),
    "donated-called-directly": (lambda m, p, a: _donated()(torch.ones(1, 3)), RuntimeError, r"_TwoLayer was called directly, but its parameters were donated to fsdpfn.shard .*run it through apply = fsdpfn.fsdp\(model\)"),
    "units-tensor": (lambda m, p, a: fsdpfn.shard(m, fsdpfn.init_mesh(), units=["blocks.1.weight"], donate=False), ValueError, r"units: 'blocks.1.weight' is a tensor of _TwoLayer, not a submodule: a unit is a module .*name the module that owns it, 'blocks.1'"),
    "units-twice": (lambda m, p, a: fsdpfn.shard(m, fsdpfn.init_mesh(), units=["blocks.0", "blocks.0"], donate=False), ValueError, r"units: 'blocks.0' is named twice"),
    "units-container": (lambda m, p, a: fsdpfn.shard(m, fsdpfn.init_mesh(), units=["blocks"], donate=False), ValueError, r"units: 'blocks' is an nn.ModuleList, a container without a forward of its own: it is never called, so its parameters \('blocks.0.weight' ...\) would never be gathered; make each module in it a unit \('blocks.0', 'blocks.1', ...; or pass their type\) or name their parent"),
    "units-parameter-container": (lambda m, p, a: fsdpfn.shard(nn.Sequential(nn.ParameterList([nn.Parameter(torch.ones(2))])), fsdpfn.init_mesh(), units=["0"], donate=False), ValueError, r"units: '0' is an nn.ParameterList, .*name the module whose forward uses them \(their parent\), or leave them to the root"),
    "donated-state-dict": (lambda m, p, a: _donated().state_dict(), RuntimeError, r"state_dict: the parameters of _TwoLayer were donated to fsdpfn.shard: its state_dict would hold meta tensors, not the trained values. Save the Sharded tree instead: fsdpfn.save\(path, params\)"),
    "donated-load-state-dict": (lambda m, p, a: _donated().blocks[1].load_state_dict(nn.Linear(4, 2).state_dict()), RuntimeError, r"load_state_dict: the parameters of Linear were donated to fsdpfn.shard: values loaded into it would never reach the Sharded tree. Load into the tree: params = fsdpfn.load\(path, params\)"),
    "shard-donated": (lambda m, p, a: fsdpfn.shard(_donated(), fsdpfn.init_mesh()), ValueError, r"parameters were donated to an earlier shard\(\) call"),
    "shard-donated-shared": (lambda m, p, a: _shared_after_donation(), ValueError, r"shard: parameter\(s\) 'blocks.0.weight', 'blocks.0.bias', 'blocks.1.weight', 'blocks.1.bias' of Sequential were donated to an earlier fsdpfn.shard of a _TwoLayer that shares them.*Shard one module holding both models"),
    "units-type": (lambda m, p, a: fsdpfn.shard(m, fsdpfn.init_mesh(), units=3, donate=False), TypeError, r"units must be a list of submodule names"),
    "meta-no-reset": (lambda m, p, a: fsdpfn.shard(_meta_module(), fsdpfn.init_mesh()), ValueError, r"has no reset_parameters\(\); pass init="),
    "sharded-pickle": (
        lambda m, p, a: torch.save(p, __import__("io").BytesIO()),
        TypeError,
        r"a Sharded cannot be pickled \(torch.save included\): its plan holds the process groups of its mesh. Save it with fsdpfn.save\(path, params\)",
    ),
    "shard-ignored-names": (
        lambda m, p, a: fsdpfn.shard(m, fsdpfn.init_mesh(), ignored_params=["blocks.0.weight"], donate=False),
        TypeError,
        r"shard: ignored_params holds a str \('blocks.0.weight'\), not a parameter: it would leave nothing out",
    ),
    "meta-init-unwritten": (
        lambda m, p, a: fsdpfn.shard(_meta_forgetful(), fsdpfn.init_mesh()),
        ValueError,
        r"shard: module '0' was built on the meta device and _ForgetfulGain.reset_parameters\(\) left parameter 'gain', buffer 'mask' uninitialised .* Initialise every direct parameter and buffer",
    ),
    "min-bucket-bytes": (lambda m, p, a: fsdpfn.shard(m, fsdpfn.init_mesh(), units=["blocks.0"], min_bucket_bytes="1MB", donate=False), ValueError, r"min_bucket_bytes must be an int >= 0 \(bytes\), 'auto' or None, got '1MB'"),
    "offload": (lambda m, p, a: fsdpfn.shard(m, fsdpfn.init_mesh(), offload_policy=fsdpfn.CPUOffloadPolicy(), donate=False), NotImplementedError, r"CPUOffloadPolicy is not supported"),
    "mp-type": (lambda m, p, a: fsdpfn.shard(m, fsdpfn.init_mesh(), mp_policy="bf16", donate=False), TypeError, r"shard: mp_policy must be a MixedPrecisionPolicy \(fsdpfn's or torch.distributed.fsdp's\), got str; e.g. fsdpfn.MixedPrecisionPolicy\(param_dtype=torch.bfloat16\)"),
    "shard-donate": (lambda m, p, a: fsdpfn.shard(m, fsdpfn.init_mesh(), donate="no"), TypeError, r"shard: donate must be True or False, got 'no'"),
    "mp-dtype": (lambda m, p, a: fsdpfn.MixedPrecisionPolicy(param_dtype=torch.int32), TypeError, r"param_dtype=torch.int32 is not a floating-point torch.dtype"),
    "sharded-missing": (lambda m, p, a: fsdpfn.Sharded({}, p.plan), KeyError, r"missing \["),
    "sharded-extra": (lambda m, p, a: fsdpfn.Sharded({**dict(p.items()), "x": 1}, p.plan), KeyError, r"not in the plan \['x'\]"),
    "leaf-shape": (lambda m, p, a: a(p.replace({"blocks.0.weight": torch.zeros(1, 1)}), torch.ones(1, 3)), ValueError, r"leaf 'blocks.0.weight' is \(1, 1\).*does not belong to this plan"),
    "leaf-dtype": (lambda m, p, a: a(p.replace({"blocks.0.bias": p["blocks.0.bias"].long()}), torch.ones(1, 3)), ValueError, r"leaf 'blocks.0.bias' is \(2,\) torch.int64"),
    "leaf-type": (lambda m, p, a: a(p.replace({"blocks.0.bias": 3}), torch.ones(1, 3)), TypeError, r"leaf 'blocks.0.bias' is int"),
    "apply-not-sharded": (lambda m, p, a: a(dict(p.items()), torch.ones(1, 3)), TypeError, r"first argument must be the fsdpfn.Sharded"),
    "apply-other-module": (lambda m, p, a: a(fsdpfn.shard(_TwoLayer(out=5), fsdpfn.init_mesh()), torch.ones(1, 3)), ValueError, r"leaf 'blocks.1.weight' was sharded as \(5, 4\)"),
    "apply-stale-dtype": (lambda m, p, a: fsdpfn.fsdp(m.double())(p, torch.ones(1, 3, dtype=torch.float64)), ValueError, r"is now \(4, 3\) torch.float64; the plan is stale: call fsdpfn.shard again \(module.to / .double\(\) / .half\(\) after shard: .*mp_policy=MixedPrecisionPolicy\(param_dtype=...\)\), or convert the module back\)"),
    "apply-stale": (lambda m, p, a: fsdpfn.fsdp(_changed(m))(p, torch.ones(1, 3)), ValueError, r"is now \(3, 4\) torch.float32; the plan is stale"),
    "apply-tied-after-shard": (lambda m, p, a: _tie_changed(False), ValueError, r"apply: _Tied ties 'embed.weight' and 'head.weight' \(one parameter\), but params holds 'embed.weight' and 'head.weight' as separate leaves: the tie was made after fsdpfn.shard.*Tie the weights before calling fsdpfn.shard"),
    "apply-module-requires-grad": (lambda m, p, a: (m.blocks[0].requires_grad_(False), a(p, torch.ones(1, 3))), ValueError, r"apply: parameter 'blocks.0.weight' of the module was set requires_grad=False after fsdpfn.shard, but params train it.*params = fsdpfn.freeze\(params, \['blocks.0.weight'\]\)"),
    "freeze-unknown": (lambda m, p, a: fsdpfn.freeze(p, "blocks.7"), ValueError, r"fsdpfn.freeze: 'blocks.7' names no parameter or module of this tree \(_TwoLayer\); modules with parameters include \['blocks.0', 'blocks.1'\]"),
    "apply-untied-after-shard": (lambda m, p, a: _tie_changed(True), ValueError, r"apply: params ties 'head.weight' to 'embed.weight' \(one leaf\), but _Tied now holds them as two parameters: the tie was undone after fsdpfn.shard"),
    "apply-extra-params": (lambda m, p, a: fsdpfn.fsdp(m)(fsdpfn.shard(nn.Sequential(nn.Linear(3, 4)), fsdpfn.init_mesh()), torch.ones(1, 3)), ValueError, r"has leaf '0.weight' but _TwoLayer has no such parameter"),
    "apply-nested": (lambda m, p, a: _nested(m, p, a), RuntimeError, r"called inside another apply of the same parameters"),
    "apply-unit-bypassed": (lambda m, p, a: _bypass(donate=False), RuntimeError, r"apply: parameter 'body.0.weight' of unit 'body' was used outside that unit's forward \(by aten\..*call the unit's module itself, or make the child a unit of its own"),
    "apply-unit-bypassed-donated": (lambda m, p, a: _bypass(donate=True), RuntimeError, r"apply: parameter 'body.0.weight' of unit 'body' was used outside that unit's forward"),
    "apply-unit-weight-elsewhere": (lambda m, p, a: _weight_elsewhere(), RuntimeError, r"apply: parameter 'embed.weight' of unit 'embed' was used outside that unit's forward \(by aten\.t\.default\).*a head computing x @ embed.weight.t\(\) while 'embed' is a unit of its own"),
    "fsdp-prefetch": (lambda m, p, a: fsdpfn.fsdp(m, prefetch=-1), ValueError, r"prefetch must be an int >= 0"),
    "shard-lazy": (lambda m, p, a: fsdpfn.shard(nn.Sequential(nn.LazyLinear(3)), fsdpfn.init_mesh()), ValueError, r"shard: '0.weight' of Sequential is not initialised yet \(a lazy module, such as nn.LazyLinear.*run the model once on a sample batch"),
    "grad-sparse": (lambda m, p, a: _embeds_functional(sparse=True), RuntimeError, r"parameter\(s\) 'emb.weight' got a sparse gradient \(e.g. nn.Embedding\(..., sparse=True\)\).*build the layer with sparse=False"),
    "apply-inplace-param": (lambda m, p, a: _embeds_functional(max_norm=0.5), RuntimeError, r"apply: the forward changed 'emb.weight' in place \(nn.Embedding\(max_norm=...\) renormalises its weight in place.*never reaches the shards"),
    "apply-inplace-no-grad": (lambda m, p, a: _embeds_no_grad("functional"), RuntimeError, r"apply: the forward changed a parameter of unit '<root>' \('emb.weight'\) in place \(nn.Embedding\(max_norm=...\)"),
    "remat-inplace-param": (lambda m, p, a: _embeds_no_grad("remat"), RuntimeError, r"apply: the forward changed a parameter of unit 'emb' \('emb.weight'\) in place"),
    "fsdp-reduce-op": (lambda m, p, a: fsdpfn.fsdp(m, reduce_op="mean"), ValueError, r"reduce_op='mean' is not a reduction"),
    "fsdp-reshard": (lambda m, p, a: fsdpfn.fsdp(m, reshard_after_forward=2), TypeError, r"reshard_after_forward must be a bool or a predicate on unit names"),
    "fsdp-reshard-predicate": (lambda m, p, a: fsdpfn.fsdp(m, reshard_after_forward=lambda u: "yes")(p, torch.ones(1, 3)), TypeError, r"predicate returned 'yes' for unit 'blocks.1'; it must return a bool"),
    "vg-not-sharded": (lambda m, p, a: fsdpfn.value_and_grad(lambda t: t)(dict(p.items())), TypeError, r"the first argument must be a fsdpfn.Sharded"),
    "vg-inference-leaf": (lambda m, p, a: _inference_shards(m), RuntimeError, r"value_and_grad: leaf 'blocks.0.weight' is an inference tensor \(made under torch.inference_mode\(\).*Make the tree outside inference_mode, or copy it there"),
    "vg-non-scalar": (lambda m, p, a: fsdpfn.value_and_grad(lambda t: a(t, torch.ones(2, 3)))(p), TypeError, r"must return a scalar tensor, got a tensor of shape \(2, 2\)"),
    "vg-aux-pair": (lambda m, p, a: fsdpfn.value_and_grad(lambda t: a(t, torch.ones(2, 3)).sum(), has_aux=True)(p), TypeError, r"value_and_grad\(has_aux=True\): fn must return a pair \(value, aux\), got a tensor of shape \(\)"),
    "reduce-unknown": (lambda m, p, a: fsdpfn.reduce({"nope": torch.zeros(1)}, p), KeyError, r"nope\W* is not a parameter of this plan"),
    "reduce-op": (lambda m, p, a: fsdpfn.reduce({}, p, op="mean"), ValueError, r"op='mean' is not a reduction"),
    "reduce-divide-by": (lambda m, p, a: fsdpfn.reduce({}, p, divide_by=-2), ValueError, r"divide_by=-2 must be a positive number"),
    "reduce-reduced": (lambda m, p, a: fsdpfn.reduce(_grads(m, p, a), p), TypeError, r"already reduced"),
    "reduce-grad-shape": (lambda m, p, a: fsdpfn.reduce({"blocks.0.weight": torch.zeros(2, 2)}, p), ValueError, r"gradient of 'blocks.0.weight' has shape \(2, 2\), expected \(4, 3\)"),
    "unshard-unit": (lambda m, p, a: fsdpfn.unshard(p, units=["blocks.7"]), KeyError, r"no unit \W*blocks.7"),
    "reshard-missing": (lambda m, p, a: fsdpfn.reshard({}, p), KeyError, r"no full tensor for parameter"),
    "accumulate-mixed": (lambda m, p, a: fsdpfn.accumulate(_grads(m, p, a, reduce=False), _grads(m, p, a)), TypeError, r"grads is already reduced"),
    "optim-unreduced": (lambda m, p, a: fsdpfn.optim.sgd(lr=0.1).update(_grads(m, p, a, reduce=False), fsdpfn.optim.sgd(lr=0.1).init(p), p), TypeError, r"grads are Unreduced"),
    "optim-other-plan": (lambda m, p, a: fsdpfn.optim.sgd(lr=0.1).update(_grads(m, fsdpfn.shard(m, fsdpfn.init_mesh(), donate=False), a), fsdpfn.optim.sgd(lr=0.1).init(p), p), ValueError, r"grads were built for another plan"),
    "optim-hyper": (lambda m, p, a: fsdpfn.optim.sgd(lr=0.1, nesterov=True), ValueError, r"nesterov=True requires momentum > 0"),
    "clip-not-sharded": (lambda m, p, a: fsdpfn.clip_grad_norm({}, 1.0), TypeError, r"grads must be a fsdpfn.Sharded"),
    "loss-scale-args": (lambda m, p, a: fsdpfn.optim.loss_scale(backoff_factor=1.5), ValueError, r"loss_scale: invalid backoff_factor=1.5; it must be in \(0, 1\)"),
    "loss-scale-interval": (lambda m, p, a: fsdpfn.optim.loss_scale(growth_interval=0), ValueError, r"loss_scale: invalid growth_interval=0; it must be an int >= 1"),
    "loss-scale-grads": (lambda m, p, a: fsdpfn.optim.loss_scale().unscale(dict(p.items()), fsdpfn.optim.loss_scale().init()), TypeError, r"loss_scale.unscale: grads must be the fsdpfn.Sharded gradients value_and_grad returns, got dict"),
    "loss-scale-state": (lambda m, p, a: fsdpfn.optim.loss_scale().scale(torch.ones(()), 1024.0), TypeError, r"loss_scale: state must be the LossScaleState init\(\) made, got float"),
    "clip-max-norm": (lambda m, p, a: fsdpfn.clip_grad_norm(p, -1.0), ValueError, r"max_norm=-1.0 must be >= 0"),
}


# --- fsdpfn.compat ------------------------------------------------------------------------------------
def _compat_model(**kw):
    from fsdpfn.compat import fully_shard

    model = _TwoLayer()
    fully_shard(model.blocks[1], mesh=fsdpfn.init_mesh(), **kw)
    fully_shard(model, mesh=fsdpfn.init_mesh(), **kw)
    return model


def _compat_twice():
    from fsdpfn.compat import fully_shard

    model = _compat_model()
    fully_shard(model.blocks[1])


def _compat_child_first():
    model = _compat_model()
    model.blocks[1](torch.ones(1, 4))
    model(torch.ones(1, 3))


def _compat_two_roots():
    from fsdpfn.compat import fully_shard

    shared = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
    first, second = nn.Sequential(shared, nn.Linear(4, 2)), nn.Sequential(shared, nn.Linear(4, 1))
    for m in (shared, first, second):
        fully_shard(m)
    first(torch.ones(1, 3))
    second(torch.ones(1, 3))


def _compat_load_plain():
    model = _compat_model()
    model.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})


class _OneElement:
    """An AllGather-shaped object whose allocate ignores the size it is asked for."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(1, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return None


def _compat_bad_allocate():
    model = _compat_model()
    model.blocks[1].set_custom_all_gather(_OneElement())
    model(torch.ones(1, 3))


def _compat_pg_alloc_custom():
    model = _compat_model()
    model.set_custom_all_gather(_OneElement())
    model.set_allocate_memory_from_process_group_for_comm(True)


class _ShardPlacementResult(NamedTuple):  # torch 2.11 has none; fsdpfn refuses the type by its name
    placement: object
    mesh_info: object


_ShardPlacementResult.__name__ = "ShardPlacementResult"


def _compat_placement_result():
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    except ImportError:
        ShardPlacementResult = _ShardPlacementResult  # noqa: N806
    from torch.distributed.tensor import Shard

    from fsdpfn.compat import fully_shard

    fully_shard(_TwoLayer(), mesh=fsdpfn.init_mesh(), shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), None))


def _tp_model(tp_mesh, placement):
    from torch.distributed.tensor import DTensor

    model = _TwoLayer()
    w = model.blocks[0].weight.detach()
    model.blocks[0].weight = nn.Parameter(DTensor.from_local(w, tp_mesh, [placement], run_check=False))
    return model


def _compat_tp_other_root():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from fsdpfn.compat import fully_shard

    dp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))["dp"]
    fully_shard(_tp_model(init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), Shard(0)), mesh=dp)


def _shard_tp_meta():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import fsdpfn

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = _TwoLayer()
    w = model.blocks[0].weight.detach()
    model.blocks[0].weight = nn.Parameter(DTensor.from_local(w, mesh["tp"], [Shard(0)], run_check=False))
    fsdpfn.shard(model, mesh["dp"])


def _compat_tp_shared_dims():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from fsdpfn.compat import fully_shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    fully_shard(_tp_model(mesh, Shard(0)), mesh=mesh)


def _compat_spmd_plain():
    from torch.distributed.device_mesh import init_device_mesh

    from fsdpfn.compat import DataParallelMeshDims, fully_shard

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    fully_shard(_TwoLayer(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))


def _compat_tp_placements():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial

    from fsdpfn.compat import fully_shard

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    fully_shard(_tp_model(mesh["tp"], Partial()), mesh=mesh["dp"])


def _compat_subclass():
    from fsdpfn.compat import fully_shard

    class WithHook(torch.Tensor):
        def fsdp_pre_all_gather(self, *args, **kwargs):  # pragma: no cover - never called
            raise AssertionError  # and no fsdp_post_all_gather: half an extension

    model = _TwoLayer()
    model.blocks[0].weight = nn.Parameter(model.blocks[0].weight.detach().as_subclass(WithHook))
    fully_shard(model, mesh=fsdpfn.init_mesh())


def _compat_prefetch_list():
    model = _compat_model()
    model.set_modules_to_forward_prefetch([model.blocks[0]])


def _compat_replaced():
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = _compat_model()
    w = model.blocks[0].weight
    model.blocks[0].weight = nn.Parameter(distribute_tensor(w.full_tensor().detach(), w.device_mesh, [Replicate()]))
    model(torch.ones(1, 3))


def _compat_new_param():
    """A plain parameter registered under a fully_shard root after fully_shard (before the root's first
    forward): LoRA-style, an adapter nobody shards or reduces."""
    model = _compat_model()
    model.blocks[1].lora = nn.Linear(4, 2, bias=False)
    model(torch.ones(1, 3))


def _compat_replaced_module():
    """A submodule swapped for a fresh one after the root's first forward."""
    model = _compat_model()
    model(torch.ones(1, 3))
    model.blocks[0] = nn.Linear(3, 4)
    model(torch.ones(1, 3))


def _compat_optimizer_before():
    """The optimizer made before the root's fully_shard: it holds the root's plain parameters."""
    from fsdpfn.compat import fully_shard

    model = _TwoLayer()
    fully_shard(model.blocks[1], mesh=fsdpfn.init_mesh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fully_shard(model, mesh=fsdpfn.init_mesh())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()


def _compat_step_unreduced():
    """Two microbatches without gradient sync, then the optimizer step (sync never turned back on)."""
    model = _compat_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.set_requires_gradient_sync(False)
    for _ in range(2):
        model(torch.ones(1, 3)).sum().backward()
    try:
        opt.step()
    finally:
        model.zero_grad()  # drops the unreduced gradients: the next trigger's optimizer may step


def _compat_functional_call_plain():
    """torch.func.functional_call on a fully_shard model with plain (full) tensors."""
    model = _compat_model()
    full = {n: torch.ones(p.shape) for n, p in model.named_parameters()}
    torch.func.functional_call(model, full, (torch.ones(1, 3),))


def _compat_sharded_read():
    """The root's forward reads a unit's weight, where it is the shard (a DTensor)."""
    from fsdpfn.compat import fully_shard

    model = _TiedHead()
    fully_shard(model.embed)
    fully_shard(model)
    model(torch.tensor([[1, 2]]))


def _compat_replicate_on_fsdp():
    from fsdpfn.compat import replicate

    replicate(_compat_model())


def _compat_offload_cuda():
    from fsdpfn.compat import CPUOffloadPolicy, fully_shard

    fully_shard(_TwoLayer(), mesh=_cuda_mesh(), offload_policy=CPUOffloadPolicy())


def _compat_other_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    from fsdpfn.compat import fully_shard

    model = _TwoLayer()
    fully_shard(model, mesh=fsdpfn.init_mesh())
    fully_shard(model.blocks[1], mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard")))
    model(torch.ones(1, 3))


def _compat_kind_after_root():
    from fsdpfn.compat import fully_shard, replicate

    model = _TwoLayer()
    fully_shard(model)
    replicate(model.blocks[1])
    model(torch.ones(1, 3))


COMPAT_TRIGGERS = {
    "compat-twice": (lambda m, p, a: _compat_twice(), AssertionError, r"^Each distinct composable distributed API can only be applied to a module once. fully_shard has already been applied to the following module:\nFSDPLinear"),
    "compat-parameter-container": (lambda m, p, a: __import__("fsdpfn.compat").compat.fully_shard(nn.ParameterList([nn.Parameter(torch.ones(2))])), ValueError, r"^fully_shard does not support containers that do not implement forward: ParameterList.*\nan nn.ParameterList is never called, so its parameters would never be gathered: apply fully_shard to the module whose forward uses them"),
    "compat-lazy": (lambda m, p, a: __import__("fsdpfn.compat").compat.fully_shard(nn.Sequential(nn.LazyLinear(3))), ValueError, r"fully_shard: '0.weight' of Sequential is not initialised yet \(a lazy module, such as nn.LazyLinear.*run the model once on a sample batch, then call fully_shard"),
    "compat-not-module": (lambda m, p, a: _compat_model.__globals__["fsdpfn"].compat.fully_shard(3), TypeError, r"^'int' object is not iterable\nfully_shard expects an nn.Module or a list of them"),
    "compat-mesh-type": (lambda m, p, a: __import__("fsdpfn.compat").compat.fully_shard(_TwoLayer(), mesh="cpu"), AttributeError, r"^'str' object has no attribute 'ndim'\nfully_shard: mesh must be a torch.distributed.device_mesh.DeviceMesh"),
    "compat-reshard-int": (lambda m, p, a: _compat_model(reshard_after_forward=3), ValueError, r"^If passing reshard_after_forward as an int, it should be a factor of 2, not 3"),
    "compat-mp-type": (lambda m, p, a: _compat_model(mp_policy="bf16"), TypeError, r"mp_policy must be a MixedPrecisionPolicy"),
    "compat-ignored-names": (
        lambda m, p, a: _compat_model(ignored_params={"blocks.1.bias"}),
        TypeError,
        r"fully_shard: ignored_params holds a str \('blocks.1.bias'\), not a parameter: it would leave nothing out. Pass the parameters themselves, e.g. \{model.get_parameter\('blocks.1.bias'\)\}",
    ),
    "compat-child-first": (lambda m, p, a: _compat_child_first(), RuntimeError, r"^FSDP state has already been lazily initialized for blocks.1\nFSDP requires running forward through the root module first\n'blocks.1' \(FSDPLinear\) ran"),
    "compat-two-roots": (lambda m, p, a: _compat_two_roots(), RuntimeError, r"^FSDP state has already been lazily initialized for 0\n'0' \(FSDPSequential\) is already a unit of another root, FSDPSequential.*a module holding both models as the root"),
    "compat-load-plain": (lambda m, p, a: _compat_load_plain(), ValueError, r"'blocks.0.weight' is a plain Tensor of shape \(4, 3\).*distribute_tensor"),
    "compat-replaced-param": (lambda m, p, a: _compat_replaced(), ValueError, r"parameter 'blocks.0.weight' was replaced by a DTensor"),
    "compat-placement": (lambda m, p, a: _compat_placement_result(), NotImplementedError, r"shard_placement_fn returned a ShardPlacementResult for parameter 'weight' of Linear"),
    "compat-tp-other-root": (lambda m, p, a: _compat_tp_other_root(), ValueError, r"parameter 'weight' of Linear is a DTensor on .*not a sub-mesh of the same device mesh as the data-parallel mesh"),
    "compat-tp-shared-dims": (lambda m, p, a: _compat_tp_shared_dims(), ValueError, r"parameter 'weight' of Linear is already a DTensor on .*shares mesh dims with the data-parallel mesh"),
    "compat-tp-placements": (lambda m, p, a: _compat_tp_placements(), NotImplementedError, r"parameter 'weight' of Linear has tensor-parallel placements \(Partial\(sum\),\)"),
    "shard-tp-meta": (lambda m, p, a: _shard_tp_meta(), NotImplementedError, r"shard: _TwoLayer is on the meta device and has tensor-parallel parameters \('blocks.0.weight'\); materialise it first"),
    "compat-dp-mesh-dims": (lambda m, p, a: _compat_model(dp_mesh_dims=object()), TypeError, r"dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims\(shard=..., replicate=...\) naming dims of the mesh, got object"),
    "compat-spmd-param": (lambda m, p, a: _compat_spmd_plain(), ValueError, r"parameter 'weight' of Linear is a plain Parameter; with dp_mesh_dims every parameter must be a DTensor on the whole mesh"),
    "compat-subclass": (lambda m, p, a: _compat_subclass(), ValueError, r"'weight' of Linear is a WithHook defining only fsdp_pre_all_gather"),
    "compat-offload-cuda": (lambda m, p, a: _compat_offload_cuda(), NotImplementedError, r"CPUOffloadPolicy on a cuda mesh"),
    "compat-kind-after-root": (lambda m, p, a: _compat_kind_after_root(), NotImplementedError, r"replicate on 'blocks.1' was applied after fully_shard on the root FSDP_TwoLayer: apply replicate to the modules inside first"),
    "compat-other-mesh": (lambda m, p, a: _compat_other_mesh(), NotImplementedError, r"module 'blocks.1' was sharded on a different mesh than the root FSDP_TwoLayer, after the root's own fully_shard call: apply fully_shard to the modules inside first"),
    "compat-custom-comm": (lambda m, p, a: _compat_model().set_symm_mem_for_comm(), NotImplementedError, r"set_symm_mem_for_comm: symmetric-memory collectives are not supported"),
    "compat-comm-protocol": (lambda m, p, a: _compat_model().set_custom_all_gather(object()), TypeError, r"set_custom_all_gather: object is not a torch.distributed.fsdp AllGather: it needs an allocate\(size, \*, dtype, device\) method"),
    "compat-comm-allocate": (lambda m, p, a: _compat_bad_allocate(), ValueError, r"set_custom_all_gather: _OneElement.allocate\(\(\d+,\), dtype=torch.float32, device=cpu\) returned \(1,\) torch.float32 on cpu"),
    "compat-hook-callable": (lambda m, p, a: _compat_model().set_all_reduce_hook(3), TypeError, r"set_all_reduce_hook: hook must be callable"),
    "compat-pg-alloc-custom": (lambda m, p, a: _compat_pg_alloc_custom(), AssertionError, r"cannot call set_allocate_memory_from_process_group\(\) when all gather comm is custom: _OneElement"),
    "compat-divide-factor": (lambda m, p, a: _compat_model().set_gradient_divide_factor(0), ValueError, r"factor must be a positive number, got 0"),
    "compat-prefetch-list": (lambda m, p, a: _compat_prefetch_list(), ValueError, r"Expects FSDPModule but got <class 'torch.nn.modules.linear.Linear'>"),
    "compat-post-optim-event": (lambda m, p, a: _compat_model().set_post_optim_event(1), TypeError, r"set_post_optim_event: event must be a torch.Event \(or torch.cuda.Event\) recorded after the optimizer step, got int"),
    "compat-min-bucket-bytes": (lambda m, p, a: _compat_model().set_min_bucket_bytes("1MB"), ValueError, r"set_min_bucket_bytes: min_bucket_bytes must be an int >= 0 \(bytes\), 'auto' or None, got '1MB'"),
    "compat-reset-non-root": (lambda m, p, a: (lambda mm: (mm(torch.ones(1, 3)), mm.blocks[1].reset_iter_state()))(_compat_model()), RuntimeError, r"^reset_iter_state must be called on the root FSDP module\nthe root is FSDP_TwoLayer, not this FSDPLinear"),
    "compat-sparse": (lambda m, p, a: _embeds_compat(sparse=True), RuntimeError, r"parameter\(s\) 'emb.weight' got a sparse gradient"),
    "compat-inplace-param": (lambda m, p, a: _embeds_compat(max_norm=0.5), RuntimeError, r"apply: the forward changed 'emb.weight' in place .*with fully_shard, the DTensor parameters under torch.no_grad\(\)"),
    "compat-inplace-no-grad": (lambda m, p, a: _embeds_no_grad("compat"), RuntimeError, r"apply: the forward changed a parameter of unit '<root>' \('emb.weight'\) in place .*with fully_shard, the DTensor parameters under torch.no_grad\(\)"),
    "compat-unmanaged-param": (lambda m, p, a: _compat_new_param(), ValueError, r"fully_shard: parameter 'blocks.1.lora.weight' of Linear is a plain Parameter, not a parameter fully_shard manages: it was replaced or added after fully_shard.*each rank would train its own copy.*Change the model before calling fully_shard, list the parameter in ignored_params"),
    "compat-replaced-module": (lambda m, p, a: _compat_replaced_module(), ValueError, r"fully_shard: parameter 'blocks.0.weight' of Linear is a plain Parameter, not a parameter fully_shard manages: it was replaced or added after fully_shard"),
    "compat-optimizer-before": (lambda m, p, a: _compat_optimizer_before(), ValueError, r"optimizer step: SGD's param_groups\[0\]\['params'\]\[0\] is parameter 'weight' of Linear as it was before fully_shard replaced it with a sharded DTensor parameter.*the model would not train. Build the optimizer after fully_shard"),
    "compat-step-unreduced": (lambda m, p, a: _compat_step_unreduced(), ValueError, r"optimizer step: SGD holds parameter\(s\) 'blocks.0.weight', .* whose gradients were accumulated with set_requires_gradient_sync\(False\) and are not reduced yet.*Run the last microbatch's backward with set_requires_gradient_sync\(True\)"),
    "compat-functional-call-plain": (lambda m, p, a: _compat_functional_call_plain(), ValueError, r"fully_shard: parameter 'blocks.0.weight' of Linear holds a plain tensor, not the sharded DTensor fully_shard manages \(torch.func.functional_call or a stateless swap with plain tensors\?\). Swap in DTensors laid out like the parameters"),
    "compat-sharded-read": (lambda m, p, a: _compat_sharded_read(), RuntimeError, r"got mixed torch.Tensor and DTensor.*\nUnder fully_shard, a module's parameters are full tensors only while its own fully_shard module runs.*Units not gathered at that point: 'embed'$"),
    "compat-replicate-on-fsdp": (lambda m, p, a: _compat_replicate_on_fsdp(), RuntimeError, r"Cannot apply `replicate\(\)` on a Module already managed by `fully_shard`"),
}
TRIGGERS.update(COMPAT_TRIGGERS)
TRIGGERS["compile-step-optimizer"] = (
    lambda m, p, a: fsdpfn.compile_step(lambda q: q, optimizer=torch.optim.SGD), TypeError,
    r"compile_step: optimizer must be an fsdpfn.optim transformation \(with init/update\), got type",
)  # fmt: skip


def _trigger_all(ids):
    out = {}
    for rid in ids:
        model, params, apply = _setup()
        fn, _, _ = TRIGGERS[rid]
        try:
            fn(model, params, apply)
        except Exception as e:  # noqa: BLE001 - we report what was raised
            out[rid] = (type(e), str(e))
        else:
            out[rid] = (None, "no error")
    return out


def test_every_trigger_raises_its_documented_error():
    results = spmd(2, _trigger_all, list(TRIGGERS))
    wrong = []  # every trigger that raised something else, at once (a torch version can change several)
    for rank, rank_result in enumerate(results):
        for rid, (exc, pattern) in ((r, TRIGGERS[r][1:]) for r in TRIGGERS):
            got, msg = rank_result[rid]
            if got is None or not issubclass(got, exc) or not re.search(pattern, msg):
                wrong.append((rank, rid, got, msg[:300]))
    assert wrong == [], wrong


def _doc_rows():
    rows = []
    for line in (ROOT / "docs" / "errors.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`") and cells[0] != "`id`":
            rows.append((cells[0].strip("`"), cells[4].strip("`")))
    return rows


def test_every_row_of_the_errors_table_has_a_test():
    rows = _doc_rows()
    assert len(rows) >= len(TRIGGERS)
    ids = [r for r, _ in rows]
    assert len(ids) == len(set(ids)), "duplicate ids in docs/errors.md"
    assert set(TRIGGERS) <= set(ids), f"triggers missing from docs/errors.md: {set(TRIGGERS) - set(ids)}"
    for rid, test in rows:
        if test.startswith("errors:"):
            assert test == f"errors:{rid}" and rid in TRIGGERS, (rid, test)
            continue
        path, _, name = test.partition("::")
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {re.escape(name)}\(", source, re.M), f"row {rid}: no test {test}"
