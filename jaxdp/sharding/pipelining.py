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

Use: a mesh with a stage axis (``("stage", "data")``, or ``("stage", "replica", "data")``
with ``axis_name=("replica", "data")``), ``layers=`` naming the stacks, and
``pipeline=jaxdp.pipeline(M, schedule, repeats=R)`` in
:func:`jaxdp.make_train_step` and :func:`jaxdp.make_eval_step`. The loss
loops over each stack with :func:`jaxdp.scan_layers`, which in a pipelined
step runs :func:`run_stack` on the stage's block of layers (a plain
``lax.scan`` elsewhere, so the same loss runs on one device); everything
before and after the stack runs on every stage alike. The gradient is
reduced over the data axes once per step, after the whole schedule; each
stage's layers get their own gradient, and the layers before the stack the
sum over the stages that autodiff inserts (the transpose of their implicit
broadcast over the stage axis). Model state (BatchNorm statistics) is
supported outside the stack only: ``scan_layers``' carry must hold the
batch rows on dim 0 in every leaf, and ``f`` must return no per-layer
outputs, so a stack cannot carry statistics (a ``ValueError`` says so).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdp.core.checks import check_int
from jaxdp.sharding.layout import layer_mask
from jaxdp.core.carries import varying_axes

SCHEDULES = ("gpipe", "circular")
"""The pipeline schedules: ``"gpipe"`` and ``"circular"`` (see :mod:`jaxdp.sharding.pipelining`)."""

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


# The runtime: what a pipelined step runs in place of the scan over a stack of layers ---------------------------


class Running(NamedTuple):
  """What :func:`jaxdp.scan_layers` reads while a pipelined step traces its loss (see :func:`running`).

  Attributes:
    pipeline: the :class:`Pipeline`.
    stages: ``P``, the size of the stage axis.
    layers: the numbers of layers ``L`` of the stacks named by ``layers=``.
    data_axes: the data axes (manual in the step, like the stage axis).
    shapes: each stacked leaf's local shape on one stage, ``(L / P, ...)``.
    ran: the local shapes of the stacked leaves the pipeline ran on, appended as it runs.
  """

  pipeline: Pipeline
  stages: int
  layers: tuple
  data_axes: tuple
  shapes: tuple
  ran: list


_RUNNING: contextvars.ContextVar[Running | None] = contextvars.ContextVar("jaxdp_pipeline", default=None)


def active() -> Running | None:
  """The pipeline of the step whose loss is being traced, or ``None`` (then :func:`jaxdp.scan_layers` scans)."""
  return _RUNNING.get()


@contextlib.contextmanager
def running(pipe: Pipeline, stages: int, layers: Any, data_axes: tuple, shapes: tuple):
  """While tracing a pipelined step's loss: :func:`jaxdp.scan_layers` runs :func:`run_stack` instead of a scan.

  Yields the :class:`Running` record; :func:`check_ran` then tells whether the loss ran every stack through it.
  """
  record = Running(pipe, stages, tuple(sorted(set(layers))), tuple(data_axes), tuple(shapes), [])
  token = _RUNNING.set(record)
  try:
    yield record
  finally:
    _RUNNING.reset(token)


def check_ran(record: Running) -> None:
  """Raises ``ValueError`` unless the loss ran each stacked leaf through :func:`jaxdp.scan_layers`.

  A loss that loops over its stage's block itself (``lax.scan`` on the stacked params) would run only that
  stage's ``L / P`` layers and train a different model, silently.
  """
  missing = [shape for shape in record.shapes if shape not in record.ran]
  if missing:
    raise ValueError(
        f"a pipelined step (pipeline={record.pipeline}) traced a loss that did not run the stacks named by layers= "
        f"through jaxdp.scan_layers: stacked leaves of local shapes {missing[:4]} (L in {list(record.layers)} layers "
        f"over P = {record.stages} stages) were not pipelined. Inside the step each stage holds only its own L / P "
        "layers, so a lax.scan or Python loop over them would run a different "
        "model. Loop over the stack with jaxdp.scan_layers(f, carry, layers, xs) (one device: a lax.scan)."
    )


