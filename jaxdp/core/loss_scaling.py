"""Dynamic loss scaling for float16: the scale in the state, its settings as arguments, its update rule.

A float16 backward pass loses small gradients to underflow (below 6e-8) and
large ones to overflow (above 65,504). Dynamic loss scaling (torch's
`GradScaler`, Micikevicius et al. 2018) multiplies the differentiated loss
by a scale `S` and divides the float32 gradient by `S` after the backward
pass, before the reduction. `S` adapts: a step whose gradient or loss is not
finite is skipped and halves `S`; after `growth_interval` consecutive
applied steps `S` doubles.

* `dynamic_loss_scale` returns the settings, a `DynamicLossScale`
  (checked once), given to the step as `loss_scaling=`.
* `LossScale` `(scale, good_steps)` is the state: it lives in
  `jaxdp.TrainState.loss_scale`, replicated on every device at every
  ZeRO stage, and is checkpointed with the rest of the state.
* `update_loss_scale` is the rule, a pure function of the step's
  collective non-finite flag (the same on every replica, so every replica
  keeps the same scale).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class LossScale(NamedTuple):
  """The dynamic loss scale carried from step to step (a pytree: two scalars).

  Attributes:
    scale: float32 scalar, what the next step multiplies the differentiated loss by.
    good_steps: int32 scalar, applied steps since the scale last changed (torch's growth tracker).
  """

  scale: Any
  good_steps: Any


class DynamicLossScale(NamedTuple):
  """The settings of dynamic loss scaling, as `dynamic_loss_scale` checked them.

  Attributes:
    init_scale: the first scale.
    growth_factor: the scale is multiplied by this after `growth_interval`
      applied steps in a row.
    backoff_factor: the scale is multiplied by this on a non-finite step.
    growth_interval: applied steps in a row before the scale grows.
  """

  init_scale: float = 2.0**16
  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  growth_interval: int = 2000

  def init(self) -> LossScale:
    """The state of a run's first step: `LossScale(float32(init_scale), int32(0))`."""
    return LossScale(jnp.asarray(self.init_scale, jnp.float32), jnp.zeros((), jnp.int32))


# The scales the float32 state can hold with a normal reciprocal: the step multiplies the gradient by 1 / scale,
# and a subnormal factor (below 2**-126, flushed to zero by accelerators) would lose the whole step.
MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT = -126, 126
MAX_GROWTH_INTERVAL = int(np.iinfo(np.int32).max)  # LossScale.good_steps is an int32 counter


def _power_of_two(value: float, name: str, low: int, high: int, why: str, fix: str) -> float:
  """`value` if it is `2**k` with `low <= k <= high`, else a `ValueError` naming `name` and the range."""
  mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, 0.5 <= mantissa < 1
  if mantissa != 0.5 or not low <= exponent - 1 <= high:
    got = f"2**{exponent - 1}" if mantissa == 0.5 else repr(value)
    raise ValueError(f"{name} must be a power of two from 2**{low} to 2**{high}, got {got}: {why}; {fix}")
  return value


def _positive_finite(value: Any, name: str, fix: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}; {fix}")
  value = float(value)
  if not math.isfinite(value) or value <= 0 or value > float(np.finfo(np.float32).max):
    raise ValueError(f"{name} must be positive, finite and within float32's range, got {value!r}; {fix}")
  return value


def dynamic_loss_scale(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> DynamicLossScale:
  """Dynamic loss scaling with torch `GradScaler`'s rules; its defaults are torch's.

  Pass the result as `make_train_step(..., loss_scaling=...)` (or
  `jaxdp.train_step`'s), with a state built with
  `jaxdp.init_state(..., loss_scale=scaling.init())`.

  Every scale is a power of two from `2**-126` to `2**126`: the float32
  gradient is multiplied by `1/scale`, which is exact for a power of two
  (a 32-bit step gives the unscaled step's bits) and a normal float32
  number in that range (a subnormal one, `1/2**127`, would be flushed to
  zero and the step lost).

  Args:
    init_scale: the first scale, a power of two from `2**-126` to
      `2**126` (`2.0**100` is fine; `2.0**127`, zero, negative,
      subnormal, infinite or NaN values and other numbers are refused).
    growth_factor: a power of two `> 1` (up to `2**126`); the scale is
      multiplied by it after `growth_interval` applied steps in a row
      (unless the product would exceed `2**126`: torch keeps it only
      when it overflows float32).
    backoff_factor: a power of two in `[2**-126, 1)`; the scale is
      multiplied by it on a step whose gradient or loss is not finite (that
      step is skipped), down to `2**-126` at the least.
    growth_interval: an integer from 1 to `2**31 - 1` (the state's
      counter is an int32).

  Returns:
    A `DynamicLossScale`.

  Raises:
    ValueError: a setting out of its range, naming it and the range.
    TypeError: not a number.
  """
  init_scale = _positive_finite(init_scale, "init_scale", "use e.g. 2.0**16 (torch's default).")
  init_scale = _power_of_two(
      init_scale, "init_scale", MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT,
      "the step multiplies the float32 gradient by 1/init_scale, exact only for a power of two, and its "
      "reciprocal must be a normal float32 number (subnormals are flushed to zero)", "use e.g. 2.0**16 (torch's default).")
  growth_factor = _positive_finite(growth_factor, "growth_factor", "use e.g. 2.0 (torch's default).")
  if growth_factor <= 1:
    raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}: the scale would never grow back after a "
                     "backoff; use e.g. 2.0 (torch's default).")
  growth_factor = _power_of_two(growth_factor, "growth_factor", 1, MAX_SCALE_EXPONENT,
                                "a grown scale must stay a power of two, whose unscaling is exact",
                                "use e.g. 2.0 (torch's default).")
  backoff_factor = _positive_finite(backoff_factor, "backoff_factor", "use e.g. 0.5 (torch's default).")
  if backoff_factor >= 1:
    raise ValueError(f"backoff_factor must lie in (0, 1), got {backoff_factor!r}: a non-finite step must lower the "
                     "scale; use e.g. 0.5 (torch's default).")
  backoff_factor = _power_of_two(backoff_factor, "backoff_factor", MIN_SCALE_EXPONENT, -1,
                                 "a lowered scale must stay a power of two, whose unscaling is exact",
                                 "use e.g. 0.5 (torch's default).")
  if (isinstance(growth_interval, bool) or not isinstance(growth_interval, (int, np.integer))
      or not 1 <= growth_interval <= MAX_GROWTH_INTERVAL):
    raise ValueError(f"growth_interval must be an integer >= 1 and <= {MAX_GROWTH_INTERVAL} (2**31 - 1: the state "
                     f"counts applied steps in an int32), got {growth_interval!r}; use e.g. 2000 (torch's default), "
                     "the applied steps in a row before the scale grows.")
  return DynamicLossScale(init_scale, growth_factor, backoff_factor, int(growth_interval))


