"""``fsdpfn.testing.memory.memory_tracker``: torch's ``MemTracker`` without gradient hooks, keeping the whole
run's peak only unless asked for each module's (those cost a pass over every tracked module per op)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fsdpfn.testing.memory import memory_tracker


def _peaks(tracker, widths, rows):
    """The whole run's peak per device and each layer's own peak (``local_peak``) over a training step."""
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())])
    x = torch.randn(rows, widths[0])
    tracker.track_external(model, x)
    with tracker:
        model(x).square().sum().backward()
    whole = {dev: snap["Total"] for dev, snap in tracker.get_tracker_snapshot("peak").items()}
    return whole, [dict(tracker.memory_tracking[layer].local_peak) for layer in layers]


@settings(max_examples=20, deadline=None)
@given(widths=st.lists(st.integers(1, 40), min_size=2, max_size=5), rows=st.integers(1, 16))
def test_the_whole_runs_peak_is_torchs_and_module_peaks_are_when_asked(widths, rows):
    from torch.distributed._tools.mem_tracker import MemTracker

    class _Plain(MemTracker):  # torch's, without gradient hooks (as memory_tracker), every module's peak kept
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    want, want_modules = _peaks(_Plain(), widths, rows)
    assert want and all(v > 0 for v in want.values())
    assert _peaks(memory_tracker(), widths, rows)[0] == want
    assert _peaks(memory_tracker(module_peaks=True), widths, rows) == (want, want_modules)
