"""The pure data-parallel step: what one replica computes, composed from the functional core.

`gradient_step` (local gradient, then its reduction) runs per replica,
inside `shard_map` or `pmap`; `finish_step` (the non-finite check and
the optimizer update) runs either there too (`train_step`, stage 0)
or outside the map on the global arrays (ZeRO stages 1-3, where the
optimizer sees whole leaves whatever their sharding: see
`jaxdp.runtime.compiled`). Nothing here places, jits or maps anything."""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxdp.core.checks import check_has_more, check_optimizer
from jaxdp.sharding.layerwise import gathering, sink_shapes, sinking
from jaxdp.sharding.layout import data_dim, model_part, per_model_shard, zero_axis
from jaxdp.core.loss import declared_keywords
from jaxdp.core.loss_scaling import check_loss_scale, update_loss_scale
from jaxdp.training import reduction as _reduction
from jaxdp.training.reduction import (
    ReducedGradient,
    buckets,
    check_axis_bound,
    checks_vma,
    divide_gradient,
    global_norm,
    local_gradient,
    reduce_scattered,
    to_row,
    varies,
    varying_axes,
    with_flat_buckets,
)
from jaxdp.training.config import StepConfig, step_config
from jaxdp.sharding.legacy import accepts_legacy_keywords
from jaxdp.core.state import TrainState


def _loss_argument(optimizer: optax.GradientTransformation, value: jax.Array | None) -> dict:
  """`{"value": value}` for an optimizer whose update takes extra arguments (optax passes the loss as `value`)."""
  if value is None or "value" not in declared_keywords(optimizer.update, ("value",)):
    return {}
  return {"value": value}


def apply_update(
    optimizer: optax.GradientTransformation,
    state: TrainState,
    grads: Any,
    apply: jax.Array | bool = True,
    model_state: Any = None,
    grad_divisor: jax.Array | None = None,
    value: jax.Array | None = None,
    compression: Any = None,
) -> TrainState:
  """Applies `grads` with `optimizer` (and installs `model_state`), or returns `state` unchanged.

  `train_step` passes `apply = (global weight > 0) & (no replica saw a
  non-finite gradient)`, a value every replica holds identically, so all
  replicas skip together: no NaN, no spurious optimizer step, no step count,
  and no model-state update from a batch that was not learned from.
  `model_state=None` keeps `state.model_state`. Gradients are cast to
  the parameters' dtypes (they are reduced in float32 at least).
  `grad_divisor`: apply `grads / grad_divisor` (a reduced gradient left
  undivided, see `jaxdp.ReducedGradient`); the division happens in
  the update's own pass over the gradient. `value`: the loss, passed as
  `optimizer.update(..., value=value)` to optimizers that take extra
  arguments (`optax.polyak_sgd`, `optax.contrib.reduce_on_plateau`);
  `finish_step` passes the step's agreed loss (under `"mean"` the
  global weighted mean, what one device passes). `compression`: the new
  `jaxdp.PowerSGDState` to install with the update (`None` keeps
  `state.compression`); a skipped step keeps the old one.
  """

  check_optimizer(optimizer)

  def step(operand):
    state, new_model_state, grads, new_compression = operand
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), divide_gradient(grads, grad_divisor), state.params)
    extra = _loss_argument(optimizer, value)
    try:
      updates, opt_state = optimizer.update(grads, state.opt_state, state.params, **extra)
    except TypeError as e:  # the optimizer's own error, unchanged: say what jaxdp passed
      e.add_note(
          f"jaxdp: raised inside optimizer.update(grads, opt_state, params{', value=loss' if extra else ''}); jaxdp "
          "passes nothing else. An optimizer that needs more is not supported as it is: optax.lbfgs's default zoom "
          "line search wants grad= and value_fn= (it evaluates the loss again at trial points, which would need the "
          "whole data-parallel step); optax.lbfgs(linesearch=None) works. Nothing ran and nothing was donated."
      )
      raise
    kept = state.model_state if new_model_state is None else new_model_state
    new_params = optax.apply_updates(state.params, updates)
    _check_update_types(state.params, new_params)
    # _replace keeps every other field of the state as it is.
    new_state = state._replace(params=new_params, opt_state=opt_state, step=state.step + 1, model_state=kept)
    return new_state if new_compression is None else new_state._replace(compression=new_compression)

  operand = (state, model_state, grads, compression)
  if _selects(operand):
    # A small state: the update is computed and selected leaf by leaf, each select fused into the leaf's
    # update (a conditional would write out every gradient leaf as its operand: one more kernel per leaf).
    new_state = step(operand)
    same = jax.tree.structure(new_state) == jax.tree.structure(state) and all(
        (new.shape, new.dtype, varying_axes(new)) == (old.shape, old.dtype, varying_axes(old))
        for new, old in zip(jax.tree.leaves(new_state), jax.tree.leaves(state)))
    if same:  # else the conditional below refuses the update with JAX's own error, as for a large state
      return jax.tree.map(lambda new, old: jnp.where(apply, new, old), new_state, state)
  # A large one: a conditional, where a select would copy every buffer each step. The division and the cast
  # happen inside the branch, fused into the update's pass over the gradient.
  return lax.cond(apply, step, lambda operand: operand[0], operand)


