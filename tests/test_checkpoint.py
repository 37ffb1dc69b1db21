"""Checkpoints: DCP save/load across world sizes and HSDP, FSDP2 interop, atomic writes, safe loading,
mismatch reports, DTensor state dicts and streamed full state dicts."""

import os
import pickle
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed import checkpoint as dcp

import fsdpfn
import fsdpfn.optim as optim
from fsdpfn import checkpoint as ck
from fsdpfn.testing import spmd
from fsdpfn.testing import strategies as fst
from fsdpfn.testing.memory import settled_live_bytes
from fsdpfn.testing.models import ParamTree


class TiedLM(nn.Module):
    """Embedding, a stack of equal blocks, a head tied to the embedding, and a buffer."""

    def __init__(self, vocab: int = 7, dim: int = 5, depth: int = 3, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.arange(dim, dtype=torch.float32) + seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) * self.scale
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.head(h)


BLOCKS = [f"blocks.{i}" for i in range(3)]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _train(recipe, units, steps=2):
    model = recipe.build()
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=units, donate=False)
    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    state = opt.init(params)
    apply = fsdpfn.fsdp(model)
    step_fn = fsdpfn.value_and_grad(lambda p, x: apply(p, x).pow(2).mean())
    for i in range(steps):
        _, grads = step_fn(params, recipe.inputs(2, seed=10 * i + _rank()))
        params, state = opt.update(grads, state, params)
    return params, state


def _shards(params, state):
    """This rank's shards of the params and the optimizer state (plain dicts travel back to the test)."""
    return dict(
        params=dict(params.params()),
        exp_avg={k: v for k, v in state.exp_avg.items() if v is not None},
        exp_avg_sq={k: v for k, v in state.exp_avg_sq.items() if v is not None},
        step={k: v for k, v in state.step.items() if v is not None},
        count=state.count,
    )


def _gather(per_rank, specs_like):
    """Full tensors from every rank's shards (pure, in the test process)."""
    full = {}
    for group in ("params", "exp_avg", "exp_avg_sq"):
        for k in per_rank[0][group]:
            spec = fsdpfn.ShardSpec(specs_like[k], len(per_rank))
            full[(group, k)] = fsdpfn.unshard_tensors([r[group][k] for r in per_rank], spec)
    for k, v in per_rank[0]["step"].items():
        assert all(torch.equal(r["step"][k], v) for r in per_rank)
        full[("step", k)] = v
    assert all(type(r["count"]) is int for r in per_rank)  # the update counter is saved and loaded as an int
    full[("count",)] = torch.tensor(per_rank[0]["count"])
    return full


# ---- workers (module level: they run in the spmd pool) ---------------------------------------
def _save_trained(path, recipe, units):
    params, state = _train(recipe, units)
    ck.save(path, {"params": params, "opt": state, "step": 2})
    return _shards(params, state)


def _load_trained(path, recipe, units):
    params = fsdpfn.shard(recipe.build(), fsdpfn.init_mesh(), units=units)
    like = {"params": params, "opt": optim.adamw().init(params), "step": 0}
    got = ck.load(path, like)
    return _shards(got["params"], got["opt"]), got["step"]


@settings(max_examples=int(os.environ.get("FSDPFN_CKPT_EXAMPLES", "6")))
@given(recipe=fst.model_recipes(), data=st.data())
def test_save_at_two_load_at_one_three_four(tmp_path_factory, recipe, data):
    path = str(tmp_path_factory.mktemp("ckpt") / "run")
    saved = spmd(2, _save_trained, path, recipe, data.draw(fst.unit_plans(recipe)))
    shapes = {n: tuple(p.shape) for n, p in recipe.build().named_parameters()}
    want = _gather(saved, shapes)
    for world in (1, 3, 4):
        out = spmd(world, _load_trained, path, recipe, data.draw(fst.unit_plans(recipe)))
        assert all(step == 2 for _, step in out)
        got = _gather([o for o, _ in out], shapes)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (world, k)


