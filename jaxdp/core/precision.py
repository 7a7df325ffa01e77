"""One precision policy: the compute dtype, the reduction dtype and loss scaling, in one value.

`jaxdp.precision(compute_dtype=jnp.bfloat16)` (mixed precision with float32
master weights), `jaxdp.precision(reduce_dtype=jnp.bfloat16)` (half the
gradient's bytes on the wire), `jaxdp.precision(jnp.float16,
loss_scaling=jaxdp.dynamic_loss_scale())` (float16 with torch GradScaler's
rule) or `loss_scaling=1024.0` (a static scale). Pass it to
`jaxdp.init_state` (which makes its state: the loss scale) and to the
steps. Its state lives in `TrainState.loss_scale`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxdp.core.checks import check_float_dtype, check_reduce_dtype
from jaxdp.core.loss_scaling import DynamicLossScale, LossScale, check_loss_scaling, static_loss_scale


class Precision(NamedTuple):
  """A checked precision policy (build it with `precision`).

  Attributes:
    compute_dtype: the forward and backward passes' floating dtype (a numpy
      dtype), or `None` for the params' own. Params, optimizer state and
      every sum stay as they are (float32 master weights).
    reduce_dtype: the dtype the gradient is communicated in (a numpy dtype),
      or `None` for its own (float32 at least). Loss, weights and the
      division stay float32.
    loss_scaling: a `jaxdp.DynamicLossScale` (a static scale is one
      that never changes), or `None`.
  """

  compute_dtype: Any = None
  reduce_dtype: Any = None
  loss_scaling: DynamicLossScale | None = None

  def init(self) -> LossScale | None:
    """The policy's state at step 0 (`TrainState.loss_scale`): the first loss scale, or `None`."""
    return None if self.loss_scaling is None else self.loss_scaling.init()


def precision(compute_dtype: Any = None, reduce_dtype: Any = None, loss_scaling: Any = None) -> Precision:
  """Checks a precision policy and returns it as a `Precision`.

  Args:
    compute_dtype: `None` or a floating dtype (`jnp.bfloat16`, `jnp.float16`, `jnp.float32`).
    reduce_dtype: `None` or a floating dtype with float32's exponent range (`jnp.bfloat16`): the gradient
      travels as weighted sums, which overflow float16.
    loss_scaling: `None`, a `jaxdp.DynamicLossScale` (`jaxdp.dynamic_loss_scale`), or a positive
      power of two: a static scale (non-finite steps are skipped; the scale never changes).

  Raises:
    ValueError, TypeError: a setting out of its range, naming it.
  """
  compute_dtype = check_float_dtype(compute_dtype, "compute_dtype")
  reduce_dtype = check_reduce_dtype(reduce_dtype, "reduce_dtype")
  if loss_scaling is not None and not isinstance(loss_scaling, DynamicLossScale):
    if isinstance(loss_scaling, (int, float)) and not isinstance(loss_scaling, bool):
      loss_scaling = static_loss_scale(loss_scaling)
  check_loss_scaling(loss_scaling)
  return Precision(compute_dtype, reduce_dtype, loss_scaling)


def as_precision(value: Any) -> Precision:
  """`value` as a `Precision` (`None`: the default policy); `TypeError` for anything else."""
  if value is None:
    return Precision()
  if not isinstance(value, Precision):
    raise TypeError(
        f"precision must be a jaxdp.Precision (from jaxdp.precision(compute_dtype=..., reduce_dtype=..., "
        f"loss_scaling=...)) or None, got {type(value).__name__} {value!r}."
    )
  return precision(*value)  # checked again: a Precision(...) built by hand skips the factory's checks


def summed_in(dtype: Any) -> Any:
  """The dtype a collective sum of `dtype` values runs in, traced inside a `shard_map`: float32 for a 16-bit
  float on the CPU backend when the map leaves mesh axes to the compiler, else `dtype` (`None` stays `None`).

  XLA's CPU backend promotes every 16-bit all-reduce and reduce-scatter to float32 (it converts the operand,
  sums in float32 and converts the sum back: the same bits as `x.astype(float32)` summed and rounded to
  `dtype`), and aborts the process compiling one inside a map that leaves other mesh axes to it (jax 0.10.2).
  There jaxdp writes that promotion itself; the caller rounds the sum back to `dtype`. GPU and TPU sum in
  `dtype`.
  """
  if dtype is None:
    return None
  dtype = jnp.dtype(dtype)
  if dtype.itemsize >= 4 or not jnp.issubdtype(dtype, jnp.floating) or jax.default_backend() != "cpu":
    return dtype
  mesh = jax.sharding.get_abstract_mesh()
  left = [a for a in mesh.axis_names if a not in mesh.manual_axes]
  return jnp.dtype(jnp.float32) if left else dtype
