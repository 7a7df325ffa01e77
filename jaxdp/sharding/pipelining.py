"""Pipeline parallelism over a `stage` mesh axis: the schedules.

A stack of `L` layers is cut into `P` stages (one per device of the
stage axis); the batch goes through in `M` microbatches. A *work unit* is
one microbatch passing through one stage's block of `L / (P·R)` layers.

* `"gpipe"`: each stage holds `L / P` contiguous layers; microbatch
  `m` enters stage 0 at iteration `m`. Bubble `(P−1) / (M+P−1)`.
* `"circular"` (MaxText's looping schedule) with `R` repeats: stage
  `s` holds the blocks `s, s+P, s+2P, …` and every microbatch goes round
  the ring of stages `R` times. Bubble `(P−1) / (R·M+P−1)`; it needs
  `M ≥ P` so that a microbatch is back at stage 0 before it is due there.

Both are one table (`schedule_table`): at iteration `t` stage `s`
runs unit `w = t − s` when `0 ≤ w < R·M` (repeat `w // M`, microbatch
`w % M`, layer block `(w // M)·P + s`), else it idles. GPipe is the
table with `R = 1`; autodiff through that loop gives the gradient.

* `"1f1b"` (PipeDream-flush): GPipe's layers and bubble, but each stage
  alternates forward and backward passes (`one_f_one_b_table`) and
  keeps at most `P` microbatches' stage inputs. The schedule takes the
  gradient itself (`one_f_one_b`, called by the step in place of
  `jax.value_and_grad`): the loss is traced in three parts (up to the
  stack, a stage's block, after the stack) on one microbatch's rows at a
  time, and a backward pass is `jax.vjp` of the block at its saved input.

At `zero_stage=3` a stage's layers are also split over the data axis;
`Pipeline.gather` says whether the step gathers the stage's block once
(`"step"`) or `jaxdp.scan_layers` gathers one layer at a time inside
each work unit (`"layer"`, `jaxdp.sharding.layerwise`). With
`example_ids` each work unit runs with its microbatch's ids, so dropout
inside the stack draws one device's masks.

Use: a mesh with a stage axis (`("stage", "data")`, or `("stage", "replica", "data")`
with `axis_name=("replica", "data")`), `layers=` naming the stacks, and
`pipeline=jaxdp.pipeline(M, schedule, repeats=R)` in
`jaxdp.make_train_step` and `jaxdp.make_eval_step`. The loss
loops over each stack with `jaxdp.scan_layers`, which in a pipelined
step runs `run_stack` on the stage's block of layers (a plain
`lax.scan` elsewhere, so the same loss runs on one device); everything
before and after the stack runs on every stage alike. The gradient is
reduced over the data axes once per step, after the whole schedule; each
stage's layers get their own gradient, and the layers before the stack the
sum over the stages that autodiff inserts (the transpose of their implicit
broadcast over the stage axis). Model state (BatchNorm statistics) is
supported outside the stack only: `scan_layers`' carry must hold the
batch rows on dim 0 in every leaf, and `f` must return no per-layer
outputs, so a stack cannot carry statistics (a `ValueError` says so).
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

from jaxdp.core import randomness
from jaxdp.core.checks import check_int
from jaxdp.sharding.layout import layer_mask
from jaxdp.core.carries import varying_axes

SCHEDULES = ("gpipe", "circular", "1f1b")
"""The pipeline schedules: `"gpipe"`, `"circular"` and `"1f1b"` (see `jaxdp.sharding.pipelining`)."""

GATHERS = ("step", "layer")
"""When a ZeRO-3 pipelined step gathers a stage's layers: `"step"` (once per step, before the schedule) or
`"layer"` (one layer at a time inside the loop over microbatches, with prefetch)."""

IDLE = -1
"""A `schedule_table` entry for a stage that does no work at that iteration."""


class Pipeline(NamedTuple):
  """A pipeline schedule over a mesh axis, as `pipeline` checked it.

  Attributes:
    microbatches: `M`, how many microbatches each device's batch is cut into (its rows must divide by it).
    schedule: one of `SCHEDULES`.
    repeats: `R`, rounds of the ring per microbatch (1 under `"gpipe"`).
    axis_name: the mesh axis of the stages.
    gather: at `zero_stage=3`, when a stage's layers (split over the data axis at rest) are gathered: one of
      `GATHERS`.
  """

  microbatches: int
  schedule: str = "gpipe"
  repeats: int = 1
  axis_name: str = "stage"
  gather: str = "step"


def pipeline(microbatches: int, schedule: str = "gpipe", *, repeats: int = 1, axis_name: str = "stage",
             gather: str = "step") -> Pipeline:
  """A checked `Pipeline`: `microbatches >= 1`, a known schedule, `repeats >= 1` (1 for `"gpipe"`;
  `"1f1b"` with `repeats > 1` is interleaved), `gather` one of `GATHERS` (read at `zero_stage=3`
  only)."""
  microbatches = check_int(microbatches, "microbatches", 1, "the number of microbatches per device and step.")
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule={schedule!r} is not a pipeline schedule; use one of {', '.join(map(repr, SCHEDULES))}.")
  repeats = check_int(repeats, "repeats", 1, "the rounds of the ring of stages each microbatch makes.")
  if schedule == "gpipe" and repeats != 1:
    raise ValueError(f"repeats={repeats} under schedule='gpipe', which passes each microbatch through the stages "
                     "once; use schedule='circular' (or '1f1b', interleaved) for repeats > 1.")
  if not isinstance(axis_name, str):
    raise TypeError(f"axis_name must be a mesh axis name (a str), got {axis_name!r}.")
  if gather not in GATHERS:
    raise ValueError(f"gather={gather!r} is not a ZeRO-3 gather of a pipeline; use 'step' (a stage's layers gathered "
                     "once per step) or 'layer' (one layer at a time inside the loop over microbatches).")
  return Pipeline(microbatches, schedule, repeats, axis_name, gather)


def check_schedule(stages: int, microbatches: int, repeats: int = 1, schedule: str = "circular") -> None:
  """Raises `ValueError` when `M < P` with `R > 1`: microbatch `m` would be due back at stage 0 before
  it has left the last stage; under `"1f1b"` with `R > 1`, unless `M % P == 0` (Megatron's interleaved
  schedule runs the microbatches in groups of `P`)."""
  if schedule == "1f1b" and repeats > 1 and microbatches % stages:
    raise ValueError(
        f"schedule='1f1b' with repeats={repeats} (interleaved) runs the microbatches in groups of P = {stages}: "
        f"microbatches={microbatches} must be a multiple of {stages}. Use microbatches={stages * max(1, round(microbatches / stages))} "
        "or repeats=1."
    )
  if repeats > 1 and microbatches < stages:
    raise ValueError(
        f"the circular schedule with repeats={repeats} over {stages} stages needs microbatches >= stages, got "
        f"microbatches={microbatches}: microbatch m re-enters stage 0 at iteration M + m but leaves stage "
        f"{stages - 1} only at iteration {stages} + m. Use microbatches >= {stages} (2·P = {2 * stages} is a "
        "good default) or schedule='gpipe'."
    )


def schedule_table(stages: int, microbatches: int, repeats: int = 1) -> np.ndarray:
  """`[R·M + P − 1, P]` int32: the work unit each stage runs at each iteration, or `IDLE`."""
  stages = check_int(stages, "stages", 1)
  microbatches = check_int(microbatches, "microbatches", 1)
  repeats = check_int(repeats, "repeats", 1)
  check_schedule(stages, microbatches, repeats)
  units = repeats * microbatches
  t = np.arange(units + stages - 1)[:, None]
  w = t - np.arange(stages)[None, :]
  return np.where((w >= 0) & (w < units), w, IDLE).astype(np.int32)


def bubble_fraction(table: np.ndarray) -> float:
  """The fraction of (iteration, stage) cells of `table` that do no work."""
  table = np.asarray(table)
  return float(np.mean(table == IDLE))


def bubble_formula(stages: int, microbatches: int, repeats: int = 1) -> float:
  """`(P − 1) / (R·M + P − 1)`: GPipe's bubble at `R = 1`, the circular schedule's otherwise."""
  return (stages - 1) / (repeats * microbatches + stages - 1)


def unit_of(w: Any, microbatches: int) -> tuple[Any, Any]:
  """`(repeat, microbatch)` of work unit `w`."""
  return w // microbatches, w % microbatches


# The runtime: what a pipelined step runs in place of the scan over a stack of layers ---------------------------


class Running(NamedTuple):
  """What `jaxdp.scan_layers` reads while a pipelined step traces its loss (see `running`).

  Attributes:
    pipeline: the `Pipeline`.
    stages: `P`, the size of the stage axis.
    layers: the numbers of layers `L` of the stacks named by `layers=`.
    data_axes: the data axes (manual in the step, like the stage axis).
    shapes: each stacked leaf's local shape on one stage, `(L / P, ...)`.
    ran: the local shapes of the stacked leaves the pipeline ran on, appended as it runs.
    stacked: the params' tree of bools marking the stacked leaves (read by the 1F1B gradient), or `None`.
  """

  pipeline: Pipeline
  stages: int
  layers: tuple
  data_axes: tuple
  shapes: tuple
  ran: list
  stacked: Any = None


_RUNNING: contextvars.ContextVar[Running | None] = contextvars.ContextVar("jaxdp_pipeline", default=None)


def active() -> Running | None:
  """The pipeline of the step whose loss is being traced, or `None` (then `jaxdp.scan_layers` scans)."""
  return _RUNNING.get()


@contextlib.contextmanager
def running(pipe: Pipeline, stages: int, layers: Any, data_axes: tuple, shapes: tuple, stacked: Any = None):
  """While tracing a pipelined step's loss: `jaxdp.scan_layers` runs `run_stack` instead of a scan.

  Yields the `Running` record; `check_ran` then tells whether the loss ran every stack through it.
  """
  record = Running(pipe, stages, tuple(sorted(set(layers))), tuple(data_axes), tuple(shapes), [], stacked)
  token = _RUNNING.set(record)
  try:
    yield record
  finally:
    _RUNNING.reset(token)


def check_ran(record: Running) -> None:
  """Raises `ValueError` unless the loss ran each stacked leaf through `jaxdp.scan_layers`.

  A loss that loops over its stage's block itself (`lax.scan` on the stacked params) would run only that
  stage's `L / P` layers and train a different model, silently.
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
  """`loss_fn` (same signature) that raises `check_ran`'s error as soon as a call of it has traced."""

  @functools.wraps(loss_fn)
  def traced(*args, **kwargs):
    record.ran.clear()
    out = loss_fn(*args, **kwargs)
    check_ran(record)
    return out

  return traced


