"""Measuring a step's peak memory on CPU with torch's ``MemTracker``, under ``fsdpfn.fsdp`` too."""

from __future__ import annotations

from typing import Any

__all__ = ["memory_tracker"]


def memory_tracker() -> Any:
    """A ``torch.distributed._tools.mem_tracker.MemTracker`` that installs no gradient hooks on parameters.

    ``MemTracker``'s module pre-forward hook registers a post-accumulate-grad hook on every parameter it
    finds in the module; under ``fsdpfn.fsdp`` those are the gathered (non-leaf) tensors swapped in for the
    call, and the registration raises. The hooks only label gradients as ``Grad`` instead of ``Temp``; the
    totals, and so the peak, do not depend on them.

    Example:
        >>> tracker = memory_tracker()
        >>> tracker.track_external(*params.values())                     # doctest: +SKIP
        >>> with tracker: step(params)                                    # doctest: +SKIP
        >>> tracker.get_tracker_snapshot("peak")                          # doctest: +SKIP
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    class _NoGradHookTracker(MemTracker):
        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> tuple[int, int]:
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    return _NoGradHookTracker()
