"""fsdpfn.compat raises FSDP2's errors: for each misuse below, torch's ``fully_shard`` (or ``replicate``,
``FSDPModule`` method) and fsdpfn.compat's are run side by side in the same process; fsdpfn must raise
the same exception class (or a subclass of it) with a message that starts with torch's message (fsdpfn may add advice after
it). torch's message is computed by triggering torch, never written down here.

All cases run in one call on a world of 2 ranks; each rank triggers
every case with both implementations and the test compares rank 0's results.
"""

from __future__ import annotations

import copy
import importlib
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from fsdpfn.testing import spmd, torch_version

WORLD = 2
IMPLS = {
    "torch": ("torch.distributed.fsdp", "torch.distributed._composable.replicate_with_fsdp"),
    "fsdpfn": ("fsdpfn.compat", "fsdpfn.compat"),
}


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


class WithScalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.s = nn.Parameter(torch.ones(4)), nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return x * self.w * self.s


class Transposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, 6).t())  # non-contiguous

    def forward(self, x):
        return x @ self.w.t()


def _meta_two() -> Two:
    with torch.device("meta"):
        return Two()


def _x() -> torch.Tensor:
    return torch.ones(2, 4)


def _cases(api, world: int) -> dict:
    """Each misuse, as a function of the implementation's module ``api`` (fully_shard, FSDPModule
    helpers and replicate)."""
    fs, rep = api.fully_shard, api.replicate

    def fully_sharded_two_units():
        m = Two()
        fs(m.a)
        fs(m.b)
        fs(m)
        return m

    def fully_sharded_two():
        m = Two()
        fs(m.a)
        fs(m)
        return m

    return {
        "applied-twice": lambda: fs(fs(nn.Linear(4, 4))),
        "applied-twice-in-a-list": lambda: (lambda m: (fs(m.a), fs([m.a, m.b])))(Two()),
        "module-list": lambda: fs(nn.ModuleList([nn.Linear(2, 2)])),
        "module-dict": lambda: fs(nn.ModuleDict({"a": nn.Linear(2, 2)})),
        "3d-mesh": lambda: fs(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 1, world))),
        "2d-mesh-without-names": lambda: fs(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, world))),
        "mesh-not-a-device-mesh": lambda: fs(nn.Linear(4, 4), mesh="cpu"),
        "scalar-parameter": lambda: fs(WithScalar()),
        "non-contiguous-parameter": lambda: fs(Transposed()),
        "shard-dim-out-of-range": lambda: fs(nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(2)),
        "placement-not-a-shard": lambda: fs(nn.Linear(4, 4), shard_placement_fn=lambda p: Replicate()),
        "placement-not-a-placement": lambda: fs(nn.Linear(4, 4), shard_placement_fn=lambda p: 3),
        "forward-on-meta": lambda: (lambda m: m(_x()))(_meta_fully_sharded(fs)),
        "deepcopy": lambda: copy.deepcopy(fully_sharded_two()),
        "deepcopy-of-a-child": lambda: copy.deepcopy(fully_sharded_two().a),
        "grouped-modules-as-root": lambda: (lambda m: (fs([m.a, m.b]), m.a(_x())))(Two()),
        "child-forward-before-root": lambda: (lambda m: (m.a(_x()), m(_x())))(fully_sharded_two()),
        "not-a-module": lambda: fs(3),
        "list-holding-a-non-module": lambda: fs([nn.Linear(2, 2), 3]),
        "empty-list": lambda: fs([]),
        "reshard-after-forward-not-bool-or-int": lambda: fs(nn.Linear(4, 4), reshard_after_forward="x"),
        "reshard-after-forward-not-a-factor": lambda: fs(nn.Linear(4, 4), reshard_after_forward=3),
        "set-reshard-after-forward-not-bool": lambda: fs(nn.Linear(4, 4)).set_reshard_after_forward("x"),
        "max-input-buffers-not-int": lambda: fs(nn.Linear(4, 4)).set_reduce_scatter_max_input_buffers("x"),
        "max-input-buffers-zero": lambda: fs(nn.Linear(4, 4)).set_reduce_scatter_max_input_buffers(0),
        "forward-method-missing": lambda: api.register_fsdp_forward_method(fs(nn.Linear(4, 4)), "nope"),
        "share-comm-ctx-non-fsdp": lambda: api.share_comm_ctx([nn.Linear(2, 2)]),
        "prefetch-non-fsdp": lambda: fs(nn.Linear(4, 4)).set_modules_to_forward_prefetch([nn.Linear(2, 2)]),
        "prefetch-not-a-list": lambda: (lambda m: m.a.set_modules_to_backward_prefetch(m.b))(fully_sharded_two_units()),
        "reset-iter-state-not-root": lambda: (lambda m: (m(_x()), m.a.reset_iter_state()))(fully_sharded_two()),
        "replicate-2d-mesh": lambda: rep(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, world), mesh_dim_names=("r", "s"))),
        "replicate-twice": lambda: rep(rep(nn.Linear(4, 4))),
        "replicate-module-list": lambda: rep(nn.ModuleList([nn.Linear(2, 2)])),
        "replicate-on-fully-shard": lambda: rep(fs(nn.Linear(4, 4))),
        "fully-shard-on-replicate": lambda: fs(rep(nn.Linear(4, 4))),
        "unshard-on-meta": lambda: _meta_fully_sharded(fs).unshard(),
    }


