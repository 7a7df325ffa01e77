"""What the step functions run under: the step's values, checked once, in one bundle.

The public functions take values (`jaxdp.DataParallel` or an axis
name, a `jaxdp.reductions.Reduction`, a `jaxdp.Precision`,
`accum_steps`, `example_ids`); `step_config` checks them and returns
the `StepConfig` that the internal functions read, unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jaxdp.core.checks import check_int
from jaxdp.core.precision import Precision, as_precision
from jaxdp.core.randomness import check_example_ids
from jaxdp.reductions import Resolved, resolve
from jaxdp.sharding.parallel import check_values


class StepConfig(NamedTuple):
  """A step's checked values.

  Attributes:
    axis_name: the data axis, or several (a tuple).
    reduction: the resolved reduction (`jaxdp.reductions.Resolved`).
    precision: the precision policy (`jaxdp.Precision`).
    accum_steps: micro-batches per device and step.
    zero_stage: 0-3 (read by the steps' ZeRO paths).
    example_ids: where the rows' ids are (`jaxdp.core.randomness`), or `None`.
    group_axis: the mesh axis of DiLoCo's replica groups (`jaxdp.runtime.diloco`), or `None`: each group takes
      its own step, so its loss may vary over that axis after the reduction over the data axes.
  """

  axis_name: Any = "data"
  reduction: Resolved = Resolved()
  precision: Precision = Precision()
  accum_steps: int = 1
  zero_stage: int = 0
  example_ids: Any = None
  group_axis: str | None = None

  @property
  def mode(self) -> str:
    return self.reduction.mode

  @property
  def bucket_bytes(self) -> int | None:
    return self.reduction.bucket_bytes

  @property
  def compression(self) -> Any:
    return self.reduction.compression

  @property
  def user(self) -> Any:
    return self.reduction.user

  @property
  def compute_dtype(self) -> Any:
    return self.precision.compute_dtype

  @property
  def grad_reduce_dtype(self) -> Any:
    return self.precision.reduce_dtype

  @property
  def loss_scaling(self) -> Any:
    return self.precision.loss_scaling


def axis_of(layout: Any) -> Any:
  """The data axes of `layout`: a `jaxdp.DataParallel`'s, or `layout` itself (an axis name)."""
  return getattr(layout, "axis_name", layout)


def step_config(layout: Any = "data", reduction: Any = None, precision: Any = None, accum_steps: int = 1,
                example_ids: Any = None) -> StepConfig:
  """Checks a step's values and returns them as a `StepConfig` (`layout`: a layout or an axis name)."""
  resolved = resolve(reduction)
  policy = as_precision(precision)
  check_example_ids(example_ids)
  accum_steps = check_int(accum_steps, "accum_steps", 1, "split each device's batch into that many micro-batches.")
  zero_stage = getattr(layout, "zero_stage", 0)
  check_values(resolved, policy, zero_stage)
  return StepConfig(axis_of(layout), resolved, policy, accum_steps, zero_stage, example_ids)
