"""Local gradients and the reduction that makes the replicas agree on one.

The two functions here are the heart of data parallelism and are kept pure
and separate so that users can compose them differently (accumulate, clip,
reduce-scatter):

* `local_gradient` differentiates the *weighted sum* of this replica's
  losses. Sums, not means, are what can be added across devices and
  micro-batches without a normalisation error.
* `reduce_gradient` turns the local sums into the gradient that every
  replica applies, according to a `reduction` mode.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from jax.extend import core as jax_core

from jaxdp.reductions.compression import compressed_sums, with_compressed
from jaxdp.sharding import pipelining
from jaxdp.sharding.layout import axis_names, model_part, per_model_shard
from jaxdp.core.loss import call_loss, in_step
from jaxdp.core.randomness import per_example
from jaxdp.core.carries import varying_axes
from jaxdp.core.precision import summed_in
from jaxdp.training.config import StepConfig, step_config
from jaxdp.sharding.legacy import accepts_legacy_keywords

class LocalGradient(NamedTuple):
  """What one replica knows before any communication.

  Attributes:
    grads: gradient of `loss_sum` with respect to the params (same pytree),
      accumulated in float32 at least.
    loss_sum: scalar `Σ w·l` over this replica's examples (or tokens), float32 at least.
    weight_sum: scalar float32 `Σ w` over this replica's examples (or tokens).
    metric_sums: `{name: Σ w·m}` of the metrics `loss_fn` returned (empty if none).
    model_state: the model state after this replica's forward pass(es), or `None`.
  """

  grads: Any
  loss_sum: jax.Array
  weight_sum: jax.Array
  metric_sums: Any = None
  model_state: Any = None


class ReducedGradient(NamedTuple):
  """The gradient every replica applies, with the matching loss, weight, metrics and model state.

  Attributes:
    grads: the normalised gradient to hand to the optimizer; or, when
      `grad_divisor` is not `None`, the reduced sums whose quotient by
      `grad_divisor` is that gradient (see `applied_gradient`).
    loss: the reduced loss matching the reduction mode.
    weight: the total weight behind `grads`: global `Σ w`, or the local one
      under `"none"`. Zero means there is nothing to learn from.
    metrics: `{name: value}`, each metric reduced like the loss.
    model_state: the model state every replica keeps (see `reduce_model_state`).
    totals: the `totals` given to `reduce_gradient`, summed over replicas.
    grad_divisor: `None` (`grads` is the gradient), or the scalar that
      `grads` is still to be divided by (`reduce_gradient(...,
      divide=False)`): `jaxdp.finish_step` then divides where the
      gradient is read (its norm, the optimizer update), so the compiler
      fuses the division into those passes instead of writing a divided
      copy of the whole gradient first. The numbers are the same.
    compression: the new `jaxdp.PowerSGDState` after a compressed
      reduction (the step installs it with the update), else `None`.
  """

  grads: Any
  loss: jax.Array
  weight: jax.Array
  metrics: Any = None
  model_state: Any = None
  totals: Any = None
  grad_divisor: Any = None
  compression: Any = None


def applied_gradient(reduced: ReducedGradient) -> Any:
  """The gradient a `ReducedGradient` stands for: `grads`, divided by `grad_divisor` if that is set."""
  return divide_gradient(reduced.grads, reduced.grad_divisor)


def divide_gradient(grads: Any, divisor: jax.Array | None) -> Any:
  """`grads / divisor` leaf by leaf, in each leaf's dtype (`divisor=None`: `grads` unchanged).

  Computed as `grads * (1 / divisor)` (within an ulp of the quotient): XLA
  fuses a multiply into every pass that reads the gradient (the norm, each
  of the optimizer's moments), where a divide would be written out first.
  """
  if divisor is None:
    return grads
  reciprocal = 1 / jnp.asarray(divisor)
  return jax.tree.map(lambda g: g * reciprocal.astype(g.dtype), grads)


def check_axis_bound(axis_name: Any, name: str = "axis_name") -> None:
  """Raises `ValueError` unless every axis of `axis_name` is bound here (inside `shard_map`/`pmap` over it)."""
  for axis in axis_names(axis_name):
    try:
      lax.axis_size(axis)
    except NameError:
      raise ValueError(
          f"{name}={axis_name!r}: axis {axis!r} is not an axis of the enclosing shard_map or pmap; call this "
          "inside jax.shard_map over a mesh with that axis (or jax.pmap(..., axis_name=...)), or pass the mesh "
          "axis it runs over."
      ) from None


def varies(x: Any, axis_name: Any) -> bool:
  """Whether `x` is typed (inside `shard_map`) as varying over any of the axes of `axis_name`."""
  return bool(set(axis_names(axis_name)) & varying_axes(x))


def as_varying(tree: Any, axis_name: str) -> Any:
  """Marks every leaf of `tree` as varying over `axis_name` (a no-op at run time).

  Inside `shard_map` with `check_vma=True`, `jax.grad` with respect to a
  replicated value returns a gradient that is already summed over the axis
  (the transpose of the implicit broadcast is a `psum`). Differentiating
  with respect to a varying copy yields the *local* gradient instead, which is
  what must be normalised before the one reduction. Under `pmap` or with
  `check_vma=False` this returns the leaves unchanged, and so it does
  where the axis is not bound at all (the same loss called on one device,
  outside any `shard_map`).
  """
  try:
    for axis in axis_names(axis_name):
      lax.axis_size(axis)
  except NameError:  # no enclosing shard_map/pmap over the axis: nothing varies over it
    return tree

  def cast(x):
    missing = tuple(a for a in axis_names(axis_name) if a not in varying_axes(x))
    if not missing:
      return x
    return lax.pcast(x, missing if len(missing) > 1 else missing[0], to="varying")

  return jax.tree.map(cast, tree)


def _at_least_float32(x: jax.Array) -> jax.Array:
  # Sums of many float16/bfloat16 terms lose counts (1,204 tokens sum to 1,200 in bfloat16) or overflow
  # (float16 tops out at 65,504): weights, losses and gradients are summed in float32 at least.
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _weighted_sum(values: jax.Array, weights: jax.Array) -> jax.Array:
  # where() keeps a non-finite value on a zero-weight (padding) row out of the sum.
  return jnp.sum(jnp.where(weights > 0, _at_least_float32(values) * weights, 0))


def cast_floating(tree: Any, dtype: Any) -> Any:
  """Every floating leaf of `tree` cast to `dtype` (other leaves, and `dtype=None`, unchanged)."""
  if dtype is None:
    return tree
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _loss_weights(weights: jax.Array | None, losses: jax.Array) -> jax.Array:
  if weights is None:
    return jnp.ones(losses.shape, jnp.float32)
  if weights.shape != losses.shape:
    raise ValueError(
        f"weights has shape {weights.shape} but loss_fn returned losses of shape {losses.shape} (this device's "
        "slice); return one loss per weight (per-example losses of shape [b]: e.g. .squeeze(-1) of a [b, 1] "
        "output), or pass weights with exactly the shape of the per-example (or per-token) losses."
    )
  return _at_least_float32(weights)


def _split_micro(tree: Any, accum_steps: int) -> Any:
  """`[b, ...] -> [K, b/K, ...]`: K contiguous micro-batches of each leaf."""

  def split(x):
    if x.shape[0] % accum_steps:
      raise ValueError(
          f"this device's batch has {x.shape[0]} rows, which do not split into accum_steps={accum_steps} "
          f"micro-batches; make the per-device batch a multiple of {accum_steps}."
      )
    return x.reshape(accum_steps, x.shape[0] // accum_steps, *x.shape[1:])

  return jax.tree.map(split, tree)


def _rows(batch: Any) -> int:
  leaves = jax.tree.leaves(batch)
  if not leaves or not np.shape(leaves[0]):
    raise ValueError("batch needs at least one array with a leading batch axis.")
  return np.shape(leaves[0])[0]


def _check_weight_rows(weights: Any, batch: Any) -> None:
  # Else a weights array of the wrong length reaches loss_fn, and the error blames the losses' shape.
  sizes = {np.shape(x)[0] for x in jax.tree.leaves(batch) if np.shape(x)}
  if sizes and (not np.shape(weights) or np.shape(weights)[0] not in sizes):
    raise ValueError(
        f"weights has shape {tuple(np.shape(weights))} but the batch's leaves have {min(sizes)} rows here; pass "
        "weights with the shape of the per-example [b] (or per-token [b, t]) losses, b the batch's leading size."
    )


def _abstract_vma(x: Any) -> frozenset:
  """The varying axes of an array or of a `ShapeDtypeStruct` from `jax.eval_shape`."""
  if isinstance(x, jax.ShapeDtypeStruct):
    manual = getattr(x, "manual_axis_type", None)  # JAX 0.10
    return frozenset(manual.varying) if manual is not None else frozenset(getattr(x, "vma", ()) or ())
  return varying_axes(x)


def loss_sums(
    loss_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    weights: jax.Array | None = None,
    *,
    rng: jax.Array | None = None,
    model_state: Any = None,
    axis_name: str | None = None,
    train: bool = True,
    example_ids: Any = None,
) -> LocalGradient:
  """This replica's weighted sums `Σ w·l`, `Σ w`, `Σ w·m` per metric, and its new model state.

  The one definition of the loss and metrics that training and evaluation
  share. Sums are in float32 at least. Rows of weight 0 never contribute to
  the sums, even if their loss or metric is NaN, so evaluation means are
  exact; the gradient is another matter: differentiating through a row whose
  loss is NaN gives a NaN gradient whatever its weight (the row's zero
  cotangent meets the NaN inside the model, and `0 * NaN` is NaN), and the
  training step then skips the step. That is why jaxdp pads with copies of real rows
  (`pad="copy"` in `jaxdp.shard_uneven` and the pipelines), never
  rows the model may turn into NaN. Returns a `LocalGradient` with
  `grads=None`. `example_ids`: where the rows' ids are in `batch`
  (see `jaxdp.core.randomness`), set while `loss_fn` runs.
  """
  if weights is not None:
    _check_weight_rows(weights, batch)
  row_weights = jnp.ones((_rows(batch),), jnp.float32) if weights is None else weights
  with per_example(batch, example_ids, train=train):
    out = call_loss(
        loss_fn, params, batch, rng, model_state=model_state, weights=row_weights, axis_name=axis_name, train=train
    )
  w = _loss_weights(weights, out.losses)
  # A negative or non-finite weight has no meaning and would give wrong sums: poison all of them (loss, metrics,
  # weight), so that the step's non-finite check skips it on every replica (metrics["nonfinite"]) and no metric
  # or evaluation mean reads as a number.
  bad = jnp.any(w < 0) | jnp.any(jnp.logical_not(jnp.isfinite(w)))
  poisoned = lambda x: jnp.where(bad, jnp.nan, x)  # noqa: E731
  metric_sums = {name: poisoned(_weighted_sum(values, w)) for name, values in out.metrics.items()}
  loss_sum = poisoned(_weighted_sum(out.losses, w))
  return LocalGradient(None, loss_sum, poisoned(jnp.sum(w)), metric_sums, out.model_state)


@accepts_legacy_keywords("local_gradient", ("loss_fn", "params", "batch", "weights"))
def local_gradient(
    loss_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    weights: jax.Array | None = None,
    *,
    layout: Any = None,
    accum_steps: int = 1,
    rng: jax.Array | None = None,
    model_state: Any = None,
    train: bool = True,
    precision: Any = None,
    example_ids: Any = None,
    loss_scale: jax.Array | None = None,
) -> LocalGradient:
  """Gradient of this replica's weighted loss *sum*, with no communication of its own.

  Args:
    loss_fn: `loss_fn(params, batch)` (or `loss_fn(params, batch, rng)`
      when `rng` is given) returning per-example losses `[b]`, per-token
      losses `[b, t]`, or a `jaxdp.LossOutput`; it may declare the
      keyword arguments of `jaxdp.LOSS_KEYWORDS` (see `jaxdp.core.loss`).
    params: the parameters (replicated across the axis).
    batch: this replica's slice of the batch.
    weights: `None` (all ones) or an array of the losses' shape with values
      `>= 0`; zero marks padding.
    layout: when called inside `shard_map` over the data axes, the
      `jaxdp.DataParallel` (or the data axis' name); the params are
      then differentiated as a per-replica value, so that the result is the
      local gradient and not an implicit all-reduce. `None`: outside any
      map. (A `loss_fn` may still communicate, e.g. for exact BatchNorm
      statistics.)
    accum_steps: split the batch into this many contiguous micro-batches and
      accumulate their gradient *sums* with `lax.scan` (activation memory
      of one micro-batch). The result equals the whole-batch one: sums add
      exactly, only the final normalisation divides. The model state flows
      through the micro-batches in order, as K forward passes would update it.
    rng: optional PRNG key for `loss_fn` (dropout); micro-batch `i` gets
      `fold_in(rng, i)` (every micro-batch `rng` itself with `example_ids`).
    model_state: the model state given to `loss_fn` (`None` if the model
      has none).
    train: the `train` flag for a `loss_fn` that declares it.
    precision: a `jaxdp.Precision`; its `compute_dtype` is mixed
      precision: the floating params and batch leaves are cast to that dtype (e.g. `jnp.bfloat16`) for the forward and backward
      pass, while the gradient is taken with respect to the params as they
      are (float32 master weights) and the sums stay float32. Where the
      backward pass runs in 16 bits (this dtype, 16-bit params, or 16-bit
      values in the loss's own trace: a model's `dtype=jnp.float16`), the
      weighted sum is divided by a power of two near the global `Σ w` per
      micro-batch over `N·√n` (`n`: a device's loss elements; see
      `_sixteen_bit_scale`; with `axis_name`, one 4-byte `psum` of
      the weights before the forward pass, so the scale is the same on
      every replica and collectives in `loss_fn` stay exact) and the
      float32 gradient scaled back exactly: the sum itself overflows
      float16's 65,504 on large batches and flushes to 0 under small
      weights, and one device's mean-loss scale underflows float16 past
      ~16k tokens. Dynamic loss scaling on top of this is the steps'
      `loss_scaling=` (`jaxdp.core.loss_scaling`). Under `"rank_mean"` or
      `"none"`, where each replica's own mean counts, a replica whose
      weights are tiny next to the others' can still underflow float16.
    example_ids: layout-invariant randomness (see `jaxdp.core.randomness`):
      the key of the ids in a dict batch (e.g. `"id"`) or a callable
      `batch -> [b]` integer ids. Each micro-batch's ids are set while
      `loss_fn` runs, and every micro-batch gets `rng` itself.
    loss_scale: the current loss scale (a float32 scalar: the state's
      `loss_scale.scale` under a policy with `loss_scaling`), or `None`.

  Returns:
    A `LocalGradient` with the gradient of `Σ w·l`, `Σ w·l`,
    `Σ w`, the metric sums and the new model state.

  The 16-bit plan first (`_sixteen_bit_plan`), then one micro-batch's
  gradient (`_micro_gradient`), or the accumulation of `accum_steps`
  of them (`_accumulated`). `loss_scale`: a float32 scalar (dynamic
  loss scaling, `jaxdp.core.loss_scaling`) that multiplies the differentiated
  value; a 16-bit plan then divides the sum by a power of two near the global
  `Σ w` per replica (a device's mean loss, as torch's `GradScaler`
  scales it) instead of the `√n` normalisation. Each micro-batch's float32
  gradient is divided by both again before it is accumulated or reduced.
  """
  settings = step_config(layout, None, precision, accum_steps, example_ids)
  if settings.axis_name is not None:
    check_axis_bound(settings.axis_name)
    params = as_varying(params, settings.axis_name)
  plan = _sixteen_bit_plan(settings, loss_fn, params, batch, weights, rng=rng, model_state=model_state, train=train,
                           scaled=loss_scale is not None)
  if loss_scale is not None:
    plan = plan._replace(loss_scale=lax.stop_gradient(jnp.asarray(loss_scale, jnp.float32)))
  micro_gradient = functools.partial(_micro_gradient, settings, loss_fn, plan, params, train=train)
  if settings.accum_steps == 1:
    return micro_gradient(batch, weights, rng, model_state)
  return _accumulated(settings, micro_gradient, batch, weights, rng, model_state)


class _SixteenBitPlan(NamedTuple):
  """How a backward pass divides the weighted sum (see `_sixteen_bit_scale`).

  Attributes:
    active: whether the backward pass runs in 16 bits (and so divides by a scale).
    replicas: the data-parallel replicas, read by the scale only.
    scale: the scale of every micro-batch, from the given weights' global sum; `None`: each
      micro-batch's own, from its count of loss elements (no weights: all ones).
    loss_scale: the dynamic loss scale (float32 scalar) the divided sum is multiplied by, or `None`.
  """

  active: bool
  replicas: int = 1
  scale: jax.Array | None = None
  loss_scale: jax.Array | None = None


def _sixteen_bit_plan(settings: StepConfig, loss_fn: Callable[..., Any], params: Any, batch: Any, weights: Any, *,
                      rng: Any, model_state: Any, train: bool, scaled: bool = False) -> _SixteenBitPlan:
  """Whether the backward pass runs in 16 bits and, if so, the scale it divides the weighted sum by.

  A 16-bit backward pass differentiates the weighted sum over one scale (a power of two that makes each
  element's cotangent about 1/√n), and the float32 gradient is scaled back: the sum itself overflows float16
  (65,504) on large batches and flushes to 0 under small weights; the mean underflows it on many tokens. The
  scale is the same on every replica (one 4-byte psum of the weights, before the forward pass and outside the
  micro-batch loop), so a loss_fn whose forward pass communicates (exact BatchNorm statistics) still gets
  every replica's terms right; a per-replica Σ w would not. Without weights (all ones) it follows from the
  count of loss elements, the same on every replica without communication.

  `scaled` (dynamic loss scaling): the power of two nearest the global Σ w per replica instead, so that the
  loss scale multiplies a device's mean loss (each element's cotangent about scale/n), as in torch.
  """
  axis_name, accum_steps, compute_dtype = settings.axis_name, settings.accum_steps, settings.compute_dtype
  active = _sixteen_bit(params, compute_dtype)
  if not active:  # a model that computes in 16 bits by its own dtype (a layer's dtype=jnp.float16)
    sample = (batch, weights) if accum_steps == 1 else jax.tree.map(lambda x: x[0], _split_micro((batch, weights),
                                                                                                 accum_steps))

    def traced(p):  # as _micro_gradient calls it: compute_dtype casts the params and the batch first
      p, b = cast_floating((p, sample[0]), compute_dtype)
      return loss_sums(loss_fn, p, b, sample[1], rng=rng, model_state=model_state, axis_name=axis_name,
                       train=train, example_ids=settings.example_ids).loss_sum

    active = _computes_in_16_bits(traced, params)
  if not active:
    return _SixteenBitPlan(False)
  replicas = 1 if axis_name is None else math.prod(lax.axis_size(a) for a in axis_names(axis_name))
  if weights is None:
    return _SixteenBitPlan(True, replicas)
  total = jnp.sum(_at_least_float32(jnp.asarray(weights)))
  total = total if axis_name is None else lax.psum(as_varying(total, axis_name), axis_name)
  return _SixteenBitPlan(True, replicas, _sixteen_bit_scale(total / accum_steps, replicas,
                                                            1 if scaled else np.size(weights) / accum_steps))


def _micro_gradient(settings: StepConfig, loss_fn: Callable[..., Any], plan: _SixteenBitPlan, params: Any,
                    micro_batch: Any, micro_weights: Any, micro_rng: Any, state: Any, *, train: bool) -> LocalGradient:
  """One micro-batch's `LocalGradient`: its sums and the gradient of `Σ w·l`, float32 at least."""

  def weighted_sum(p, rows=micro_batch, row_weights=micro_weights):
    p, b = cast_floating((p, rows), settings.compute_dtype)
    sums = loss_sums(
        loss_fn, p, b, row_weights, rng=micro_rng, model_state=state, axis_name=settings.axis_name, train=train,
        example_ids=settings.example_ids,
    )
    if not plan.active:
      scale = None
    else:
      # Without weights every replica counts its losses' elements (the same shapes everywhere): all ones.
      # Under dynamic loss scaling the divisor is that count itself (a device's mean, see _sixteen_bit_plan).
      elements = 1 if plan.loss_scale is not None else sums.weight_sum
      scale = plan.scale if plan.scale is not None else _sixteen_bit_scale(plan.replicas * sums.weight_sum,
                                                                           plan.replicas, elements)
    value = sums.loss_sum if scale is None else sums.loss_sum / scale
    if plan.loss_scale is not None:  # dynamic loss scaling: the gradient comes out multiplied by it
      value = value * plan.loss_scale
      scale = (1.0 if scale is None else scale) / plan.loss_scale
    return value, (sums, scale)

  piped = pipelining.active()
  with in_step(settings.axis_name):  # the backward pass too: a custom_vjp rule traced there may take statistics
    if piped is not None and piped.pipeline.schedule == "1f1b":  # the schedule takes the gradient itself
      if state is not None:
        raise ValueError(
            "schedule='1f1b' with a model state (BatchNorm statistics): it runs the loss on one microbatch at a "
            "time, so statistics would be per microbatch, not the batch's. Use schedule='gpipe' or 'circular'.")
      (_, (sums, scale)), grads = pipelining.one_f_one_b(weighted_sum, params, micro_batch, micro_weights, piped,
                                                         _add_sums)
    else:
      (_, (sums, scale)), grads = jax.value_and_grad(weighted_sum, has_aux=True)(params)
  # Unscaled in float32 (a power of two over a power of two: exact), before any accumulation or reduction.
  widen = _at_least_float32 if scale is None else (lambda g: _at_least_float32(g) * scale)
  return sums._replace(grads=jax.tree.map(widen, grads))


def _add_sums(total: tuple, part: tuple) -> tuple:
  """One microbatch's `(sums, scale)` added to `total` (the scale, the same for every microbatch, kept)."""
  (sums, _), (more, scale) = total, part
  if more.model_state is not None:
    raise ValueError("schedule='1f1b' with a loss that returns a model state: statistics would be per microbatch; "
                     "use schedule='gpipe' or 'circular'.")
  added = jax.tree.map(jnp.add, sums._replace(model_state=None), more._replace(model_state=None))
  return added, scale


def _accumulated(settings: StepConfig, micro_gradient: Callable[..., LocalGradient], batch: Any, weights: Any,
                 rng: Any, model_state: Any) -> LocalGradient:
  """The sums of `accum_steps` contiguous micro-batches, scanned; the model state flows through them in order.

  `micro_gradient(micro_batch, micro_weights, micro_rng, state)`: one micro-batch's `LocalGradient`.
  """
  axis_name, accum_steps, example_ids = settings.axis_name, settings.accum_steps, settings.example_ids
  micro = _split_micro((batch, weights), accum_steps)
  first = jax.eval_shape(micro_gradient, *jax.tree.map(lambda x: x[0], micro), rng, model_state)
  if axis_name is not None:
    # The carry's types must not change across iterations: a model state that the first micro-batch makes
    # per-replica (local statistics) is per-replica from the start; one it keeps replicated stays so.
    # (Any of the data axes: a hybrid axis is a tuple, never itself an element of the set.)
    # A hand-written tensor-parallel step adds its manual model axes: every axis the first result varies over.
    model_state = jax.tree.map(_varying_like, model_state, first.model_state)

  def accumulate(carry, xs):
    total, state = carry
    index, micro_batch, micro_weights = xs
    # With example ids, every micro-batch gets the same key: the masks follow the ids, not the micro-batch.
    micro_rng = rng if rng is None or example_ids is not None else jax.random.fold_in(rng, index)
    part = micro_gradient(micro_batch, micro_weights, micro_rng, state)
    sums = part._replace(model_state=None)
    if axis_name is not None:  # keep the carry's type fixed under check_vma
      sums = as_varying(sums, axis_name)
    return (jax.tree.map(jnp.add, total, sums), part.model_state), None

  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, out_sharding=_explicit_sharding(s)),
                       first._replace(model_state=None))
  if axis_name is not None:
    zeros = as_varying(zeros, axis_name)
    zeros = jax.tree.map(_varying_like, zeros, first._replace(model_state=None))
  (total, new_state), _ = lax.scan(accumulate, (zeros, model_state), (jnp.arange(accum_steps), *micro))
  return total._replace(model_state=new_state)


