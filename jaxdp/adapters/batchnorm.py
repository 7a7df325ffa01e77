"""Cross-replica batch normalisation with exact statistics over uneven, padded batches.

jaxdp pads uneven per-device batches with rows of weight 0 (`shard_uneven`,
`DataPipeline`). Batch statistics must then come from the real rows of
*all* devices, each row counted with its weight, as if one device held the
whole global batch. Two common recipes get this wrong:

* flax's `BatchNorm(axis_name=..., mask=...)` takes each device's masked
  mean and averages those with equal weight (`pmean`). With uneven numbers
  of real rows that is not the global mean (a device with one real row
  weighs as much as one with a hundred), and a device with no real row
  contributes NaN.
* without a mask, the zero-weight padding rows enter the statistics.

Here each device computes three sums over its rows, `Σw`, `Σw·x` and
`Σw·x²`, and one `lax.psum` of the three (a tuple psum, which XLA emits
as a single variadic all-reduce) makes them global. Then `mean = Σw·x / Σw`
and `var = max(0, Σw·x² / Σw − mean²)` (flax's "fast variance": biased,
clamped at 0 against round-off), in float32 at least.

Where the statistics come from (`axis_name`):

* `STEP_AXIS` (the default): the data axis of the jaxdp step whose
  `loss_fn` is running (`make_train_step`'s, `make_eval_step`'s or
  `train_step`'s `axis_name`: `"batch"`, or `("replica", "data")` on
  a hybrid mesh), whatever the mesh calls it; outside a jaxdp step,
  `"data"`.
* a name (or tuple of names) *bound in the current trace* (inside
  `shard_map`/`pmap`/named `vmap` over it): synchronised statistics
  over the real rows of every device of the axis (SyncBatchNorm, exact for
  any split, zero-row devices included). Inside a jaxdp step, a name that is
  not bound there is refused (`ValueError`): it would silently give each
  device's own statistics.
* a name that is *not* bound (plain single-device code, evaluation after
  training, or `jit` over globally sharded arrays, where XLA partitions
  the sums itself): statistics over the whole batch the code sees, which is
  then the global batch. The same model code runs in both places.
* `None`: each device's own rows only ("local" statistics, PyTorch DDP
  without SyncBatchNorm).

Gradients are exact too: inside `shard_map` (`check_vma=True`) the
transpose of the psum hands every device the sum over devices of the
cotangents of the statistics, so each device's input gradient is that of the
global-batch loss (tested against a single-device reference; with
`check_vma=False` the psum transposes to a psum, with the same result).

If no row has weight (`Σw == 0`), mean and var are 0 rather than NaN, and
`BatchNorm` leaves its running statistics unchanged.

Accuracy: the only difference from one device holding the concatenated real
rows is the order of the float32 additions (per device, then across
devices). Re-associating a sum of n terms moves it by about log2(n)·eps of
the sum of the terms' magnitudes (eps = 1.2e-7), so mean and var agree with
a float64 reference to a few eps of E[|x|] and E[x²] respectively (the
tests check 2e-6 of those scales on up to 8 devices). As with flax's fast variance, var loses about log2(E[x²]/var)
bits to cancellation, and the backward pass, which divides by σ, amplifies
that for nearly constant features. On one device with no padding and no
mask, `BatchNorm` runs the same float32 operations as flax's
`nnx.BatchNorm` and equals it bitwise (tested, eagerly and under jit).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading

import math
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import linen, nnx
from flax.nnx.nn import dtypes
from jax import lax

from jaxdp.sharding.layout import axis_names
from jaxdp.core.loss import step_axis, step_weights

__all__ = ["BatchNorm", "Moments", "masked_moments"]


class _StepAxis:
  def __repr__(self) -> str:
    return "jaxdp.adapters.batchnorm.STEP_AXIS"

  def __reduce__(self) -> str:
    return "STEP_AXIS"  # pickles as the one instance


STEP_AXIS = _StepAxis()
"""The default `axis_name` of `BatchNorm` and `masked_moments`: the enclosing jaxdp step's data
axis (`"data"` outside a step)."""


def _statistics_axis(axis_name: Any) -> Any:
  """The axis (or axes, or `None`) to sum the statistics over, `axis_name` resolved against the step's."""
  step = step_axis()
  if axis_name is STEP_AXIS:
    return "data" if step is None else step
  if step is not None and axis_name is not None and not _is_bound(axis_name):
    raise ValueError(
        f"BatchNorm axis_name={axis_name!r} is not bound in this jaxdp step, whose data axis is {step!r}: the "
        "statistics would silently cover each device's own rows only. Leave axis_name at its default (the step's "
        f"data axis), pass axis_name={step!r}, or axis_name=None for per-device statistics."
    )
  if step is not None and axis_name is not None and not set(axis_names(step)) <= set(axis_names(axis_name)):
    raise ValueError(
        f"BatchNorm axis_name={axis_name!r} covers only part of this jaxdp step's data axes {step!r}: the "
        "statistics would silently cover the devices of that axis only, not the global batch. Leave axis_name at "
        f"its default (the step's data axis), pass axis_name={step!r}, or axis_name=None for per-device statistics."
    )
  return axis_name