def circular_order(x: Any, stages: int, repeats: int) -> Any:
  """A stacked leaf's layer axis (natural order) put in the circular assignment: stage `s`'s rows hold the
  blocks `s, s + P, s + 2P, …` (`[L, ...]` as `[R, P, B, ...]` transposed to `[P, R, B, ...]`)."""
  shape = np.shape(x)
  block = shape[0] // (stages * repeats)
  blocks = x.reshape(repeats, stages, block, *shape[1:])
  return jnp.swapaxes(blocks, 0, 1).reshape(shape)


def natural_order(x: Any, stages: int, repeats: int) -> Any:
  """The inverse of `circular_order`."""
  shape = np.shape(x)
  block = shape[0] // (stages * repeats)
  blocks = x.reshape(stages, repeats, block, *shape[1:])
  return jnp.swapaxes(blocks, 0, 1).reshape(shape)


def _carry_axes(axis: str, data_axes: tuple) -> tuple:
  """The axes a pipeline loop's carry varies over: the stage axis, the data axes and any other axis the step is
  manual over (DiLoCo's groups: each group's layers differ)."""
  others = tuple(a for a in jax.sharding.get_abstract_mesh().manual_axes if a != axis and a not in data_axes)
  return (axis, *data_axes, *others)


def _vary(x: jax.Array, axes: tuple) -> jax.Array:
  # Varying over every manual axis of the step: the loop's carry mixes activations (varying over the data
  # axes) and a stage's layers (varying over the stage axis), and its type must not change across iterations.
  missing = tuple(a for a in axes if a not in varying_axes(x))
  return lax.pcast(x, missing, to="varying") if missing else x