# A state (with its gradient) of up to this many bytes is updated with selects instead of a conditional.
SELECT_BYTES = 1 << 18


def _selects(operand: Any) -> bool:
  """Whether the update selects (`jnp.where`) instead of branching: a state of up to `SELECT_BYTES`
  (read at trace time) whose leaves are all numbers (a PRNG key cannot be selected)."""
  leaves = jax.tree.leaves(operand)
  return all(jnp.issubdtype(x.dtype, np.number) or jnp.issubdtype(x.dtype, np.bool_) for x in leaves) and (
      sum(x.size * x.dtype.itemsize for x in leaves) <= SELECT_BYTES)


def _check_update_types(params: Any, new_params: Any) -> None:
  """Refuses an update that varies over manual axes its parameter does not (JAX's cond would say only that
  its branches' types differ): the optimizer read values that differ between those devices."""
  paths = jax.tree_util.tree_flatten_with_path(params)[0]
  for (path, old), new in zip(paths, jax.tree.leaves(new_params)):
    extra = varying_axes(new) - varying_axes(old)
    if extra:
      raise ValueError(
          f"the optimizer's update of params{jax.tree_util.keystr(path)} varies over the manual mesh axes "
          f"{sorted(extra)}, where the parameter is replicated: the optimizer read values that differ between "
          "those devices (a gradient not reduced over them, or a whole-gradient transformation of a shard). Inside "
          "your own shard_map with a manual model axis the optimizer sees each device's "
          "shard of the gradient only, so transformations that read the whole gradient (optax.clip_by_global_norm, "
          "LAMB's trust ratio, Adafactor's factored moments) compute each shard's own value. Use "
          "jaxdp.make_train_step with that axis in the mesh (XLA partitions the update on the global arrays), or "
          "an optimizer that reads each element on its own."
      )


def gather_params(params: Any, split: Any, axis_name: str, bucket_bytes: int | None = None) -> Any:
  """Whole parameters from this device's slices (ZeRO stage 3): one all-gather per split leaf, the small ones shared.

  `bucket_bytes`: the leaves split over the data axis only are gathered in flat buckets of about that
  many bytes instead, one all-gather each (the slices concatenated, as FSDP's flat parameters); without it,
  those whose whole value has up to `jaxdp.training.reduction.PACK_BYTES` share one such bucket. The gathered
  values are the same, bit for bit.
  """
  if split is None:
    return params

  def gather(x, spec):
    dim = data_dim(spec, axis_name)
    if dim is None:
      return x
    return per_model_shard(lambda y: _all_gather_invariant(y, zero_axis(axis_name), dim), spec, axis_name)(x)

  zero = zero_axis(axis_name)
  n = lax.axis_size(zero)

  def gather_buckets(leaves, dims):
    out = [None] * len(leaves)
    # Buckets by the gathered (whole) leaves' bytes, so they group as the gradient's reduce-scatter does;
    # without bucket_bytes, the small leaves (what with_flat_buckets passes, grouped) in one bucket per dtype.
    for bucket in buckets(leaves, math.inf if bucket_bytes is None else bucket_bytes, scale=n):
      moved = [jnp.moveaxis(leaves[i], dims[i], 0) for i in bucket]
      # Each device's slices as one row; the tiled gather stacks the devices' rows in order.
      rows = _all_gather_invariant(to_row(moved), zero, 0)
      offsets = np.cumsum([0] + [m.size for m in moved])
      for i, m, start, stop in zip(bucket, moved, offsets[:-1], offsets[1:]):
        out[i] = jnp.moveaxis(rows[:, start:stop].reshape((-1, *m.shape[1:])), 0, dims[i])
    return out

  # Without bucket_bytes, the leaves whose gathered value has up to PACK_BYTES share one all-gather.
  small = _reduction.PACK_BYTES // n if bucket_bytes is None else None  # read at trace time: settable
  return with_flat_buckets(params, split, axis_name, gather, gather_buckets, small_bytes=small)


