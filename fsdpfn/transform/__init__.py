"""The functional transform: ``fsdp(module) -> apply``, ``value_and_grad``/``grad`` and ``compile_step``."""

from fsdpfn.transform.apply import Apply, fsdp
from fsdpfn.transform.grad import grad, value_and_grad
from fsdpfn.transform.remat import remat
from fsdpfn.transform.step import compile_step

__all__ = ["Apply", "compile_step", "fsdp", "grad", "remat", "value_and_grad"]