# ---- FSDP2 interop -------------------------------------------------------------------------------
def _fsdp2(model, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdpfn_save(path, seed):
    params = fsdpfn.shard(TiedLM(seed=seed), fsdpfn.init_mesh(), units=BLOCKS, donate=False)
    ck.save(path, {"model": params, "epoch": 3})


def _fsdp2_load(path, seed, world):
    model = _fsdp2(TiedLM(seed=seed), world)
    sd = model.state_dict()
    dcp.load({"model": sd}, checkpoint_id=path)
    model.load_state_dict(sd)
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


def _fsdp2_save(path, seed, world):
    model = _fsdp2(TiedLM(seed=seed), world)
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)


def _fsdpfn_load(path, seed):
    params = fsdpfn.shard(TiedLM(seed=seed), fsdpfn.init_mesh(), units=BLOCKS, donate=False)
    got = ck.load(path, {"model": params})["model"]
    return ck.full_state_dict(got, rank0_only=False)


def _fsdp2_state_to_sharded(seed, world):
    sd = _fsdp2(TiedLM(seed=seed), world).state_dict()
    params = ck.from_dtensor(sd, fsdpfn.shard(TiedLM(seed=seed + 1), fsdpfn.init_mesh(), units=BLOCKS, donate=False))
    return ck.full_state_dict(params, rank0_only=False)


@pytest.mark.parametrize("world", [1, 3])
def test_fsdpfn_checkpoint_loads_into_fsdp2_and_back(tmp_path, world):
    want = TiedLM(seed=1).state_dict()
    spmd(2, _fsdpfn_save, str(tmp_path / "a"), 1)
    for sd in spmd(world, _fsdp2_load, str(tmp_path / "a"), 2, world):
        assert sd.keys() == want.keys()
        assert all(torch.equal(sd[k], want[k]) for k in want)
    spmd(world, _fsdp2_save, str(tmp_path / "b"), 1, world)
    for sd in spmd(2, _fsdpfn_load, str(tmp_path / "b"), 2):
        assert sd.keys() == want.keys()
        assert all(torch.equal(sd[k], want[k]) for k in want)
    for sd in spmd(world, _fsdp2_state_to_sharded, 1, world):  # an FSDP2 state dict, in memory
        assert sd.keys() == want.keys()
        assert all(torch.equal(sd[k], want[k]) for k in want)


# ---- HSDP ------------------------------------------------------------------------------------------
def _hsdp_save(path, recipe):
    params = fsdpfn.shard(recipe.build(), fsdpfn.init_mesh((2, 2)), units=recipe.unit_candidates()[:2])
    params = torch.utils._pytree.tree_map(lambda t: t * 3 + 1, params)
    sd = ck.to_dtensor(params)
    placements = {tuple(v.placements) for v in sd.values()}
    ck.save(path, {"model": params})
    return placements


def _load_full(path, recipe):
    params = fsdpfn.shard(recipe.build(), fsdpfn.init_mesh())
    return ck.full_state_dict(ck.load(path, {"model": params})["model"], rank0_only=False)


def test_hsdp_save_loads_on_a_flat_mesh(tmp_path):
    from torch.distributed.tensor import Replicate, Shard

    recipe = fsdpfn.testing.models.ModelRecipe("transformer", (3, 6, 2, 5, 4), seed=3)
    placements = spmd(4, _hsdp_save, str(tmp_path / "h"), recipe)
    assert all(p == {(Replicate(), Shard(0))} for p in placements)
    want = {k: v * 3 + 1 for k, v in recipe.build().state_dict().items()}
    for got in spmd(2, _load_full, str(tmp_path / "h"), recipe):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# ---- pipeline stages: trees on sub-meshes checkpoint over their own ranks --------------------------