def update_loss_scale(scaling: DynamicLossScale, loss_scale: LossScale, nonfinite: Any, applied: Any) -> LossScale:
  """The next step's `LossScale` (torch `GradScaler.update`'s rule).

  `nonfinite`: the step's gradient or loss was not finite (the step was
  skipped): `scale *= backoff_factor` (not below `2**-126`),
  `good_steps = 0`. Else `applied`: `good_steps += 1`, and when it
  reaches `growth_interval` `scale *= growth_factor` (kept if that
  product exceeds `2**126`, whose reciprocal is float32's smallest normal
  number; torch keeps it only if the product is not finite) and
  `good_steps = 0`. A step neither (skipped for a global weight of zero)
  leaves both unchanged.
  """
  scale, good = jnp.asarray(loss_scale.scale, jnp.float32), jnp.asarray(loss_scale.good_steps, jnp.int32)
  nonfinite, applied = jnp.asarray(nonfinite, bool), jnp.asarray(applied, bool)
  counted = good + 1
  grow = applied & ~nonfinite & (counted >= scaling.growth_interval)
  grown = scale * jnp.float32(scaling.growth_factor)
  lowered = jnp.maximum(scale * jnp.float32(scaling.backoff_factor), jnp.float32(2.0**MIN_SCALE_EXPONENT))
  new_scale = jnp.where(nonfinite, lowered, jnp.where(grow & (grown <= jnp.float32(2.0**MAX_SCALE_EXPONENT)),
                                                      grown, scale))
  new_good = jnp.where(nonfinite | grow, 0, jnp.where(applied, counted, good)).astype(jnp.int32)
  return LossScale(new_scale, new_good)