def checked_loss(loss_fn: Callable, record: Running) -> Callable:
  """``loss_fn`` (same signature) that raises :func:`check_ran`'s error as soon as a call of it has traced."""

  @functools.wraps(loss_fn)
  def traced(*args, **kwargs):
    record.ran.clear()
    out = loss_fn(*args, **kwargs)
    check_ran(record)
    return out

  return traced


def circular_order(x: Any, stages: int, repeats: int) -> Any:
  """A stacked leaf's layer axis (natural order) put in the circular assignment: stage ``s``'s rows hold the
  blocks ``s, s + P, s + 2P, …`` (``[L, ...]`` as ``[R, P, B, ...]`` transposed to ``[P, R, B, ...]``)."""
  shape = np.shape(x)
  block = shape[0] // (stages * repeats)
  blocks = x.reshape(repeats, stages, block, *shape[1:])
  return jnp.swapaxes(blocks, 0, 1).reshape(shape)


def natural_order(x: Any, stages: int, repeats: int) -> Any:
  """The inverse of :func:`circular_order`."""
  shape = np.shape(x)
  block = shape[0] // (stages * repeats)
  blocks = x.reshape(stages, repeats, block, *shape[1:])
  return jnp.swapaxes(blocks, 0, 1).reshape(shape)


def _vary(x: jax.Array, axes: tuple) -> jax.Array:
  # Varying over every manual axis of the step: the loop's carry mixes activations (varying over the data
  # axes) and a stage's layers (varying over the stage axis), and its type must not change across iterations.
  missing = tuple(a for a in axes if a not in varying_axes(x))
  return lax.pcast(x, missing, to="varying") if missing else x