def _refuse_linen_batchnorm(next_fun, args, kwargs, context):
  """A flax.linen method interceptor: a linen `BatchNorm` computing batch statistics raises, any other call runs."""
  module = context.module
  if isinstance(module, linen.BatchNorm) and context.method_name == "__call__":
    given = kwargs.get("use_running_average", args[1] if len(args) > 1 else None)
    if not linen.merge_param("use_running_average", module.use_running_average, given):
      raise ValueError(
          f"flax.linen.BatchNorm ({module.name or 'unnamed'}) is computing batch statistics inside a jaxdp training "
          "step, where they are not the global batch's: without mask= the zero-weight padding rows enter them, and "
          "with mask= its pmean weighs every device equally (off on uneven splits, NaN on a device without rows). "
          "Use jaxdp.adapters.linen.BatchNorm (the same fields and variables; it takes the step's weights, no mask "
          "needed), or compute "
          "them with jaxdp.masked_moments(x, weights) (exact over every device's real rows; axis_name=None for "
          "per-device statistics). Evaluation (use_running_average=True) is unaffected."
      )
  return next_fun(*args, **kwargs)


# True while a training step runs loss_fn: its batches may hold padding rows, so a jaxdp BatchNorm needs mask=.
_PADDED_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxdp_padded_step", default=False)


@contextlib.contextmanager
def training_batch_guards():
  """Entered while a training step traces `loss_fn`: linen's own `BatchNorm` raises in training mode, and
  `BatchNorm` / `jaxdp.adapters.linen.BatchNorm` without a mask and without step weights refuse to
  compute statistics."""
  token = _PADDED_STEP.set(True)
  try:
    with linen.intercept_methods(_refuse_linen_batchnorm), _nnx_batchnorm_guarded():
      yield
  finally:
    _PADDED_STEP.reset(token)


class Moments(NamedTuple):
  """Weighted batch statistics per feature.

  Attributes:
    mean: `Σw·x / Σw`, of the feature shape (the sizes of `feature_axes`).
    var: the biased (population) variance `Σw·x² / Σw − mean²`, clamped at
      0 like flax's.
    count: `Σw` over every reduced element (all devices when synchronised):
      for `x` `[b, h, w, c]` with weights `[b]` it is `h·w·Σw`. A
      scalar, unless the weights vary along a feature axis (a full per-element
      mask): then it has the feature shape. Zero means no real rows, and then
      mean and var are 0.
  """

  mean: jax.Array
  var: jax.Array
  count: jax.Array


def canonical_axes(ndim: int, axes: int | Sequence[int]) -> tuple[int, ...]:
  axes = tuple(axes) if isinstance(axes, Sequence) else (int(axes),)
  for axis in axes:
    if not -ndim <= axis < ndim:
      raise ValueError(f"feature axis {axis} is out of range for an input of rank {ndim}.")
  return tuple(sorted({axis % ndim for axis in axes}))


def _is_bound(axis_name: Any) -> bool:
  """Whether `axis_name` names a mapped axis of the current trace (collectives over it work).

  `lax.axis_size` raises `NameError` ("unbound axis name") for a name that
  no enclosing `shard_map` (manual axis), `pmap` or named `vmap` binds:
  in eager code, under plain `jit`, under `jax.set_mesh` (global view)
  and inside a partial-manual `shard_map` that leaves the axis automatic
  (checked with jax 0.10.2). A mesh axis that is not manual is treated as
  unbound even if a later JAX answers `axis_size` for it: there XLA
  partitions the sums over the global batch by itself.
  """
  if axis_name is None:
    return False
  if not isinstance(axis_name, str):  # several axes (a hybrid data axis): bound if each one is
    return all(_is_bound(name) for name in axis_name)
  mesh = jax.sharding.get_abstract_mesh()
  if axis_name in mesh.axis_names and axis_name not in getattr(mesh, "manual_axes", ()):
    return False
  try:
    lax.axis_size(axis_name)
  except NameError:
    return False
  return True


