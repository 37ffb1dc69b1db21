"""The functional transform: ``fsdp(module) -> apply`` and ``value_and_grad``/``grad``."""

from fsdpfn.transform.apply import Apply, fsdp
from fsdpfn.transform.grad import grad, value_and_grad

__all__ = ["Apply", "fsdp", "grad", "value_and_grad"]