def run_stack(f: Callable, init: Any, layers: Any, xs: Any, record: Running) -> tuple[Any, None]:
  """The pipelined loop over a stack (:func:`jaxdp.scan_layers` inside a pipelined step): ``(carry, None)``.

  Runs inside the step's ``shard_map`` (manual over the stage and data axes). ``layers``: this stage's block
  of each stacked leaf, ``[L / P, ...]`` (under ``"circular"`` the blocks ``s, s + P, …`` in that order);
  ``init``: the activations, every leaf with this device's rows on dim 0, the same on every stage; ``xs``:
  per-layer inputs of the whole stack (``[L, ...]``, e.g. dropout keys), each stage takes its layers' rows.
  The loop runs over the rows of :func:`schedule_table` (its input): at iteration ``t`` stage ``s`` runs unit
  ``table[t, s]`` (``w = t − s``); its output moves to stage
  ``s + 1`` by ``ppermute`` (stage ``P − 1`` to stage 0 for the next repeat, kept there per microbatch until
  due). The last stage's outputs of the last repeat are summed over the stage axis (zeros elsewhere), so the
  result is the same on every stage. Idle iterations run the layers on a real microbatch's values and their
  results are dropped (never zeros: ``0 · NaN`` is NaN in the backward pass).
  """
  pipe, stages = record.pipeline, record.stages
  axis, m_count, repeats = pipe.axis_name, pipe.microbatches, pipe.repeats
  local = {np.shape(x)[0] for x in jax.tree.leaves(layers)}
  if len(local) != 1:
    raise ValueError(f"scan_layers: the stacked layers must share a leading layer axis, got sizes {sorted(local)}.")
  local = local.pop()
  total = local * stages
  if total not in record.layers or local % repeats:
    raise ValueError(
        f"scan_layers in a pipelined step got layers with a leading axis of {local}; pass a stack named by "
        f"layers= as the loss got it (L / P layers per stage, L in {list(record.layers)}, P = {stages})."
    )
  record.ran.extend(tuple(np.shape(x)) for x in jax.tree.leaves(layers))
  block = local // repeats
  rows = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(init)}
  if len(rows) != 1 or None in rows:
    raise ValueError(
        f"scan_layers in a pipelined step cuts the carry into {m_count} microbatches along dim 0, so every leaf of "
        f"it must hold the batch rows there; got leading sizes {sorted(map(str, rows))}. Carry only activations "
        "through the stack (a model state such as BatchNorm statistics inside a pipelined stack is not supported)."
    )
  rows = rows.pop()
  if rows % m_count:
    raise ValueError(
        f"scan_layers in a pipelined step: this device's {rows} rows (per micro-batch of accum_steps) do not divide "
        f"into microbatches={m_count}; pad the batch to rows per device and micro-batch that divide by {m_count}: "
        "jaxdp.split_batch(batch, mesh, weights=..., rows=R) (weight-0 padding rows; shard_uneven takes rows= too)."
    )
  axes = (axis, *record.data_axes)
  s = lax.axis_index(axis)
  # This stage's rows of the per-layer inputs: layer (r·P + s)·B + j at local row r·B + j.
  if xs is not None:
    counts = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(xs)}
    if counts != {total}:
      raise ValueError(
          f"scan_layers in a pipelined step: xs must have a leading layer axis of the whole stack, "
          f"{total} layers, got sizes {sorted(map(str, counts))}; each stage takes its own layers' rows."
      )
    index = ((jnp.arange(repeats)[:, None] * stages + s) * block + jnp.arange(block)[None, :]).reshape(-1)
    xs = jax.tree.map(lambda x: jnp.take(_vary(x, axes), index, axis=0), xs)
  micro = jax.tree.map(lambda x: _vary(x, axes).reshape(m_count, rows // m_count, *np.shape(x)[1:]), init)
  pick = lambda tree, i: jax.tree.map(lambda x: x[i], tree)  # noqa: E731
  select = lambda c, a, b: jax.tree.map(lambda x, y: jnp.where(c, x, y), a, b)  # noqa: E731
  ring = [(i, (i + 1) % stages) for i in range(stages)]

  def run_block(x, r):
    start = r * block
    mine = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, start, block, axis=0), layers)
    own_xs = None if xs is None else jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, start, block, axis=0), xs)
    y, ys = lax.scan(lambda c, lx: f(c, lx[0], lx[1]), x, (mine, own_xs), length=block)
    if jax.tree.leaves(ys):
      raise ValueError("scan_layers in a pipelined step: f must return (carry, None); per-layer outputs (ys) are "
                       "not gathered across stages. Return what the loss needs in the carry.")
    return y

  def iteration(state, row):
    # row: schedule_table's row of this iteration, the unit each stage runs (IDLE: none).
    incoming, waiting, outputs = state
    w = row[s]
    r, m = unit_of(jnp.maximum(w, 0), m_count)  # idle: unit 0's block and microbatch, results dropped
    # Stage 0 takes a new microbatch in the first repeat, later the one back from stage P − 1 (idle: a real one).
    first = select(r == 0, pick(micro, m), pick(waiting, m))
    y = run_block(select(s == 0, first, incoming), r)
    done = (w != IDLE) & (s == stages - 1) & (r == repeats - 1)
    outputs = jax.tree.map(lambda o, v: o.at[m].set(jnp.where(done, v, o[m])), outputs, y)
    sent = jax.tree.map(lambda v: lax.ppermute(v, axis, ring), y)
    # Stage 0 receives the unit stage P − 1 ran, due back at stage 0 M iterations after it entered it (M ≥ P).
    back = row[stages - 1]
    slot = jnp.maximum(back, 0) % m_count
    keep = (s == 0) & (back != IDLE)
    waiting = jax.tree.map(lambda o, v: o.at[slot].set(jnp.where(keep, v, o[slot])), waiting, sent)
    return (sent, waiting, outputs), None

  start = (pick(micro, 0), micro, micro)
  table = jnp.asarray(schedule_table(stages, m_count, repeats))
  (_, _, outputs), _ = lax.scan(iteration, start, table)
  last = jax.tree.map(lambda o: lax.psum(jnp.where(s == stages - 1, o, jnp.zeros_like(o)), axis), outputs)
  return jax.tree.map(lambda o: o.reshape(rows, *o.shape[2:]), last), None


# Checks before anything runs or is donated ------------------------------------------------------------------------