def _stage_checkpoints(path, recipes, stages):
    """Rank r is in stage r // (world // stages): each stage trains its own model over its dp ranks and
    saves, loads and exports it on those ranks alone, the stages' keys alike and their paths apart."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dp = dist.get_world_size() // stages
    mesh = init_device_mesh("cpu", (stages, dp), mesh_dim_names=("pp", "dp"))["dp"]
    stage = dist.get_rank() // dp
    recipe = recipes[stage]
    units = recipe.unit_candidates()[:1]
    params = fsdpfn.shard(recipe.build(), mesh, units=units, donate=False)
    apply = fsdpfn.fsdp(recipe.build())
    step = fsdpfn.value_and_grad(lambda p, x: apply(p, x).pow(2).mean(), check_finite=True)
    _, grads = step(params, recipe.inputs(2, seed=dist.get_rank()))  # the reductions run over the stage too
    grads, _ = fsdpfn.clip_grad_norm(grads, 1.0)
    params = torch.utils._pytree.tree_map(lambda t: t * (stage + 2) + 1, params)
    ck.save(f"{path}/stage{stage}", {"model": params, "stage": stage})
    like = fsdpfn.shard(recipe.build(), mesh, units=units)
    got = ck.load(f"{path}/stage{stage}", {"model": like, "stage": -1})
    full = ck.full_state_dict(params)  # the stage's first rank keeps it
    back = ck.load_full_state_dict(like, full or None)
    same = all(torch.equal(got["model"][k], params[k]) and torch.equal(back[k], params[k]) for k in params.keys())
    return stage, got["stage"], same, full


@settings(max_examples=3, deadline=None)
@given(recipes=st.lists(fst.model_recipes(), min_size=4, max_size=4), stages=st.sampled_from([2, 4]))
def test_pipeline_stages_checkpoint_on_their_own_ranks(tmp_path_factory, recipes, stages):
    path = str(tmp_path_factory.mktemp("stages"))
    out = spmd(4, _stage_checkpoints, path, recipes, stages)
    dp = 4 // stages
    for rank, (stage, saved_stage, same, full) in enumerate(out):
        assert stage == saved_stage == rank // dp and same, rank
        if rank % dp:
            assert full == {}
        else:
            want = {k: v * (stage + 2) + 1 for k, v in recipes[stage].build().state_dict().items()}
            assert full.keys() == want.keys() and all(torch.equal(full[k], want[k]) for k in want), rank


# ---- atomic writes ---------------------------------------------------------------------------------
def _leftovers(path):
    parent, name = os.path.split(path)
    return sorted(os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(f".{name}.tmp-"))


def _barrier(path):
    """A save is synchronising (DCP gathers every rank's write results): use one as a barrier."""
    ck.save(os.path.join(os.path.dirname(path), "barrier"), {"x": torch.zeros(1)})


def _interrupted_saves(path, seed):
    """Save v1, then three saves that fail at different points; report what load sees each time."""
    import torch.distributed.checkpoint.filesystem as fs

    from fsdpfn.checkpoint import atomic

    params = fsdpfn.shard(TiedLM(seed=seed), fsdpfn.init_mesh(), units=BLOCKS, donate=False)
    ck.save(path, {"model": params})
    newer = torch.utils._pytree.tree_map(lambda t: t + 100, params)
    report = {}

    def attempt(name, patch_target, attr, replacement):
        original = getattr(patch_target, attr)
        setattr(patch_target, attr, replacement(original))
        try:
            ck.save(path, {"model": newer})
            report[name] = "saved?!"
        except Exception as e:  # every rank must raise, none may hang
            report[name] = type(e).__name__
        finally:
            setattr(patch_target, attr, original)
        got = ck.load(path, {"model": params})["model"]
        report[name + ":old_intact"] = all(torch.equal(got[k], params[k]) for k in params.keys())
        partial = _leftovers(path)
        try:
            ck.load(partial[-1], {"model": params})
            report[name + ":partial"] = "loaded?!"
        except ck.CheckpointError as e:
            report[name + ":partial"] = str(e)
        _barrier(path)
        if _rank() == 0:
            for p in partial:
                shutil.rmtree(p)

    def rank1_dies_after_writing(original):  # rank 1 writes its shard file, then fails
        def write_data(self, plan, planner):
            fut = original(self, plan, planner)
            if _rank() == 1:
                fut.wait()
                raise OSError("disk full (injected)")
            return fut

        return write_data

    def no_marker(original):  # DCP finished everywhere, then the root fails before the marker
        def write_json(p, obj):
            if p.endswith(atomic.COMPLETE):
                raise OSError("crash before the marker (injected)")
            return original(p, obj)

        return write_json

    attempt("dcp", fs.FileSystemWriter, "write_data", rank1_dies_after_writing)
    attempt("marker", atomic, "_write_json", no_marker)
    # a finished checkpoint that lost a shard file is rejected with the file's name
    if _rank() == 0:
        os.remove(os.path.join(path, "__1_0.distcp"))
    _barrier(path)
    try:
        ck.load(path, {"model": params})
        report["lost_file"] = "loaded?!"
    except ck.CheckpointError as e:
        report["lost_file"] = str(e)
    return report


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    for report in spmd(2, _interrupted_saves, path, 4):
        assert report["dcp"] != "saved?!" and report["marker"] != "saved?!", report
        assert report["dcp:old_intact"] and report["marker:old_intact"]
        for what in ("dcp:partial", "marker:partial"):
            assert "no completion marker" in report[what] and "did not finish" in report[what], report[what]
        assert "missing shard file '__1_0.distcp'" in report["lost_file"]


def test_interrupted_swap_is_reported_and_overwrite_is_guarded(tmp_path):
    path = str(tmp_path / "c")
    ck.save(path, {"x": torch.arange(3)})  # no process group: a single process
    ck.save(path, {"x": torch.arange(3) + 1})  # replaces it
    assert torch.equal(ck.load(path, {"x": torch.zeros(3, dtype=torch.int64)})["x"], torch.arange(3) + 1)
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no temporary or backup directory is left
    os.rename(path, str(tmp_path / ".c.old-00000000000000ab"))  # as if the swap died between renames
    with pytest.raises(ck.CheckpointError, match=r"no checkpoint directory .*interrupted save is at .*\.c\.old-"):
        ck.load(path, {"x": torch.zeros(3)})
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not a checkpoint"):
        ck.save(str(tmp_path / "notes"), {"x": torch.zeros(1)})
    assert (tmp_path / "notes" / "todo.txt").read_text() == "precious"


# ---- safe loading ----------------------------------------------------------------------------------
class _Payload:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_malicious_metadata_is_refused_and_nothing_runs(tmp_path):
    from fsdpfn.checkpoint.safe_pickle import SafeFileSystemReader

    pwned = tmp_path / "pwned"
    for marker in (False, True):
        path = tmp_path / f"evil{marker}"
        if marker:
            ck.save(str(path), {"x": torch.ones(2)})
        else:
            dcp.save({"x": torch.ones(2)}, checkpoint_id=str(path))  # a plain DCP checkpoint
        (path / ".metadata").write_bytes(pickle.dumps(_Payload(pwned)))
        if marker:  # make the completion marker agree with the new size, so only the unpickler stands guard
            import json

            info = json.loads((path / "fsdpfn_complete.json").read_text())
            info["files"][".metadata"] = (path / ".metadata").stat().st_size
            (path / "fsdpfn_complete.json").write_text(json.dumps(info))
        with pytest.raises(ck.UnsafeCheckpointError, match=r"refused to unpickle (posix|nt|os)\.system"):
            ck.load(str(path), {"x": torch.zeros(2)})
        with pytest.raises(ck.UnsafeCheckpointError):
            SafeFileSystemReader(str(path)).read_metadata()
        assert not pwned.exists()
    assert pickle.loads(pickle.dumps(_Payload(tmp_path / "control"))) == 0 and (tmp_path / "control").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_pickled_entries_and_scalars(tmp_path):
    path = str(tmp_path / "objs")
    dcp.save({"x": {"a": [1, 2]}, "y": torch.ones(2)}, checkpoint_id=path)  # DCP pickles "x"
    with pytest.raises(ck.CheckpointMismatchError, match="'x.a': stored as a pickled object"):
        ck.load(path, {"x": {"a": torch.zeros(2)}})
    tree = {"i": 7, "f": float("inf"), "b": True, "s": "héllo", "n": None, "t": (torch.arange(4), [2.5, "x"])}
    ck.save(str(tmp_path / "s"), tree)
    like = {"i": 0, "f": 0.0, "b": False, "s": "", "n": None, "t": (torch.zeros(4, dtype=torch.int64), [0.0, ""])}
    got = ck.load(str(tmp_path / "s"), like)
    assert got["i"] == 7 and got["f"] == float("inf") and got["b"] is True and got["s"] == "héllo"
    assert got["n"] is None and torch.equal(got["t"][0], torch.arange(4)) and got["t"][1] == [2.5, "x"]
    with pytest.raises(TypeError, match=r"leaf 'o' is a builtins.object"):
        ck.save(str(tmp_path / "bad"), {"o": object()})
    with pytest.raises(ValueError, match="several leaves map to the checkpoint keys"):
        ck.save(str(tmp_path / "dup"), {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}})


