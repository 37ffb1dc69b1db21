"""The Sharded pytree: registration with torch's pytree, optree and torch.func; mapping behaviour."""

import optree
import pytest
import torch
import torch.utils._pytree as tp
from torch import nn

import fsdpfn
from fsdpfn.layout import ParamInfo, Sharded, build_plan
from fsdpfn.testing import spmd


def _plan(world=2, rank=0):
    infos = [
        ParamInfo("b.w", (5, 3), torch.float32, True, ""),
        ParamInfo("a.w", (4,), torch.float32, True, ""),
        ParamInfo("f", (2,), torch.float32, False, ""),
    ]
    return build_plan(infos, ["buf"], [""], rank=rank, world=world)


def _tree(plan):
    leaves = {k: torch.full(plan.specs[k].local_shape(plan.rank), float(i)) for i, k in enumerate(plan.params)}
    leaves["buf"] = torch.arange(3.0)
    return Sharded(leaves, plan)


def test_leaf_order_is_the_plan_order_whatever_the_insertion_order():
    plan = _plan()
    t = _tree(plan)
    shuffled = Sharded(dict(reversed(list(t.items()))), plan)
    assert list(shuffled.keys()) == ["b.w", "a.w", "f", "buf"]
    assert [id(x) for x in tp.tree_leaves(shuffled)] == [id(t[k]) for k in ["b.w", "a.w", "f", "buf"]]
    assert [id(x) for x in optree.tree_leaves(shuffled, namespace="torch")] == [id(x) for x in tp.tree_leaves(t)]


def test_tree_map_keeps_the_plan_in_torch_pytree_and_optree():
    t = _tree(_plan())
    for mapped in (tp.tree_map(lambda x: x + 1, t), optree.tree_map(lambda x: x + 1, t, namespace="torch")):
        assert isinstance(mapped, Sharded)
        assert mapped.plan is t.plan
        assert torch.equal(mapped["a.w"], t["a.w"] + 1)
    leaves, spec = tp.tree_flatten(t)
    assert tp.tree_unflatten(leaves, spec).plan is t.plan


def test_keypaths_name_the_leaves():
    t = _tree(_plan())
    paths = [tp.keystr(p) for p, _ in tp.tree_flatten_with_path(t)[0]]
    assert paths == ["['b.w']", "['a.w']", "['f']", "['buf']"]


def test_torch_func_grad_sees_sharded_leaves():
    t = _tree(_plan())
    g = torch.func.grad(lambda s: (s["a.w"] ** 2).sum() + s["b.w"].sum())(t)
    assert isinstance(g, Sharded) and g.plan is t.plan
    assert torch.equal(g["a.w"], 2 * t["a.w"])
    assert torch.equal(g["b.w"], torch.ones_like(t["b.w"]))


def test_trees_from_different_plans_do_not_mix():
    a, b = _tree(_plan()), _tree(_plan())
    with pytest.raises(ValueError):
        tp.tree_map(lambda x, y: x + y, a, b)


def test_none_leaves_are_allowed():
    t = _tree(_plan())
    g = t.replace({"f": None})
    assert g["f"] is None
    assert tp.tree_map(lambda x: x, g)["f"] is None


def test_mapping_behaviour_and_errors():
    plan = _plan()
    t = _tree(plan)
    assert len(t) == 4 and "a.w" in t and "zzz" not in t
    assert list(t.params()) == ["b.w", "a.w", "f"] and list(t.buffers()) == ["buf"]
    assert t.specs["b.w"] == fsdpfn.ShardSpec((5, 3), 2)
    assert "Sharded(" in repr(t) and "rank 0 of 2" in repr(t)
    with pytest.raises(KeyError, match="'zzz' is not a leaf"):
        t["zzz"]
    with pytest.raises(KeyError, match=r"missing \['f'\]"):
        Sharded({k: v for k, v in t.items() if k != "f"}, plan)
    with pytest.raises(KeyError, match=r"not in the plan \['extra'\]"):
        Sharded({**dict(t.items()), "extra": torch.zeros(1)}, plan)
    with pytest.raises(KeyError, match="replace"):
        t.replace({"nope": 1})
    with pytest.raises(TypeError, match="ShardPlan"):
        Sharded({}, "not a plan")


def _tied_model():
    emb = nn.Embedding(7, 4)
    model = nn.Sequential(emb, nn.Linear(4, 7, bias=False))
    model[1].weight = emb.weight
    return model


def _tied_worker():
    torch.manual_seed(0)
    model = _tied_model()
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), donate=False)
    full = fsdpfn.unshard(params)
    return list(params.keys()), dict(params.plan.aliases), torch.equal(full["0.weight"], model[0].weight), params["1.weight"] is params["0.weight"]


def test_tied_parameters_are_sharded_once():
    for keys, aliases, equal, same in spmd(2, _tied_worker):
        assert keys == ["0.weight"]
        assert aliases == {"1.weight": "0.weight"}
        assert equal and same


def _deepcopy_worker():
    import copy

    import fsdpfn.optim as optim

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=["0"])
    apply = fsdpfn.fsdp(model)
    x = torch.randn(2, 3)
    ema = copy.deepcopy(params)  # a reference copy: its own leaves, the same plan (and mesh)
    before = apply(ema, x)
    opt = optim.adamw(lr=0.1)
    state = opt.init(params)
    state_copy = copy.deepcopy(state)
    _, grads = fsdpfn.value_and_grad(lambda p: apply(p, x).sum())(params)
    params, state = opt.update(grads, state, params)
    shared = any(ema[k].untyped_storage().data_ptr() == params[k].untyped_storage().data_ptr() for k in params.keys())
    return {
        "same_plan": ema.plan is params.plan,
        "shared": shared,
        "ema_kept": torch.equal(apply(ema, x), before),
        "params_moved": not torch.equal(apply(params, x), before),
        "state_copy": type(state_copy) is type(state)
        and all(float(v) == 0.0 for v in state_copy.step.params().values())
        and all(float(v) == 1.0 for v in state.step.params().values()),
    }


@pytest.mark.parametrize("world", [1, 2])
def test_deepcopy_copies_the_leaves_and_shares_the_plan(world):
    for out in spmd(world, _deepcopy_worker):
        assert out == {"same_plan": True, "shared": False, "ema_kept": True, "params_moved": True, "state_copy": True}


def _pickle_worker():
    import io

    params = fsdpfn.shard(nn.Linear(3, 2), fsdpfn.init_mesh())
    with pytest.raises(TypeError, match=r"a Sharded cannot be pickled \(torch.save included\).*fsdpfn.save\(path, params\)"):
        torch.save(params, io.BytesIO())
    buf = io.BytesIO()
    torch.save(dict(params.items()), buf)  # this rank's leaves, as the message says
    buf.seek(0)
    back = params.replace(torch.load(buf))
    return all(torch.equal(back[k], params[k]) for k in params.keys())


def test_pickling_a_tree_says_how_to_save_it():
    assert spmd(2, _pickle_worker) == [True, True]