def _plain_scan(f: Callable, init: Any, layers: Any, xs: Any, *, in_loop: bool = False) -> tuple[Any, Any]:
  del in_loop
  count = {np.shape(x)[0] for x in jax.tree.leaves(layers)}.pop()
  return lax.scan(lambda c, lx: f(c, lx[0], lx[1]), init, (layers, xs), length=count)


def run_stack(f: Callable, init: Any, layers: Any, xs: Any, record: Running,
              scan: Callable = _plain_scan) -> tuple[Any, None]:
  """The pipelined loop over a stack (`jaxdp.scan_layers` inside a pipelined step): `(carry, None)`.

  Runs inside the step's `shard_map` (manual over the stage and data axes). `layers`: this stage's block
  of each stacked leaf, `[L / P, ...]` (under `"circular"` the blocks `s, s + P, …` in that order);
  `init`: the activations, every leaf with this device's rows on dim 0, the same on every stage; `xs`:
  per-layer inputs of the whole stack (`[L, ...]`, e.g. dropout keys), each stage takes its layers' rows.
  The loop runs over the rows of `schedule_table` (its input): at iteration `t` stage `s` runs unit
  `table[t, s]` (`w = t − s`); its output moves to stage
  `s + 1` by `ppermute` (stage `P − 1` to stage 0 for the next repeat, kept there per microbatch until
  due). The last stage's outputs of the last repeat are summed over the stage axis (zeros elsewhere), so the
  result is the same on every stage. Idle iterations run the layers on a real microbatch's values and their
  results are dropped (never zeros: `0 · NaN` is NaN in the backward pass).
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
        "through the stack: statistics such as BatchNorm's would be per microbatch there, so keep a "
        "BatchNorm before or after the stack (exact under 'gpipe' and 'circular')."
    )
  rows = rows.pop()
  if rows % m_count:
    raise ValueError(
        f"scan_layers in a pipelined step: this device's {rows} rows (per micro-batch of accum_steps) do not divide "
        f"into microbatches={m_count}; pad the batch to rows per device and micro-batch that divide by {m_count}: "
        "jaxdp.split_batch(batch, mesh, weights=..., rows=R) (weight-0 padding rows; shard_uneven takes rows= too)."
    )
  axes = _carry_axes(axis, record.data_axes)
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
  micro_ids = _microbatch_ids(rows, m_count, axes)
  pick = lambda tree, i: jax.tree.map(lambda x: x[i], tree)  # noqa: E731
  select = lambda c, a, b: jax.tree.map(lambda x, y: jnp.where(c, x, y), a, b)  # noqa: E731
  ring = [(i, (i + 1) % stages) for i in range(stages)]

  def run_block(x, r, m):
    if repeats == 1:  # the whole block, a loop-invariant value (never saved per iteration for the backward pass)
      mine, own_xs = layers, xs
    else:
      start = r * block
      mine = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, start, block, axis=0), layers)
      own_xs = None if xs is None else jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, start, block, axis=0), xs)
    # Layout-invariant dropout: the rows of this unit's microbatch are the ones f draws masks for.
    with contextlib.nullcontext() if micro_ids is None else randomness.use_example_ids(micro_ids[m]):
      y, ys = scan(f, x, mine, own_xs, in_loop=True)
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
    y = run_block(select(s == 0, first, incoming), r, m)
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


def _microbatch_ids(rows: int, microbatches: int, axes: tuple) -> jax.Array | None:
  """`[M, rows / M]`: the example ids of the rows being traced (a step with `example_ids`), cut as the carry is
  into microbatches, or `None` without ids."""
  ids = randomness.current_example_ids()
  if ids is None:
    return None
  if ids.shape[0] != rows:
    raise ValueError(
        f"scan_layers in a pipelined step with example_ids: the carry has {rows} rows but the batch has "
        f"{ids.shape[0]} ids; the stack's microbatches take the ids of their rows, so the carry's dim 0 must be the "
        "batch's rows (one id per row), in order."
    )
  return _vary(ids, axes).reshape(microbatches, rows // microbatches)


# Checks before anything runs or is donated ------------------------------------------------------------------------


def check_pipeline(pipe: Any, mesh: Any, axis_name: Any, *, layers: Any, zero_stage: int, backend: str) -> None:
  """Raises unless `pipe` (a `Pipeline` or `None`) can run on `mesh` with this layout (the pairs with
  a reduction are `jaxdp.sharding.parallel.check_step`'s)."""
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
  pipe = pipeline(pipe.microbatches, pipe.schedule, repeats=pipe.repeats, axis_name=pipe.axis_name,
                  gather=pipe.gather)  # checked again: a Pipeline(...) built by hand skips the constructor's checks
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
  if backend != "shard_map":  # (jaxdp.sharding.layout.check_backend refuses pmap on a mesh of several axes first)
    raise ValueError(f"backend={backend!r} with a pipeline: the stages run inside shard_map over the stage axis; use "
                     "backend='shard_map'.")
  check_schedule(mesh.shape[pipe.axis_name], pipe.microbatches, pipe.repeats, pipe.schedule)


def check_stacks(params: Any, layers: Any, pipe: Pipeline, stages: int) -> None:
  """Raises unless every stack named by `layers` in `params` splits into `stages` (times `repeats`) blocks."""
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
  """Raises unless each device's rows per micro-batch of `accum_steps` divide into `pipe.microbatches`."""
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


# 1F1B: the gradient taken by the schedule itself ----------------------------------------------------------------

FORWARD, BACKWARD = 1, 2
"""The work kinds of `one_f_one_b_table` (`0`: idle)."""


class OneFOneBTable(NamedTuple):
  """The 1F1B (PipeDream-flush) schedule as tables of `[T, P]` int32, `T = 2·(R·M + P − 1)` ticks.

  Attributes:
    kind: 0 (idle), `FORWARD` or `BACKWARD` for each tick and stage.
    microbatch: the microbatch of that work (0 when idle).
    repeat: the block of the stage it runs (its `r`-th, virtual stage `r·P + s`; 0 when idle).
    slot: the buffer slot of that microbatch's stage input (read by the backward pass, written by stage 0's
      forward), `0` when idle.
    received: the slot where the activation that arrives at the end of the tick is kept, or `-1`.
    cotangent_slot: the slot of the microbatch's output cotangent (read by the backward, written by the last
      stage's forward), `0` when idle.
    cotangent_received: the slot where the cotangent that arrives at the end of the tick is kept, or `-1`.
    slots: the stage-input slots a stage needs (at most `P` when `R = 1`; independent of `M` in any case);
      cotangent_slots: the cotangent slots.
  """

  kind: np.ndarray
  microbatch: np.ndarray
  repeat: np.ndarray
  slot: np.ndarray
  received: np.ndarray
  cotangent_slot: np.ndarray
  cotangent_received: np.ndarray
  slots: int
  cotangent_slots: int


def one_f_one_b_table(stages: int, microbatches: int, repeats: int = 1) -> OneFOneBTable:
  """The 1F1B schedule over `stages` and `microbatches` (interleaved over `repeats` blocks per stage),
  one unit of work (a forward or a backward pass of one block on one microbatch) per stage and tick.

  `repeats = 1`: stage `s` runs `min(P − 1 − s, M)` forward passes, then alternates one forward and one
  backward pass, then runs the remaining backward passes (Megatron's order). `repeats = R > 1` (Megatron's
  interleaved schedule, `M % P == 0`): stage `s` holds blocks `s, s + P, …` (virtual stage `r·P + s`
  for its `r`-th block), runs the forward passes of each group of `P` microbatches block by block (the
  backward passes in the reverse block order), after `2·(P − 1 − s) + (R − 1)·P` warm-up forward passes.
  Each unit runs at the first tick after the work it needs: the previous virtual stage's forward pass of that
  microbatch, the next one's backward pass (the last: its own forward pass, where the loss's cotangent is
  taken). A stage keeps a unit's input from its arrival to its backward pass, in the lowest free slot.
  """
  stages = check_int(stages, "stages", 1)
  microbatches = check_int(microbatches, "microbatches", 1)
  repeats = check_int(repeats, "repeats", 1)
  check_schedule(stages, microbatches, repeats, "1f1b")
  p_count, m_count, r_count = stages, microbatches, repeats
  groups = [list(range(g, min(g + p_count, m_count))) for g in range(0, m_count, p_count)]
  forwards = [(m, r) for g in groups for r in range(r_count) for m in g]
  backwards = [(m, r) for g in groups for r in reversed(range(r_count)) for m in g]
  units = m_count * r_count
  orders = []
  for s in range(p_count):
    warm = min(p_count - 1 - s if r_count == 1 else 2 * (p_count - 1 - s) + (r_count - 1) * p_count, units)
    ops = [(FORWARD, *forwards[i]) for i in range(warm)]
    for i in range(units - warm):
      ops += [(FORWARD, *forwards[warm + i]), (BACKWARD, *backwards[i])]
    orders.append(ops + [(BACKWARD, *backwards[i]) for i in range(units - warm, units)])
  last_stage, last_repeat = p_count - 1, r_count - 1

  def needs(kind, m, r, s):  # the work a unit waits for, or None
    if kind == FORWARD:
      return (FORWARD, m, r, s - 1) if s > 0 else (FORWARD, m, r - 1, last_stage) if r > 0 else None
    if s == last_stage and r == last_repeat:
      return (FORWARD, m, r, s)
    return (BACKWARD, m, r, s + 1) if s < last_stage else (BACKWARD, m, r + 1, 0)

  done: dict = {}
  position, rows = [0] * p_count, []
  while any(position[s] < len(orders[s]) for s in range(p_count)):
    t, row = len(rows), []
    for s in range(p_count):
      if position[s] == len(orders[s]):
        row.append(None)
        continue
      need = needs(*orders[s][position[s]], s)
      row.append(orders[s][position[s]] if need is None or done.get(need, t) < t else None)
    for s, work in enumerate(row):
      if work is not None:
        done[(*work, s)] = t
        position[s] += 1
    rows.append(row)
  ticks = len(rows)
  shape = (ticks, p_count)
  kind, micro, repeat = (np.zeros(shape, np.int32) for _ in range(3))
  slot, received = np.zeros(shape, np.int32), np.full(shape, -1, np.int32)
  cslot, creceived = np.zeros(shape, np.int32), np.full(shape, -1, np.int32)
  for t, row in enumerate(rows):
    for s, work in enumerate(row):
      if work is not None:
        kind[t, s], micro[t, s], repeat[t, s] = work

  def assign(arrive: Callable, own: Callable, at_use: np.ndarray, at_arrival: np.ndarray, forward_reads: bool) -> int:
    # Unit (m, r)'s slot at stage s, taken from its arrival (the end of tick arrive(m, r, s), or during that tick
    # when the stage writes it itself: own(m, r, s)) to its backward pass there (free again from that tick's end).
    # forward_reads: the stage's forward pass reads it too (a stage input; a cotangent is read backward only).
    most = 0
    for s in range(p_count):
      free_at: dict = {}
      for m, r in sorted(((m, r) for m in range(m_count) for r in range(r_count)), key=lambda u: arrive(*u, s)):
        a, backward = arrive(m, r, s), done[(BACKWARD, m, r, s)]
        k = next(k for k in range(units + 1) if free_at.get(k, -1) <= a)
        free_at[k], most = backward, max(most, k + 1)
        at_use[backward, s] = k
        if own(m, r, s):
          at_use[a, s] = k
        else:
          at_arrival[a, s] = k
          if forward_reads:
            at_use[done[(FORWARD, m, r, s)], s] = k
    return most

  first_unit = lambda m, r, s: s == 0 and r == 0  # noqa: E731
  last_unit = lambda m, r, s: s == last_stage and r == last_repeat  # noqa: E731
  slots = assign(lambda m, r, s: done[needs(FORWARD, m, r, s)] if not first_unit(m, r, s) else done[(FORWARD, m, r, s)],
                 first_unit, slot, received, True)
  cotangent_slots = assign(lambda m, r, s: done[needs(BACKWARD, m, r, s)], last_unit, cslot, creceived, False)
  return OneFOneBTable(kind, micro, repeat, slot, received, cslot, creceived, slots, cotangent_slots)


class _Mode(NamedTuple):
  """How `jaxdp.scan_layers` runs while the 1F1B schedule traces the loss in one of its three parts."""

  part: str  # "input": record the stack's input; "stage": run this stage's block on value; "output": return value
  value: Any
  found: list  # what the part found: the stack's input, or the block's output


_MODE: contextvars.ContextVar[_Mode | None] = contextvars.ContextVar("jaxdp_1f1b_part", default=None)


def run_part(f: Callable, init: Any, layers: Any, xs: Any, record: Running, scan: Callable) -> tuple[Any, None] | None:
  """`jaxdp.scan_layers` inside a 1F1B step, or `None` outside the schedule's parts (then the stack runs
  as GPipe's forward pass: evaluation, and the step's traces of the loss that are never differentiated)."""
  mode = _MODE.get()
  if mode is None:
    return None
  stages = record.stages
  sizes = sorted({np.shape(x)[0] for x in jax.tree.leaves(layers)})
  if len(sizes) != 1 or sizes[0] * stages not in record.layers:
    raise ValueError(
        f"scan_layers in a pipelined step got layers with a leading axis of {sizes}; pass a stack named by "
        f"layers= as the loss got it (L / P layers per stage, L in {list(record.layers)}, P = {stages}).")
  if mode.found:
    raise ValueError("schedule='1f1b' runs one stack per loss (one call of jaxdp.scan_layers); this loss calls it "
                     "again. Use schedule='gpipe' or 'circular' for a loss with several stacks.")
  record.ran.extend(tuple(np.shape(x)) for x in jax.tree.leaves(layers))
  if mode.part == "input":
    mode.found.append((init, ))
    return init, None
  if mode.part == "output":
    mode.found.append((None, ))
    return mode.value, None
  # This stage's block r (its r-th, virtual stage r·P + s; the layers arrive in the circular order when R > 1).
  x, r = mode.value
  repeats = record.pipeline.repeats
  block = np.shape(jax.tree.leaves(layers)[0])[0] // repeats
  if repeats > 1:
    layers = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, r * block, block, axis=0), layers)
  if xs is not None:
    s = lax.axis_index(record.pipeline.axis_name)
    xs = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, (r * stages + s) * block, block, axis=0), xs)
  y, ys = scan(f, x, layers, xs)
  if jax.tree.leaves(ys):
    raise ValueError("scan_layers in a pipelined step: f must return (carry, None); per-layer outputs (ys) are "
                     "not gathered across stages. Return what the loss needs in the carry.")
  mode.found.append((y, ))
  return init, None


