"""The training state: parameters, optimizer state and step counter."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import optax


class TrainState(NamedTuple):
  """Everything a data-parallel replica carries from one step to the next.

  A ``NamedTuple``, hence a pytree: it passes through ``jit``, ``shard_map``
  and ``pmap`` as it is, and ``state._replace(...)`` returns a modified copy.

  Attributes:
    params: the model parameters (any pytree of arrays).
    opt_state: the optax optimizer state for ``params``.
    step: int32 scalar, the number of updates applied so far. Steps skipped
      because the global batch weight was zero do not count.
  """

  params: Any
  opt_state: Any
  step: Any

  @classmethod
  def create(cls, params: Any, optimizer: optax.GradientTransformation) -> TrainState:
    """Builds a state at step 0 with ``optimizer.init(params)``.

    The arrays are not placed on any mesh; use :func:`jaxdp.init_state` for a
    state placed the way :func:`jaxdp.make_train_step` expects.
    """
    return cls(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))
