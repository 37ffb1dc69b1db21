"""The functional transform: ``fsdp(module) -> apply`` and ``value_and_grad``/``grad``."""

from fsdpfn.transform.apply import Apply, fsdp
from fsdpfn.transform.grad import grad, value_and_grad
from fsdpfn.transform.remat import remat

__all__ = ["Apply", "fsdp", "grad", "remat", "value_and_grad"]