def check_pipeline(pipe: Any, mesh: Any, axis_name: Any, *, layers: Any, zero_stage: int, backend: str) -> None:
  """Raises unless ``pipe`` (a :class:`Pipeline` or ``None``) can run on ``mesh`` with this layout (the pairs with
  a reduction are :func:`jaxdp.sharding.parallel.check_step`'s)."""
  names = tuple(getattr(mesh, "axis_names", ()))
  data = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  if pipe is None:
    if "stage" in names and "stage" not in data:
      raise ValueError(
          f"mesh has a 'stage' axis (axes {names}, sizes {dict(mesh.shape)}) but pipeline=None: the step would "
          "replicate the work over it. Pass pipeline=jaxdp.pipeline(microbatches, 'gpipe') (with layers= naming the "
          "stacks to split over the stages), or build the mesh without a 'stage' axis."
      )
    return
  if not isinstance(pipe, Pipeline):
    raise TypeError(f"pipeline must be a jaxdp.Pipeline (from jaxdp.pipeline(microbatches, schedule)), got {pipe!r}.")
  pipe = pipeline(pipe.microbatches, pipe.schedule, repeats=pipe.repeats, axis_name=pipe.axis_name)  # checked again: a Pipeline(...) built by hand skips the constructor's checks
  if pipe.axis_name not in names:
    raise ValueError(
        f"pipeline.axis_name={pipe.axis_name!r} is not an axis of the mesh (axes {names}); build the mesh with a "
        f"stage axis, e.g. jax.make_mesh((P, N), ({pipe.axis_name!r}, 'data')), or pass axis_name= to jaxdp.pipeline."
    )
  if pipe.axis_name in data:
    raise ValueError(f"pipeline.axis_name={pipe.axis_name!r} is also a data axis (axis_name={axis_name!r}); the "
                     "stage axis is never a data axis: give them different names.")
  if layers is None:
    raise ValueError(
        f"pipeline={pipe} splits stacks of layers over the stage axis {pipe.axis_name!r}, but layers=None: a stage "
        "axis with no stacked layers. Name the stacks in the params with layers= (e.g. layers='blocks')."
    )
  if zero_stage == 3:
    raise ValueError(
        "zero_stage=3 with a pipeline is not supported: stage 3 gathers the parameters inside the loss, and a "
        "pipelined stack's layers would need their gather inside the pipeline's loop over microbatches (once per "
        "microbatch and repeat). Use zero_stage=1 or 2 (optimizer state and gradient split over the data axis)."
    )
  if backend != "shard_map":  # (jaxdp.sharding.layout.check_backend refuses pmap on a mesh of several axes first)
    raise ValueError(f"backend={backend!r} with a pipeline: the stages run inside shard_map over the stage axis; use "
                     "backend='shard_map'.")
  check_schedule(mesh.shape[pipe.axis_name], pipe.microbatches, pipe.repeats)


def check_stacks(params: Any, layers: Any, pipe: Pipeline, stages: int) -> None:
  """Raises unless every stack named by ``layers`` in ``params`` splits into ``stages`` (times ``repeats``) blocks."""
  mask = layer_mask(params, layers)
  counts = sorted({np.shape(x)[0] for x, is_layer in zip(jax.tree.leaves(params), jax.tree.leaves(mask)) if is_layer})
  parts = stages * pipe.repeats
  for count in counts:
    if count % parts:
      how = (f"P = {stages} stages" if pipe.repeats == 1 else
             f"P·R = {stages}·{pipe.repeats} = {parts} blocks (stage s holds blocks s, s+P, …)")
      raise ValueError(
          f"layers={layers!r}: a stack of L = {count} layers does not split into {how}: L % {parts} = "
          f"{count % parts}. Use a number of layers that divides by {parts}, or another stage-axis size"
          f"{'' if pipe.repeats == 1 else ' or repeats'}."
      )


def check_rows(batch: Any, pipe: Pipeline, replicas: int, accum_steps: int) -> None:
  """Raises unless each device's rows per micro-batch of ``accum_steps`` divide into ``pipe.microbatches``."""
  leaves = jax.tree.leaves(batch)
  if not leaves or not np.ndim(leaves[0]):
    return  # the step's own checks name this
  rows = np.shape(leaves[0])[0] // (replicas * accum_steps)
  if rows % pipe.microbatches:
    raise ValueError(
        f"the batch has {np.shape(leaves[0])[0]} rows: {rows} per device of the {replicas} data-parallel replicas and "
        f"micro-batch of accum_steps={accum_steps}, which do not divide into microbatches={pipe.microbatches}. "
        f"Pad it with weight-0 rows to such a size: jaxdp.split_batch(batch, mesh, weights=..., rows=R) with R rows "
        f"per device, R a multiple of {accum_steps * pipe.microbatches} (shard_uneven(..., rows=R) for portions, "
        f"DataPipeline(per_device_batch=R)); or use fewer microbatches."
    )