# ---- mismatch ----------------------------------------------------------------------------------------
def _mismatch(path):
    params = fsdpfn.shard(TiedLM(seed=0), fsdpfn.init_mesh(), units=BLOCKS, donate=False)
    ck.save(path, {"model": params, "epoch": 1, "other": torch.ones(1)})
    other = fsdpfn.shard(TiedLM(vocab=9, depth=2), fsdpfn.init_mesh(), donate=False)
    try:
        ck.load(path, {"model": other, "epoch": 0, "lr": 0.1})
    except ck.CheckpointMismatchError as e:
        first = (str(e), e.problems)
    loose = ck.load(path, {"model": params, "missing": 5}, strict=False)
    return first, loose["missing"], ck.load(path, {"model": params})["model"]["emb.weight"].shape


def _per_rank(path):
    ck.save(path, {"rng": torch.full((3,), float(_rank())), "tag": f"rank{_rank()}"})
    return ck.load(path, {"rng": torch.zeros(3), "tag": ""})


def test_replicated_values_are_rank_zeros(tmp_path):
    for got in spmd(2, _per_rank, str(tmp_path / "r")):
        assert torch.equal(got["rng"], torch.zeros(3)) and got["tag"] == "rank0"


def test_mismatch_is_one_error_listing_everything(tmp_path):
    (msg, problems), missing, shape = spmd(1, _mismatch, str(tmp_path / "m"))[0]
    assert "does not match like (4 problems)" in msg
    assert "missing from the checkpoint: 'lr'" in msg
    assert "unexpected in the checkpoint: 'model.blocks.2.weight'" in msg
    assert "unexpected in the checkpoint: 'model.blocks.2.bias'" in msg
    assert "'model.emb.weight': shape (7, 5) in the checkpoint, (9, 5) in like" in msg
    assert "other" not in msg and "head" not in msg  # 'other' is not asked for; tied aliases are known
    assert len(problems) == 4 and missing == 5 and shape == (7, 5)


