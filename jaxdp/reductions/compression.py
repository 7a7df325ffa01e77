"""PowerSGD: a low-rank gradient reduction with error feedback (Vogels et al., 2019), as an explicit opt-in.

The exact step all-reduces every gradient leaf whole. With
`make_train_step(..., compression=jaxdp.powersgd(rank=2))` each large
leaf, viewed as the matrix `[m, n]` of its most-square contiguous split
`m = prod(shape[:k])`, `n = prod(shape[k:])` (see `matrix_shape`), instead sends two small sums,
`P = Σ_i M_i Q` (`[m, r]`) and `Q' = Σ_i M_iᵀ P̂` (`[n, r]`), where
`M_i` is replica `i`'s local weighted gradient sum `Σ w·∇l` plus its
error feedback `e_i` and `P̂` is `P` orthonormalised (QR, float32).
Every replica applies the rank-`r` sum `A = P̂ Q'ᵀ`, divided by the exact
`Σ w` as the exact step divides; each keeps what was not sent,
`e_i ← M_i − A/N`, and `Q ← Q'` is the next step's warm start. Leaves
with `m·n ≤ (m+n)·r·min_compression_rate`, vectors, scalars and leaves
that are not real floating point are all-reduced exactly, in the step's
usual all-reduce; so is every leaf during the first `start_iter` steps
(torch's `powerSGD_hook` does the same).

The state (`PowerSGDState`) lives in `TrainState.compression`:
`q` is replicated; `error` holds one `[N, *shape]` array per compressed
leaf, split over the data axes so that each device holds its own replica's
`[1, *shape]` (that split is the same at every ZeRO stage). At stages 2-3
the step all-reduces the factors as at stage 0 and each device keeps its
slice of the decompressed sum (`jaxdp.training.reduction.own_slices`).

In a pipeline each stage holds its block of a stack of layers, so a stacked
leaf `[L, ...]` is compressed layer by layer: each layer's `[m, n]` (the
matrix of `shape[1:]`) has its own factors, `q` is `[L, n, r]` and split
over the stage axis with the layers, and every sum stays within a stage.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxdp.core.checks import check_int


MAX_START_ITER = int(np.iinfo(np.int32).max)  # PowerSGDState.iteration is an int32 counter


class PowerSGD(NamedTuple):
  """The settings of a PowerSGD reduction; build it with `powersgd`, which checks them.

  Attributes:
    rank: the rank `r` of each compressed leaf's approximation (clipped to `min(m, n)` per leaf).
    start_iter: the number of steps (applied updates of the compression state) reduced exactly first.
    min_compression_rate: a leaf is compressed only if `m·n > (m+n)·r·min_compression_rate`.
    seed: the seed of the initial `Q` (standard normal, the same on every replica).
  """

  rank: int = 2
  start_iter: int = 10
  min_compression_rate: float = 2.0
  seed: int = 0


class PowerSGDState(NamedTuple):
  """What PowerSGD carries from step to step, in `TrainState.compression`.

  `q` and `error` have the params' structure with `None` at every leaf
  that is reduced exactly.

  Attributes:
    q: per compressed leaf, the warm-started `Q` `[n, r]`, the same on every replica (`[L, n, r]`, one
      per layer, for a stack of `L` layers compressed layer by layer).
    error: per compressed leaf, the error feedback `[N, *shape]` of the `N` data-parallel replicas,
      split over the data axes (each device holds its own `[1, *shape]`).
    iteration: int32 scalar, the steps applied since the state was made; exact while below `start_iter`.
  """

  q: Any
  error: Any
  iteration: Any


def powersgd(rank: int = 2, *, start_iter: int = 10, min_compression_rate: float = 2.0, seed: int = 0) -> PowerSGD:
  """PowerSGD settings for `jaxdp.make_train_step`'s `compression=` (and `jaxdp.init_state`'s).

  Args:
    rank: an integer `>= 1`; 1-4 is the usual range (`min(m, n)` reproduces the exact sum).
    start_iter: an integer from 0 to `2**31 - 1` (the state's counter is
      an int32): the first `start_iter` steps are exact.
    min_compression_rate: a number `>= 0`; 0 compresses every matrix leaf.
    seed: an integer in `[0, 2**32)`, the seed of the initial `Q`.

  Raises:
    ValueError: a setting out of its range.
  """
  rank = check_int(rank, "rank", 1, "the rank of the low-rank approximation, e.g. powersgd(rank=2).")
  start_iter = check_int(start_iter, "start_iter", 0, "the number of exact steps before compressing (0: none).")
  if start_iter > MAX_START_ITER:
    raise ValueError(f"start_iter must be <= {MAX_START_ITER} (2**31 - 1: the state counts steps in an int32), got "
                     f"{start_iter}; the number of exact steps before compressing (0: none).")
  if isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float, np.number)) or not (
      math.isfinite(min_compression_rate) and min_compression_rate >= 0):
    raise ValueError(
        f"min_compression_rate must be a finite number >= 0, got {min_compression_rate!r}; a leaf [m, n] is "
        "compressed only if m*n > (m+n)*rank*min_compression_rate (0 compresses every matrix)."
    )
  seed = check_int(seed, "seed", 0, "the seed of the initial Q.")
  if seed >= 2**32:
    raise ValueError(f"seed must be < 2**32, got {seed}: without jax_enable_x64 jax.random.key keeps only a seed's "
                     "low 32 bits, so larger seeds would give the same Q as smaller ones. Use a seed in [0, 2**32).")
  return PowerSGD(rank, start_iter, float(min_compression_rate), seed)


def check_compression(compression: Any) -> None:
  """Raises `TypeError` unless `compression` is `None` or a `PowerSGD` (from `powersgd`);
  `ValueError` for one built by hand with a setting `powersgd` refuses."""
  if compression is not None and not isinstance(compression, PowerSGD):
    raise TypeError(
        f"compression must be None (the exact reduction) or jaxdp.powersgd(...), got {type(compression).__name__}."
    )
  if compression is not None:
    powersgd(compression.rank, start_iter=compression.start_iter,
             min_compression_rate=compression.min_compression_rate, seed=compression.seed)


def matrix_shape(shape: tuple) -> tuple[int, int]:
  """The `(m, n)` matrix PowerSGD views a leaf of `shape` (2 dims or more) as: its most-square contiguous split.

  Among the splits of the dims into a leading and a trailing group, `m = prod(shape[:k])`, `n = prod(shape[k:])`
  for `k = 1 .. ndim - 1`, it is the one with the smallest `max(m, n) / min(m, n)` (ties: the larger `k`, output
  dims last) — the split whose rank-`r` factors `r·(m + n)` are fewest, so the best compression the shape allows.
  A 2-D leaf is itself. A flax convolution kernel `[3, 3, 16, 32]` is `144 × 32` (inputs × outputs),
  `[3, 3, 1, 16]` is `9 × 16`, an `nnx.LinearGeneral` kernel `[64, 3, 4, 16]` is `64 × 192`.
  """
  best = None
  for k in range(1, len(shape)):
    m, n = math.prod(shape[:k]), math.prod(shape[k:])
    # Compare max/min ratios by cross-multiplying (exact in integers); a zero-size dim makes every split equal.
    key = (max(m, n) * min(best) if best else 0, max(best) * min(m, n) if best else 0)
    if best is None or key[0] < key[1]:
      best = (m, n)
  return best


def leaf_rank(shape: tuple, compression: PowerSGD, dtype: Any = jnp.float32) -> int | None:
  """The rank a leaf of `shape` and `dtype` is compressed at, or `None` where it is reduced exactly."""
  if len(shape) < 2 or not jnp.issubdtype(dtype, jnp.floating):
    return None
  m, n = matrix_shape(shape)
  r = min(compression.rank, m, n)
  if m * n <= (m + n) * r * compression.min_compression_rate or not m * n:
    return None
  return r


def _names(axis_name: Any) -> tuple[str, ...]:
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def init_compression(params: Any, compression: PowerSGD | None, replicas: int,
                     layers: Any = None) -> PowerSGDState | None:
  """The initial `PowerSGDState` of `params` for `replicas` data-parallel replicas (host arrays, unplaced).

  `Q` of leaf `k` (in flattening order) is standard normal from `fold_in(key(seed), k)`; errors are zero.
  `layers`: `None`, or the params' tree of bools marking stacks of layers compressed layer by layer (a
  pipeline's: `[L, ...]` gets `L` factors of its layers' shape `shape[1:]`).
  `compression=None` gives `None`. `jaxdp.init_state` calls it and places the result.
  """
  check_compression(compression)
  if compression is None:
    return None
  replicas = check_int(replicas, "replicas", 1, "the number of data-parallel replicas.")
  leaves, treedef = jax.tree.flatten(params)
  per_layer = [False] * len(leaves) if layers is None else treedef.flatten_up_to(layers)
  key = jax.random.key(compression.seed)
  qs, errors = [], []
  for k, (x, stacked) in enumerate(zip(leaves, per_layer)):
    shape, dtype = np.shape(x), jnp.result_type(x)
    matrix = shape[1:] if stacked else shape
    r = leaf_rank(matrix, compression, dtype)
    if r is None:
      qs.append(None)
      errors.append(None)
      continue
    acc = jnp.promote_types(dtype, jnp.float32)  # gradients are summed in float32 at least
    q_shape = (*shape[:1], matrix_shape(matrix)[1], r) if stacked else (matrix_shape(matrix)[1], r)
    qs.append(jax.random.normal(jax.random.fold_in(key, k), q_shape, acc))
    errors.append(jnp.zeros((replicas, *shape), acc))
  return PowerSGDState(treedef.unflatten(qs), treedef.unflatten(errors), jnp.zeros((), jnp.int32))


def compression_specs(state: Any, axis_name: Any, stage_axis: str | None = None) -> Any:
  """The `PartitionSpec`s of a `PowerSGDState` (or `None`): `q` and `iteration` replicated,
  each error split over the data axes along its leading replica dimension. With a pipeline's `stage_axis`,
  the factors of a stack compressed layer by layer (`q` `[L, n, r]`) and its error are split over the stages
  along their layer dimension, as the stack is."""
  if state is None:
    return None
  names = _names(axis_name)
  data = names[0] if len(names) == 1 else names
  if not isinstance(state, PowerSGDState):  # a user reduction's state: one copy per replica on the leading axis
    return jax.tree.map(lambda _: P(data), state)

  def per_layer(q):  # the entries after the leading one: the stage split of a stack's layer dimension
    return (stage_axis,) if stage_axis is not None and len(q.shape) == 3 else ()

  return PowerSGDState(jax.tree.map(lambda q: P(*per_layer(q)), state.q),
                       jax.tree.map(lambda q, _: P(data, *per_layer(q)), state.q, state.error), P())


def check_compression_state(state: Any, params: Any, compression: PowerSGD | None, replicas: int,
                            name: str = "state.compression", layers: Any = None) -> None:
  """Raises `ValueError` unless `state` is what `init_compression` makes for these params, settings, number
  of replicas and stacks compressed layer by layer (shapes and structure only; nothing is read)."""
  if compression is None:
    if state is not None:
      raise ValueError(
          f"{name} holds a PowerSGD state but the step was built without compression=; build the step with "
          "the same compression=jaxdp.powersgd(...) as the state (jaxdp.init_state(..., compression=...)), or pass "
          f"state._replace(compression=None) to reduce exactly."
      )
    return
  expected = jax.eval_shape(lambda p: init_compression(p, compression, replicas, layers), params)
  if state is None:
    raise ValueError(
        f"the step was built with compression={compression} but {name} is None; make the state with "
        "jaxdp.init_state(params, optimizer, mesh, compression=...) with the same settings."
    )
  if not isinstance(state, PowerSGDState):
    raise ValueError(f"{name} must be a jaxdp.PowerSGDState (from jaxdp.init_state(..., compression=...)), got "
                     f"{type(state).__name__}.")
  got = jax.tree.map(lambda x: (tuple(np.shape(x)), jnp.result_type(x)), state)
  want = jax.tree.map(lambda x: (tuple(x.shape), x.dtype), expected)
  if jax.tree.structure(got) != jax.tree.structure(want) or jax.tree.leaves(got) != jax.tree.leaves(want):
    errors = [np.shape(x)[0] for x in jax.tree.leaves(state.error)]
    if errors and errors[0] != replicas:
      raise ValueError(
          f"{name} holds the error feedback of {errors[0]} replicas, but this step runs {replicas}; the error "
          "feedback is per replica. Start it afresh for this device count, state._replace(compression="
          f"jaxdp.init_compression(params, compression, {replicas})), or run on {errors[0]} replicas."
      )
    raise ValueError(
        f"{name} does not match the step's compression={compression} for these params (its leaves' shapes, or which "
        "leaves are compressed, differ); build the state with jaxdp.init_state(..., compression=) with the same "
        "settings as the step."
    )


def _orthonormal(p: jax.Array) -> jax.Array:
  # Householder QR: orthonormal columns whose span holds P's, also for a rank-deficient (or zero) P.
  return jnp.linalg.qr(p.astype(jnp.promote_types(p.dtype, jnp.float32)))[0].astype(p.dtype)


def _matrices(shape: tuple, q: jax.Array) -> tuple:
  """The shape PowerSGD views a gradient leaf as: `[m, n]`, or `[L, m, n]` for a stack with per-layer factors."""
  return (shape[0], *matrix_shape(shape[1:])) if q.ndim == 3 else matrix_shape(shape)


def _transposed(x: jax.Array) -> jax.Array:
  return jnp.swapaxes(x, -1, -2)  # each matrix of a batch of them


def powersgd_sum(grads: list, state: PowerSGDState, compression: PowerSGD, axis_name: Any,
                 qs: list, errors: list) -> tuple[list, list, list]:
  """`(sums, new_qs, new_errors)` of the compressed leaves (per replica, inside `shard_map` over `axis_name`).

  `grads`: this replica's local sums of the compressed leaves; `qs`, `errors`: their `Q` and this
  device's `[1, *shape]` error block. Two all-reduces in all (every leaf's `P` in one, every `Q'` in
  the other); from `state.iteration >= start_iter` on, else one exact all-reduce of the leaves (the
  program holds both branches of a `lax.cond`; with `start_iter=0` there is no cond). A leaf whose `Q` is
  `[L, n, r]` is a stack compressed layer by layer: every product below is batched over its layers.
  """
  names = _names(axis_name)
  axes = names[0] if len(names) == 1 else names
  replicas = math.prod(lax.axis_size(a) for a in names)

  def compressed(operand):
    grads, qs, errors = operand
    ms = [(g + e[0].astype(g.dtype)).reshape(_matrices(g.shape, q)) for g, e, q in zip(grads, errors, qs)]
    ps = lax.psum([m @ q.astype(m.dtype) for m, q in zip(ms, qs)], axes)
    ps = [_orthonormal(p) for p in ps]
    new_qs = lax.psum([_transposed(m) @ p for m, p in zip(ms, ps)], axes)
    sums = [p @ _transposed(q) for p, q in zip(ps, new_qs)]
    new_errors = [(m - a / replicas).reshape(e.shape).astype(e.dtype) for m, a, e in zip(ms, sums, errors)]
    return ([a.reshape(g.shape) for a, g in zip(sums, grads)], [q.astype(old.dtype) for q, old in zip(new_qs, qs)],
            new_errors)

  def exact(operand):
    grads, qs, errors = operand
    return lax.psum(list(grads), axes), list(qs), list(errors)

  operand = (list(grads), list(qs), list(errors))
  if compression.start_iter == 0:
    return compressed(operand)
  return lax.cond(state.iteration >= compression.start_iter, compressed, exact, operand)


def compressed_sums(grads: Any, compression: PowerSGD, axis_name: Any, state: Any, scatter: Any = False) -> tuple[Any, tuple]:
  """`(grads with None at the compressed leaves, (treedef, sums, new state))`: PowerSGD's sums of those leaves."""
  if not isinstance(state, PowerSGDState):
    raise ValueError(
        f"compression={compression} needs the PowerSGD state: pass compression_state= (the state's "
        f"compression, made by jaxdp.init_state(..., compression=)), got {type(state).__name__}."
    )
  if scatter is not False:
    raise ValueError("compression=powersgd(...) all-reduces whole matrices; it cannot scatter (use scatter=False).")
  leaves, treedef = jax.tree.flatten(grads)
  try:
    qs, errors = treedef.flatten_up_to(state.q), treedef.flatten_up_to(state.error)
  except (ValueError, TypeError):
    raise ValueError(
        "the PowerSGD state's q and error do not have the gradient's (the params') structure; make the state for "
        "these params (jaxdp.init_state(..., compression=))."
    ) from None
  picked = [i for i, q in enumerate(qs) if q is not None]
  sums, new_qs, new_errors = powersgd_sum([leaves[i] for i in picked], state, compression,
                                          axis_name, [qs[i] for i in picked], [errors[i] for i in picked])
  for i, q, e in zip(picked, new_qs, new_errors):
    leaves[i], qs[i], errors[i] = None, q, e
  new_state = PowerSGDState(treedef.unflatten(qs), treedef.unflatten(errors), state.iteration + 1)
  return treedef.unflatten(leaves), (treedef, dict(zip(picked, sums)), new_state)


def with_compressed(grads: Any, compressed: tuple) -> tuple[Any, PowerSGDState]:
  """The exactly reduced `grads` (None at the compressed leaves) completed with PowerSGD's sums."""
  treedef, sums, new_state = compressed
  leaves = treedef.flatten_up_to(grads)
  return treedef.unflatten([sums.get(i, x) for i, x in enumerate(leaves)]), new_state


def powersgd_reduce(sums: Any, state: PowerSGDState, compression: PowerSGD, axis_name: Any) -> tuple[Any, PowerSGDState]:
  """PowerSGD's reduction on its own (`jaxdp.reductions.powersgd`'s `reduce`): the compressed leaves'
  low-rank sums, the others' exact `psum`; `state` is this replica's (each error a `[1, *shape]` block)."""
  rest, compressed = compressed_sums(sums, compression, axis_name, state)
  return with_compressed(lax.psum(rest, axis_name), compressed)