@contextlib.contextmanager
def _part(part: str, value: Any = None):
  mode = _Mode(part, value, [])
  token = _MODE.set(mode)
  try:
    yield mode
  finally:
    _MODE.reset(token)


def _found(mode: _Mode) -> Any:
  if not mode.found:
    raise ValueError("schedule='1f1b': the loss did not run its stack through jaxdp.scan_layers.")
  return mode.found[0][0]


def one_f_one_b(fn: Callable, params: Any, batch: Any, weights: Any, record: Running, add: Callable) -> tuple:
  """`((value, aux), grads)` as `jax.value_and_grad(lambda p: fn(p, batch, weights), has_aux=True)(params)`
  gives them, computed by the 1F1B schedule (`one_f_one_b_table`) instead of autodiff.

  `fn(params, batch, weights) -> (value, aux)`: the loss on some rows (it calls `jaxdp.scan_layers` once);
  its value and aux must add over row subsets (`add(total, aux)` adds one microbatch's aux). Each device's rows
  are cut into `M` microbatches; `fn` is traced in three parts: up to the stack (stage 0), one stage's block,
  and after the stack (the last stage: value and aux). A stage keeps its microbatches' inputs (at most `P`)
  until their backward pass, which recomputes the block's forward pass from the input (`jax.vjp`) and sends
  the input's cotangent back one stage with `ppermute`. The gradient of the stacked leaves stays on its
  stage; that of every other leaf, and the value and aux, are summed over the stages.
  """
  pipe, stages = record.pipeline, record.stages
  axis, m_count = pipe.axis_name, pipe.microbatches
  axes = _carry_axes(axis, record.data_axes)
  rows = {np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x)}
  if len(rows) != 1 or rows.pop() % m_count:
    raise ValueError(f"schedule='1f1b' cuts every leaf of the batch into microbatches={m_count} along dim 0; its leaves "
                     f"have leading sizes {sorted(np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(batch))}.")
  params = jax.tree.map(lambda x: _vary(x, axes), params)  # each stage's own part: summed over the stages below
  split = lambda x: x.reshape(m_count, x.shape[0] // m_count, *x.shape[1:])  # noqa: E731
  micro_batch = jax.tree.map(lambda x: _vary(split(x), axes), batch)
  micro_weights = None if weights is None else _vary(split(weights), axes)
  pick = lambda tree, i: jax.tree.map(lambda x: x[i], tree)  # noqa: E731
  rows_of = lambda m: (pick(micro_batch, m), None if weights is None else micro_weights[m])  # noqa: E731

  def first(p, m):  # the stack's input: the loss up to scan_layers
    with _part("input") as mode:
      fn(p, *rows_of(m))
    return jax.tree.map(lambda x: _vary(x, axes), _found(mode))

  def block(p, x, m, r):  # this stage's block r of layers on x
    with _part("stage", (x, r)) as mode:
      fn(p, *rows_of(m))
    return jax.tree.map(lambda x: _vary(x, axes), _found(mode))

  def last(p, y, m):  # the loss after the stack, on the stack's output y
    with _part("output", y) as mode:
      value, aux = fn(p, *rows_of(m))
    _found(mode)
    return value, aux

  x_shape = jax.eval_shape(first, params, 0)
  # `last` on `first`'s output, not on x_shape: with a model axis left to the compiler, a ShapeDtypeStruct of
  # an activation varying over the manual axes cannot be turned back into an abstract value (JAX asserts).
  value_shape, aux_shape = jax.eval_shape(lambda p: last(p, first(p, 0), 0), params)
  repeats = pipe.repeats
  table = one_f_one_b_table(stages, m_count, repeats)
  zeros = lambda shapes, lead=(): jax.tree.map(  # noqa: E731
      lambda a: _vary(jnp.zeros(lead + tuple(a.shape), a.dtype), axes), shapes)
  wide = lambda x: jnp.promote_types(x.dtype, jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype  # noqa: E731
  grads0 = jax.tree.map(lambda x: _vary(jnp.zeros(x.shape, wide(x)), axes), params)
  s = lax.axis_index(axis)
  # Interleaved (R > 1): stage P − 1's output goes on to stage 0's next block, and its cotangent back.
  hops = stages if repeats > 1 else stages - 1
  forward_ring = [(i, (i + 1) % stages) for i in range(hops)]
  backward_ring = [((i + 1) % stages, i) for i in range(hops)]
  put = lambda buf, k, v: jax.tree.map(lambda b, x: b.at[k].set(x.astype(b.dtype)), buf, v)  # noqa: E731
  add_to = lambda total, part: jax.tree.map(lambda a, b: a + b.astype(a.dtype), total, part)  # noqa: E731

  def tick(state, row):
    inputs, cts, grads, value, aux = state
    kind, m, r, k, ck = (row[name][s] for name in ("kind", "microbatch", "repeat", "slot", "cotangent_slot"))
    entry, exit_ = (s == 0) & (r == 0), (s == stages - 1) & (r == repeats - 1)  # the stack's first, last block

    def idle(inputs, cts, grads, value, aux):
      return inputs, cts, grads, value, aux, zeros(x_shape), zeros(x_shape)

    def forward(inputs, cts, grads, value, aux):
      x = lax.cond(entry, lambda: first(params, m), lambda: pick(inputs, k))
      y = block(params, x, m, r)
      inputs = put(inputs, k, x)

      def loss_end(cts, grads, value, aux):
        (v, a), pullback = jax.vjp(lambda p, y: last(p, y, m), params, y)
        ct_p, ct_y = pullback((jnp.ones_like(v), jax.tree.map(jnp.zeros_like, a)))
        aux = jax.tree.map(lambda old, new: _vary(new.astype(old.dtype), axes), aux, add(aux, a))
        return put(cts, ck, ct_y), add_to(grads, ct_p), _vary(value + v.astype(value.dtype), axes), aux

      cts, grads, value, aux = lax.cond(exit_, loss_end, lambda *a: a, cts, grads, value, aux)
      return inputs, cts, grads, value, aux, y, zeros(x_shape)

    def backward(inputs, cts, grads, value, aux):
      x, ct_y = pick(inputs, k), pick(cts, ck)
      _, pullback = jax.vjp(lambda p, x: block(p, x, m, r), params, x)
      ct_p, ct_x = pullback(jax.tree.map(lambda c, a: c.astype(a.dtype), ct_y, x_shape))
      grads = add_to(grads, ct_p)

      def input_end(grads):
        _, pullback = jax.vjp(lambda p: first(p, m), params)
        return add_to(grads, pullback(ct_x)[0])

      grads = lax.cond(entry, input_end, lambda g: g, grads)
      return inputs, cts, grads, value, aux, zeros(x_shape), ct_x

    *state, y, ct_x = lax.switch(kind, (idle, forward, backward), inputs, cts, grads, value, aux)
    inputs, cts, grads, value, aux = state
    if stages > 1:
      arrived = jax.tree.map(lambda v: lax.ppermute(v, axis, forward_ring), y)
      returned = jax.tree.map(lambda v: lax.ppermute(v, axis, backward_ring), ct_x)
      k_in, ck_in = row["received"][s], row["cotangent_received"][s]
      inputs = jax.tree.map(lambda b, v: b.at[jnp.maximum(k_in, 0)].set(
          jnp.where(k_in >= 0, v, b[jnp.maximum(k_in, 0)])), inputs, arrived)
      cts = jax.tree.map(lambda b, v: b.at[jnp.maximum(ck_in, 0)].set(
          jnp.where(ck_in >= 0, v.astype(b.dtype), b[jnp.maximum(ck_in, 0)])), cts, returned)
    return (inputs, cts, grads, value, aux), None

  rows_table = {name: jnp.asarray(getattr(table, name)) for name in
                ("kind", "microbatch", "repeat", "slot", "received", "cotangent_slot", "cotangent_received")}
  start = (zeros(x_shape, (table.slots,)), zeros(x_shape, (table.cotangent_slots,)), grads0,
           zeros(value_shape), zeros(aux_shape))
  (_, _, grads, value, aux), _ = lax.scan(tick, start, rows_table)
  stacked = record.stacked
  grads = jax.tree.map(lambda g, is_layer: g if is_layer else lax.psum(g, axis), grads, stacked)
  value, aux = lax.psum((value, aux), axis)
  return (value, aux), grads
