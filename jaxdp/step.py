"""The data-parallel train step: the pure per-replica step and its jitted, mapped form."""

from __future__ import annotations

import collections
import functools
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxdp import _checks
from jaxdp._checks import check_float_dtype, check_int, check_optimizer
from jaxdp.loss import check_loss_fn
from jaxdp.mesh import auto_mesh, check_mesh_axis, data_mesh, place, replicated, split_along
from jaxdp.reduction import (
    ReducedGradient,
    check_reduction,
    global_norm,
    local_gradient,
    reduce_gradient,
)
from jaxdp.replicas import replica_divergence
from jaxdp.sharding import check_zero_stage, flatten_tree, gather_chunks, my_chunk, state_shardings, state_specs
from jaxdp.state import TrainState

BACKENDS = ("shard_map", "pmap")
_MAX_UNREAD_FLAGS = 2  # non-finite flags of earlier steps read at the latest two calls later


def _check_modes(reduction: str, zero_stage: int) -> None:
  check_reduction(reduction)
  check_zero_stage(zero_stage)
  if zero_stage and reduction == "none":
    raise ValueError("reduction='none' keeps independent replicas, which a sharded (zero_stage > 0) state cannot hold; use zero_stage=0.")


def apply_update(
    optimizer: optax.GradientTransformation,
    state: TrainState,
    grads: Any,
    apply: jax.Array | bool = True,
    model_state: Any = None,
) -> TrainState:
  """Applies ``grads`` with ``optimizer`` (and installs ``model_state``), or returns ``state`` unchanged.

  ``train_step`` passes ``apply = (global weight > 0) & (no replica saw a
  non-finite gradient)``, a value every replica holds identically, so all
  replicas skip together: no NaN, no spurious optimizer step, no step count,
  and no model-state update from a batch that was not learned from.
  ``model_state=None`` keeps ``state.model_state``. Gradients are cast to
  the parameters' dtypes (they are reduced in float32 at least).
  """
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)

  def step(operand):
    state, new_model_state = operand
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    kept = state.model_state if new_model_state is None else new_model_state
    return TrainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1, kept)

  # cond rather than a select over the whole state: a select copies every buffer each step.
  return lax.cond(apply, step, lambda operand: operand[0], (state, model_state))


