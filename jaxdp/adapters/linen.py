"""flax.linen models in jaxdp: an exact synchronised `BatchNorm` and a layout-invariant `Dropout`.

A linen model needs nothing else from jaxdp: its `params` are the
parameters, its other collections (`batch_stats`) the model state, and its
`loss_fn` calls `model.apply` (see docs/porting-linen.md). Only linen's own
`nn.BatchNorm` is refused while it trains inside a jaxdp step: it would put
the zero-weight padding rows into its statistics, and with `mask=` its
`pmean` weighs every device equally. `BatchNorm` here has the same
fields, call, variable names and collections (`params`: `scale`,
`bias`; `batch_stats`: `mean`, `var`), so a model and its saved
variables keep working; its training statistics are
`jaxdp.masked_moments` over the real rows of every device, weighted by
the step's weights when no `mask` is passed (nested BatchNorms need
nothing threaded):

```python
class Net(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    x = jaxdp.adapters.linen.BatchNorm(use_running_average=not train)(nn.Dense(64)(x))
    ...

def loss_fn(params, batch, *, model_state, train):
  out, updates = model.apply({"params": params, "batch_stats": model_state}, batch["x"], train,
                             mutable=["batch_stats"])
  return jaxdp.LossOutput(losses(out, batch), model_state=updates["batch_stats"])
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen
from flax.core import meta
from flax.linen import dtypes, initializers
from jax import lax
from jaxdp.adapters import flax_support
from jaxdp.core import randomness
from jaxdp.adapters.batchnorm import (
    STEP_AXIS,
    canonical_axes,
    check_supported,
    masked_moments,
    running_update,
    step_mask,
)

__all__ = ["BatchNorm", "Dropout", "stack_blocks", "unstack_blocks"]


class BatchNorm(linen.Module):
  """flax.linen's `BatchNorm` with exact cross-replica statistics over weighted, padded batches.

  The same fields, call and variables as `flax.linen.BatchNorm`; the
  differences are those of `jaxdp.adapters.nnx.BatchNorm`:

  * training statistics are `jaxdp.masked_moments`: weighted by
    `mask` over the real rows of every device of `axis_name`, summed by
    one `psum` (not an equal-weight `pmean` of per-device means);
  * `axis_name` defaults to `jaxdp.adapters.batchnorm.STEP_AXIS`, the data
    axis of the jaxdp step it runs in (in plain single-device code the whole
    batch it sees); `None` gives per-device statistics;
  * `mask` may be numeric weights `>= 0` and of lower rank than `x`
    (`[b]`: the weights `loss_fn` receives). Without it, inside a jaxdp
    step, the step's weights of the rows are used (this replica's, of the
    current micro-batch), so padding rows never enter the statistics;
  * the running statistics follow linen's update, `ra = momentum·ra +
    (1 − momentum)·batch_stat`, and stay unchanged when the batch has no
    real row (linen's would take NaN);
  * `axis_index_groups`, `use_fast_variance=False` and
    `force_float32_reductions=False` are refused (statistics are computed
    in float32 at least, from one psum).

  On one device, without a mask or with an all-ones one, it computes what
  linen's `BatchNorm` computes (equal to float32 round-off; tested).
  """

  use_running_average: bool | None = None
  axis: int = -1
  momentum: float = 0.99
  epsilon: float = 1e-5
  dtype: Any = None
  param_dtype: Any = jnp.float32
  use_bias: bool = True
  use_scale: bool = True
  bias_init: Any = initializers.zeros
  scale_init: Any = initializers.ones
  axis_name: Any = STEP_AXIS
  axis_index_groups: Any = None
  use_fast_variance: bool = True
  force_float32_reductions: bool = True

  @linen.compact
  def __call__(self, x: jax.Array, use_running_average: bool | None = None, *, mask: jax.Array | None = None):
    """Normalises `x` with batch statistics (training) or the running ones.

    Args:
      x: the input; `axis` holds the features.
      use_running_average: overrides the field of the same name.
      mask: `None` (inside a jaxdp step: the step's weights of the rows,
        see `jaxdp.adapters.batchnorm.step_mask`) or weights `>= 0`
        (bool or numeric; 0 = padding) of the leading non-feature axes (e.g.
        `[b]`) or broadcastable to `x`.
        Numeric weights weigh each row's statistics (frequency weights);
        flax's boolean mask counts each row once: with sample weights, pass
        `mask=weights > 0` for flax's statistics.

    Returns:
      The normalised input, of `x`'s shape.
    """
    check_supported(self.axis_index_groups, self.use_fast_variance)
    if not self.force_float32_reductions:
      raise ValueError("force_float32_reductions=False is not supported: statistics are computed in float32 at least.")
    use_running_average = linen.merge_param("use_running_average", self.use_running_average, use_running_average)
    x = jnp.asarray(x)
    feature_axes = canonical_axes(x.ndim, self.axis)
    feature_shape = tuple(x.shape[i] for i in feature_axes)
    ra_mean = self.variable("batch_stats", "mean", lambda s: jnp.zeros(s, jnp.float32), feature_shape)
    ra_var = self.variable("batch_stats", "var", lambda s: jnp.ones(s, jnp.float32), feature_shape)
    if use_running_average:
      mean, var = ra_mean.value, ra_var.value
    else:
      # At init linen computes the statistics without synchronising and leaves the running ones as created.
      axis_name = None if self.is_initializing() else self.axis_name
      stats_x = x if self.dtype is None else x.astype(jnp.promote_types(self.dtype, x.dtype))
      mask = step_mask(mask, stats_x, feature_axes, "jaxdp.adapters.linen.BatchNorm")
      mean, var, count = masked_moments(stats_x, mask, axis_name=axis_name, feature_axes=feature_axes)
      mean, var = mean.reshape(feature_shape), var.reshape(feature_shape)
      if not self.is_initializing():
        ra_mean.value = running_update(ra_mean.value, mean, count, self.momentum)
        ra_var.value = running_update(ra_var.value, var, count, self.momentum)
    return self._normalize(x, mean, var, feature_axes)

  def _normalize(self, x: jax.Array, mean: jax.Array, var: jax.Array, feature_axes: tuple[int, ...]) -> jax.Array:
    """linen's `_normalize`, operation for operation, creating `scale` and `bias` as linen does."""
    stats_shape = tuple(n if i in feature_axes else 1 for i, n in enumerate(x.shape))
    feature_shape = [x.shape[i] for i in feature_axes]
    y = x - mean.reshape(stats_shape)
    mul = lax.rsqrt(var.reshape(stats_shape) + self.epsilon)
    args = [x]
    if self.use_scale:
      scale = self.param("scale", self.scale_init, feature_shape, self.param_dtype).reshape(stats_shape)
      mul *= scale
      args.append(scale)
    y *= mul
    if self.use_bias:
      bias = self.param("bias", self.bias_init, feature_shape, self.param_dtype).reshape(stats_shape)
      y += bias
      args.append(bias)
    return jnp.asarray(y, dtypes.canonicalize_dtype(*args, dtype=self.dtype))


class Dropout(linen.Dropout):
  """flax.linen's `Dropout` with one mask per example, drawn from the example's id: the same on any layout.

  The same fields, call and rng collection as `flax.linen.Dropout`. In a
  step built with `example_ids` (see `jaxdp.core.randomness`), or inside
  `jaxdp.use_example_ids`, row `r` of the input (axis 0 is the
  batch) is masked with `fold_in(make_rng(rng_collection), id_r)`, so an
  example's mask does not depend on the device count, split or
  `accum_steps`. Without ids it computes exactly what linen's
  `Dropout` computes. `broadcast_dims` holding axis 0 shares one mask
  between all rows, as linen's (drawn from the layer's key alone).
  """

  @linen.compact
  def __call__(self, inputs, deterministic: bool | None = None, rng: jax.Array | None = None):
    """Applies a random dropout mask to `inputs` (see `flax.linen.Dropout`)."""
    deterministic = linen.merge_param("deterministic", self.deterministic, deterministic)
    if self.rate == 0.0 or deterministic:
      return inputs
    if self.rate == 1.0:  # as linen: no NaN gradients
      return jnp.zeros_like(inputs)
    if rng is None:
      rng = self.make_rng(self.rng_collection)
    return randomness.dropout(inputs, self.rate, self.broadcast_dims, rng, randomness.current_example_ids())


def _refuse_flax_dropout(next_fun, args, kwargs, context):
  """A flax.linen method interceptor: linen's own `Dropout` drawing a mask raises, any other call runs."""
  module = context.module
  if isinstance(module, linen.Dropout) and not isinstance(module, Dropout) and context.method_name == "__call__":
    given = kwargs.get("deterministic", args[1] if len(args) > 1 else None)
    deterministic = module.deterministic if given is None else given
    if module.rate != 0.0 and not deterministic:
      raise ValueError(
          f"flax.linen.Dropout ({module.name or 'unnamed'}) is drawing a mask in a jaxdp step with example_ids, "
          "where the key is the same on every replica: it would drop the same units on every device (correlated "
          "dropout). Use jaxdp.adapters.linen.Dropout (the same fields), which draws each example's mask from its id, or "
          "build the step without example_ids (a key per replica)."
      )
  return next_fun(*args, **kwargs)


@contextlib.contextmanager
def refusing_flax_dropout():
  """Entered by a training step with `example_ids` while it traces `loss_fn` (see `_refuse_flax_dropout`)."""
  with linen.intercept_methods(_refuse_flax_dropout):
    yield


def _block_keys(params: Any, prefix: str) -> list[str]:
  """The keys `{prefix}_0 .. {prefix}_{N-1}` of `params`, in layer order; refuses a gap or none."""
  if not isinstance(prefix, str) or not prefix:
    raise TypeError(f"prefix must be the blocks' attribute name (a non-empty string), got {prefix!r}.")
  if not isinstance(params, Mapping):
    raise TypeError(f"params must be a linen params dict (variables['params']), got {type(params).__name__}.")
  found = {}
  for key in params:
    head, _, index = str(key).rpartition("_")
    if head == prefix and index.isdigit():
      found[int(index)] = key
  if not found:
    raise ValueError(
        f"params has no {prefix}_0, {prefix}_1, ... (keys: {sorted(map(str, params))[:8]}); pass prefix= the name of "
        "the list of blocks in the model's setup (self.blocks = [...] gives blocks_0, blocks_1, ...)."
    )
  missing = sorted(set(range(max(found) + 1)) - set(found))
  if missing:
    raise ValueError(f"params has {prefix}_{max(found)} but no {', '.join(f'{prefix}_{i}' for i in missing)}.")
  return [found[i] for i in range(len(found))]


def stack_blocks(params: Any, prefix: str = "blocks") -> dict:
  """A linen model's list of identical blocks as one stack: what `layers=` and `jaxdp.scan_layers` take.

  A list attribute of a linen `setup` (`self.blocks = [Block() for _ in range(N)]`) names its
  params `blocks_0 .. blocks_{N-1}`. This returns `params` with those entries replaced by one entry
  `blocks` whose every leaf has a leading layer axis of size `N` (layer `i` at index `i`), the
  other entries unchanged. `nn.with_partitioning` boxes keep their names, the layer axis unsplit. Run a
  layer with the block's own module, `Block().apply({"params": layer}, h)`, and the rest of the model
  with `model.apply({"params": params}, ..., method=...)` (see docs/porting-linen.md).

  Args:
    params: `variables["params"]` of the model (a dict or FrozenDict).
    prefix: the name of the list attribute, default `"blocks"`; also the stack's key.

  Raises:
    ValueError: no `{prefix}_i` entries, a gap in their numbers, a `prefix` entry already there, or
      blocks that differ in structure, shape or dtype (named).
  """
  keys = _block_keys(params, prefix)
  if prefix in params:
    raise ValueError(f"params already has an entry {prefix!r}; stack into another key, or rename it.")
  blocks = [params[k] for k in keys]
  is_box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
  flax_support.check_identical(blocks, [f"params[{k!r}]" for k in keys], is_box)
  stacked = jax.tree.map(flax_support.stack_leaf, *blocks, is_leaf=is_box)
  out = {k: v for k, v in params.items() if k not in set(keys)}
  out[prefix] = stacked
  return out


def unstack_blocks(params: Any, prefix: str = "blocks") -> dict:
  """The inverse of `stack_blocks`: the stack `params[prefix]` back as `{prefix}_0 .. {prefix}_{N-1}`.

  For the original model: its checkpoints, its inference code, `model.apply` of its own `__call__`.
  `unstack_blocks(stack_blocks(p)) == p` (the entries' order aside).

  Raises:
    ValueError: no `prefix` entry, leaves without a common leading axis, or an entry `{prefix}_i`
      already there.
  """
  if not isinstance(params, Mapping) or prefix not in params:
    raise ValueError(f"params has no stack {prefix!r}; pass prefix= the key stack_blocks wrote.")
  is_box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
  n = flax_support.stack_length(params[prefix], is_box, f"params[{prefix!r}]")
  taken = [f"{prefix}_{i}" for i in range(n) if f"{prefix}_{i}" in params]
  if taken:
    raise ValueError(f"params already has {taken}; unstack into params without them.")
  out = {k: v for k, v in params.items() if k != prefix}
  for i in range(n):
    out[f"{prefix}_{i}"] = jax.tree.map(lambda x: flax_support.unstack_leaf(x, i), params[prefix], is_leaf=is_box)
  return out