def _full_weights(weights: Any, shape: tuple[int, ...], features: tuple[int, ...], dtype) -> jax.Array:
  """Weights as an array of rank `len(shape)`, broadcastable to `shape`, of `dtype`."""
  w = jnp.asarray(weights)
  if w.ndim != len(shape):  # aligned with the non-feature axes, from the first one
    reduced = len(shape) - len(features)
    if w.ndim > reduced:
      raise ValueError(
          f"weights has shape {w.shape}, more axes than the {reduced} non-feature axes of x {shape}; pass "
          "weights for the leading non-feature axes (e.g. [b]) or a mask of x's rank."
      )
    w = jnp.expand_dims(w.reshape(w.shape + (1,) * (reduced - w.ndim)), features)
  try:
    jnp.broadcast_shapes(w.shape, shape)
  except ValueError:
    raise ValueError(
        f"weights of shape {jnp.shape(weights)} do not broadcast against x {shape} with feature axes "
        f"{features}; pass weights for the leading non-feature axes (e.g. [b]) or a mask broadcastable to x."
    ) from None
  return w.astype(dtype)


def _local_sums(x: jax.Array, w: jax.Array | None, reduce_axes: tuple[int, ...], features: tuple[int, ...]):
  """`(Σw, Σw·x, Σw·x²)` over this device's rows."""
  if w is None:  # the same operations as flax's unmasked jnp.mean, for bitwise parity
    count = jnp.asarray(math.prod(x.shape[i] for i in reduce_axes), x.dtype)
    return count, jnp.sum(x, reduce_axes), jnp.sum(lax.square(x), reduce_axes)
  # where(): a NaN or Inf in a padding row must not reach the sums (0 · NaN = NaN).
  x = jnp.where(w > 0, x, jnp.zeros((), x.dtype))
  if all(w.shape[i] == 1 for i in features):  # one weight per reduced element: a scalar count
    counted = tuple(1 if i in features else n for i, n in enumerate(x.shape))
    count = jnp.sum(jnp.broadcast_to(w, counted))
  else:
    count = jnp.sum(jnp.broadcast_to(w, x.shape), reduce_axes)
  return count, jnp.sum(w * x, reduce_axes), jnp.sum(w * lax.square(x), reduce_axes)


def masked_moments(
    x: jax.Array,
    weights: jax.Array | None = None,
    *,
    axis_name: Any = STEP_AXIS,
    feature_axes: int | Sequence[int] = -1,
) -> Moments:
  """Weighted mean and biased variance per feature, over every device's real rows.

  Args:
    x: the input, e.g. `[b, c]` or `[b, h, w, c]`; float16/bfloat16 are
      upcast, statistics are computed in float32 at least.
    weights: `None` (every element weighs 1; inside a jaxdp step, the
      step's weights of the rows, see `step_mask`), or bool/numeric values
      `>= 0`, 0 marking padding. Two broadcasting rules: weights of lower
      rank than `x` are aligned with `x`'s *non-feature* axes from the
      first one, trailing size-1 axes being added (`[b]` for `x`
      `[b, h, w, c]` acts as `[b, 1, 1, 1]`); weights of `x`'s rank (a
      flax-style `mask`) broadcast against `x` as numpy does. Elements of
      weight 0 are excluded even when `x` is NaN there.
    axis_name: the data-parallel axis (a name or a tuple of names); default
      `STEP_AXIS`, the enclosing jaxdp step's (else `"data"`). When
      bound in the current trace, one `lax.psum` makes the statistics
      global; when not bound, they cover the whole batch seen here (refused
      inside a jaxdp step, see the module docstring); `None`: this
      device's rows only.
    feature_axes: the axis or axes kept (like flax's `axis`); all others
      are reduced.

  Returns:
    `Moments` of the feature shape (`count`: see there).
  """
  x = jnp.asarray(x)
  dtype = jnp.promote_types(x.dtype, jnp.float32)  # float32 at least; float64 stays float64
  x = x.astype(dtype)
  features = canonical_axes(x.ndim, feature_axes)
  # In a jaxdp step the batch may hold padding rows, which only the weights exclude: the step's, when none given.
  weights = step_mask(weights, x, features, "jaxdp.masked_moments", "weights")
  reduce_axes = tuple(i for i in range(x.ndim) if i not in features)
  w = None if weights is None else _full_weights(weights, x.shape, features, dtype)
  sums = _local_sums(x, w, reduce_axes, features)
  axis_name = _statistics_axis(axis_name)
  if _is_bound(axis_name):  # one tuple psum: a single (variadic) all-reduce of the three sums
    sums = lax.psum(sums, axis_name)
  count, total, total_sq = sums
  # A zero count only comes with zero sums (no real rows): dividing by 1 keeps mean and var at 0.
  safe = jnp.where(count > 0, count, jnp.ones((), dtype))
  mean = total / safe
  var = jnp.maximum(0.0, total_sq / safe - lax.square(mean))
  return Moments(mean, var, count)