def _meta_fully_sharded(fs) -> Two:
    m = _meta_two()
    fs(m.a)
    fs(m)
    return m


class _Api:
    def __init__(self, impl: str):
        shard_lib, replicate_lib = IMPLS[impl]
        mod = importlib.import_module(shard_lib)
        self.fully_shard = mod.fully_shard
        self.register_fsdp_forward_method = mod.register_fsdp_forward_method
        self.share_comm_ctx = mod.share_comm_ctx
        self.replicate = importlib.import_module(replicate_lib).replicate


def _trigger_all() -> dict:
    out = {}
    for impl in IMPLS:
        for name, fn in _cases(_Api(impl), dist.get_world_size()).items():
            torch.manual_seed(0)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    fn()
            except Exception as e:  # noqa: BLE001 - the error is what we compare
                out[(name, impl)] = (type(e), str(e))
            else:
                out[(name, impl)] = (None, "no error")
    return out


CASES = list(_cases(_Api("fsdpfn"), WORLD))

# Where torch's text holds something fsdpfn cannot print identically, compare what comes before it.
_CLASS_PATH = re.compile(r"<class '[\w.]+\.(\w+)'>")
PREFIX_UNTIL = {
    # FSDP2 has no parameter names before lazy init and prints [None, None]; fsdpfn names them
    "unshard-on-meta": "still on meta device: ",
}
NORMALISE = {
    # torch's FSDP<Class> lives in torch.distributed.fsdp._fully_shard._fsdp_init, fsdpfn's in fsdpfn.compat
    "forward-method-missing": lambda s: _CLASS_PATH.sub(r"<class '\1'>", s),
}


@pytest.fixture(scope="module")
def raised() -> dict:
    return spmd(WORLD, _trigger_all)[0]


@pytest.mark.parametrize("case", CASES)
def test_fsdpfn_raises_torchs_error(raised, case):
    want_type, want = raised[(case, "torch")]
    got_type, got = raised[(case, "fsdpfn")]
    if want_type is AttributeError and torch_version() < (2, 13):  # torch 2.11: no such method, or no check
        pytest.skip(f"{case}: torch {torch.__version__} has no error of its own to match ({want})")
    assert want_type is not None, f"{case}: torch raised nothing; the case is not a misuse for FSDP2"
    # a subclass catches the same: fsdpfn's derive from ValueError too where it raised ValueError before
    assert got_type is not None and issubclass(got_type, want_type), f"{case}: fsdpfn raised {got_type} ({got!r}), torch {want_type} ({want!r})"
    norm = NORMALISE.get(case, lambda s: s)
    want, got = norm(want), norm(got)
    if case in PREFIX_UNTIL:
        want = want[: want.index(PREFIX_UNTIL[case]) + len(PREFIX_UNTIL[case])]
    assert got.startswith(want), f"{case}: fsdpfn's message does not start with torch's:\n torch:  {want!r}\n fsdpfn: {got!r}"