def _all_gather_invariant(x: jax.Array, axis_name: str, dim: int) -> jax.Array:
  # The gathered value is the same on every device: say so, so that shard_map may treat it as replicated.
  try:
    return lax.all_gather(x, axis_name, axis=dim, tiled=True, to="invarying")  # JAX 0.10 spelling
  except ValueError:
    return lax.all_gather(x, axis_name, axis=dim, tiled=True, to="invariant")


@accepts_legacy_keywords("gradient_step", ("loss_fn", "state", "batch", "weights"), internal=lambda **kw: _legacy_sharded(**kw),
                         internal_keywords=("params_split", "grads_split", "divide", "stacked"))
def gradient_step(
    loss_fn: Callable[..., Any],
    state: TrainState,
    batch: Any,
    weights: jax.Array | None = None,
    *,
    layout: Any = "data",
    reduction: Any = None,
    precision: Any = None,
    accum_steps: int = 1,
    example_ids: Any = None,
    rng: jax.Array | None = None,
    has_more: jax.Array | None = None,
) -> ReducedGradient:
  """This replica's gradient, loss, metrics and model state, reduced over the data axes (per replica).

  `jaxdp.local_gradient` then `jaxdp.reduce_gradient`: see
  `train_step` for the arguments. `state.opt_state` is not read. A
  state with a `loss_scale` (`jaxdp.core.loss_scaling`) has its backward
  pass scaled by it and the gradient unscaled before the reduction. The
  reduction's new state (`state.compression`'s) is in the result's
  `compression`.
  """
  config = step_config(layout, reduction, precision, accum_steps, example_ids)
  return sharded_gradient_step(config, loss_fn, state, batch, weights, rng=rng, has_more=has_more)


