"""The training state: parameters, optimizer state, step counter and model state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import optax


class TrainState(NamedTuple):
  """Everything a data-parallel replica carries from one step to the next.

  A `NamedTuple`, hence a pytree: it passes through `jit`, `shard_map`
  and `pmap` as it is, and `state._replace(...)` returns a modified copy.

  Attributes:
    params: the model parameters (any pytree of arrays), the only part that is
      differentiated.
    opt_state: the optax optimizer state for `params`.
    step: int32 scalar, the number of updates applied so far. Steps skipped
      because the global batch weight was zero (or a gradient was not finite)
      do not count.
    model_state: non-trainable model state that the forward pass updates
      (BatchNorm running statistics: flax linen's `batch_stats` collection,
      nnx `BatchStat` variables), or `None` for a model without any. The
      step hands it to `loss_fn` and keeps it identical on every replica
      (see `jaxdp.train_step`). Always replicated, also under ZeRO.
    loss_scale: the dynamic loss scale, a `jaxdp.LossScale`, for a
      step given `loss_scaling=` (see `jaxdp.core.loss_scaling`), else
      `None`. Always replicated, also under ZeRO.
    compression: the gradient compression's state, a
      `jaxdp.PowerSGDState` (made by `jaxdp.init_state(...,
      compression=jaxdp.powersgd(...))`), or `None` for the exact
      reduction. Its error feedback is per replica: split over the data axes.
  """

  params: Any
  opt_state: Any
  step: Any
  model_state: Any = None
  loss_scale: Any = None
  compression: Any = None

  @classmethod
  def create(cls, params: Any, optimizer: optax.GradientTransformation, model_state: Any = None,
             loss_scale: Any = None, compression: Any = None) -> TrainState:
    """Builds a state at step 0 with `optimizer.init(params)`; `loss_scale`: e.g. `scaling.init()`
    (`jaxdp.core.loss_scaling`); `compression`: the compression state to hold (e.g.
    `jaxdp.init_compression(params, jaxdp.powersgd(), replicas)`), or `None`.

    The arrays are not placed on any mesh; use `jaxdp.init_state` for a
    state placed the way `jaxdp.make_train_step` expects.
    """
    return cls(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32), model_state=model_state,
               loss_scale=loss_scale, compression=compression)