def _old_sgd_state(path):
    """An sgd-with-momentum state in the layout fsdpfn kept before 0.1.0 dropped its step counters for
    undampened momentum: strict load names the extra keys and says strict=False skips them; with it the
    buffers and count come back, and the next update equals the one made from the state never saved."""
    from fsdpfn.optim._common import new_step, state_tree

    torch.manual_seed(_rank())
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), donate=False)
    opt = optim.sgd(0.1, momentum=0.9)
    state = opt.init(params)
    grads = fsdpfn.Sharded({k: torch.full_like(v, 0.5) for k, v in params.items()}, params.plan)
    params, state = opt.update(grads, state, params)
    old = state._replace(step=state_tree(params, lambda p: new_step() + 1))
    ck.save(path, {"params": params, "opt": old})
    try:
        ck.load(path, {"params": params, "opt": opt.init(params)})
        msg = ""
    except ck.CheckpointMismatchError as e:
        msg = str(e)
    got = ck.load(path, {"params": params, "opt": opt.init(params)}, strict=False)
    after_load = opt.update(grads, got["opt"], got["params"])[0]
    kept = opt.update(grads, state, params)[0]
    return msg, got["opt"].count, all(torch.equal(after_load[k], kept[k]) for k in kept.params())


def test_an_old_sgd_state_loads_with_strict_false_and_is_told_so(tmp_path):
    for msg, count, same in spmd(2, _old_sgd_state, str(tmp_path / "sgd")):
        assert "unexpected in the checkpoint: 'opt.step.0.weight'" in msg
        assert "nothing it needs is missing" in msg and "strict=False" in msg
        assert count == 1 and same