def sharded_gradient_step(
    settings: StepConfig,
    loss_fn: Callable[..., Any],
    state: TrainState,
    batch: Any,
    weights: jax.Array | None = None,
    *,
    rng: jax.Array | None = None,
    has_more: jax.Array | None = None,
    params_split: Any = None,
    grads_split: Any = None,
    divide: bool = True,
    stacked: Any = None,
) -> ReducedGradient:
  """`gradient_step` under a checked `StepConfig`, with ZeRO's splits (what
  `jaxdp.make_train_step` runs per replica at stages 1-3 and in pipelines).

  `params_split` is the params' tree of `PartitionSpec`s of parameters
  that arrive split over the data axis (stage 3: all-gathered here, once,
  before the forward pass); `grads_split` the same for the gradient
  (stages 2-3: reduce-scattered, so each device keeps only its slice of each
  reduced leaf). Specs may also name the model axes a leaf is split over
  (the full spec): the gather and scatter then run per model shard.
  `divide=False` leaves the gradient undivided for `finish_step`.
  `stacked`: the params' tree of bools marking the leaves of stacks of
  layers (`jaxdp.sharding.layout.layer_mask`); at stage 3 those arrive split
  and stay so, `jaxdp.gather` gathers one layer at a time inside the
  loss, and their gradient leaves the loss reduce-scattered already (see
  `jaxdp.sharding.layerwise`).
  """
  axis_name, reduction = settings.axis_name, settings.mode
  _check_compression_present(settings, state)
  check_has_more(has_more)  # its dtype, while tracing (train_step in the user's own shard_map)
  if rng is not None and settings.example_ids is not None:  # the same key on every replica: masks follow the ids
    rng = jax.random.fold_in(rng, state.step)
  elif rng is not None:
    rng = jax.random.fold_in(jax.random.fold_in(rng, state.step), lax.axis_index(axis_name))
  presummed = None
  if stacked is not None and params_split is not None:
    if grads_split is None:
      raise ValueError(
          "stacked layers arriving split (params_split) have their gradient reduce-scattered inside the backward "
          "pass: pass grads_split too (the stage-3 layout's split specs), so that reduce_gradient does not "
          "all-reduce those slices as whole leaves."
      )
    if reduction == "rank_mean":
      raise ValueError(
          "reduction='rank_mean' divides each replica's gradient by its own weight before the reduction, but a "
          "stacked layer's gradient is reduce-scattered inside the backward pass (layers=); use reduction='mean'."
      )
    # The stacked leaves stay split: the loss gathers one layer at a time (jaxdp.gather), and the transpose of
    # that gather reduce-scatters the layer's gradient inside the backward loop.
    # (Not a leaf split along its layer axis, as a layout made without layers= may split it: gathered whole.)
    presummed = jax.tree.map(lambda is_layer, spec: bool(is_layer and (data_dim(spec, axis_name) or 0) > 0),
                             stacked, params_split, is_leaf=lambda x: isinstance(x, P))
    specs = params_split
    params_split = jax.tree.map(lambda spec, keep: model_part(spec, axis_name) if keep else spec, params_split,
                                presummed, is_leaf=lambda x: isinstance(x, P))
  params = gather_params(state.params, params_split, axis_name, settings.bucket_bytes)
  sinks = None
  if presummed is not None and (settings.compression is not None or settings.user is not None):
    # PowerSGD compresses a device's local gradient, a user's reduction sums whole leaves: a stack it reduces
    # leaves the backward pass whole, through zeros added to its gathered layers (a sink), and each device
    # keeps its slice of the reduced sum instead of a reduce-scatter in the backward pass.
    presummed, sinks = _sunk_stacks(params, specs, stacked, axis_name, presummed,
                                    state.compression if settings.user is None else None)
  differentiated, loss = (params, loss_fn) if sinks is None else ((params, sinks), _through_sinks(loss_fn))
  with gathering(params, specs, stacked, axis_name, settings.grad_reduce_dtype) if presummed is not None else (
      contextlib.nullcontext()):
    local = local_gradient(loss, differentiated, batch, weights, layout=axis_name, accum_steps=settings.accum_steps,
                           rng=rng, model_state=state.model_state, precision=settings.precision,
                           example_ids=settings.example_ids,
                           loss_scale=None if state.loss_scale is None else state.loss_scale.scale)
  if sinks is not None:  # a sunk stack's local gradient: its sink's, and its slice's in this device's place (zero
    # unless the loss also uses the split stack outside scan_layers: then summed as a reduce-scatter would)
    grads, sink_grads = local.grads
    zero = zero_axis(axis_name)

    def whole(g, sink, s, spec):
      if sink is None:
        return g
      dim = data_dim(spec, zero)
      own = lax.axis_index(zero) * g.shape[dim]
      return s + lax.dynamic_update_slice_in_dim(jnp.zeros_like(s), g.astype(s.dtype), own, axis=dim)

    local = local._replace(grads=jax.tree.map(whole, grads, sinks, sink_grads, specs, is_leaf=lambda x: x is None))
  totals = None if has_more is None else jnp.sum(has_more).astype(jnp.int32)
  return reduce_scattered(settings, local, getattr(state, "compression", None),
                          scatter=False if grads_split is None else grads_split, totals=totals, divide=divide,
                          presummed=presummed)


