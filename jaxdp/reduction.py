"""Local gradients and the reduction that makes the replicas agree on one.

The two functions here are the heart of data parallelism and are kept pure
and separate so that users can compose them differently (accumulate, clip,
reduce-scatter):

* :func:`local_gradient` differentiates the *weighted sum* of this replica's
  losses. Sums, not means, are what can be added across devices and
  micro-batches without a normalisation error.
* :func:`reduce_gradient` turns the local sums into the gradient that every
  replica applies, according to a ``reduction`` mode.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxdp._checks import check_int

REDUCTIONS = ("mean", "rank_mean", "sum", "none")
"""The reduction modes accepted by :func:`reduce_gradient` and the steps.

* ``"mean"``: gradient of the global weighted mean ``Σ w·l / Σ w`` over every
  device's examples: exactly the one-big-batch gradient for any uneven split.
* ``"rank_mean"``: mean over replicas of each replica's local weighted mean,
  what PyTorch DDP computes; a replica with zero weight contributes zero but
  still counts in the denominator.
* ``"sum"``: all-reduced sum of the local weighted sums.
* ``"none"``: no communication; each replica steps on its own local mean.
"""


class LocalGradient(NamedTuple):
  """What one replica knows before any communication.

  Attributes:
    grads: gradient of ``loss_sum`` with respect to the params (same pytree).
    loss_sum: scalar ``Σ w·l`` over this replica's examples (or tokens).
    weight_sum: scalar ``Σ w`` over this replica's examples (or tokens).
  """

  grads: Any
  loss_sum: jax.Array
  weight_sum: jax.Array


class ReducedGradient(NamedTuple):
  """The gradient every replica applies, with the matching loss and weight.

  Attributes:
    grads: the normalised gradient to hand to the optimizer.
    loss: the reduced loss matching the reduction mode.
    weight: the total weight behind ``grads``: global ``Σ w``, or the local one
      under ``"none"``. Zero means there is nothing to learn from.
  """

  grads: Any
  loss: jax.Array
  weight: jax.Array


def check_reduction(reduction: str) -> None:
  """Raises ``ValueError`` unless ``reduction`` is one of :data:`REDUCTIONS`."""
  if reduction not in REDUCTIONS:
    raise ValueError(
        f"reduction={reduction!r} is not supported; use one of {', '.join(map(repr, REDUCTIONS))}."
    )


def _varying_axes(x: Any) -> frozenset:
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))  # JAX 0.11 spelling


def as_varying(tree: Any, axis_name: str) -> Any:
  """Marks every leaf of ``tree`` as varying over ``axis_name`` (a no-op at run time).

  Inside ``shard_map`` with ``check_vma=True``, ``jax.grad`` with respect to a
  replicated value returns a gradient that is already summed over the axis
  (the transpose of the implicit broadcast is a ``psum``). Differentiating
  with respect to a varying copy yields the *local* gradient instead, which is
  what must be normalised before the one reduction. Under ``pmap`` or with
  ``check_vma=False`` this returns the leaves unchanged.
  """

  def cast(x):
    if axis_name in _varying_axes(x):
      return x
    return lax.pcast(x, axis_name, to="varying")

  return jax.tree.map(cast, tree)


def _weighted_losses(losses: jax.Array, weights: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  if weights is None:
    weights = jnp.ones_like(losses)
  if weights.shape != losses.shape:
    raise ValueError(
        f"weights has shape {weights.shape} but loss_fn returned losses of shape {losses.shape}; "
        "pass weights with exactly the shape of the per-example (or per-token) losses."
    )
  weights = weights.astype(losses.dtype)
  # where() keeps a non-finite loss on a zero-weight (padding) row out of the sum.
  return jnp.sum(jnp.where(weights > 0, losses * weights, 0)), jnp.sum(weights)


def _call_loss(loss_fn, params, batch, rng):
  return loss_fn(params, batch) if rng is None else loss_fn(params, batch, rng)


def _split_micro(tree: Any, accum_steps: int) -> Any:
  """``[b, ...] -> [K, b/K, ...]``: K contiguous micro-batches of each leaf."""

  def split(x):
    if x.shape[0] % accum_steps:
      raise ValueError(
          f"this device's batch has {x.shape[0]} rows, which do not split into accum_steps={accum_steps} "
          f"micro-batches; make the per-device batch a multiple of {accum_steps}."
      )
    return x.reshape(accum_steps, x.shape[0] // accum_steps, *x.shape[1:])

  return jax.tree.map(split, tree)


def local_gradient(
    loss_fn: Callable[..., jax.Array],
    params: Any,
    batch: Any,
    weights: jax.Array | None = None,
    *,
    axis_name: str | None = None,
    accum_steps: int = 1,
    rng: jax.Array | None = None,
) -> LocalGradient:
  """Gradient of this replica's weighted loss *sum*, with no communication.

  Args:
    loss_fn: ``loss_fn(params, batch)`` (or ``loss_fn(params, batch, rng)``
      when ``rng`` is given) returning per-example losses ``[b]`` or
      per-token losses ``[b, t]``.
    params: the parameters (replicated across the axis).
    batch: this replica's slice of the batch.
    weights: ``None`` (all ones) or an array of the losses' shape with values
      ``>= 0``; zero marks padding.
    axis_name: when called inside ``shard_map`` over this axis, the name of
      the axis; the params are then differentiated as a per-replica value, so
      that the result is the local gradient and not an implicit all-reduce.
    accum_steps: split the batch into this many contiguous micro-batches and
      accumulate their gradient *sums* with ``lax.scan`` (activation memory
      of one micro-batch). The result equals the whole-batch one: sums add
      exactly, only the final normalisation divides.
    rng: optional PRNG key for ``loss_fn`` (dropout); micro-batch ``i`` gets
      ``fold_in(rng, i)``.

  Returns:
    A :class:`LocalGradient` with the gradient of ``Σ w·l``, ``Σ w·l`` and ``Σ w``.
  """
  check_int(accum_steps, "accum_steps", 1, "split each device's batch into that many micro-batches.")
  if axis_name is not None:
    params = as_varying(params, axis_name)

  def micro_gradient(micro_batch, micro_weights, micro_rng):
    def weighted_sum(p):
      return _weighted_losses(_call_loss(loss_fn, p, micro_batch, micro_rng), micro_weights)

    (loss_sum, weight_sum), grads = jax.value_and_grad(weighted_sum, has_aux=True)(params)
    return LocalGradient(grads, loss_sum, weight_sum)

  if accum_steps == 1:
    return micro_gradient(batch, weights, rng)

  def accumulate(total, xs):
    index, micro_batch, micro_weights = xs
    micro_rng = None if rng is None else jax.random.fold_in(rng, index)
    part = micro_gradient(micro_batch, micro_weights, micro_rng)
    if axis_name is not None:  # keep the carry's type fixed under check_vma
      part = as_varying(part, axis_name)
    return jax.tree.map(jnp.add, total, part), None

  micro = _split_micro((batch, weights), accum_steps)
  first = jax.eval_shape(micro_gradient, *jax.tree.map(lambda x: x[0], micro), rng)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), first)
  if axis_name is not None:
    zeros = as_varying(zeros, axis_name)
  total, _ = lax.scan(accumulate, zeros, (jnp.arange(accum_steps), *micro))
  return total


def _is_trivial(tree: Any, axis_name: str) -> bool:
  # One device and no varying types (check_vma off): the sum is the value, and XLA would still copy it.
  return lax.axis_size(axis_name) == 1 and not any(axis_name in _varying_axes(x) for x in jax.tree.leaves(tree))


def _psum(tree: Any, axis_name: str) -> Any:
  if _is_trivial(tree, axis_name):
    return tree
  return lax.psum(as_varying(tree, axis_name), axis_name)


def _psum_scatter(tree: Any, axis_name: str) -> Any:
  # Leaves are flat and padded to a multiple of the axis size: each device keeps its chunk of the sum.
  return jax.tree.map(
      lambda x: lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True), as_varying(tree, axis_name)
  )


def _safe_divide(tree: Any, denominator: jax.Array) -> Any:
  # A zero denominator only happens when every numerator is zero too (no weight, no
  # gradient); dividing by one then keeps the result at zero instead of NaN.
  safe = jnp.where(denominator > 0, denominator, jnp.ones_like(denominator))
  return jax.tree.map(lambda x: x / safe.astype(x.dtype), tree)


def reduce_gradient(
    local: LocalGradient, *, axis_name: str, reduction: str = "mean", scatter: bool = False
) -> ReducedGradient:
  """Makes the replicas agree on one gradient (one all-reduce per leaf).

  Must run inside ``shard_map`` or ``pmap`` over ``axis_name`` (except for
  ``reduction="none"``, which communicates nothing).

  Args:
    local: this replica's :class:`LocalGradient`.
    axis_name: the data-parallel mesh axis.
    reduction: one of :data:`REDUCTIONS`.
    scatter: reduce-scatter the gradient instead of all-reducing it (ZeRO
      stages 2 and 3): every gradient leaf must be flat with a length
      divisible by the axis size, and each device receives its contiguous
      chunk of the reduced gradient. A fully reduced gradient never exists.

  Returns:
    A :class:`ReducedGradient`. Every replica holds the same values except
    under ``"none"`` (and the gradient chunks under ``scatter``).
  """
  check_reduction(reduction)
  grads, loss_sum, weight_sum = local
  if reduction == "none":
    if scatter:
      raise ValueError("reduction='none' communicates nothing, so it cannot scatter; use scatter=False.")
    return ReducedGradient(_safe_divide(grads, weight_sum), _safe_divide(loss_sum, weight_sum), weight_sum)
  if reduction == "rank_mean":  # each replica's local mean first, as DDP does
    grads, loss_sum = _safe_divide((grads, loss_sum), weight_sum)
  if scatter:
    grads = _psum_scatter(grads, axis_name)
    loss_sum, weight_sum = _psum((loss_sum, weight_sum), axis_name)
  else:  # one psum call: XLA can reduce gradient and scalars in a single all-reduce
    grads, loss_sum, weight_sum = _psum((grads, loss_sum, weight_sum), axis_name)
  if reduction == "sum":
    return ReducedGradient(grads, loss_sum, weight_sum)
  if reduction == "rank_mean":
    n = lax.axis_size(axis_name)
    return ReducedGradient(jax.tree.map(lambda x: x / n, grads), loss_sum / n, weight_sum)
  return ReducedGradient(*_safe_divide((grads, loss_sum), weight_sum), weight_sum)


def global_norm(tree: Any, axis_name: str | None = None) -> jax.Array:
  """The L2 norm of a whole gradient tree, also when its leaves are sharded over ``axis_name``.

  Leaves that vary over ``axis_name`` (chunks of a sharded gradient inside
  ``shard_map``) contribute their squared norms through one ``psum``;
  replicated leaves are counted once. Outside ``shard_map``, or with
  ``axis_name=None``, it is ``optax.tree.norm``. Chunks must partition the
  vector (ZeRO's zero padding adds nothing to the norm).
  """
  local, shared = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
  for leaf in jax.tree.leaves(tree):
    squares = jnp.sum(jnp.square(leaf.astype(jnp.float32)))
    if axis_name is not None and axis_name in _varying_axes(leaf):
      local = local + squares
    else:
      shared = shared + squares
  if axis_name is not None and axis_name in _varying_axes(local):
    local = lax.psum(local, axis_name)
  return jnp.sqrt(local + shared)


def clip_by_global_norm(max_norm: float, axis_name: str | None = "data") -> optax.GradientTransformation:
  """``optax.clip_by_global_norm`` with the norm of the *global* gradient under ZeRO.

  ``optax.clip_by_global_norm`` computes the norm of what it is given; under
  ZeRO stages 1-3 that is one device's chunk, so each device would clip by a
  different, too small norm (the bug class of PyTorch FSDP #72548). This
  transform uses :func:`global_norm`, which all-reduces the squared norms of
  sharded chunks, and is identical to optax's at stage 0.
  """
  if not max_norm > 0:
    raise ValueError(f"max_norm must be > 0, got {max_norm!r}.")

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    norm = global_norm(updates, axis_name)
    trigger = norm < max_norm
    clipped = jax.tree.map(lambda t: lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm), updates)
    return clipped, state

  return optax.GradientTransformation(init_fn, update_fn)