# ---- full state dicts --------------------------------------------------------------------------------
def _full_sd(seed, mp):
    model = TiedLM(seed=seed)
    policy = fsdpfn.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp else None
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=BLOCKS, mp_policy=policy, donate=False)
    sd = ck.full_state_dict(params)  # rank 0 only, on the CPU
    everywhere = ck.full_state_dict(params, rank0_only=False)
    fresh = TiedLM(seed=seed + 1)
    loads = fresh.load_state_dict(everywhere, strict=True) is not None
    # the way back: rank 0 alone holds the state (broadcast unit by unit), or every rank does
    back0 = ck.load_full_state_dict(params, sd if _rank() == 0 else None)
    back1 = ck.load_full_state_dict(params, everywhere, rank0_only=False)
    same = all(torch.equal(b[k], params[k]) for b in (back0, back1) for k in params.keys())
    try:
        bad = dict(everywhere, extra=torch.ones(1))
        bad["blocks.0.weight"] = torch.ones(2, 2)
        del bad["blocks.1.bias"]
        ck.load_full_state_dict(params, bad if _rank() == 0 else None)
        error = "accepted?!"
    except ck.CheckpointMismatchError as e:
        error = str(e)
    return sd, everywhere, loads, same, error


@pytest.mark.parametrize("world,mp", [(1, False), (2, True), (3, False)])
def test_full_state_dict_equals_module_state_dict(world, mp):
    want = TiedLM(seed=5).state_dict()
    for rank, (sd, everywhere, loads, same, error) in enumerate(spmd(world, _full_sd, 5, mp)):
        assert sd == {} if rank else list(sd) == list(want)  # same names (tied ones too), same order
        assert list(everywhere) == list(want) and loads and same
        for k in want:
            assert everywhere[k].dtype == want[k].dtype and torch.equal(everywhere[k], want[k]), k
            assert rank or torch.equal(sd[k], want[k])
        assert "(3 problems)" in error and "unexpected key 'extra'" in error
        assert "missing key 'blocks.1.bias'" in error and "'blocks.0.weight' has shape (2, 2)" in error


class Stack(nn.Module):
    def __init__(self, n=8, dim=16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))


def _peak():
    params = fsdpfn.shard(Stack(), fsdpfn.init_mesh(), units=[f"layers.{i}" for i in range(8)])
    stats = params.plan.comm.stats
    stats.reset()
    with torch.no_grad():
        one = fsdpfn.unshard(params, units=["layers.3"])
    del one
    unit_peak = stats.peak_gathered_bytes
    stats.reset()
    ck.full_state_dict(params)
    return unit_peak, stats.peak_gathered_bytes, settled_live_bytes(stats)