def _varying_like(x: jax.Array, like: Any) -> jax.Array:
  """`x` typed as varying over every axis `like` (an array or `ShapeDtypeStruct`) varies over too."""
  missing = tuple(sorted(_abstract_vma(like) - varying_axes(x)))
  return lax.pcast(x, missing, to="varying") if missing else x


def _sixteen_bit_scale(total: jax.Array, replicas: int, elements: Any) -> jax.Array:
  """The power of two nearest `total / (replicas · √elements)`: what a 16-bit backward pass divides Σ w·l by.

  `total`: the global batch's Σ w (per micro-batch); `elements`: the loss elements of one device's
  (micro-)batch. Each element's cotangent is then about `1/√elements` of its share (the mean weight counts
  as 1, whatever the weights' magnitude) and a device's sum about `√elements` times an element's: between
  the sum's overflow of float16's 65,504 and the mean's underflow below its 6.1e-5 (past ~16k tokens), far
  from both. A power of two, so that dividing and scaling back are exact. The same on every replica (a
  global total, static shapes), so collectives inside loss_fn see consistent values. A zero, negative or
  non-finite total (the poison path reports those) or an empty batch keeps the plain sum (1).
  """
  scale = jnp.asarray(total, jnp.float32) / (replicas * jnp.sqrt(jnp.asarray(elements, jnp.float32)))
  power = jnp.exp2(jnp.round(jnp.log2(scale)))
  return lax.stop_gradient(jnp.where((scale > 0) & jnp.isfinite(power) & (power > 0), power, 1.0))