def _normalize(x, mean, var, scale, bias, feature_axes, dtype, epsilon):
  """flax's `_normalize`, operation for operation (so that outputs match it bitwise)."""
  stats_shape = tuple(n if i in feature_axes else 1 for i, n in enumerate(x.shape))
  mean = mean.reshape(stats_shape)
  var = var.reshape(stats_shape)
  y = x - mean
  mul = lax.rsqrt(var + epsilon)
  args = [x]
  if scale is not None:
    scale = scale.reshape(stats_shape)
    mul *= scale
    args.append(scale)
  y *= mul
  if bias is not None:
    bias = bias.reshape(stats_shape)
    y += bias
    args.append(bias)
  return jnp.asarray(y, dtypes.canonicalize_dtype(*args, dtype=dtype))


def check_supported(axis_index_groups: Any, use_fast_variance: bool) -> None:
  """The flax BatchNorm options that jaxdp's BatchNorms refuse (they would need other collectives)."""
  if axis_index_groups is not None:
    raise ValueError("axis_index_groups is not supported: statistics are summed over the whole axis_name.")
  if not use_fast_variance:
    raise ValueError("use_fast_variance=False would need a second psum; only E[x²] − E[x]² (one psum) is supported.")


def step_mask(mask: Any, x: Any, feature_axes: tuple[int, ...], module: str, argument: str = "mask") -> Any:
  """`mask`, or when it is `None` inside a jaxdp step the weights of the rows `loss_fn` runs on.

  The step's weights are this replica's (of the current micro-batch), `[b]` or `[b, t]`; they fit an input
  whose non-feature axes start with their shape (the batch on axis 0, as for jaxdp's Dropout). An input they do
  not fit is refused, naming `argument`, rather than normalised over rows the weights do not describe.
  """
  if mask is not None:
    return mask
  weights = step_weights()
  if weights is None:
    refuse_unmasked_training(None, module, argument)
    return None
  shape = jnp.shape(x)
  rows = tuple(n for i, n in enumerate(shape) if i not in feature_axes)
  if 0 in feature_axes or rows[:jnp.ndim(weights)] != tuple(jnp.shape(weights)):
    raise ValueError(
        f"{module} was called without {argument}= inside a jaxdp step, so it takes the padding weights of the rows "
        f"from the step: this replica's weights have shape {tuple(jnp.shape(weights))}, but the input has shape "
        f"{shape} with feature axes {feature_axes}, whose other axes do not start with that shape (the batch on axis "
        f"0). Pass {argument}= yourself: weights (0 = padding) of the input's leading non-feature axes, e.g. the "
        "`weights` loss_fn receives, reshaped as the rows were."
    )
  return weights


def refuse_unmasked_training(mask: Any, module: str, argument: str = "mask") -> None:
  """Raises if a BatchNorm computes training statistics in a jaxdp training step without a mask."""
  if mask is None and _PADDED_STEP.get():
    raise ValueError(
        f"{module} is computing training statistics without {'a mask' if argument == 'mask' else argument} where "
        "jaxdp trains (make_train_step, "
        "train_step, local_gradient), whose batches may hold zero-weight padding rows that would enter them; pass "
        "the weights loss_fn receives: declare `weights` in loss_fn (or in the function given to jaxdp.adapters.nnx.loss_fn) "
        f"and call it with {argument}=weights."
    )