def test_full_state_dict_streams_one_unit_at_a_time():
    for unit_peak, peak, live in spmd(2, _peak):
        assert unit_peak >= (16 * 16 + 16) * 4  # at least one unit's full parameters
        assert peak <= 1.5 * unit_peak and live == 0


# ---- DTensor state dicts and 0-d parameters -----------------------------------------------------------
ZERO_D = ParamTree(
    (("w", (5, 3), torch.float32, True), ("a.s", (), torch.float32, True), ("a.t", (), torch.int64, False)), seed=2
)


def _dtensors(path):
    from torch.distributed.tensor import DTensor, Replicate

    params = fsdpfn.shard(ZERO_D.build(), fsdpfn.init_mesh())
    sd = ck.to_dtensor(params)
    kinds = {k: (type(v).__name__, tuple(getattr(v, "placements", ())), tuple(v.shape)) for k, v in sd.items()}
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}
    back = ck.from_dtensor(sd, params)
    replicated = {k: v.redistribute(v.device_mesh, [Replicate()]) if isinstance(v, DTensor) else v
                  for k, v in sd.items()}
    back_r = ck.from_dtensor(replicated, params)
    plain = ck.from_dtensor(full, params)  # full plain tensors are sliced
    same = all(torch.equal(b[k], params[k]) for b in (back, back_r, plain) for k in params.keys())
    try:
        ck.from_dtensor({"w": full["w"][:2], "zzz": full["w"]}, params)
        error = "accepted?!"
    except ck.CheckpointMismatchError as e:
        error = str(e)
    ck.save(path, {"p": params})
    return kinds, full, same, error, {k: v for k, v in params.items()}


def _zero_d_load(path):
    params = fsdpfn.shard(ParamTree(ZERO_D.entries, seed=9).build(), fsdpfn.init_mesh())
    return dict(ck.load(path, {"p": params})["p"].items())


def test_to_from_dtensor_and_zero_d_parameters(tmp_path):
    from torch.distributed.tensor import Shard

    want = dict(ZERO_D.build().named_parameters())
    out = spmd(3, _dtensors, str(tmp_path / "z"))
    for kinds, full, same, error, _ in out:
        assert kinds["w"] == ("DTensor", (Shard(0),), (5, 3))
        assert kinds["a.s"] == ("Tensor", (), ()) and kinds["a.t"] == ("Tensor", (), ())  # 0-d: plain, replicated
        assert all(torch.equal(full[k], want[k]) for k in want) and same
        assert "(4 problems)" in error and "unexpected key 'zzz'" in error and "missing key 'a.s'" in error
        assert "'w' has global shape (2, 3), like has (5, 3)" in error
    for world in (2, 4):
        got = spmd(world, _zero_d_load, str(tmp_path / "z"))
        for k, p in want.items():
            spec = fsdpfn.ShardSpec(tuple(p.shape), world)
            assert torch.equal(fsdpfn.unshard_tensors([g[k] for g in got], spec), p.detach()), (world, k)


class _WithCache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("cache", torch.arange(3.0), persistent=False)  # e.g. a rotary table
        self.register_buffer("count", torch.tensor(2))

    def forward(self, x):
        return self.lin(x) + self.cache


def _non_persistent_worker():
    torch.manual_seed(0)
    model = _WithCache()
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), donate=False)
    state = fsdpfn.full_state_dict(params, rank0_only=False)
    fresh = _WithCache()
    fresh.load_state_dict(state, strict=True)
    return sorted(state), torch.equal(fresh.lin.weight, model.lin.weight)


def test_full_state_dict_leaves_out_non_persistent_buffers_like_state_dict():
    for keys, equal in spmd(2, _non_persistent_worker):
        assert keys == sorted(_WithCache().state_dict())
        assert equal