def train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    state: TrainState,
    batch: Any,
    weights: jax.Array | None = None,
    *,
    axis_name: str = "data",
    reduction: str = "mean",
    accum_steps: int = 1,
    rng: jax.Array | None = None,
    zero_stage: int = 0,
    has_more: jax.Array | None = None,
    compute_dtype: Any = None,
    grad_reduce_dtype: Any = None,
    bucket_bytes: int | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One synchronous data-parallel step, as seen by one replica.

  Call it inside your own ``jax.shard_map`` (state replicated, batch split
  over ``axis_name``) or ``jax.pmap`` over ``axis_name``. It is the
  composition ``local_gradient -> reduce_gradient -> apply_update``.

  Args:
    loss_fn: ``loss_fn(params, batch)`` returning per-example losses ``[b]``
      or per-token losses ``[b, t]``, or a :class:`jaxdp.LossOutput` with the
      new model state and metrics; it may declare the keyword arguments
      ``model_state``, ``weights``, ``axis_name`` and ``train`` (see
      :mod:`jaxdp.loss`).
    optimizer: an optax ``GradientTransformation``.
    state: this replica's :class:`TrainState`.
    batch: this replica's slice of the batch.
    weights: ``None`` (all ones) or an array of the losses' shape, ``>= 0``,
      zero for padding.
    axis_name: the data-parallel axis to reduce over.
    reduction: one of :data:`jaxdp.REDUCTIONS`; ``"mean"`` (the default) is
      the exact gradient of the global weighted mean.
    accum_steps: number of micro-batches this replica's batch is split into;
      their gradient sums are accumulated locally and reduced once.
    rng: optional PRNG key, the same on every replica. Each replica derives
      its own key with ``fold_in(fold_in(rng, state.step), axis_index)`` (and
      ``fold_in(·, i)`` for micro-batch ``i``) and ``loss_fn`` is called as
      ``loss_fn(params, batch, key)``. Only gradients and per-replica model
      state depend on the key, so the replicas stay identical.
    zero_stage: the ZeRO stage of ``state``'s layout (see
      :func:`jaxdp.init_state`); stages 1-3 need ``shard_map`` with the
      state's specs from :func:`jaxdp.state_specs`.
    has_more: optional per-replica count (e.g. 1 if this replica's input
      stream has data after this batch), summed over replicas in the step's
      own all-reduce into ``metrics["has_more"]``.
    compute_dtype: mixed precision (see :func:`jaxdp.local_gradient`):
      forward and backward in this dtype, e.g. ``jnp.bfloat16``, with the
      params, optimizer state and sums kept as they are (float32).
    grad_reduce_dtype: all-reduce (or reduce-scatter) the gradient in this
      dtype, e.g. ``jnp.bfloat16`` for half the bytes; default float32.
    bucket_bytes: reduce the gradient in buckets of about this many bytes
      (see :func:`jaxdp.reduce_gradient`); ``None``: one all-reduce.

  Returns:
    ``(new_state, metrics)`` with ``metrics`` holding ``loss`` (reduced as
    ``reduction`` says), each metric ``loss_fn`` returned (reduced like the
    loss), ``weight`` (global ``Σ w``; local under ``"none"``), ``grad_norm``
    (global norm of the applied gradient), ``nonfinite`` (1 when the reduced
    gradient or loss holds a NaN/Inf, which happens when any replica's does,
    or when the gradient norm overflows float32), ``skipped`` (1 when the
    update was skipped: zero global weight or ``nonfinite``; the state,
    ``step`` and model state included, is then returned unchanged on every
    replica) and ``has_more`` when given. The new model state is identical
    on every replica (see :func:`jaxdp.reduce_model_state`).
  """
  _check_modes(reduction, zero_stage)
  if rng is not None:
    rng = jax.random.fold_in(jax.random.fold_in(rng, state.step), lax.axis_index(axis_name))
  params = gather_chunks(state.params, axis_name) if zero_stage == 3 else state.params
  local = local_gradient(
      loss_fn, params, batch, weights,
      axis_name=axis_name, accum_steps=accum_steps, rng=rng, model_state=state.model_state,
      compute_dtype=compute_dtype,
  )
  if zero_stage >= 2:
    local = local._replace(grads=flatten_tree(local.grads, lax.axis_size(axis_name), zero_stage))
  totals = None if has_more is None else jnp.sum(has_more).astype(jnp.int32)
  reduced: ReducedGradient = reduce_gradient(
      local, axis_name=axis_name, reduction=reduction, scatter=zero_stage >= 2, totals=totals,
      bucket_bytes=bucket_bytes, reduce_dtype=grad_reduce_dtype,
  )
  # The reduction spreads a NaN/Inf of any replica to every replica's gradient norm and loss (a sum with
  # a NaN is NaN; the norm of sharded chunks is all-reduced), so this flag is the same everywhere: all skip.
  grad_norm = global_norm(reduced.grads, axis_name)
  nonfinite = jnp.logical_not(jnp.isfinite(grad_norm) & jnp.isfinite(reduced.loss))
  apply = (reduced.weight > 0) & jnp.logical_not(nonfinite)
  if zero_stage == 0:
    new_state = apply_update(optimizer, state, reduced.grads, apply, reduced.model_state)
  else:
    # Each device updates only its chunk of the parameters, with its chunk of the optimizer state.
    grads = reduced.grads if zero_stage >= 2 else my_chunk(reduced.grads, axis_name, zero_stage)
    chunks = state.params if zero_stage == 3 else my_chunk(state.params, axis_name, zero_stage)
    new_state = apply_update(optimizer, state._replace(params=chunks), grads, apply, reduced.model_state)
    if zero_stage < 3:
      new_state = new_state._replace(params=gather_chunks(new_state.params, axis_name))
  metrics = {
      "loss": reduced.loss,
      **reduced.metrics,
      "weight": reduced.weight,
      "grad_norm": grad_norm,
      "nonfinite": nonfinite.astype(jnp.int32),
      "skipped": jnp.logical_not(apply).astype(jnp.int32),
  }
  if has_more is not None:
    metrics["has_more"] = reduced.totals
  return new_state, metrics


class CompiledStep:
  """A jitted data-parallel step: ``step(state, batch, weights=None, rng=None) -> (state, metrics)``.

  Built by :func:`make_train_step`. Inputs are validated on the host (shapes
  and structure only, cached per signature) before anything runs or is
  donated, then placed on the mesh. ``lower(...)`` validates and places the
  same way and returns the ``jax.stages.Lowered`` of the jitted step, for HLO
  and ``memory_analysis()``.
  """

  def __init__(
      self, jitted, *, loss_fn, optimizer, mesh, axis_name, reduction, backend, accum_steps, zero_stage,
      max_consecutive_skips, donate=True,
  ):
    self.jitted, self.donate = jitted, donate
    self.loss_fn, self.optimizer = loss_fn, optimizer
    self.mesh, self.axis_name = mesh, axis_name
    self.reduction, self.backend = reduction, backend
    self.accum_steps, self.zero_stage = accum_steps, zero_stage
    self.max_consecutive_skips = max_consecutive_skips
    self.consecutive_skips = 0  # non-finite steps in a row, as of the last flag read
    self._validated: set = set()
    self._pending: collections.deque = collections.deque()  # non-finite flags of steps not read yet, oldest first
    self._returned: tuple = ()  # weak references to the leaves of the state the last call returned
    self._returned_signature = self._prepared_signature = None
    self._shardings: dict = {}

  def reset_nonfinite_guard(self) -> None:
    """Clears the count of consecutive non-finite steps, so that a tripped step runs again."""
    self.consecutive_skips = 0
    self._pending.clear()

  def _check_previous_steps(self) -> None:
    # Reads the flags of earlier steps once they are done, and waits only for one two steps old: the
    # device then still has the previous step to run while this one is prepared and dispatched.
    if self.max_consecutive_skips is None:
      return
    while self.consecutive_skips < self.max_consecutive_skips and self._pending and (
        self._pending[0].is_ready() or len(self._pending) >= _MAX_UNREAD_FLAGS
    ):
      bad = int(jax.device_get(self._pending.popleft())) > 0
      self.consecutive_skips = self.consecutive_skips + 1 if bad else 0
    # Once tripped it stays tripped (nothing runs, so no good step can clear it) until reset_nonfinite_guard().
    if self.consecutive_skips >= self.max_consecutive_skips:
      raise FloatingPointError(
          f"the last {self.consecutive_skips} steps all had a NaN or Inf gradient or loss on at least one replica; "
          "every replica skipped them, so the replicas are still consistent and the state passed in is the last good "
          "one. Lower the learning rate, check the data, or raise max_consecutive_skips; then call "
          "step.reset_nonfinite_guard() to run again."
      )

  def _is_returned_state(self, leaves: list) -> bool:
    """Whether ``leaves`` are exactly those of the state the last call returned (placed, unshared, checked)."""
    return len(leaves) == len(self._returned) and all(ref() is x for ref, x in zip(self._returned, leaves))

  def _prepare(self, state, batch, weights, rng, has_more=None):
    _checks.check_state(state)
    leaves = jax.tree.leaves(state)
    _checks.check_not_donated(state)  # also a state this step returned: another step may have consumed it
    ours = self._is_returned_state(leaves)
    if not ours and self.donate:
      state = _checks.unshared_buffers(state)
    if jax.process_count() > 1:
      # Every call, on every process: a process whose inputs differ must fail with the others, not
      # leave them blocked in the step's all-reduce (a per-process cache could desynchronise them).
      from jaxdp.distributed import assert_same_across_processes

      inputs = {"state": state, "batch": batch, "weights": weights, "rng": rng, "has_more": has_more}
      assert_same_across_processes(inputs, "step inputs")
    state_signature = self._returned_signature if ours else _checks.signature(state)
    self._prepared_signature = state_signature
    key = (state_signature, _checks.signature(batch, weights, rng, has_more))
    if key not in self._validated:
      n = self.mesh.shape[self.axis_name]
      _checks.check_step_inputs(
          self.loss_fn, self.optimizer, state, batch, weights, rng,
          n_replicas=n, accum_steps=self.accum_steps, zero_stage=self.zero_stage,
      )
      if has_more is not None and np.shape(has_more) != (n,):
        raise ValueError(
            f"has_more has shape {np.shape(has_more)}; pass one count per device of the data axis, shape ({n},) "
            "(jaxdp.StreamingPipeline yields it), or None."
        )
      self._validated.add(key)
    if not ours:  # the returned state is placed already: skip a device_put per leaf
      if state_signature not in self._shardings:
        self._shardings[state_signature] = state_shardings(state, self.mesh, self.axis_name)
      state = place(state, self._shardings[state_signature])
    rng = place(rng, replicated(self.mesh))
    batch, weights, has_more = jax.device_put((batch, weights, has_more), split_along(self.mesh, self.axis_name))
    return state, batch, weights, rng, has_more

  def __call__(
      self,
      state: TrainState,
      batch: Any,
      weights: jax.Array | None = None,
      rng: jax.Array | None = None,
      *,
      has_more: jax.Array | None = None,
  ):
    self._check_previous_steps()
    prepared = self._prepare(state, batch, weights, rng, has_more)
    state, metrics = self.jitted(*prepared)
    if self.max_consecutive_skips is not None:
      self._pending.append(metrics["nonfinite"])
    leaves = jax.tree.leaves(state)
    self._returned = tuple(weakref.ref(x) for x in leaves)
    self._returned_signature = self._prepared_signature  # the output has the input's structure and shapes
    return state, metrics

  def lower(
      self,
      state: TrainState,
      batch: Any,
      weights: jax.Array | None = None,
      rng: jax.Array | None = None,
      *,
      has_more: jax.Array | None = None,
  ) -> jax.stages.Lowered:
    return self.jitted.lower(*self._prepare(state, batch, weights, rng, has_more))


def make_train_step(
    loss_fn: Callable[..., jax.Array],
    optimizer: optax.GradientTransformation,
    mesh: Mesh | None = None,
    *,
    axis_name: str = "data",
    reduction: str = "mean",
    backend: str = "shard_map",
    donate: bool = True,
    check_replicas: bool = False,
    accum_steps: int = 1,
    zero_stage: int = 0,
    max_consecutive_skips: int | None = 10,
    compute_dtype: Any = None,
    grad_reduce_dtype: Any = None,
    bucket_bytes: int | None = None,
) -> CompiledStep:
  """Builds the jitted step that runs :func:`train_step` on every device of ``mesh[axis_name]``.

  Args:
    loss_fn: ``loss_fn(params, batch)`` returning per-example losses ``[b]``
      or per-token losses ``[b, t]``.
    optimizer: an optax ``GradientTransformation``.
    mesh: the device mesh; default ``jaxdp.data_mesh()`` over every device.
      It may have more axes than ``axis_name``; only ``axis_name`` is reduced
      over (the batch is replicated over the others).
    axis_name: the data-parallel axis.
    reduction: one of :data:`jaxdp.REDUCTIONS`.
    backend: ``"shard_map"`` (``jit`` of ``jax.shard_map``) or ``"pmap"``
      (``jit`` of ``jax.pmap`` with the state passed unmapped); both take and
      return the same global arrays and compute the same numbers. ``"pmap"``
      needs a mesh whose only axis is ``axis_name`` and ``zero_stage=0``.
    donate: donate the input state's buffers to the output state.
    check_replicas: add ``metrics["replica_divergence"]`` (see
      :func:`jaxdp.replica_divergence`), computed in the graph.
    accum_steps: gradient accumulation: each device's slice is split into
      this many contiguous micro-batches, scanned, and reduced once per step.
    zero_stage: 0 (replicated, DDP), 1 (sharded optimizer state), 2 (also
      reduce-scattered gradients) or 3 (also sharded parameters). The state
      must come from ``jaxdp.init_state(..., zero_stage=zero_stage)``.
    max_consecutive_skips: a step whose gradient or loss is NaN/Inf on any
      replica is skipped by every replica (``metrics["skipped"]``). After
      this many such steps in a row the next call raises
      ``FloatingPointError`` (before running anything), and so does every
      call until ``step.reset_nonfinite_guard()``. ``None`` never raises.
      The check reads earlier steps' flags once they are done and never
      waits for the previous step's, so dispatch stays asynchronous: the
      error comes one call after the limit is reached when the steps keep
      up, at the latest three calls after.
    compute_dtype: mixed precision: forward and backward in this floating
      dtype (e.g. ``jnp.bfloat16``); params, optimizer state and every sum
      stay as they are (float32 master weights).
    grad_reduce_dtype: communicate the gradient in this floating dtype
      (``jnp.bfloat16`` halves the bytes); default: the gradient's own
      (float32 at least). The loss, weights and the division stay float32.
    bucket_bytes: reduce the gradient in buckets of about this many bytes,
      in reverse layer order, one all-reduce each (DDP's ``bucket_cap_mb``);
      ``None`` (default) reduces it in one; ``0`` per leaf. Bitwise the same
      results.

  Returns:
    A :class:`CompiledStep` ``step(state, batch, weights=None, rng=None) ->
    (state, metrics)``; with ``rng`` (a PRNG key) ``loss_fn`` is called as
    ``loss_fn(params, batch, key)`` with a key per replica, step and
    micro-batch.
  """
  _check_modes(reduction, zero_stage)
  check_int(accum_steps, "accum_steps", 1, "split each device's batch into that many micro-batches.")
  if backend not in BACKENDS:
    raise ValueError(f"backend={backend!r} is not supported; use one of {', '.join(map(repr, BACKENDS))}.")
  check_loss_fn(loss_fn)
  check_optimizer(optimizer)
  mesh = data_mesh(axis_name=axis_name) if mesh is None else mesh
  check_mesh_axis(mesh, axis_name)
  mesh = auto_mesh(mesh)
  if backend == "pmap" and mesh.axis_names != (axis_name,):
    raise ValueError(
        f"backend='pmap' maps over one axis only, but mesh has axes {mesh.axis_names}; "
        "use backend='shard_map' for multi-axis meshes."
    )
  if backend == "pmap" and zero_stage:
    raise ValueError(
        "backend='pmap' passes the state unmapped (replicated), so it cannot hold a ZeRO-sharded state; "
        "use backend='shard_map' with zero_stage > 0."
    )
  if max_consecutive_skips is not None:
    check_int(max_consecutive_skips, "max_consecutive_skips", 1, "or None to never stop on skipped steps.")

  compute_dtype = check_float_dtype(compute_dtype, "compute_dtype")
  grad_reduce_dtype = check_float_dtype(grad_reduce_dtype, "grad_reduce_dtype")
  if bucket_bytes is not None:
    check_int(bucket_bytes, "bucket_bytes", 0, "or None to reduce the gradient in one all-reduce.")

  def replica_step(state, batch, weights, rng, has_more):
    new_state, metrics = train_step(
        loss_fn, optimizer, state, batch, weights,
        axis_name=axis_name, reduction=reduction, accum_steps=accum_steps, rng=rng, zero_stage=zero_stage,
        has_more=has_more, compute_dtype=compute_dtype, grad_reduce_dtype=grad_reduce_dtype,
        bucket_bytes=bucket_bytes,
    )
    if check_replicas:
      metrics["replica_divergence"] = replica_divergence(new_state, axis_name)
    return new_state, metrics

  if backend == "shard_map":
    # One device needs no type-checked collectives, and without the check they compile to nothing.
    mapped = _shard_map_over(replica_step, mesh, axis_name, check_vma=reduction != "none" and mesh.shape[axis_name] > 1)
  else:
    mapped = _pmap_over(replica_step, mesh, axis_name)
  jitted = jax.jit(mapped, donate_argnums=(0,) if donate else ())
  return CompiledStep(
      jitted,
      loss_fn=loss_fn,
      optimizer=optimizer,
      mesh=mesh,
      axis_name=axis_name,
      reduction=reduction,
      backend=backend,
      accum_steps=accum_steps,
      zero_stage=zero_stage,
      max_consecutive_skips=max_consecutive_skips,
      donate=donate,
  )


def _shard_map_over(replica_step, mesh: Mesh, axis_name: str, *, check_vma: bool):
  """``shard_map`` with the state's specs read off its structure (ZeRO chunks split, the rest replicated)."""

  @functools.wraps(replica_step)
  def step(state, batch, weights, rng, has_more):
    specs = state_specs(state, axis_name)
    mapped = jax.shard_map(
        replica_step,
        mesh=mesh,
        in_specs=(specs, P(axis_name), P(axis_name), P(), P(axis_name)),
        out_specs=(specs, P()),
        # "none" returns replicas that differ on purpose, which the check would reject.
        check_vma=check_vma,
    )
    return mapped(state, batch, weights, rng, has_more)

  return step


def _pmap_over(replica_step, mesh: Mesh, axis_name: str):
  """The same step through ``jax.pmap``: global batch reshaped to ``[n, b, ...]``."""
  n = mesh.shape[axis_name]
  devices = list(mesh.devices.flat)
  # pmap mis-flattens in_axes against a None argument, so each combination of absent arguments has its own map.
  maps = {}

  def mapped(rng_given: bool, has_more_given: bool):
    if (rng_given, has_more_given) not in maps:
      def replica(state, batch, weights, *rest):
        rest = list(rest)
        rng = rest.pop(0) if rng_given else None
        has_more = rest.pop(0) if has_more_given else None
        return replica_step(state, batch, weights, rng, has_more)

      in_axes = (None, 0, 0) + ((None,) if rng_given else ()) + ((0,) if has_more_given else ())
      maps[rng_given, has_more_given] = jax.pmap(
          replica, axis_name, in_axes=in_axes, out_axes=(None, None), devices=devices
      )
    return maps[rng_given, has_more_given]

  def split_leading(x):
    return x.reshape(n, x.shape[0] // n, *x.shape[1:])

  @functools.wraps(replica_step)
  def step(state, batch, weights, rng, has_more):
    batch, weights = jax.tree.map(split_leading, (batch, weights))
    extra = [x for x in (rng, has_more) if x is not None]
    return mapped(rng is not None, has_more is not None)(state, batch, weights, *extra)

  return step