def _refuse_flax_nnx_batchnorm(call):
  """Wraps flax's `nnx.BatchNorm.__call__`: in training mode inside a jaxdp training step it raises.

  The route that `jaxdp.adapters.nnx.split` cannot see: a loss written by hand over flax's own `nnx.split` /
  `nnx.merge`. nnx has no method interceptor (linen's is used above), so the class's call is wrapped once;
  outside a jaxdp training step, or on running averages, it runs unchanged.
  """

  @functools.wraps(call)
  def checked(self, x, use_running_average=None, *args, **kwargs):
    if _PADDED_STEP.get() and not (self.use_running_average if use_running_average is None else use_running_average):
      raise ValueError(
          "flax's nnx.BatchNorm is computing batch statistics inside a jaxdp training step, where they are not the "
          "global batch's: without mask= the zero-weight padding rows enter them, and with mask= its pmean weighs "
          "every device equally (off on uneven splits, NaN on a device without rows). Use jaxdp.adapters.nnx.BatchNorm (the "
          "same arguments and variables; it takes the step's weights, no mask needed), or compute them with "
          "jaxdp.masked_moments(x, weights). Evaluation (use_running_average=True) is unaffected."
      )
    return call(self, x, use_running_average, *args, **kwargs)

  checked.__jaxdp_checked__ = True
  return checked


# nnx has no method interceptor, so flax's nnx.BatchNorm.__call__ is wrapped, but only while a jaxdp training step
# traces loss_fn (nothing is patched when jaxdp is imported): the traces under way share one wrapper, counted here.
_GUARD_LOCK = threading.Lock()
_guarded_traces = [0]


@contextlib.contextmanager
def _nnx_batchnorm_guarded():
  """flax's `nnx.BatchNorm.__call__` wrapped by `_refuse_flax_nnx_batchnorm` while this is entered."""
  with _GUARD_LOCK:
    if _guarded_traces[0] == 0 and not getattr(nnx.BatchNorm.__call__, "__jaxdp_checked__", False):
      nnx.BatchNorm.__call__ = _refuse_flax_nnx_batchnorm(nnx.BatchNorm.__call__)
    _guarded_traces[0] += 1
  try:
    yield
  finally:
    with _GUARD_LOCK:
      _guarded_traces[0] -= 1
      if _guarded_traces[0] == 0 and getattr(nnx.BatchNorm.__call__, "__jaxdp_checked__", False):
        nnx.BatchNorm.__call__ = nnx.BatchNorm.__call__.__wrapped__


def running_update(running: jax.Array, batch: jax.Array, count: jax.Array, momentum: float) -> jax.Array:
  """flax's `momentum·running + (1 − momentum)·batch`; a batch without real rows (`count` 0) leaves it as is."""
  batch = batch.reshape(running.shape) if batch.size == running.size else batch
  count = count.reshape(running.shape) if count.ndim else count
  new = momentum * running + (1 - momentum) * batch
  return lax.stop_gradient(jnp.where(count > 0, new, running))


