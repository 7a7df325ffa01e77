"""The step's settings, validated once: :func:`step_settings` checks them and returns a :class:`StepSettings`.

The steps (:func:`jaxdp.make_train_step`, :func:`jaxdp.train_step` and the
composable functions a user calls directly: :func:`jaxdp.gradient_step`,
:func:`jaxdp.local_gradient`, :func:`jaxdp.reduce_gradient`) build one from
their keyword arguments at entry and pass it down unchanged to the functions
that take a ``settings`` argument, which do not check it again.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jaxdp._checks import check_float_dtype, check_int, check_reduce_dtype
from jaxdp.compression import check_compression
from jaxdp.layout import check_zero_stage
from jaxdp.randomness import check_example_ids


REDUCTIONS = ("mean", "rank_mean", "sum", "none")
"""The reduction modes accepted by :func:`reduce_gradient` and the steps.

* ``"mean"``: gradient of the global weighted mean ``Σ w·l / Σ w`` over every
  device's examples: exactly the one-big-batch gradient for any uneven split.
* ``"rank_mean"``: mean over replicas of each replica's local weighted mean,
  what PyTorch DDP computes; a replica with zero weight contributes zero but
  still counts in the denominator.
* ``"sum"``: all-reduced sum of the local weighted sums.
* ``"none"``: no communication of the gradient; each replica steps on its own
  local mean (a 16-bit backward pass still sums the weights once, 4 bytes, for
  its scale: see :func:`local_gradient`).
"""


def check_reduction(reduction: str) -> None:
  """Raises ``ValueError`` unless ``reduction`` is one of :data:`REDUCTIONS`."""
  if reduction not in REDUCTIONS:
    raise ValueError(
        f"reduction={reduction!r} is not supported; use one of {', '.join(map(repr, REDUCTIONS))}."
    )


def check_bucket_bytes(bucket_bytes: Any) -> None:
  """Raises ``ValueError`` unless ``bucket_bytes`` is ``None`` or an integer ``>= 0``."""
  if bucket_bytes is not None:
    check_int(bucket_bytes, "bucket_bytes", 0, "or None to reduce the gradient in one all-reduce.")


class StepSettings(NamedTuple):
  """The settings of a data-parallel step, as :func:`step_settings` checked them.

  Attributes:
    axis_name: the data-parallel axis, or several (a tuple).
    reduction: one of :data:`jaxdp.REDUCTIONS`.
    accum_steps: micro-batches per device and step.
    zero_stage: 0, 1, 2 or 3 (see :mod:`jaxdp.layout`).
    compute_dtype: the forward and backward passes' floating dtype (a numpy
      dtype), or ``None`` for the params' own.
    grad_reduce_dtype: the dtype the gradient is communicated in (a numpy
      dtype), or ``None`` for its own.
    bucket_bytes: the gradient's bucket size in bytes, or ``None`` for one
      all-reduce.
    example_ids: where the rows' ids are (see :mod:`jaxdp.randomness`), or
      ``None``.
    compression: a :class:`jaxdp.PowerSGD` (the gradient's low-rank
      reduction, see :mod:`jaxdp.compression`), or ``None`` for the exact one.
  """

  axis_name: Any = "data"
  reduction: str = "mean"
  accum_steps: int = 1
  zero_stage: int = 0
  compute_dtype: Any = None
  grad_reduce_dtype: Any = None
  bucket_bytes: int | None = None
  example_ids: Any = None
  compression: Any = None


def step_settings(
    *,
    axis_name: Any = "data",
    reduction: str = "mean",
    accum_steps: int = 1,
    zero_stage: int = 0,
    compute_dtype: Any = None,
    grad_reduce_dtype: Any = None,
    bucket_bytes: int | None = None,
    example_ids: Any = None,
    reduce_dtype_name: str = "grad_reduce_dtype",
    compression: Any = None,
) -> StepSettings:
  """Checks a step's settings and returns them as a :class:`StepSettings`.

  Args:
    axis_name: the data-parallel axis, or several (a tuple).
    reduction: one of :data:`jaxdp.REDUCTIONS`.
    accum_steps: an integer ``>= 1``.
    zero_stage: 0, 1, 2 or 3; ``reduction="none"`` needs 0.
    compute_dtype: a floating dtype or ``None``.
    grad_reduce_dtype: a floating dtype with float32's range or ``None``.
    bucket_bytes: an integer ``>= 0`` or ``None``.
    example_ids: ``None``, a key of a dict batch (a str) or a callable.
    reduce_dtype_name: the name an error gives ``grad_reduce_dtype`` (the
      caller's own keyword).
    compression: ``None`` or :func:`jaxdp.powersgd`'s settings; it needs
      ``reduction="mean"`` or ``"sum"``, ``zero_stage`` 0 or 1 and no
      ``grad_reduce_dtype``.

  Returns:
    The settings, dtypes resolved to numpy dtypes.

  Raises:
    ValueError: a setting out of its range, or ``reduction="none"`` with
      ``zero_stage > 0``.
    TypeError: ``example_ids`` of another type.
  """
  check_reduction(reduction)
  check_zero_stage(zero_stage)
  if zero_stage and reduction == "none":
    raise ValueError("reduction='none' keeps independent replicas, which a sharded (zero_stage > 0) state cannot hold; use zero_stage=0.")
  check_example_ids(example_ids)
  accum_steps = check_int(accum_steps, "accum_steps", 1, "split each device's batch into that many micro-batches.")
  compute_dtype = check_float_dtype(compute_dtype, "compute_dtype")
  grad_reduce_dtype = check_reduce_dtype(grad_reduce_dtype, reduce_dtype_name)
  check_bucket_bytes(bucket_bytes)
  check_compression(compression)
  if compression is not None:
    _check_compressed(reduction, zero_stage, grad_reduce_dtype, reduce_dtype_name)
  return StepSettings(axis_name, reduction, accum_steps, zero_stage, compute_dtype, grad_reduce_dtype, bucket_bytes,
                      example_ids, compression)


def _check_compressed(reduction: str, zero_stage: int, grad_reduce_dtype: Any, reduce_dtype_name: str) -> None:
  """Refuses what PowerSGD does not combine with (it compresses the sums that "mean" and "sum" reduce)."""
  if reduction not in ("mean", "sum"):
    raise ValueError(
        f"compression=powersgd(...) with reduction={reduction!r}: PowerSGD compresses the all-reduce of the local "
        "weighted sums, which 'none' does not have and 'rank_mean' replaces by per-replica means; use "
        "reduction='mean' (or 'sum')."
    )
  if zero_stage >= 2:
    raise ValueError(
        f"compression=powersgd(...) with zero_stage={zero_stage}: stages 2-3 reduce-scatter the gradient, and "
        "PowerSGD's low-rank sum is a whole-matrix all-reduce; use zero_stage=0 or 1."
    )
  if grad_reduce_dtype is not None:
    raise ValueError(
        f"compression=powersgd(...) with {reduce_dtype_name}={grad_reduce_dtype.name}: PowerSGD sends its factors "
        f"in float32; use one or the other ({reduce_dtype_name}=None with compression=)."
    )
