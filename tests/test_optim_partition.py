"""``fsdpfn.optim.partition``: an optimizer per group of parameters, as ``torch.optim`` parameter groups (or
one ``torch.optim`` optimizer per group) give, with state only for each group's own parameters.
"""

import torch
import torch.distributed as dist
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import fsdpfn
import fsdpfn.optim as optim
from fsdpfn.testing import spmd

MODULES = ["inp", "blocks.0", "blocks.1", "blocks.2", "head"]
UNITS = ["blocks.0", "blocks.1", "blocks.2"]
STEPS = 3
# label -> (kind, lr, weight decay or momentum)
KINDS = {"a": ("adamw", 0.03, 0.1), "b": ("adamw", 0.003, 0.0), "c": ("sgd", 0.1, 0.5)}


class _Net(nn.Module):
    def __init__(self, width: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).pow(2).mean()


def _batch(rank: int, step: int, seed: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(seed + 1000 * step + 7 * rank))


def _label(assign: dict, fqn: str) -> str:
    return assign[fqn.rsplit(".", 1)[0].removesuffix(".0")]


def _ours(kind: str, lr: float, x: float):
    return optim.adamw(lr=lr, weight_decay=x) if kind == "adamw" else optim.sgd(lr=lr, momentum=x)


def _torch(kind: str, lr: float, x: float, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=x)
    return torch.optim.SGD(params, lr=lr, momentum=x)


def _reference(world: int, case: dict) -> dict[str, torch.Tensor]:
    model = _Net(case["width"], case["seed"])
    groups = {lab: [p for n, p in model.named_parameters() if _label(case["assign"], n) == lab] for lab in KINDS}
    opts = [_torch(*KINDS[lab], ps) for lab, ps in groups.items() if ps]
    for step in range(STEPS):
        model.get_submodule(case["frozen"]).requires_grad_(step != 1)  # frozen for the middle step
        for r in range(world):
            (model(_batch(r, step, case["seed"])) / world).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _functional(case: dict) -> tuple[dict[str, torch.Tensor], bool]:
    model = _Net(case["width"], case["seed"])
    params = fsdpfn.shard(model, fsdpfn.init_mesh(), units=UNITS, min_bucket_bytes=case["fuse"])
    apply = fsdpfn.fsdp(model, reshard_after_forward=case["reshard"])
    grad_fn = fsdpfn.value_and_grad(apply)
    opt = optim.partition({lab: _ours(*k) for lab, k in KINDS.items()}, lambda fqn, shape: _label(case["assign"], fqn))
    state = opt.init(params)
    # each label's state holds tensors for its own parameters only
    own = all(
        (state.inner[lab][1][f] is not None) == (_label(case["assign"], f) == lab)
        for lab in KINDS if KINDS[lab][0] == "adamw" for f in params.keys()
    )  # fmt: skip
    for step in range(STEPS):
        params = (fsdpfn.freeze if step == 1 else fsdpfn.unfreeze)(params, case["frozen"])
        _, grads = grad_fn(params, _batch(dist.get_rank(), step, case["seed"]))
        params, state = opt.update(grads, state, params)
    return {k: v.clone() for k, v in fsdpfn.full_state_dict(params, rank0_only=False).items()}, own


def _run(case: dict) -> tuple[dict[str, float], bool]:
    got, own = _functional(case)
    want = _reference(dist.get_world_size(), case)
    return {k: (got[k] - want[k]).abs().max().item() for k in want}, own


@settings(max_examples=8, deadline=None)
@given(
    world=st.integers(1, 3),
    assign=st.fixed_dictionaries({m: st.sampled_from(sorted(KINDS)) for m in MODULES}),
    frozen=st.sampled_from(MODULES),
    reshard=st.booleans(),
    fuse=st.sampled_from([None, "auto"]),
    width=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
@example(world=2, assign=dict.fromkeys(MODULES, "a") | {"head": "c"}, frozen="blocks.0", reshard=True, fuse="auto",
         width=5, seed=0)  # fmt: skip
def test_each_group_trains_with_its_own_optimizer_as_torch_param_groups_do(
    world, assign, frozen, reshard, fuse, width, seed
):
    """Random labels over the modules (AdamW with two settings, SGD with momentum), one module frozen for
    the middle step: the same as one process with one ``torch.optim`` optimizer per group."""
    case = dict(assign=assign, frozen=frozen, reshard=reshard, fuse=fuse, width=width, seed=seed)
    off, own = spmd(world, _run, case)[0]
    worst = max(off, key=off.get)
    assert own
    assert off[worst] < 1e-5, f"{case} world {world}: {worst} off by {off[worst]:.3g} ({off})"


def _misuse() -> dict:
    model = _Net(3, 0)
    params = fsdpfn.shard(model, fsdpfn.init_mesh())
    out = {}
    for name, make in {
        "unlabelled": lambda: optim.partition({"a": optim.sgd(lr=0.1)}, {"inp.weight": "a"}).init(params),
        "unknown_label": lambda: optim.partition({"a": optim.sgd(lr=0.1)}, lambda f, s: "z").init(params),
        "unknown_name": lambda: optim.partition({"a": optim.sgd(lr=0.1)}, dict.fromkeys([*params.keys(), "nope"], "a"))
        .init(params),
        "not_an_optimizer": lambda: optim.partition({"a": torch.optim.SGD}, lambda f, s: "a"),
    }.items():
        try:
            make()
        except (TypeError, ValueError) as e:
            out[name] = str(e)
    opt = optim.partition({"a": optim.sgd(lr=0.1)}, lambda f, s: "a")
    state = opt.init(params)
    grads = fsdpfn.grad(fsdpfn.fsdp(model))(params, torch.ones(2, 4))
    new, state = opt.update(grads, state, params)
    try:
        params["inp.weight"]
    except fsdpfn.layout.DonatedError:
        out["donated"] = True
    return out


def test_partition_refuses_bad_labels_and_donates_in_place():
    out = spmd(1, _misuse)[0]
    assert "gives parameter 'inp.bias' no label" in out["unlabelled"]
    assert "labelled 'z', which names no optimizer" in out["unknown_label"]
    assert "labels names 'nope'" in out["unknown_name"]
    assert "transforms['a'] must be an fsdpfn.optim transformation" in out["not_an_optimizer"]
    assert out["donated"]