def check_loss_scaling(loss_scaling: Any, reduction: str = "mean") -> None:
  """Raises `TypeError` unless `loss_scaling` is `None` or a `DynamicLossScale`; `ValueError`
  under `reduction="none"`."""
  if loss_scaling is None:
    return
  if not isinstance(loss_scaling, DynamicLossScale):
    raise TypeError(f"loss_scaling must be a jaxdp.DynamicLossScale (from jaxdp.dynamic_loss_scale()) or None, got "
                    f"{type(loss_scaling).__name__}.")
  # One built as a NamedTuple by hand is checked as the factory checks it.
  if loss_scaling.growth_factor == loss_scaling.backoff_factor == 1.0:
    static_loss_scale(loss_scaling.init_scale)
  else:
    dynamic_loss_scale(*loss_scaling)
  if reduction == "none":
    # Each replica would see only its own overflows and keep its own scale: the replicated scale could not hold it.
    raise ValueError(
        "loss_scaling with reduction='none': each replica skips on its own non-finite flag there, and one scale "
        "replicated over the replicas cannot follow them all. Use a reducing reduction ('mean', 'sum', "
        "'rank_mean'), or no loss_scaling."
    )


def check_loss_scale(loss_scaling: Any, loss_scale: Any, name: str = "state") -> None:
  """Refuses a step's `loss_scaling` and a state's `loss_scale` that do not go together (host side, shapes only).

  Raises `ValueError` when one is given without the other, `TypeError` for a
  `loss_scaling` that is not a `DynamicLossScale` or a `loss_scale`
  that is not a `LossScale` of a float32 and an int32 scalar.
  """
  check_loss_scaling(loss_scaling)
  if loss_scaling is not None and loss_scale is None:
    raise ValueError(
        f"loss_scaling is given but {name}.loss_scale is None: the scale lives in the state. Build the state with "
        f"jaxdp.init_state(..., loss_scale=scaling.init()) or pass {name}._replace(loss_scale=scaling.init()). "
        "Nothing ran and nothing was donated."
    )
  if loss_scaling is None and loss_scale is not None:
    raise ValueError(
        f"{name}.loss_scale is set but the step has no loss_scaling: its scale would never be updated. Pass "
        f"loss_scaling=jaxdp.dynamic_loss_scale(...) to the step, or {name}._replace(loss_scale=None). Nothing ran "
        "and nothing was donated."
    )
  if loss_scale is not None:
    check_loss_scale_value(loss_scale, f"{name}.loss_scale")


def check_loss_scale_value(loss_scale: Any, name: str = "loss_scale") -> None:
  """Raises `TypeError`/`ValueError` unless `loss_scale` is a `LossScale` of a float32 and an
  int32 scalar (arrays or `ShapeDtypeStruct`s; shapes and dtypes only)."""
  if not isinstance(loss_scale, LossScale):
    raise TypeError(f"{name} must be a jaxdp.LossScale (scaling.init()), got {type(loss_scale).__name__}.")
  for field, dtype in (("scale", np.float32), ("good_steps", np.int32)):
    value = getattr(loss_scale, field)
    got = getattr(value, "dtype", type(value).__name__)
    if np.shape(value) != () or got != dtype:
      raise ValueError(
          f"{name}.{field} must be a {np.dtype(dtype).name} scalar array, got shape {np.shape(value)} and dtype "
          f"{got}; build it with scaling.init()."
      )


def abstract_loss_scale() -> LossScale:
  """A `LossScale` of `ShapeDtypeStruct`s (a checkpoint's restore target)."""
  return LossScale(jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))


def static_loss_scale(scale: float) -> DynamicLossScale:
  """A loss scale that never changes: the backward pass is scaled by `scale`, a non-finite step is skipped.

  A `DynamicLossScale` whose factors are 1, so the same state
  (`LossScale`) and checkpoints hold it.
  """
  fix = "use a static scale such as 1024.0, or jaxdp.dynamic_loss_scale()."
  scale = _power_of_two(
      _positive_finite(scale, "loss_scaling", fix), "loss_scaling", MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT,
      "the step multiplies the float32 gradient by 1/scale, exact only for a power of two, and its reciprocal must "
      "be a normal float32 number", fix)
  return DynamicLossScale(scale, 1.0, 1.0, int(np.iinfo(np.int32).max))