def _sixteen_bit(params: Any, compute_dtype: Any) -> bool:
  """Whether the backward pass runs in a 16-bit float: a 16-bit `compute_dtype` or parameter."""
  dtypes = [compute_dtype] if compute_dtype is not None else []
  dtypes += [x.dtype for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
  return any(jnp.finfo(d).bits < 32 for d in dtypes)


def _computes_in_16_bits(fn: Callable, params: Any) -> bool:
  """Whether `fn(params)` computes a floating value in fewer than 32 bits (its backward pass then does too).

  Traces `fn` once more (no computation); nested jaxprs (jit, scan, cond, custom rules) are read as well.
  """
  def narrow(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
      for var in eqn.outvars:
        dtype = getattr(var.aval, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
          return True
      for value in eqn.params.values():
        for inner in value if isinstance(value, (tuple, list)) else (value,):
          inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's Jaxpr
          if isinstance(inner, jax_core.Jaxpr) and narrow(inner):
            return True
    return False

  try:
    jaxpr = jax.make_jaxpr(fn)(params).jaxpr
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
          jax.errors.TracerIntegerConversionError):  # an eager call whose loss reads values: no abstract trace
    return False
  return narrow(jaxpr)


def _is_trivial(tree: Any, axis_name: str) -> bool:
  # One device and no varying types (check_vma off): the sum is the value, and XLA would still copy it.
  return lax.axis_size(axis_name) == 1 and not any(varies(x, axis_name) for x in jax.tree.leaves(tree))


# Leaves of up to this many bytes share one flat operand (per dtype) in an all-reduce.
PACK_BYTES = 1 << 18
# XLA CPU runs a program's kernels one after another on the calling thread when none of its buffers exceeds
# 512 bytes (its executor's execute_sequential_buffer_threshold), and on its thread pool otherwise; on a step
# that small the pool's hand-offs cost more than the kernels (measured: 2.4x the step at 96 leaves). So a
# small gradient (every leaf and the whole row of at most ROW_BYTES and SMALL_ROWS * ROW_BYTES) is packed
# in rows of at most ROW_BYTES (several operands of one all-reduce), where a larger one has one row.
ROW_BYTES = 512
SMALL_ROWS = 16


def rows_of(nbytes: list) -> list:
  """The positions `0 .. len(nbytes) - 1` of leaves of these byte sizes cut into packed rows, in order: one
  row, or for a small gradient rows of at most `ROW_BYTES` each (see `SMALL_ROWS`)."""
  if not nbytes or sum(nbytes) <= ROW_BYTES or max(nbytes) > ROW_BYTES or sum(nbytes) > SMALL_ROWS * ROW_BYTES:
    return [list(range(len(nbytes)))]
  rows, size = [[]], 0
  for i, b in enumerate(nbytes):
    if rows[-1] and size + b > ROW_BYTES:
      rows.append([])
      size = 0
    rows[-1].append(i)
    size += b
  return rows


def _psum(tree: Any, axis_name: str) -> Any:
  """One all-reduce of every leaf of `tree`, the small leaves packed into one flat operand per dtype (and
  varying type).

  XLA CPU's all-reduce pays a fixed cost per operand, so many small operands cost more than one flat
  operand of the same values; packing leaves of up to `PACK_BYTES` costs a copy of them. Each element is summed as before: the same values, bit for bit.
  A small gradient is packed in rows of `ROW_BYTES` instead (`rows_of`).
  Leaves the compiler may split over another mesh axis stay whole (packing would gather them).
  """
  if _is_trivial(tree, axis_name):
    return tree
  leaves, treedef = jax.tree.flatten(as_varying(tree, axis_name))
  groups: dict = {}
  for i, x in enumerate(leaves):
    if x.size * x.dtype.itemsize <= PACK_BYTES and _splittable(x):
      # By type too: a leaf replicated over a manual model axis packed with one split over it would come
      # back typed as varying there (and differ from the parameter it updates).
      groups.setdefault((jnp.dtype(x.dtype), varying_axes(x)), []).append(i)
  packs = [[group[i] for i in row] for group in groups.values()
           for row in rows_of([leaves[i].size * leaves[i].dtype.itemsize for i in group]) if len(row) > 1]
  packed = {i for group in packs for i in group}
  rows = [to_row([leaves[i] for i in group]) for group in packs]
  rows, whole = lax.psum((rows, [x for i, x in enumerate(leaves) if i not in packed]), axis_name)
  out = iter(whole)
  summed = [None if i in packed else next(out) for i in range(len(leaves))]
  for group, row in zip(packs, rows):
    for i, x in zip(group, _from_row(row, [leaves[i] for i in group])):
      summed[i] = x
  return jax.tree.unflatten(treedef, summed)


def to_row(leaves: list, rows: int = 1) -> jax.Array:
  """The leaves flattened into `[rows, Σ size / rows]`: row `i` holds row `i` of each leaf seen as `rows` rows.

  Rows, not a vector: XLA CPU concatenates rows with copies, where it concatenates a rank-1 vector element
  by element.
  """
  return jnp.concatenate([x.reshape(rows, -1) for x in leaves], axis=1)


def _from_row(row: jax.Array, like: list) -> list:
  """The leaves of a one-row `[1, Σ size]` array made by `to_row`, shaped as `like`."""
  offsets = np.cumsum([0] + [x.size for x in like])
  return [row[0, start:stop].reshape(x.shape) for x, start, stop in zip(like, offsets[:-1], offsets[1:])]


def _scatter_dim(spec: Any, axis_name: str) -> int | None:
  if spec is True:
    return 0
  return next((d for d, entry in enumerate(spec) if entry == axis_name or (
      isinstance(entry, tuple) and axis_name in entry)), None)


def _psum_scatter(tree: Any, specs: Any, axis_name: Any, bucket_bytes: int | None = None) -> Any:
  """Each leaf reduce-scattered along the dimension its spec names (each device keeps its slice of the
  sum), or all-reduced where the spec names none (a leaf with no dimension that divides).

  With several data axes (hybrid sharding), the scatter is over the last one (ZeRO's) and the slices are
  then all-reduced over the others (plain data parallelism between the groups). With `bucket_bytes`,
  the leaves split over the data axis only are reduce-scattered in flat buckets (see `_scatter_buckets`).
  """
  names = axis_names(axis_name)
  zero, others = names[-1], names[:-1]

  def reduce(x, spec):
    dim = _scatter_dim(spec, zero)
    if dim is None:
      return _psum(x, axis_name)
    _check_scatter(x, dim, zero)

    def scatter(y):
      sliced = lax.psum_scatter(as_varying(y, axis_name), zero, scatter_dimension=dim, tiled=True)
      return lax.psum(sliced, others) if others else sliced

    return scatter(x) if spec is True else per_model_shard(scatter, spec, axis_name)(x)

  if bucket_bytes is None:
    # Leaves of up to PACK_BYTES split over the data axis only share one reduce-scatter (per dtype), as
    # _psum packs the all-reduced ones; the larger ones keep a collective each.
    return with_flat_buckets(tree, specs, axis_name, reduce, lambda leaves, dims: _scatter_buckets(
        leaves, dims, axis_name, math.inf), small_bytes=PACK_BYTES)
  return with_flat_buckets(tree, specs, axis_name, reduce,
                            lambda leaves, dims: _scatter_buckets(leaves, dims, axis_name, bucket_bytes))


def with_flat_buckets(tree: Any, specs: Any, axis_name: Any, per_leaf: Callable, bucketed: Callable,
                       small_bytes: int | None = None) -> Any:
  """`tree` with `bucketed(leaves, dims)` applied to the leaves flat buckets take, `per_leaf(x, spec)` to the rest.

  Flat buckets take the leaves split over ZeRO's axis only (`dims`: the dimension each is split along); a
  leaf also split over a model axis, or not split, keeps a collective of its own. `small_bytes`: only leaves
  of up to that many bytes, grouped by dtype and varying type whatever their order (the default packing,
  without `bucket_bytes`); none on a mesh with another axis the compiler partitions, which would split
  the packed row over it and gather it back (and part of the backward pass with it).
  """
  zero = axis_names(axis_name)[-1]
  leaves, treedef = jax.tree.flatten(tree)
  spec_leaves = treedef.flatten_up_to(specs)
  dims = [_scatter_dim(spec, zero) for spec in spec_leaves]
  # An empty leaf has nothing to put in a row: it keeps its own (empty) collective.
  flat = [i for i, (dim, spec) in enumerate(zip(dims, spec_leaves))
          if dim is not None and leaves[i].size and (spec is True or not any(model_part(spec, axis_name)))
          and (small_bytes is None or leaves[i].size * leaves[i].dtype.itemsize <= small_bytes)]
  if small_bytes is not None:
    groups: dict = {}
    for i in flat:
      groups.setdefault((jnp.dtype(leaves[i].dtype), _abstract_vma(leaves[i])), []).append(i)
    # (None, no mesh information: assume such an axis.)
    flat = ([] if _compiler_partitioned_axes() != {}
            else [i for group in groups.values() if len(group) > 1 for i in group])
  out = [None if i in flat else per_leaf(x, spec) for i, (x, spec) in enumerate(zip(leaves, spec_leaves))]
  for i, x in zip(flat, bucketed([leaves[i] for i in flat], [dims[i] for i in flat])):
    out[i] = x
  return jax.tree.unflatten(treedef, out)


def _check_scatter(x: jax.Array, dim: int, zero: str) -> None:
  if x.ndim <= dim:
    raise ValueError(
        f"scatter: a gradient leaf of shape {x.shape} has no dimension {dim} to reduce-scatter along; give it P() "
        "(all-reduce) in scatter's tree of specs."
    )
  if x.shape[dim] % lax.axis_size(zero):
    raise ValueError(
        f"scatter: a gradient leaf of shape {x.shape} cannot be reduce-scattered along dimension {dim} over "
        f"{lax.axis_size(zero)} devices; give that leaf a dimension that divides, or P() to all-reduce it."
    )


def _scatter_buckets(leaves: list, dims: list[int], axis_name: Any, bucket_bytes: int) -> list:
  """`leaves` reduce-scattered along `dims` with one reduce-scatter per bucket, as FSDP's flat parameters.

  Each leaf is laid out as `[N, its slice]` (the scatter dimension moved to the front, so that row `i` is
  device `i`'s slice), a bucket's leaves are concatenated along the slices, and one tiled reduce-scatter of
  the `[N, bucket]` array leaves each device its row, cut back into its slices of the leaves. Every element
  is the same sum as with one reduce-scatter per leaf; the leaves of a model are many collectives fewer.
  """
  names = axis_names(axis_name)
  zero, others = names[-1], names[:-1]
  n = lax.axis_size(zero)
  out, previous = [None] * len(leaves), None
  for bucket in buckets(leaves, bucket_bytes):
    for i in bucket:
      _check_scatter(leaves[i], dims[i], zero)
    moved = [jnp.moveaxis(leaves[i], dims[i], 0) for i in bucket]
    flat = _after(to_row(moved, rows=n), previous)
    previous = lax.psum_scatter(as_varying(flat, axis_name), zero, scatter_dimension=0, tiled=True)
    previous = lax.psum(previous, others) if others else previous
    slices = [jax.ShapeDtypeStruct((m.shape[0] // n, *m.shape[1:]), m.dtype) for m in moved]
    for i, x in zip(bucket, _from_row(previous, slices)):
      out[i] = jnp.moveaxis(x, 0, dims[i])
  return out


def safe_divide(tree: Any, denominator: jax.Array) -> Any:
  return divide_gradient(tree, _safe_denominator(denominator))


def _safe_denominator(denominator: jax.Array) -> jax.Array:
  # A zero denominator only happens when every numerator is zero too (no weight, no
  # gradient); dividing by one then keeps the result at zero instead of NaN. A NaN one
  # (a NaN weight) stays NaN: replaced by 1, the means would read as sums.
  return jnp.where(denominator == 0, jnp.ones_like(denominator), denominator)


def _tracks_replication(axis_name: str) -> bool:
  # Inside shard_map with check_vma, JAX types every value as replicated or varying over the axis; under
  # pmap (or check_vma=False) it does not, and then every model-state leaf must be assumed to vary.
  return set(axis_names(axis_name)) <= varying_axes(lax.axis_index(axis_name))


def _state_contributions(model_state: Any, weight_sum: jax.Array, axis_name: str,
                         fallback: bool = False) -> tuple[list, list, Any]:
  """`(how, contributions, treedef)`: how each model-state leaf is made identical, and what it psums.

  `how` is `"keep"` (already replicated), `"mean"` (floating: weighted by
  this replica's `Σ w`; with `fallback`, replica 0's value if no replica
  has weight: the training step skips such a step and keeps the old state, so
  it does not send that second value) or `"first"` (other dtypes: replica
  0's value, where nothing tells whether the replicas' values differ: under
  `pmap` or `check_vma=False`). Where replication is tracked, a leaf of
  another dtype that varies over the replicas is refused: it depends on each
  replica's rows (a count of examples), and no replica's value is the one
  device's.
  """
  paths, treedef = jax.tree_util.tree_flatten_with_path(model_state)
  if lax.axis_size(axis_name) == 1:
    return ["keep"] * len(paths), [], treedef
  tracked = _tracks_replication(axis_name)
  how, contributions = [], []
  for path, x in paths:
    if tracked and not varies(x, axis_name):
      how.append("keep")
    elif tracked and not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(
          f"model_state{jax.tree_util.keystr(path)} ({x.dtype}) differs between the replicas: it depends on each "
          "replica's rows, so no replica's value is what one device would hold (DDP keeps rank 0's, silently). Make "
          "it identical where it is computed (in loss_fn): lax.psum it over axis_name for a count, "
          "lax.pmax(lax.stop_gradient(x), axis_name) for a maximum, or compute it from replicated values only (a "
          "step counter: model_state['n'] + 1). A value the same everywhere but computed from the params or an "
          "all_gather is typed as per-replica too (the step differentiates each replica's copy of the params): "
          "lax.pmax(lax.stop_gradient(x), axis_name) makes it replicated without changing it."
      )
    elif jnp.issubdtype(x.dtype, jnp.floating):
      how.append("mean")
      contributions.append(jnp.where(weight_sum > 0, _at_least_float32(x) * weight_sum, 0))
      if fallback:  # for a global weight of 0 (no replica saw a real row): replica 0's value, not 0
        contributions.append(jnp.where(lax.axis_index(axis_name) == 0, x, jnp.zeros_like(x)))
    elif jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # typed keys: their bits travel
      how.append("key")
      bits = jax.random.key_data(x)
      contributions.append(jnp.where(lax.axis_index(axis_name) == 0, bits, jnp.zeros_like(bits)))
    else:
      how.append("first")
      contributions.append(jnp.where(lax.axis_index(axis_name) == 0, x, jnp.zeros_like(x)))
  if not tracked:
    # Nothing types a floating leaf as the same on every replica here (a float step counter, a decay factor):
    # one pmax of each element's bits b and ~b (max ~b = ~min b) finds the elements every replica holds bit
    # for bit, kept exactly (a weighted mean of equal values is not always the value: Σ w·x / Σ w rounds).
    # Bits, not values: XLA's max skips NaN (a replica without rows holds 0/0) and has 0.0 == -0.0.
    floats = [i for i, mode in enumerate(how) if mode == "mean"]
    if floats:
      leaves = [paths[i][1] for i in floats]
      bits = [lax.bitcast_convert_type(x, jnp.dtype(f"int{jnp.dtype(x.dtype).itemsize * 8}")) for x in leaves]
      highest = lax.pmax([jnp.stack([b, ~b]) for b in bits], axis_name)
      for i, both in zip(floats, highest):
        how[i] = ("mean", both[0] == ~both[1])
  return how, contributions, treedef


def _rebuild_state(leaves: list, how: list, sums: list, weight: jax.Array, treedef: Any, fallback: bool = False) -> Any:
  sums, out = iter(sums), []
  for x, mode in zip(leaves, how):
    mode, agreed = mode if isinstance(mode, tuple) else (mode, None)  # untracked: ("mean", where all agree)
    if mode == "keep":
      out.append(x)
    elif mode == "key":  # replica 0's bits
      out.append(jax.random.wrap_key_data(next(sums), impl=jax.random.key_impl(x)))
    elif mode == "mean":
      if fallback:
        weighted, first = next(sums), next(sums)
        value = jnp.where(weight > 0, safe_divide(weighted, weight).astype(x.dtype), first.astype(x.dtype))
      else:
        value = safe_divide(next(sums), weight).astype(x.dtype)
      out.append(value if agreed is None else jnp.where(agreed, x, value))
    else:
      out.append(next(sums).astype(x.dtype))
  return jax.tree.unflatten(treedef, out)


def reduce_model_state(model_state: Any, weight_sum: jax.Array, *, axis_name: str) -> Any:
  """The model state every replica keeps, from each replica's own (one psum).

  A leaf that is already replicated (computed from cross-replica statistics,
  e.g. `jaxdp.adapters.nnx.BatchNorm` in sync mode; known from JAX's
  replication types inside `shard_map`) is kept as it is. A floating leaf
  that differs per replica (per-device BatchNorm statistics) becomes the mean
  over replicas weighted by each replica's `Σ w`, so a replica without real
  rows does not count and, with one micro-batch a step, per-device running
  means average to the running mean of the global batch (replica 0's value
  if no replica has weight). That is right for mean-like statistics only: a
  count or a maximum over the batch must be made identical in `loss_fn`
  (`lax.psum`; `lax.pmax` of a `lax.stop_gradient`). A leaf of another
  dtype that differs per replica raises `ValueError` (no replica's value
  is one device's). Under `pmap` or `check_vma=False` (no replication
  types) every leaf is treated as differing: floating elements that every
  replica holds bit for bit are kept exactly (one `pmax`), the others
  averaged;
  non-floating leaves take replica 0's value.
  `reduce_gradient` does the same inside its one all-reduce.
  """
  check_axis_bound(axis_name)
  how, contributions, treedef = _state_contributions(model_state, weight_sum, axis_name, fallback=True)
  contributions, weight = _psum((contributions, weight_sum), axis_name)
  return _rebuild_state(jax.tree.leaves(model_state), how, contributions, weight, treedef, fallback=True)


def buckets(leaves: list, bucket_bytes: int, scale: int = 1, alone: list[bool] | None = None) -> list[list[int]]:
  """Leaf indices grouped, in reverse order (the order backprop produces them), into buckets of ~`bucket_bytes`.

  A bucket holds one dtype and one varying type (it is reduced as one flat vector: a leaf replicated over a
  manual model axis would come back typed as split over it). Empty leaves are left out (nothing to carry).
  `scale`: each leaf counts as that many times its bytes (a slice counted as the whole leaf it gathers to).
  `alone`: leaves left out as well (the caller reduces them on their own).
  """
  groups, current, size = [], [], 0
  for i in reversed(range(len(leaves))):
    if not leaves[i].size or (alone is not None and alone[i]):
      continue
    nbytes = leaves[i].size * leaves[i].dtype.itemsize * scale
    if current and (size + nbytes > bucket_bytes or leaves[i].dtype != leaves[current[0]].dtype
                    or _abstract_vma(leaves[i]) != _abstract_vma(leaves[current[0]])):
      groups.append(current)
      current, size = [], 0
    current.append(i)
    size += nbytes
  return groups + ([current] if current else [])


def _after(tree: Any, previous: jax.Array | None) -> Any:
  """`tree` made to depend on `previous` without changing a bit of it.

  XLA's all-reduce combiner merges independent all-reduces into one (also on
  CPU, after optimization barriers are gone); a data dependency on the
  previous bucket's sum keeps one all-reduce per bucket, launched in order.
  Adding -0.0 (= -(0 * |an element|)) changes no value, not even the sign of
  a zero. The element is first made finite (a NaN or Inf gradient would
  otherwise turn the loss and weight sent after it into NaN); XLA folds
  neither the product nor the select, so the dependency stays.
  """
  if previous is None:
    return tree
  element = previous.reshape(-1)[0]
  real = jnp.real(jnp.zeros((), previous.dtype)).dtype  # a complex bucket's tie is real too
  tie = -(jnp.zeros((), real) * jnp.abs(jnp.where(jnp.isfinite(element), element, 0)).astype(real))

  def tied(x):
    if varying_axes(tie) - varying_axes(x):  # the tie would retype x (a model-split bucket before it): untied
      return x
    if jnp.issubdtype(x.dtype, jnp.complexfloating):  # -0.0 in both parts: a cast would add +0.0 to the imaginary
      part = tie.astype(jnp.real(x).dtype)
      return x + lax.complex(part, part)
    return x + tie.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x

  return jax.tree.map(tied, tree)


def _psum_buckets(grads: Any, small: Any, axis_name: str, bucket_bytes: int | None) -> tuple[Any, Any]:
  """`psum` of the gradient and the small values: one all-reduce, or one per bucket of gradient leaves."""
  if bucket_bytes is None:  # one psum call: XLA reduces everything in a single all-reduce
    return _psum((grads, small), axis_name)
  leaves, treedef = jax.tree.flatten(grads)
  # On their own: empty leaves (nothing to carry) and leaves split over an Explicit mesh axis of a user's shard_map
  # (their flat row cannot be concatenated with others, nor an element sliced for the tie).
  alone = [not x.size or _split_by_compiler(x) for x in leaves]
  reduced = [_psum(x, axis_name) if own else x for x, own in zip(leaves, alone)]
  previous = None
  for bucket in buckets(leaves, bucket_bytes, alone=alone):
    # One flat row per bucket, as DDP's buckets: one all-reduce whatever XLA's combiner would do.
    previous = _psum(_after(to_row([leaves[i] for i in bucket]), previous), axis_name)
    for i, x in zip(bucket, _from_row(previous, [leaves[i] for i in bucket])):
      reduced[i] = x
  # The small values ride with the last bucket, the one the backward pass finishes last.
  return jax.tree.unflatten(treedef, reduced), _psum(_after(small, previous), axis_name)


@accepts_legacy_keywords("reduce_gradient", ("local", "state"), internal=lambda **kw: _legacy_scattered(**kw),
                         internal_keywords=("scatter", "presummed"))
def reduce_gradient(
    local: LocalGradient,
    state: Any = None,
    *,
    layout: Any = "data",
    reduction: Any = None,
    precision: Any = None,
    totals: Any = None,
    divide: bool = True,
) -> ReducedGradient:
  """Makes the replicas agree on one gradient, loss, metrics and model state, in one all-reduce.

  Must run inside `shard_map` or `pmap` over `axis_name` (except for
  `reduction="none"`, which communicates no gradient).

  Args:
    local: this replica's `LocalGradient`.
    state: this replica's state of `reduction` (`TrainState.compression`
      as the step hands it over: PowerSGD's with each error its own
      `[1, *shape]` block, a user reduction's likewise), or `None`; the
      new one is in the result's `compression` field.
    layout: the `jaxdp.DataParallel` (or the data axis' name) this
      runs over.
    reduction: a `jaxdp.reductions.Reduction` (default
      `jaxdp.reductions.mean`): the mode (`mean`, `rank_mean`,
      `sum`, `none`; metrics are reduced like the loss), and how the
      gradient's sums travel. `jaxdp.reductions.bucketed` reduces them
      in buckets of about that many bytes, in reverse order of the leaves
      (the order the backward pass produces them), one all-reduce each, as
      DDP's 25 MB buckets do, plus one all-reduce of the loss, weight,
      metrics and model state after the last: on GPU and TPU XLA's scheduler
      can then overlap a bucket's all-reduce with the rest of the backward
      pass. The sums are the same, element by element (bitwise on CPU).
      `jaxdp.reductions.powersgd` sums the large matrices as low-rank
      approximations with error feedback; a user's reduction replaces the
      all-reduce of the gradient's sums with its own `reduce`.
    precision: a `jaxdp.Precision`: its `reduce_dtype` (e.g.
      `jnp.bfloat16`, half the bytes of float32) is the dtype the gradient
      is communicated in, cast back after the sum; `None` keeps the local
      gradient's dtype (float32 at least). The loss, weights, metrics and
      the weighted-mean division stay float32; complex leaves travel as they
      are.
    totals: optional pytree of per-replica values to sum over replicas in the
      same all-reduce (e.g. the streaming input's "has more data" flags);
      refused under `"none"`, which has no all-reduce.
    divide: `True` returns the normalised gradient. `False` leaves the
      gradient as the reduced sums and sets `grad_divisor` (the global
      weight under `"mean"`, the replica count under `"rank_mean"`): for
      `jaxdp.finish_step`, which divides where it reads the gradient,
      saving a pass over it (`jaxdp.train_step` does this). The loss and
      metrics are divided either way.

  Returns:
    A `ReducedGradient`. Every replica holds the same values except
    under `"none"` (and the gradient chunks under `scatter`). The model
    state is made identical as `reduce_model_state` says (kept
    per-replica under `"none"`), except where no replica has weight: the
    averaged leaves are then 0, not replica 0's value (the step that reads
    them, `jaxdp.finish_step`, skips such a step and keeps the state;
    sending replica 0's value too would double the state's share of every
    all-reduce).
  """
  config = step_config(layout, reduction, precision)
  return reduce_scattered(config, local, state, totals=totals, divide=divide)


def _legacy_scattered(local, state=None, *, layout="data", reduction=None, precision=None, **rest):
  """`reduce_gradient(..., scatter=, presummed=)` of jaxdp 0.1: ZeRO's scatter, which left the public
  signature, runs through `reduce_scattered`."""
  return reduce_scattered(step_config(layout, reduction, precision), local, state, **rest)


def reduce_scattered(
    settings: StepConfig,
    local: LocalGradient,
    compression_state: Any = None,
    *,
    scatter: Any = False,
    totals: Any = None,
    divide: bool = True,
    presummed: Any = None,
) -> ReducedGradient:
  """`reduce_gradient` under a checked `StepConfig`, with ZeRO's scatter.

  `scatter`: reduce-scatter the gradient instead of all-reducing it (ZeRO
  stages 2 and 3): a tree of `PartitionSpec`s like the gradient's, each
  naming the data axis at the dimension that leaf is split along (each
  device receives its slice of the reduced leaf; a fully reduced leaf never
  exists), or `P()` for a leaf to all-reduce; `True` splits every leaf
  along its first dimension; `False`: all-reduce. With buckets the leaves
  split over the data axis only are reduce-scattered in flat buckets (each
  leaf's scatter dimension moved to the front, the bucket's slices
  concatenated: one reduce-scatter per bucket, as FSDP's flat parameters,
  where the default gives the leaves of up to `PACK_BYTES` one
  reduce-scatter and each larger leaf its own); leaves also split over model
  axes stay one reduce-scatter each. Each element is the same sum; XLA may
  compile the backward pass feeding the concatenation differently, so the
  result can differ from the per-leaf reduction in the last bits.
  `presummed`: with `scatter`, a tree of bools like the gradient's:
  `True` for a leaf already reduce-scattered over ZeRO's axis inside the
  loss (a stacked layer gathered with `jaxdp.gather`, whose transpose
  is that reduce-scatter); such a leaf is only all-reduced over the other
  data axes (hybrid sharding) and divided.
  """
  axis_name, reduction, bucket_bytes = settings.axis_name, settings.mode, settings.bucket_bytes
  reduce_dtype = settings.grad_reduce_dtype
  if presummed is not None and (scatter is False or reduction not in ("mean", "sum")):
    raise ValueError(
        "presummed leaves were reduce-scattered inside the loss already: reduce them with scatter= (their "
        f"slices' specs) and reduction='mean' or 'sum', not scatter={scatter!r}, reduction={reduction!r}."
    )
  if reduction != "none":
    check_axis_bound(axis_name)
  grads, loss_sum, weight_sum, metric_sums, model_state = local
  metric_sums = {} if metric_sums is None else metric_sums
  if reduction == "none" and totals is not None:
    raise ValueError(
        "totals (has_more) are summed over the replicas in the reduction's all-reduce, and reduction='none' has "
        "none: each replica would see only its own count. Use a reducing reduction ('mean', 'sum', 'rank_mean')."
    )
  if reduction == "none":
    if scatter is not False:
      raise ValueError("reduction='none' communicates nothing, so it cannot scatter; use scatter=False.")
    grads, loss, metrics, divisor = _normalised((grads, loss_sum, metric_sums), weight_sum, divide)
    return ReducedGradient(grads, loss, weight_sum, metrics, model_state, totals, divisor)
  _check_local(grads, loss_sum, axis_name, scatter)
  compressed = None
  specs = None if scatter is False else (jax.tree.map(lambda _: True, grads) if scatter is True else scatter)
  if settings.compression is not None:  # its leaves leave the exact all-reduce below (None there)
    whole_specs = specs
    grads, compressed = compressed_sums(grads, settings.compression, settings.axis_name, compression_state)
    if specs is not None:  # the compressed leaves leave the reduce-scatter too: sliced from their sums below
      specs = _without_compressed(specs, compressed)
  # Axes the local sums vary over that the reduction does not cover (read before the packed all-reduce, which
  # types the sums as its gradient leaves are: a model-axis split there is not the loss's).
  leftover = (varying_axes(loss_sum) | varying_axes(weight_sum)) - set(axis_names(axis_name)) - {settings.group_axis}
  local_weight = weight_sum
  if reduction == "rank_mean":  # each replica's local mean first, as DDP does
    grads, loss_sum, metric_sums = safe_divide((grads, loss_sum, metric_sums), weight_sum)
  how, contributions, treedef = _state_contributions(model_state, local_weight, axis_name)
  small = (loss_sum, weight_sum, metric_sums, contributions, totals)
  dtypes = jax.tree.map(lambda x: x.dtype, grads)
  if reduce_dtype is not None:  # real leaves only: a complex gradient cast to a real dtype loses its imaginary part
    # (and not a presummed leaf: reduced inside the backward pass already, in reduce_dtype there)
    done = jax.tree.map(lambda _: False, grads) if presummed is None else presummed
    cast = jax.tree.map(lambda x, d: bool(jnp.issubdtype(x.dtype, jnp.floating) and not d), grads, done)
    wire = summed_in(reduce_dtype)  # float32 where XLA's CPU backend would abort on a 16-bit sum: same bits
    grads = jax.tree.map(lambda x, c: x.astype(reduce_dtype).astype(wire) if c else x, grads, cast)
  if scatter is not False and settings.user is not None:
    # A user reduction returns whole-leaf sums: all-reduced, then each device keeps its ZeRO slice.
    loss_sum, weight_sum, metric_sums, contributions, totals = _psum(small, axis_name)
    grads, compressed = _user_sums(grads, settings, compression_state)
    grads = own_slices(grads, specs, axis_name)
  elif scatter is not False:
    if presummed is None:
      grads = _psum_scatter(grads, specs, axis_name, bucket_bytes)
    else:
      grads = _scatter_unless_presummed(grads, specs, presummed, axis_name, bucket_bytes)
    loss_sum, weight_sum, metric_sums, contributions, totals = _psum(small, axis_name)
  elif settings.user is not None:  # the user's reduce replaces jaxdp's all-reduce of the gradient's sums
    loss_sum, weight_sum, metric_sums, contributions, totals = _psum(small, axis_name)
    grads, compressed = _user_sums(grads, settings, compression_state)
  else:
    grads, (loss_sum, weight_sum, metric_sums, contributions, totals) = _psum_buckets(grads, small, axis_name, bucket_bytes)
  if reduce_dtype is not None:  # a sum made in float32 in place of reduce_dtype is rounded to it, as XLA would
    grads = jax.tree.map(lambda x, dtype, c: (x.astype(reduce_dtype) if c else x).astype(dtype), grads, dtypes, cast)
  new_compression = None
  if settings.user is not None:
    new_compression = compressed
  elif compressed is not None:
    grads_def, sums, new_state = compressed
    if scatter is not False:  # stages 2-3: each device keeps its slice of the decompressed sum, as a scatter would
      whole = grads_def.flatten_up_to(whole_specs)
      sums = {i: own_slices(a, whole[i], axis_name) for i, a in sums.items()}
    grads, new_compression = with_compressed(grads, (grads_def, sums, new_state))
  if leftover:  # typed shard_map only (elsewhere nothing is typed as varying)
    raise ValueError(
        f"after the reduction over axis_name={axis_name!r} the loss still varies over {sorted(leftover)}: the batch "
        "(or the loss) is split over those mesh axes too, and each group would take its own step. Name every axis "
        "the batch is split over in axis_name (a tuple for several), or psum a loss computed in model-axis parts "
        "inside loss_fn."
    )
  model_state = _rebuild_state(jax.tree.leaves(model_state), how, contributions, weight_sum, treedef)
  if reduction == "sum":
    return ReducedGradient(grads, loss_sum, weight_sum, metric_sums, model_state, totals, compression=new_compression)
  denominator = weight_sum if reduction == "mean" else jnp.asarray(lax.axis_size(axis_name), jnp.float32)
  grads, loss, metrics, divisor = _normalised((grads, loss_sum, metric_sums), denominator, divide)
  return ReducedGradient(grads, loss, weight_sum, metrics, model_state, totals, divisor, new_compression)


def _without_compressed(specs: Any, compressed: tuple) -> Any:
  """`specs` (the gradient's tree of scatter specs) with `None` at the leaves PowerSGD reduces."""
  treedef, sums, _ = compressed
  leaves = treedef.flatten_up_to(specs)
  return treedef.unflatten([None if i in sums else spec for i, spec in enumerate(leaves)])


def own_slices(tree: Any, specs: Any, axis_name: Any) -> Any:
  """Each leaf of `tree` (a sum, the same on every device of the data axes) cut to this device's slice along
  the dimension its spec splits over ZeRO's axis, as `_psum_scatter` leaves it (whole where none does).

  For reductions that return whole-leaf sums (PowerSGD, a user's) at ZeRO stages 2-3: the same values as the
  reduce-scatter of the exact sums would give, at the same place.
  """
  zero = axis_names(axis_name)[-1]

  def cut(x, spec):
    dim = _scatter_dim(spec, zero)
    if dim is None:
      return x
    _check_scatter(x, dim, zero)

    def own(y):
      size = y.shape[dim] // lax.axis_size(zero)
      return lax.dynamic_slice_in_dim(y, lax.axis_index(zero) * size, size, axis=dim)

    return own(x) if spec is True else per_model_shard(own, spec, axis_name)(x)

  if isinstance(specs, P) or specs is True:
    return cut(tree, specs)
  return jax.tree.map(cut, tree, specs, is_leaf=lambda x: isinstance(x, P) or x is True)


def _user_sums(grads: Any, settings: StepConfig, state: Any) -> tuple[Any, Any]:
  """A user reduction's sums of `grads` and its new state (this replica's block of the stacked state)."""
  own = jax.tree.map(lambda x: x[0], state)  # the step hands over [1, ...] blocks: the reduction sees its own
  summed, new = settings.user.reduce(grads, own, axis_name=settings.axis_name)
  try:
    jax.tree.map(lambda a, b: None, grads, summed)
  except (ValueError, TypeError):
    raise ValueError(
        f"the user reduction returned sums of another structure than the gradient's ({jax.tree.structure(summed)} "
        f"for {jax.tree.structure(grads)}): reduce(sums, state, axis_name) must return (summed, state) with summed "
        "like sums."
    ) from None
  summed = jax.tree.map(lambda s, g: s.astype(g.dtype), summed, grads)
  return summed, jax.tree.map(lambda x: x[None], new)


def _scatter_unless_presummed(grads: Any, specs: Any, presummed: Any, axis_name: Any, bucket_bytes: int | None) -> Any:
  """`_psum_scatter` of the leaves not `presummed`; those are summed over the other data axes only."""
  leaves, treedef = jax.tree.flatten(grads)
  spec_leaves = treedef.flatten_up_to(specs)
  # (grads has None at the leaves PowerSGD reduced: not in `leaves`)
  done = jax.tree.leaves(jax.tree.map(lambda g, d: None if g is None else d, grads, presummed,
                                      is_leaf=lambda x: x is None))
  others = axis_names(axis_name)[:-1]
  rest = _psum_scatter([x for x, d in zip(leaves, done) if not d], [s for s, d in zip(spec_leaves, done) if not d],
                       axis_name, bucket_bytes)
  rest = iter(rest)
  return treedef.unflatten([(lax.psum(x, others) if others else x) if d else next(rest) for x, d in zip(leaves, done)])


def _check_local(grads: Any, loss_sum: jax.Array, axis_name: Any, scatter: Any) -> None:
  """Refuses what reduce_gradient would reduce wrongly, without a sign in the values."""
  typed = checks_vma(axis_name)
  if typed and not varies(loss_sum, axis_name):
    # The local loss sum reads this replica's rows and weights: one typed as the same everywhere was reduced already.
    raise ValueError(
        f"the loss sum given to reduce_gradient is typed as the same on every replica of {axis_name!r}: these are "
        "values reduce_gradient (or train_step) already returned, and reducing them again would sum N copies and "
        "divide by the weight twice. Pass the LocalGradient that local_gradient returned, once; a loss that reads "
        "nothing of the batch, with weights=None, has no per-replica sum to reduce either."
    )
  if typed:
    # Each leaf must vary over every data axis: one replicated over some axis was summed over it by jax.grad.
    summed = [jax.tree_util.keystr(p) for p, g in jax.tree_util.tree_leaves_with_path(grads)
              if not all(varies(g, a) for a in axis_names(axis_name))]
    if summed:
      raise ValueError(
          f"the gradient leaves {', '.join(summed[:3])}{', ...' if len(summed) > 3 else ''} are already summed over "
          f"{axis_name!r} (typed as replicated): jax.grad of replicated params inside shard_map sums over the axis "
          "itself, and reducing would count every replica N times. Pass axis_name= to local_gradient (or "
          "differentiate jaxdp.as_varying(params, axis_name)); a leaf you replaced by hand (e.g. zeros for a "
          "frozen layer) must be made varying too (jaxdp.as_varying), or freeze it after the reduction "
          "(optax.set_to_zero / optax.masked)."
      )
  if scatter is not False and not typed and math.prod(lax.axis_size(a) for a in axis_names(axis_name)) > 1:
    raise ValueError(
        "scatter needs shard_map with check_vma=True: the scattered chunks are told apart from agreed leaves by "
        "their types, and under pmap or check_vma=False the gradient norm and the non-finite skip would be each "
        "device's own (replicas would diverge). Use shard_map(..., check_vma=True), or scatter=False."
    )


def _normalised(sums: tuple, denominator: jax.Array, divide: bool) -> tuple:
  """`(grads, loss, metrics, grad_divisor)`: the sums over `denominator` (zero read as one).

  The gradient is divided only if `divide`; otherwise it stays the sums and the divisor is returned.
  """
  grads, loss_sum, metric_sums = sums
  divisor = _safe_denominator(denominator)
  loss, metrics = divide_gradient((loss_sum, metric_sums), divisor)
  if divide:
    return divide_gradient(grads, divisor), loss, metrics, None
  return grads, loss, metrics, divisor


def global_norm(tree: Any, axis_name: str | None = None, divisor: jax.Array | None = None, *,
                agreed: bool = False) -> jax.Array:
  """The L2 norm of a whole gradient tree, also when its leaves are sharded over `axis_name`.

  With `axis_name` (inside `shard_map` or `pmap`), leaves typed as
  varying over it are chunks of a sharded vector: each is counted once and
  the partial sums are added with one `psum`. A leaf that holds the same
  value on every device (an agreed, replicated gradient) is split instead:
  each device sums the squares of its own 1/N of it, added in the same
  `psum`, so the norm costs each device a pass over 1/N of the gradient,
  not over all of it. That split is done only where the leaf is known to be
  the same everywhere: inside `shard_map` with `check_vma=True` (the
  type system proves it for every leaf not typed as varying), or where the
  caller says so with `agreed=True` (e.g. the `grads` of a
  `jaxdp.ReducedGradient` of `"mean"`, `"sum"` or
  `"rank_mean"`: `jaxdp.train_step` has `jaxdp.finish_step`
  pass it).
  Under `pmap` or `check_vma=False` without `agreed`, nothing tells
  agreed leaves from per-replica ones, so each device sums such leaves whole:
  the norm of its own values, never a mix of the replicas' slices. A leaf the
  compiler may split over another mesh axis (an `Auto` model axis) is
  summed whole on every device, counted once. A leaf also typed as varying
  over a manual axis that is not a data axis (a tensor-parallel shard in a
  hand-written `shard_map`) is a part of the vector there too: its squares
  are added over that axis as well, so every device holds the whole
  gradient's norm (only with `axis_name`). Without `axis_name` it is
  `optax.tree.norm`. Chunks must partition the vector (ZeRO's zero padding
  adds nothing to the norm). `divisor`: the norm of `tree / divisor`
  (see `divide_gradient`), without writing the quotient.
  """
  data = set(axis_names(axis_name)) if axis_name is not None else None
  # Sums of squares keyed by the manual axes besides the data axes that the leaf varies over (a tensor-parallel
  # shard of a hand-written shard_map): its part of the norm is completed over them too.
  partial: dict = {}  # added over the data axes (and the key's)
  shared: dict = {}  # added over the key's axes only
  # One device: nothing to split or add. Otherwise split agreed leaves only where they are known to be agreed.
  parts = axis_name is not None and lax.axis_size(axis_name) > 1 and (agreed or checks_vma(axis_name))
  # Per replica, the small leaves split or summed whole (up to PACK_BYTES, real, splittable) are pooled per
  # dtype into rows as _psum packs them (rows_of), in tree order: XLA reads the rows the reduction packed
  # (their slices, concatenated again, are those rows), and the norm is one reduction per row (and one window
  # of it per device), not one per leaf. (On the global arrays the compiler partitions each leaf: a row of
  # them could move shards.)
  pools: dict = {}
  for leaf in jax.tree.leaves(tree):
    # Without axis_name nothing says which axes hold parts and which hold replicas (reduction="none"): none added.
    extra = frozenset() if data is None else varying_axes(leaf) - data
    varying = axis_name is not None and varies(leaf, axis_name)
    if axis_name is not None and not varying and leaf.size * leaf.dtype.itemsize <= PACK_BYTES and (
        not jnp.iscomplexobj(leaf) and _splittable(leaf)):
      pools.setdefault((bool(parts), extra, jnp.dtype(leaf.dtype)), []).append(leaf)
    elif varying:
      squares = _squares(leaf, divisor)
      # A chunk that is the same over some of the axes (ZeRO's, over "replica" of ("replica", "data")) is summed
      # once: only where those axes' index is 0.
      for other in axis_names(axis_name):
        if not varies(leaf, other):
          squares = jnp.where(lax.axis_index(other) == 0, squares, 0)
      partial[extra] = partial.get(extra, 0) + squares
    elif parts and _splittable(leaf):
      partial[extra] = partial.get(extra, 0) + _squares(_own_part(leaf, axis_name), divisor)
    else:
      shared[extra] = shared.get(extra, 0) + _squares(leaf, divisor)
  for (split, extra, _), pool in pools.items():
    for row in rows_of([x.size * x.dtype.itemsize for x in pool]):
      flat = to_row([pool[i] for i in row]).reshape(-1)
      if split:
        partial[extra] = partial.get(extra, 0) + _squares(_own_part(flat, axis_name), divisor)
      else:
        shared[extra] = shared.get(extra, 0) + _squares(flat, divisor)
  total = jnp.zeros((), jnp.float32)
  for extra, squares in partial.items():
    total = total + lax.psum(squares, tuple(axis_names(axis_name)) + tuple(sorted(extra)))
  for extra, squares in shared.items():
    total = total + (lax.psum(squares, tuple(sorted(extra))) if extra else squares)
  return jnp.sqrt(total)


def checks_vma(axis_name: Any) -> bool:
  """Whether values are typed as varying or not over `axis_name` here (`shard_map` with `check_vma=True`).

  A value cast to varying carries the axis in its type only then; under `pmap` or `check_vma=False` it
  does not, and a leaf not typed as varying may still differ between devices. (The probe is dead code.)
  """
  probe = lax.pcast(jnp.zeros((), jnp.float32), axis_names(axis_name)[0], to="varying")
  return bool(set(axis_names(axis_name)) & varying_axes(probe))


def _squares(x: jax.Array, divisor: jax.Array | None) -> jax.Array:
  x = divide_gradient(x, divisor)
  if jnp.iscomplexobj(x):  # |z|² = re² + im² (a cast to float32 would drop the imaginary part)
    x = x.astype(jnp.promote_types(x.dtype, jnp.complex64))
    return jnp.sum(jnp.square(x.real) + jnp.square(x.imag)).astype(jnp.float32)
  return jnp.sum(jnp.square(x.astype(jnp.float32)))


def _own_part(x: jax.Array, axis_name: Any) -> jax.Array:
  """This device's 1/N of `x` (flattened), the rest of each device's equal-length window zeroed."""
  flat = x.reshape(-1)
  n, i = lax.axis_size(axis_name), lax.axis_index(axis_name)
  chunk = -(-flat.shape[0] // n)
  # The last windows are moved back to fit in the array; what overlaps the previous device's part is zeroed.
  start = jnp.minimum(i * chunk, flat.shape[0] - chunk)
  window = lax.dynamic_slice_in_dim(flat, start, chunk)
  if flat.shape[0] % n == 0:  # the parts tile the array: no window overlaps another
    return window
  return jnp.where(start + jnp.arange(chunk) >= i * chunk, window, jnp.zeros_like(window))


def _compiler_partitioned_axes() -> dict | None:
  """`{axis: type}` of the mesh axes of size > 1 that are not manual here (the compiler partitions them);
  `None` where this JAX gives no mesh information."""
  try:
    mesh = jax.sharding.get_abstract_mesh()
    return {a: t for a, t in zip(mesh.axis_names, mesh.axis_types) if a not in mesh.manual_axes and mesh.shape[a] > 1}
  except (AttributeError, TypeError):
    return None


def _explicit_sharding(x: Any) -> Any:
  """`x`'s sharding where its type splits it over an Explicit mesh axis (a zero like it must keep it), else None."""
  return x.sharding if _split_by_compiler(x) else None


def _spec_axes(x: Any) -> set | None:
  """The mesh axes `x`'s type says it is split over (axes the compiler partitions: Explicit ones); `None`
  where this JAX gives no such type."""
  try:
    spec = jax.typeof(x).sharding.spec
  except (AttributeError, TypeError):
    return None
  except AssertionError:
    # jax 0.10: typeof of a ShapeDtypeStruct typed as varying over a manual axis whose sharding's mesh is not
    # the manual one (accumulation's first micro-batch, on a mesh with a model axis): read its sharding's spec.
    spec = getattr(getattr(x, "sharding", None), "spec", None)
    if spec is None:
      return None
  return {a for part in spec if part is not None for a in ((part,) if isinstance(part, str) else part)}


def _split_by_compiler(x: jax.Array) -> bool:
  """Whether `x`'s type says it is split over a mesh axis the compiler partitions (an Explicit axis)."""
  return bool(_spec_axes(x))


def _splittable(x: jax.Array) -> bool:
  """Whether slicing `x` on the manual axes leaves it where it is: no other mesh axis may split it."""
  others = _compiler_partitioned_axes()
  if others is None:  # no mesh information: sum the whole leaf
    return False
  if not others:
    return True
  if any(t != jax.sharding.AxisType.Explicit for t in others.values()):
    return False  # the compiler chooses how an Auto axis splits the leaf: slicing could make it gather
  named = _spec_axes(x)
  return named is not None and not named & set(others)