def _sunk_stacks(params: Any, specs: Any, stacked: Any, axis_name: Any, presummed: Any, compression: Any) -> tuple:
  """`(presummed, sinks)` at layer-wise ZeRO-3 with PowerSGD (`compression`, its state) or a user's reduction
  (`compression=None`): the stacked leaves it reduces (PowerSGD: those whose `q` is not `None`; a user's: all)
  are no longer reduced in the backward pass; `sinks` has zeros of their gathered shape there
  (`jaxdp.sharding.layerwise.sinking`), `None` elsewhere."""
  treedef = jax.tree.structure(params)
  compressed = ([True] * treedef.num_leaves if compression is None else
                [q is not None for q in treedef.flatten_up_to(compression.q)])
  shapes = sink_shapes(params, specs, stacked, axis_name)
  flat = jax.tree.leaves(presummed)
  sunk = [bool(p and c and shape is not None) for p, c, shape in zip(flat, compressed, shapes)]
  sinks = [jnp.zeros(shape, x.dtype) if is_sunk else None
           for x, shape, is_sunk in zip(jax.tree.leaves(params), shapes, sunk)]
  presummed = treedef.unflatten([p and not is_sunk for p, is_sunk in zip(flat, sunk)])
  return presummed, (treedef.unflatten(sinks) if any(sunk) else None)


def _through_sinks(loss_fn: Callable) -> Callable:
  """`loss_fn` on `(params, sinks)`: the sinks handed to the layer-wise loop (`sinking`) while it is traced."""

  @functools.wraps(loss_fn)
  def loss(differentiated, *args, **kwargs):
    params, sinks = differentiated
    with sinking(jax.tree.structure(params).flatten_up_to(sinks)):
      return loss_fn(params, *args, **kwargs)

  return loss


def _check_compression_present(settings: StepConfig, state: TrainState) -> None:
  """A state with a PowerSGD state needs a step with that reduction, and the other way round."""
  held = getattr(state, "compression", None) is not None
  if held and not settings.reduction.stateful:
    raise ValueError(
        "state.compression holds a reduction's state (PowerSGD's) but the step's reduction has none; pass the same "
        "reduction=jaxdp.reductions.powersgd(...) the state was made with, or state._replace(compression=None)."
    )
  if settings.compression is not None and not held:
    raise ValueError(
        f"reduction=powersgd({settings.compression}) but state.compression is None; make the state with "
        "jaxdp.init_state(..., reduction=) with the same reduction."
    )


