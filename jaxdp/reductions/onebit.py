"""1-bit Adam (Tang et al., 2021): an exact warm-up, then a frozen variance and 1-bit momentum with error feedback.

Error feedback on compressed *gradients* breaks under Adam, whose variance
term is not linear in the gradient. 1-bit Adam runs Adam exactly for
`warmup_steps` steps, then freezes the variance `v` and communicates the
*momentum* instead, compressed to one bit per value (its sign) plus one
float32 scale per chunk, with error feedback on both sides:

1. worker `i` (one data-parallel replica) forms its momentum
   `m_i = b1·M + (1 − b1)·N·s_i` from the last synced momentum `M` and
   its local weighted gradient sum `s_i`, adds its error `e_i`, and
   splits the result into `N` chunks; each chunk is sent as its signs (8
   to a byte) and its scale `‖chunk‖₂ / √len` (an all-to-all: chunk `j`
   goes to replica `j`); `e_i` keeps what the 1-bit chunks missed;
2. replica `j` averages the `N` 1-bit chunks it received, adds its
   server error, compresses that the same way and sends it to every replica
   (a `psum` of the `N` chunks, each replica contributing its own: an
   all-gather would leave the result typed as varying inside `shard_map`);
3. every replica rebuilds the same momentum `M̃`; it is both the new
   `M` and what the step's optimizer receives (divided by the step's
   `Σw` as every jaxdp reduction's sum is).

The momentum lives in units of the weighted gradient *sums*, so with the
same `Σw` every step (full batches) `M̃ / Σw` is 1-bit Adam's momentum of
the mean gradient. A step with another `Σw` (a padded last batch) divides
the whole momentum by its own `Σw`: the reference in
`tests/test_onebit_adam.py` implements exactly this.

Use the pair that `onebit_adam` returns, one value for the reduction
and one for the optimizer:

```python
method = jaxdp.reductions.onebit_adam(1e-3, warmup_steps=100, weight_decay=0.01)
step = jaxdp.make_train_step(loss_fn, method.optimizer, dp, reduction=method.reduction)
state = jaxdp.init_state(params, method.optimizer, dp, reduction=method.reduction)
```

The reduction's state (`OneBitAdamState`: the momentum, the worker
and server errors, a step counter) is per replica, in
`TrainState.compression`; the optimizer's (`ScaleByOneBitAdamState`:
Adam's `mu` and `nu`, its counter) is in `TrainState.opt_state`. Both
are NamedTuples of arrays that `jaxdp.CheckpointManager` saves and restores
with the rest of the state. Both count steps: a step that skips the
optimizer's update (`optax.apply_if_finite`, dynamic loss scaling) while
the reduction runs would put them out of step, so do not combine those.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxdp.core.carries import varying_axes
from jaxdp.core.checks import check_int

BITS = 8
"""Signs per byte."""


class OneBitAdam(NamedTuple):
  """The settings of 1-bit Adam; build them with `onebit_adam`, which checks them.

  Attributes:
    learning_rate: a float or an optax schedule.
    b1, b2, eps: Adam's.
    weight_decay: AdamW's decoupled weight decay (`optax.add_decayed_weights`), 0 for none.
    warmup_steps: exact Adam steps before the variance freezes and the momentum is compressed.
  """

  learning_rate: Any
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  warmup_steps: int = 100


class OneBitAdamState(NamedTuple):
  """One replica's reduction state (`TrainState.compression` stacks one per replica).

  Attributes:
    momentum: `[n]` float32, the synced momentum of every floating leaf, flattened and concatenated in the
      params' flattening order, zero-padded to `n`, a multiple of `8·N` (units of the gradient sums).
    worker_error: `[n]` float32, what this replica's 1-bit chunks missed.
    server_error: `[n / N]` float32, what this replica's 1-bit server chunk missed.
    count: int32 scalar, the steps reduced so far (exact while below `warmup_steps`).
  """

  momentum: Any
  worker_error: Any
  server_error: Any
  count: Any


class ScaleByOneBitAdamState(NamedTuple):
  """The optimizer's state (in `TrainState.opt_state`): Adam's, with `nu` frozen after the warm-up.

  Attributes:
    count: int32 scalar, updates so far.
    mu: Adam's first moment (the momentum the reduction sent, after the warm-up), like the params.
    nu: Adam's second moment, frozen at step `warmup_steps`, like the params.
  """

  count: Any
  mu: Any
  nu: Any


class OneBitAdamMethod(NamedTuple):
  """What `onebit_adam` returns: give `reduction` and `optimizer` to the same step and state."""

  reduction: Any
  optimizer: optax.GradientTransformation
  settings: OneBitAdam


def _number(value: Any, name: str, low: float, high: float | None, low_open: bool, fix: str) -> float:
  ok = not isinstance(value, bool) and isinstance(value, (int, float, np.number)) and math.isfinite(value)
  ok = ok and (value > low if low_open else value >= low) and (high is None or value < high)
  if not ok:
    bounds = f"{'>' if low_open else '>='} {low}" + ("" if high is None else f" and < {high}")
    raise ValueError(f"{name} must be a finite number {bounds}, got {value!r}; {fix}")
  return float(value)


def check_settings(settings: OneBitAdam, *, min_warmup: int = 1) -> OneBitAdam:
  """`settings` with every value checked (`TypeError`/`ValueError` naming the setting and the fix)."""
  if not isinstance(settings, OneBitAdam):
    raise TypeError(f"settings must be jaxdp.reductions.onebit.OneBitAdam (from onebit_adam(...)), got "
                    f"{type(settings).__name__}.")
  lr = settings.learning_rate
  if not callable(lr):
    lr = _number(lr, "learning_rate", 0.0, None, True, "a float, or an optax schedule (a callable of the step).")
  b1 = _number(settings.b1, "b1", 0.0, 1.0, False, "Adam's first-moment decay, e.g. 0.9.")
  b2 = _number(settings.b2, "b2", 0.0, 1.0, False, "Adam's second-moment decay, e.g. 0.999.")
  eps = _number(settings.eps, "eps", 0.0, None, True, "Adam's epsilon, e.g. 1e-8.")
  wd = _number(settings.weight_decay, "weight_decay", 0.0, None, False, "AdamW's weight decay (0: none).")
  warmup = check_int(settings.warmup_steps, "warmup_steps", min_warmup,
                     "the exact Adam steps that estimate the variance before it is frozen and the momentum "
                     "compressed (1-bit Adam uses about 15-25% of the run).")
  if warmup > np.iinfo(np.int32).max:
    raise ValueError(f"warmup_steps must be <= {np.iinfo(np.int32).max} (an int32 counter), got {warmup}.")
  return OneBitAdam(lr, b1, b2, eps, wd, warmup)


def onebit_adam(learning_rate: Any, *, warmup_steps: int, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0) -> OneBitAdamMethod:
  """1-bit Adam for `jaxdp.make_train_step`: its `reduction=` and its optimizer, checked once.

  Args:
    learning_rate: a float > 0 or an optax schedule.
    warmup_steps: an integer >= 1: exact Adam steps before the variance freezes (the paper: 15-25% of training).
    b1: in [0, 1). b2: in [0, 1). eps: > 0.
    weight_decay: >= 0, decoupled as in `optax.adamw` (0: Adam).

  Returns:
    `OneBitAdamMethod`: `reduction` (a `jaxdp.reductions.Reduction`) and `optimizer` (an
    `optax.GradientTransformation`: during the warm-up it is `optax.adamw` with these settings).

  Raises:
    ValueError, TypeError: a setting out of its range, naming it.
  """
  settings = check_settings(OneBitAdam(learning_rate, b1, b2, eps, weight_decay, warmup_steps))
  return OneBitAdamMethod(reduction(settings), optimizer(settings), settings)


def optimizer(settings: OneBitAdam) -> optax.GradientTransformation:
  """The optimizer half: `scale_by_onebit_adam`, decoupled weight decay, the learning rate."""
  settings = check_settings(settings)
  parts = [scale_by_onebit_adam(settings.b1, settings.b2, settings.eps, settings.warmup_steps)]
  if settings.weight_decay:
    parts.append(optax.add_decayed_weights(settings.weight_decay))
  parts.append(optax.scale_by_learning_rate(settings.learning_rate))
  return optax.chain(*parts)


def scale_by_onebit_adam(b1: float, b2: float, eps: float, warmup_steps: int) -> optax.GradientTransformation:
  """Adam's scaling for `warmup_steps` updates (`optax.scale_by_adam`), then `g / (1 − b1^t)` over the
  frozen, bias-corrected `√v̂ + eps`, where `g` is the momentum the reduction sent (0 where the frozen
  variance is 0: values that had no gradient in the whole warm-up)."""
  settings = check_settings(OneBitAdam(1.0, b1, b2, eps, 0.0, warmup_steps))
  b1, b2, eps, warmup = settings.b1, settings.b2, settings.eps, settings.warmup_steps

  def init_fn(params):
    zeros = lambda: jax.tree.map(lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32)), params)  # noqa: E731
    return ScaleByOneBitAdamState(jnp.zeros((), jnp.int32), zeros(), zeros())

  def update_fn(updates, state, params=None):
    del params
    warm = state.count < warmup
    t = state.count + 1
    frozen_t = jnp.where(warm, t, warmup).astype(jnp.float32)  # the variance's bias correction stops at the freeze
    mu = jax.tree.map(lambda g, m: jnp.where(warm, b1 * m + (1 - b1) * g, g), updates, state.mu)
    nu = jax.tree.map(lambda g, v: jnp.where(warm, b2 * v + (1 - b2) * jnp.square(g), v), updates, state.nu)
    mu_hat = 1 - b1 ** t.astype(jnp.float32)
    nu_hat = 1 - b2 ** frozen_t
    # After the freeze a value whose variance is 0 (no gradient in the whole warm-up: an embedding row never
    # looked up) gets no update: the 1-bit momentum there is the sign's noise, and over √0 + eps it would be
    # a step of scale / eps (DeepSpeed's 1-bit Adam asks for an ``exp_avg_mask`` for the same reason).
    mu = jax.tree.map(lambda m, v: jnp.where(warm | (v > 0), m, jnp.zeros_like(m)), mu, nu)
    new = jax.tree.map(lambda m, v, g: ((m / mu_hat) / (jnp.sqrt(v / nu_hat) + eps)).astype(g.dtype), mu, nu, updates)
    return new, ScaleByOneBitAdamState(t, mu, nu)

  return optax.GradientTransformation(init_fn, update_fn)


def _floating(leaves: list) -> list[int]:
  return [i for i, x in enumerate(leaves) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]


def padded_size(params: Any, replicas: int) -> int:
  """`n`: the floating leaves' total size rounded up to a multiple of `8·replicas`."""
  leaves = jax.tree.leaves(params)
  total = sum(math.prod(np.shape(leaves[i])) for i in _floating(leaves))
  block = BITS * replicas
  return max(block, -(-total // block) * block)


def init(params: Any, replicas: int) -> OneBitAdamState:
  """One replica's initial `OneBitAdamState` for `params` on `replicas` data-parallel replicas."""
  replicas = check_int(replicas, "replicas", 1, "the number of data-parallel replicas.")
  n = padded_size(params, replicas)
  zeros = lambda k: jnp.zeros((k,), jnp.float32)  # noqa: E731
  return OneBitAdamState(zeros(n), zeros(n), zeros(n // replicas), jnp.zeros((), jnp.int32))


def pack(signs: jax.Array) -> jax.Array:
  """`[..., 8k]` bools as `[..., k]` uint8 (bit `b` of byte `j`: value `8j + b`)."""
  bits = signs.reshape(*signs.shape[:-1], -1, BITS).astype(jnp.uint8)
  shifts = jnp.arange(BITS, dtype=jnp.uint8).reshape((1,) * (bits.ndim - 1) + (BITS,))
  return jnp.sum(bits << shifts, axis=-1, dtype=jnp.uint8)


def unpack(packed: jax.Array) -> jax.Array:
  """The inverse of `pack`: `[..., k]` uint8 as `[..., 8k]` values in `{−1, +1}` (float32)."""
  shifts = jnp.arange(BITS, dtype=jnp.uint8).reshape((1,) * packed.ndim + (BITS,))
  bits = (packed[..., None] >> shifts) & 1
  return (2.0 * bits.astype(jnp.float32) - 1.0).reshape(*packed.shape[:-1], -1)


def compress(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(signs packed [..., L/8], scale [...])` of `x` `[..., L]`: `x ≈ scale · sign(x)`, sign(0) = +1,
  `scale = ‖x‖₂ / √L` per row."""
  scale = jnp.sqrt(jnp.mean(jnp.square(x), axis=-1))
  return pack(x >= 0), scale


def _varying(x: jax.Array, axes: tuple) -> jax.Array:
  """`x` typed as varying over `axes` (a per-replica state leaf), whatever it was."""
  missing = tuple(a for a in axes if a not in varying_axes(x))
  return lax.pcast(x, missing, to="varying") if missing else x


def reduction(settings: OneBitAdam) -> Any:
  """The reduction half (a `jaxdp.reductions.Reduction`); `warmup_steps` may be 0 here (compressed from
  the first step, e.g. to read the compressed program's bytes; the optimizer needs a warm-up)."""
  from jaxdp.reductions import Reduction

  settings = check_settings(settings, min_warmup=0)
  b1, warmup = settings.b1, settings.warmup_steps

  def init_fn(params, layout):
    return init(params, layout.replicas)

  def reduce_fn(sums, state, axis_name):
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    axes = names[0] if len(names) == 1 else names
    replicas = math.prod(lax.axis_size(a) for a in names)
    leaves, treedef = jax.tree.flatten(sums)
    picked = _floating(leaves)
    rest = lax.psum([x for i, x in enumerate(leaves) if i not in picked], axes)
    n = state.momentum.shape[0]
    flat = jnp.concatenate([jnp.ravel(leaves[i]).astype(jnp.float32) for i in picked] or [jnp.zeros((0,))])
    if n != padded_size([leaves[i] for i in picked], replicas) or state.server_error.shape[0] * replicas != n:
      raise ValueError(f"the 1-bit Adam state holds {n} values for {flat.shape[0]} gradient values on {replicas} "
                       "replicas; make it with jaxdp.init_state(..., reduction=) for these params and devices.")
    flat = jnp.pad(flat, (0, n - flat.shape[0]))

    def exact(operand):
      flat, state = operand
      summed = lax.psum(flat, axes)
      momentum = b1 * state.momentum + (1 - b1) * summed
      return summed, state._replace(momentum=_varying(momentum, names))

    def compressed(operand):
      flat, state = operand
      chunk = n // replicas
      local = b1 * state.momentum + (1 - b1) * replicas * flat + state.worker_error
      rows = local.reshape(replicas, chunk)
      signs, scales = compress(rows)
      worker_error = (rows - unpack(signs) * scales[:, None]).reshape(n)
      got_signs = lax.all_to_all(signs, axes, 0, 0)  # row k: replica k's chunk for this replica
      got_scales = lax.all_to_all(scales[:, None], axes, 0, 0)
      average = jnp.mean(unpack(got_signs) * got_scales, axis=0) + state.server_error
      mine_signs, mine_scale = compress(average)
      server_error = average - unpack(mine_signs) * mine_scale
      me = lax.axis_index(axes)
      own = jnp.arange(replicas) == me
      all_signs = lax.psum(jnp.where(own[:, None], mine_signs[None], jnp.zeros_like(mine_signs)[None]), axes)
      all_scales = lax.psum(jnp.where(own, mine_scale[None], 0.0), axes)
      momentum = (unpack(all_signs) * all_scales[:, None]).reshape(n)
      return momentum, OneBitAdamState(_varying(momentum, names), _varying(worker_error, names),
                                       _varying(server_error, names), state.count)

    operand = (flat, state)
    if warmup == 0:
      summed, new = compressed(operand)
    else:
      summed, new = lax.cond(state.count >= warmup, compressed, exact, operand)
    new = new._replace(count=state.count + 1)
    out, offset, rest = list(leaves), 0, iter(rest)
    for i, x in enumerate(leaves):
      if i in picked:
        size = math.prod(x.shape)
        out[i] = summed[offset:offset + size].reshape(x.shape).astype(x.dtype)
        offset += size
      else:
        out[i] = next(rest)
    return treedef.unflatten(out), new

  return Reduction(init_fn, reduce_fn)


__all__ = ["OneBitAdam", "OneBitAdamMethod", "OneBitAdamState", "ScaleByOneBitAdamState", "check_settings",
           "compress", "init", "onebit_adam", "optimizer", "pack", "padded_size", "reduction",
           "scale_by_onebit_adam", "unpack"]