class BatchNorm(nnx.Module):
  """Batch normalisation with exact cross-replica statistics over weighted, padded batches.

  A drop-in replacement for flax's `nnx.BatchNorm` (same constructor, call,
  parameters `scale`/`bias` and batch statistics `mean`/`var`,
  `train()`/`eval()`/`nnx.view` switching `use_running_average`) whose
  training-mode statistics are `masked_moments`: weighted by `mask`
  over the real rows of every device of `axis_name` through one psum, not
  an equal-weight `pmean` of per-device means. The running statistics
  follow flax's update, `ra = momentum·ra + (1 − momentum)·batch_stat`
  (biased variance), and stay unchanged when the batch has no real row.

  Differences from `nnx.BatchNorm`: `axis_name` defaults to
  `STEP_AXIS`, the data axis of the jaxdp step it runs in (`"data"`
  outside one), and is only used when bound (outside `shard_map` the whole
  local batch is the batch); `axis_name=None` gives per-device statistics.
  `mask` may be numeric weights and may have lower rank than `x` (see
  `masked_moments`). `axis_index_groups` and
  `use_fast_variance=False` are not supported (they would need other
  collectives or a second psum). Statistics are computed in float32 at least.

  Args:
    num_features: the number of input features.
    use_running_average: if True, normalise with the running statistics.
    axis: the feature axis (or axes) of the input.
    momentum: decay rate of the running statistics.
    epsilon: added to the variance.
    dtype: the dtype of the result (default: inferred from input and params).
    param_dtype: the dtype of `scale` and `bias`.
    use_bias: if True, add `bias`.
    use_scale: if True, multiply by `scale`.
    bias_init: initializer of `bias` (zeros).
    scale_init: initializer of `scale` (ones).
    axis_name: the data-parallel axis to synchronise over when bound (a
      name or a tuple of names; default: the enclosing jaxdp step's data
      axis), or `None` for per-device statistics.
    axis_index_groups: must be None.
    use_fast_variance: must be True (`E[x²] − E[x]²`, as flax's default).
    promote_dtype: as flax's: promotes `(x, mean, var, scale, bias)`.
    rngs: the `nnx.Rngs` for the initializers.
    bias_metadata: metadata of the `bias` Param.
    scale_metadata: metadata of the `scale` Param.
  """

  def __init__(
      self,
      num_features: int,
      *,
      use_running_average: bool | None = False,
      axis: int | Sequence[int] = -1,
      momentum: float = 0.99,
      epsilon: float = 1e-5,
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      use_bias: bool = True,
      use_scale: bool = True,
      bias_init: Any = nnx.initializers.zeros_init(),
      scale_init: Any = nnx.initializers.ones_init(),
      axis_name: Any = STEP_AXIS,
      axis_index_groups: Any = None,
      use_fast_variance: bool = True,
      promote_dtype: Any = dtypes.promote_dtype,
      rngs: nnx.Rngs,
      bias_metadata: Mapping[str, Any] = MappingProxyType({}),
      scale_metadata: Mapping[str, Any] = MappingProxyType({}),
  ):
    check_supported(axis_index_groups, use_fast_variance)
    feature_shape = (num_features,)
    self.mean = nnx.BatchStat(jnp.zeros(feature_shape, jnp.float32))
    self.var = nnx.BatchStat(jnp.ones(feature_shape, jnp.float32))
    # Keys drawn in flax's order (scale, then bias), so that the same Rngs give the same parameters.
    self.scale = nnx.data(None)
    if use_scale:
      self.scale = nnx.Param(scale_init(rngs.params(), feature_shape, param_dtype), **scale_metadata)
    self.bias = nnx.data(None)
    if use_bias:
      self.bias = nnx.Param(bias_init(rngs.params(), feature_shape, param_dtype), **bias_metadata)
    self.num_features = num_features
    self.use_running_average = use_running_average
    self.axis = axis
    self.momentum = momentum
    self.epsilon = epsilon
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.use_bias = use_bias
    self.use_scale = use_scale
    self.axis_name = axis_name
    self.promote_dtype = promote_dtype

  def __call__(self, x: jax.Array, use_running_average: bool | None = None, *, mask: jax.Array | None = None):
    """Normalises `x` with batch statistics (training) or the running ones.

    Args:
      x: the input; `axis` holds the features.
      use_running_average: overrides the attribute of the same name.
      mask: `None` (inside a jaxdp step: the step's weights of the rows,
        see `step_mask`) or weights `>= 0` (bool or numeric; 0 =
        padding) of the leading non-feature axes (e.g. `[b]`) or
        broadcastable to `x`.
        Numeric weights weigh each row's statistics (frequency weights);
        flax's boolean mask counts each row once: with sample weights, pass
        `mask=weights > 0` for flax's statistics.

    Returns:
      The normalised input, of `x`'s shape.
    """
    if use_running_average is None:
      use_running_average = self.use_running_average
    if use_running_average is None:
      raise ValueError(
          "BatchNorm needs use_running_average: pass it to the constructor or the call, or use "
          "model.train() / model.eval() / nnx.view(model, use_running_average=...)."
      )
    feature_axes = canonical_axes(jnp.ndim(x), self.axis)
    scale = self.scale[...] if self.scale is not None else None
    bias = self.bias[...] if self.bias is not None else None
    x, mean, var, scale, bias = self.promote_dtype((x, self.mean[...], self.var[...], scale, bias), dtype=self.dtype)
    if not use_running_average:
      mask = step_mask(mask, x, feature_axes, "jaxdp.adapters.nnx.BatchNorm")
      mean, var, count = masked_moments(x, mask, axis_name=self.axis_name, feature_axes=feature_axes)
      self.mean[...] = running_update(self.mean[...], mean, count, self.momentum)
      self.var[...] = running_update(self.var[...], var, count, self.momentum)
    return _normalize(x, mean, var, scale, bias, feature_axes, self.dtype, self.epsilon)

  def set_view(self, use_running_average: bool | None = None):
    """Used by `nnx.view`: sets `use_running_average` when given."""
    if use_running_average is not None:
      self.use_running_average = use_running_average
