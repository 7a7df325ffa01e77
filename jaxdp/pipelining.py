"""Pipeline parallelism over a ``stage`` mesh axis: the schedules.

A stack of ``L`` layers is cut into ``P`` stages (one per device of the
stage axis); the batch goes through in ``M`` microbatches. A *work unit* is
one microbatch passing through one stage's block of ``L / (P·R)`` layers.

* ``"gpipe"``: each stage holds ``L / P`` contiguous layers; microbatch
  ``m`` enters stage 0 at iteration ``m``. Bubble ``(P−1) / (M+P−1)``.
* ``"circular"`` (MaxText's looping schedule) with ``R`` repeats: stage
  ``s`` holds the blocks ``s, s+P, s+2P, …`` and every microbatch goes round
  the ring of stages ``R`` times. Bubble ``(P−1) / (R·M+P−1)``; it needs
  ``M ≥ P`` so that a microbatch is back at stage 0 before it is due there.

Both are one table (:func:`schedule_table`): at iteration ``t`` stage ``s``
runs unit ``w = t − s`` when ``0 ≤ w < R·M`` (repeat ``w // M``, microbatch
``w % M``, layer block ``(w // M)·P + s``), else it idles. GPipe is the
table with ``R = 1``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from jaxdp._checks import check_int

SCHEDULES = ("gpipe", "circular")
"""The pipeline schedules: ``"gpipe"`` and ``"circular"`` (see :mod:`jaxdp.pipelining`)."""

IDLE = -1
"""A :func:`schedule_table` entry for a stage that does no work at that iteration."""


class Pipeline(NamedTuple):
  """A pipeline schedule over a mesh axis, as :func:`pipeline` checked it.

  Attributes:
    microbatches: ``M``, how many microbatches each device's batch is cut into (its rows must divide by it).
    schedule: one of :data:`SCHEDULES`.
    repeats: ``R``, rounds of the ring per microbatch (1 under ``"gpipe"``).
    axis_name: the mesh axis of the stages.
  """

  microbatches: int
  schedule: str = "gpipe"
  repeats: int = 1
  axis_name: str = "stage"


def pipeline(microbatches: int, schedule: str = "gpipe", *, repeats: int = 1, axis_name: str = "stage") -> Pipeline:
  """A checked :class:`Pipeline`: ``microbatches >= 1``, a known schedule, ``repeats >= 1`` (1 for ``"gpipe"``)."""
  microbatches = check_int(microbatches, "microbatches", 1, "the number of microbatches per device and step.")
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule={schedule!r} is not a pipeline schedule; use one of {', '.join(map(repr, SCHEDULES))}.")
  repeats = check_int(repeats, "repeats", 1, "the rounds of the ring of stages each microbatch makes.")
  if schedule == "gpipe" and repeats != 1:
    raise ValueError(f"repeats={repeats} under schedule='gpipe', which passes each microbatch through the stages "
                     "once; use schedule='circular' for repeats > 1.")
  if not isinstance(axis_name, str):
    raise TypeError(f"axis_name must be a mesh axis name (a str), got {axis_name!r}.")
  return Pipeline(microbatches, schedule, repeats, axis_name)


def check_schedule(stages: int, microbatches: int, repeats: int = 1) -> None:
  """Raises ``ValueError`` when ``M < P`` with ``R > 1``: microbatch ``m`` would be due back at stage 0 before
  it has left the last stage."""
  if repeats > 1 and microbatches < stages:
    raise ValueError(
        f"the circular schedule with repeats={repeats} over {stages} stages needs microbatches >= stages, got "
        f"microbatches={microbatches}: microbatch m re-enters stage 0 at iteration M + m but leaves stage "
        f"{stages - 1} only at iteration {stages} + m. Use microbatches >= {stages} (2·P = {2 * stages} is a "
        "good default) or schedule='gpipe'."
    )


def schedule_table(stages: int, microbatches: int, repeats: int = 1) -> np.ndarray:
  """``[R·M + P − 1, P]`` int32: the work unit each stage runs at each iteration, or :data:`IDLE`."""
  stages = check_int(stages, "stages", 1)
  microbatches = check_int(microbatches, "microbatches", 1)
  repeats = check_int(repeats, "repeats", 1)
  check_schedule(stages, microbatches, repeats)
  units = repeats * microbatches
  t = np.arange(units + stages - 1)[:, None]
  w = t - np.arange(stages)[None, :]
  return np.where((w >= 0) & (w < units), w, IDLE).astype(np.int32)


def bubble_fraction(table: np.ndarray) -> float:
  """The fraction of (iteration, stage) cells of ``table`` that do no work."""
  table = np.asarray(table)
  return float(np.mean(table == IDLE))


def bubble_formula(stages: int, microbatches: int, repeats: int = 1) -> float:
  """``(P − 1) / (R·M + P − 1)``: GPipe's bubble at ``R = 1``, the circular schedule's otherwise."""
  return (stages - 1) / (repeats * microbatches + stages - 1)


def unit_of(w: Any, microbatches: int) -> tuple[Any, Any]:
  """``(repeat, microbatch)`` of work unit ``w``."""
  return w // microbatches, w % microbatches
