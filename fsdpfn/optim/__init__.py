"""Optimizers for ``Sharded`` parameters, optax-shaped and built on ``torch.optim``'s functional kernels.

``sgd(...)`` and ``adamw(...)`` return a ``GradientTransformation(init, update)``; ``partition({label: opt},
labels)`` gives each group of parameters its own (``torch.optim`` parameter groups):
``init(params) -> state`` and ``update(grads, state, params) -> (params, state)``. The state is a
NamedTuple of ``Sharded`` trees plus an ``int`` update counter, so it is a pytree (save it, ``tree_map`` it: the
counter is a non-tensor leaf).
Updates are local to each rank's shards and in place by default. ``clip_grad_norm(grads, max_norm)``
clips by the global norm over every rank (one all-reduce). ``loss_scale()`` is float16's dynamic loss
scaling (``torch.amp.GradScaler``'s rule): scale the loss, unscale the gradients, skip non-finite steps.

Example:
    >>> import fsdpfn.optim as optim                                      # doctest: +SKIP
    >>> opt = optim.adamw(lr=1e-3, weight_decay=0.1)                      # doctest: +SKIP
    >>> state = opt.init(params)                                          # doctest: +SKIP
    >>> loss, grads = fsdpfn.value_and_grad(loss_fn)(params, batch)       # doctest: +SKIP
    >>> grads, norm = optim.clip_grad_norm(grads, 1.0)                    # doctest: +SKIP
    >>> params, state = opt.update(grads, state, params)                  # doctest: +SKIP
"""

from fsdpfn.optim._common import DecayMask, GradientTransformation, LearningRate
from fsdpfn.optim.adamw import AdamWState, adamw
from fsdpfn.optim.clip import clip_grad_norm
from fsdpfn.optim.loss_scale import LossScale, LossScaleState, loss_scale
from fsdpfn.optim.partition import Labels, PartitionState, partition
from fsdpfn.optim.sgd import SGDState, sgd

__all__ = [
    "AdamWState", "DecayMask", "GradientTransformation", "Labels", "LearningRate", "LossScale", "LossScaleState",
    "PartitionState", "SGDState", "adamw", "clip_grad_norm", "loss_scale", "partition", "sgd",
]