def finish_step(
    optimizer: optax.GradientTransformation,
    state: TrainState,
    reduced: ReducedGradient,
    *,
    axis_name: str | None = None,
    agreed: bool = False,
    loss_scaling: Any = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """The skip decision and the update: `(new_state, metrics)` from a reduced gradient.

  Runs per replica (`axis_name` given; leaves that vary over it are
  chunks, counted once each in the norm, see `jaxdp.global_norm`) or
  on the global arrays (`axis_name=None`: the optimizer sees whole
  leaves, XLA partitions the update as the arrays are sharded, so every
  optax optimizer gives stage 0's numbers). A gradient left undivided
  (`grad_divisor`) is divided inside the norm's and the update's passes.

  `agreed=True`: the caller vouches that `reduced.grads` is the same on
  every replica (reduced with `"mean"`, `"sum"` or `"rank_mean"`), so
  each replica sums the squares of only its 1/N of it for the norm (one
  4-byte all-reduce; `train_step` passes it). The default is safe for
  any gradient: inside `shard_map` with `check_vma=True` the types tell
  agreed leaves apart and the norm is split anyway; under `pmap` or
  `check_vma=False` each replica takes the norm of its own values (a
  `reduction="none"` gradient: each replica's own norm and skip). For a
  `"none"` gradient pass `axis_name=None`, as `train_step` does:
  each replica's own norm everywhere (inside `shard_map` with
  `check_vma=True` its leaves are typed as varying, and with
  `axis_name` the norm would count them as chunks of one vector).

  `loss_scaling`: a `jaxdp.DynamicLossScale`, with a state whose
  `loss_scale` is set (and only then): the new state's loss scale follows
  `jaxdp.update_loss_scale` from the non-finite flag, also when the
  update is skipped, and `metrics["loss_scale"]` is the scale this step used.
  """
  check_loss_scale(loss_scaling, state.loss_scale)
  # The reduction spreads a NaN/Inf of any replica to every replica's gradient norm and loss (a sum with
  # a NaN is NaN), so this flag is the same everywhere: all skip.
  grad_norm = global_norm(reduced.grads, axis_name, reduced.grad_divisor, agreed=agreed)
  nonfinite = jnp.logical_not(jnp.isfinite(grad_norm) & jnp.isfinite(reduced.loss))
  if reduced.grad_divisor is not None:
    # The division multiplies by 1/divisor, which flushes to 0 from 2**126 on (a global weight of 8.5e37): the
    # gradient, loss and norm would read 0 and the step would apply. Counted as non-finite instead.
    nonfinite = nonfinite | jnp.logical_not(reduced.grad_divisor < 2.0**126)
  apply = (reduced.weight > 0) & jnp.logical_not(nonfinite)
  new_state = apply_update(optimizer, state, reduced.grads, apply, reduced.model_state, reduced.grad_divisor,
                           value=reduced.loss, compression=reduced.compression)
  if loss_scaling is not None:  # outside the update's cond: a skipped step changes the scale too
    new_state = new_state._replace(loss_scale=update_loss_scale(loss_scaling, state.loss_scale, nonfinite, apply))
  metrics = {
      "loss": reduced.loss,
      **(reduced.metrics or {}),
      "weight": reduced.weight,
      "grad_norm": grad_norm,
      "nonfinite": nonfinite.astype(jnp.int32),
      "skipped": jnp.logical_not(apply).astype(jnp.int32),
  }
  if reduced.totals is not None:
    metrics["has_more"] = reduced.totals
  if loss_scaling is not None:
    metrics["loss_scale"] = state.loss_scale.scale
  return new_state, metrics


def _bound_and_typed(axis_name: str) -> bool:
  check_axis_bound(axis_name)
  return checks_vma(axis_name)


@accepts_legacy_keywords("train_step", ("loss_fn", "optimizer", "state", "batch", "weights"))
def train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    state: TrainState,
    batch: Any,
    weights: jax.Array | None = None,
    *,
    layout: Any = "data",
    reduction: Any = None,
    precision: Any = None,
    accum_steps: int = 1,
    example_ids: Any = None,
    rng: jax.Array | None = None,
    has_more: jax.Array | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One synchronous data-parallel step, as seen by one replica.

  Call it inside your own `jax.shard_map` (state replicated, batch split
  over `axis_name`) or `jax.pmap` over `axis_name`. It is the
  composition `local_gradient -> reduce_gradient -> apply_update`
  (`gradient_step` then `finish_step`), with the state
  replicated over `axis_name` (ZeRO stage 0; model axes may be left to
  the compiler with `shard_map(..., axis_names={axis_name})`). ZeRO
  stages 1-3 are the same two functions with the update outside the map:
  `jaxdp.make_train_step` composes them so.

  Args:
    loss_fn: `loss_fn(params, batch)` returning per-example losses `[b]`
      or per-token losses `[b, t]`, or a `jaxdp.LossOutput` with the
      new model state and metrics; it may declare the keyword arguments
      `model_state`, `weights`, `axis_name` and `train` (see
      `jaxdp.core.loss`).
    optimizer: an optax `GradientTransformation`.
    state: this replica's `TrainState`.
    batch: this replica's slice of the batch.
    weights: `None` (all ones) or an array of the losses' shape, `>= 0`,
      zero for padding.
    layout: the `jaxdp.DataParallel` of the step (or the data axis'
      name, a str or a tuple): the axes to reduce over.
    reduction: a `jaxdp.reductions.Reduction`; default
      `jaxdp.reductions.mean`, the exact gradient of the global
      weighted mean. `rank_mean` (DDP's),
      `sum`, `none`,
      `bucketed`, `powersgd`
      (`state.compression` then holds its state) or a user's own, composed
      with `jaxdp.reductions.chain`.
    precision: a `jaxdp.Precision` (`jaxdp.precision`): the
      compute dtype of the forward and backward passes (params, optimizer
      state and sums stay as they are), the dtype the gradient is all-reduced
      in, and loss scaling (the state's `loss_scale` then holds the scale:
      the backward pass differentiates the loss multiplied by it, the
      float32 gradient is divided by it before the reduction, and the scale
      is updated from the step's non-finite flag).
    accum_steps: number of micro-batches this replica's batch is split into;
      their gradient sums are accumulated locally and reduced once.
    rng: optional PRNG key, the same on every replica. Each replica derives
      its own key with `fold_in(fold_in(rng, state.step), axis_index)` (and
      `fold_in(·, i)` for micro-batch `i`) and `loss_fn` is called as
      `loss_fn(params, batch, key)`. Only gradients and per-replica model
      state depend on the key, so the replicas stay identical. With
      `example_ids` the key is `fold_in(rng, state.step)` on every
      replica and micro-batch instead.
    has_more: optional per-replica count (e.g. 1 if this replica's input
      stream has data after this batch), summed over replicas in the step's
      own all-reduce into `metrics["has_more"]`.
    example_ids: layout-invariant randomness (`jaxdp.core.randomness`): the
      key of each row's global id in a dict batch (e.g. `"id"`), or a
      callable `batch -> [b]` integer ids. `loss_fn` gets the same key
      everywhere and `jaxdp.adapters.nnx.Dropout` / `jaxdp.adapters.linen.Dropout`
      draw row `r`'s mask from `fold_in(layer_key, id_r)`: the same masks
      on any number of devices, split and `accum_steps`. A library's own
      `Dropout` (linen's, nnx's) is then refused. `None` (default):
      per-replica keys.

  Returns:
    `(new_state, metrics)` with `metrics` holding `loss` (reduced as
    `reduction` says), each metric `loss_fn` returned (reduced like the
    loss), `weight` (global `Σ w`; local under `"none"`), `grad_norm`
    (global norm of the applied gradient), `nonfinite` (1 when the reduced
    gradient or loss holds a NaN/Inf, which happens when any replica's does,
    when the gradient norm overflows float32, or when the divisor reaches
    2**126, whose reciprocal flushes to 0), `skipped` (1 when the
    update was skipped: zero global weight or `nonfinite`; the state,
    `step` and model state included, is then returned unchanged on every
    replica) and `has_more` when given. The new model state is identical
    on every replica (see `jaxdp.reduce_model_state`), and with
    `loss_scaling` `loss_scale`, the scale this step used.
  """
  settings = step_config(layout, reduction, precision, accum_steps, example_ids)
  check_optimizer(optimizer)  # before the forward and backward passes are traced
  axis_name, reduction = settings.axis_name, settings.mode
  check_loss_scale(settings.loss_scaling, state.loss_scale)  # before the forward and backward passes are traced
  if reduction == "none" and _bound_and_typed(axis_name) and not all(varies(p, axis_name) for p in jax.tree.leaves(state.params)):
    raise ValueError(
        "reduction='none' inside shard_map with check_vma=True: each replica's update makes the state per-replica, "
        "which its replicated type cannot hold. Pass jaxdp.as_varying(state, axis_name) (and out_specs that keep "
        "the replicas), or use shard_map(..., check_vma=False) as make_train_step does."
    )
  reduced = sharded_gradient_step(settings, loss_fn, state, batch, weights, rng=rng, has_more=has_more, divide=False)
  # Under "none" the replicas' gradients differ: each takes the norm of its own.
  if reduction == "none":
    return finish_step(optimizer, state, reduced)
  return finish_step(optimizer, state, reduced, axis_name=axis_name, agreed=True, loss_scaling=settings.loss_scaling)


def _legacy_sharded(loss_fn, state, batch, weights=None, *, layout="data", reduction=None, precision=None, accum_steps=1,
                    example_ids=None, **splits):
  """`gradient_step(..., params_split=, grads_split=, divide=, stacked=)` of jaxdp 0.1: ZeRO's splits, which
  left the public signature, run through `sharded_gradient_step`."""
  config = step_config(layout, reduction, precision, accum_steps, example_ids)
  return sharded_gradient_step(config, loss_fn, state, batch, weights, **splits)
