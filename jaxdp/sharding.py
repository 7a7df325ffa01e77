"""ZeRO: the training state sharded over the data-parallel devices.

Stage 0 replicates everything (DDP). Stage 1 shards the optimizer state,
stage 2 also reduce-scatters the gradients, stage 3 also keeps the parameters
sharded at rest (Rajbhandari et al., 2020). The mathematics of the step does
not change; only where each number lives.

Layout: every sharded leaf is flattened, zero-padded to a multiple of the
device count ``N`` and split into ``N`` equal contiguous chunks, wrapped in a
:class:`FlatShards` node that remembers the original shape. Flat chunks work
for any leaf shape (no divisible axis needed), cost at most ``N - 1`` padding
elements per leaf, and keep elementwise optimizers (SGD, momentum, Adam)
exact: padded entries have zero gradient and stay zero. Because optax builds
its state by mapping over the params tree, ``optimizer.init`` on a tree of
:class:`FlatShards` returns moments that are :class:`FlatShards` too, so the
layout of every leaf is visible in the state's own structure.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdp.state import TrainState

ZERO_STAGES = (0, 1, 2, 3)


@jax.tree_util.register_pytree_node_class
class FlatShards:
  """A leaf stored flat, zero-padded and split over the data axis.

  Attributes:
    flat: the padded flat data: ``[N * chunk]`` as a global array (sharded
      ``P(axis_name)``), ``[chunk]`` inside ``shard_map``.
    shape: the leaf's original shape (static).
    stage: the ZeRO stage the layout was built for (static), so that a state
      cannot silently run under a step built for another stage.
  """

  def __init__(self, flat: Any, shape: tuple[int, ...], stage: int):
    self.flat, self.shape, self.stage = flat, tuple(shape), stage

  def tree_flatten(self):
    return (self.flat,), (self.shape, self.stage)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def __repr__(self) -> str:
    return f"FlatShards(shape={self.shape}, stage={self.stage}, flat={self.flat!r})"


def is_flat_shards(x: Any) -> bool:
  return isinstance(x, FlatShards)


def check_zero_stage(zero_stage: Any) -> None:
  if type(zero_stage) is not int or zero_stage not in ZERO_STAGES:
    raise ValueError(f"zero_stage={zero_stage!r} is not supported; use one of {ZERO_STAGES}.")


def padded_size(shape: tuple[int, ...], n: int) -> int:
  """The flat length of a leaf of ``shape`` padded to a multiple of ``n`` (at least ``n``)."""
  return max(1, -(-math.prod(shape) // n)) * n


def flatten_leaf(x: jax.Array, n: int, stage: int) -> FlatShards:
  """``x`` raveled and zero-padded to :func:`padded_size`."""
  flat = jnp.ravel(x)
  return FlatShards(jnp.pad(flat, (0, padded_size(x.shape, n) - flat.size)), x.shape, stage)


def unflatten_leaf(shards: FlatShards) -> jax.Array:
  """The original leaf from its full padded flat data."""
  return shards.flat[: math.prod(shards.shape)].reshape(shards.shape)


def flatten_tree(tree: Any, n: int, stage: int) -> Any:
  return jax.tree.map(lambda x: flatten_leaf(x, n, stage), tree)


def zero_stage_of(state: TrainState) -> int:
  """The ZeRO stage visible in a state's layout (0 when nothing is sharded).

  A stateless optimizer (plain SGD) leaves nothing to shard at stages 1-2, so
  such a state reads as stage 0: its layout *is* stage 0's.
  """
  stages = {x.stage for x in jax.tree.leaves((state.params, state.opt_state), is_leaf=is_flat_shards) if is_flat_shards(x)}
  if len(stages) > 1:
    raise ValueError(f"state mixes layouts of ZeRO stages {sorted(stages)}; rebuild it with jaxdp.init_state.")
  return stages.pop() if stages else 0


def state_specs(state: Any, axis_name: str) -> Any:
  """The ``PartitionSpec`` tree of a state: ``P(axis_name)`` inside :class:`FlatShards`, ``P()`` elsewhere."""

  def spec(x):
    return FlatShards(P(axis_name), x.shape, x.stage) if is_flat_shards(x) else P()

  return jax.tree.map(spec, state, is_leaf=is_flat_shards)


def state_shardings(state: Any, mesh: Mesh, axis_name: str) -> Any:
  """The ``NamedSharding`` tree that places ``state`` on ``mesh``."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs(state, axis_name))


def abstract_zero_state(
    params: Any, optimizer: optax.GradientTransformation, n: int, zero_stage: int, model_state: Any = None
) -> TrainState:
  """The state's layout as ``ShapeDtypeStruct``s, without computing anything."""
  return jax.eval_shape(lambda p, m: _build_state(p, optimizer, n, zero_stage, m), params, model_state)


def _build_state(
    params: Any, optimizer: optax.GradientTransformation, n: int, zero_stage: int, model_state: Any = None
) -> TrainState:
  if zero_stage == 0:
    return TrainState.create(params, optimizer, model_state)
  flat = flatten_tree(params, n, zero_stage)
  return TrainState(
      params=flat if zero_stage == 3 else params,
      opt_state=optimizer.init(flat),
      step=jnp.zeros((), jnp.int32),
      model_state=model_state,  # small and read by every replica's forward pass: never sharded
  )


def init_zero_state(
    params: Any,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    axis_name: str,
    zero_stage: int,
    model_state: Any = None,
) -> TrainState:
  """Builds the state of ``zero_stage`` directly in its sharded layout.

  Computed under ``jit`` with sharded outputs, so the full optimizer state is
  never materialised on one device. The outputs are fresh buffers, never the
  caller's.
  """
  n = mesh.shape[axis_name]
  if zero_stage and n > 1:
    check_chunkable(optimizer, params, mesh, axis_name)
  abstract = abstract_zero_state(params, optimizer, n, zero_stage, model_state)
  shardings = state_shardings(abstract, mesh, axis_name)
  # Copying inside the jit keeps outputs from aliasing the caller's arrays, which a donating step would consume.
  copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731
  build = jax.jit(lambda p, m: _build_state(copy(p), optimizer, n, zero_stage, copy(m)), out_shardings=shardings)
  return build(params, model_state)


def _probe_updates(optimizer, params, grads):
  """Parameters after two updates with ``grads[0]`` then ``grads[1]``."""
  opt_state = optimizer.init(params)
  for g in grads:
    updates, opt_state = optimizer.update(g, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params


def _shape_only(tree: Any) -> Any:
  """The tree with every leaf (a FlatShards node counting as one) replaced by its full element count."""
  return jax.tree.map(lambda x: math.prod(x.shape), tree, is_leaf=is_flat_shards)


def _check_relayout(optimizer: optax.GradientTransformation, params: Any, n: int) -> None:
  """Refuses an optimizer whose state or update depends on the leaves' shapes (factored or matrix optimizers).

  Abstract (``jax.eval_shape``) with the real shapes: the state built for the
  flat chunks must be the flat re-layout of the state for the whole leaves,
  leaf for leaf, and an update on the chunks must trace.
  """
  refuse = (
      "optimizer keeps a state or computes an update that depends on the parameters' shapes ({why}), e.g. "
      "optax.adafactor's factored moments or optax.contrib.muon's Newton-Schulz iteration on whole matrices; ZeRO "
      "stages 1-3 hand it flat chunks, which would silently change or break it. Use zero_stage=0 with this optimizer."
  )
  try:
    whole = jax.eval_shape(optimizer.init, params)
    chunked = jax.eval_shape(lambda p: optimizer.init(flatten_tree(p, n, 1)), params)

    def update_chunks(p):
      flat = flatten_tree(p, n, 1)
      chunks = jax.tree.map(lambda x: FlatShards(x.flat[: x.flat.size // n], x.shape, 1), flat, is_leaf=is_flat_shards)
      return optimizer.update(chunks, optimizer.init(chunks), chunks)

    jax.eval_shape(update_chunks, params)
  except Exception as e:  # the optimizer's own failure on chunks: refuse it with the reason
    raise ValueError(refuse.format(why=f"on flat chunks it fails with {type(e).__name__}: {e}")) from e
  if jax.tree.structure(_shape_only(whole)) != jax.tree.structure(_shape_only(chunked)):
    raise ValueError(refuse.format(why="its state has another structure for flat chunks"))
  if jax.tree.leaves(_shape_only(whole)) != jax.tree.leaves(_shape_only(chunked)):
    raise ValueError(refuse.format(why="its state has other sizes for flat chunks"))


def check_chunkable(optimizer: optax.GradientTransformation, params: Any, mesh: Mesh, axis_name: str) -> None:
  """Refuses an optimizer whose update of a leaf is not the concatenation of the updates of its chunks.

  ZeRO stages 1-3 run the optimizer on each device's flat chunk of every leaf.
  That is exact for elementwise transforms (SGD, momentum, Adam, weight decay)
  and for :func:`jaxdp.clip_by_global_norm`, whose norm is all-reduced; it is
  silently wrong for anything computed over a whole leaf or tree from what it
  is given (``optax.lamb``'s trust ratio, ``optax.clip_by_global_norm``).
  This probe runs two updates on small random stand-ins of the params (same
  structure and dtypes, every leaf a vector that pads and splits over the
  devices) both whole, on one device, and chunked inside ``shard_map`` as the
  step does, and raises if they differ beyond float32 round-off.

  Raises:
    ValueError: naming the optimizer's problem and the alternatives.
  """
  n = mesh.shape[axis_name]
  _check_relayout(optimizer, params, n)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(0), 3 * max(len(leaves), 1)).reshape(3, -1)

  def stand_in(row):
    return treedef.unflatten(
        [jax.random.normal(k, (2 * n + 1,), jnp.result_type(x)) for k, x in zip(keys[row], leaves)]
    )

  probe_params, grads = stand_in(0), (stand_in(1), stand_in(2))
  whole = jax.jit(_probe_updates, static_argnums=0)(optimizer, probe_params, grads)

  def chunked(params, grads):
    out = _probe_updates(optimizer, my_chunk(params, axis_name, 1), [my_chunk(g, axis_name, 1) for g in grads])
    return gather_chunks(out, axis_name)

  run = jax.jit(jax.shard_map(chunked, mesh=mesh, in_specs=(P(), P()), out_specs=P()))
  split = run(*jax.device_put((probe_params, list(grads)), NamedSharding(mesh, P())))
  # Compare the parameter *changes*: a learning rate makes them small next to the parameters.
  start = [np.asarray(x, np.float64) for x in jax.tree.leaves(probe_params)]
  moved = [np.asarray(x, np.float64) - x0 for x, x0 in zip(jax.tree.leaves(whole), start)]
  moved_split = [np.asarray(x, np.float64) - x0 for x, x0 in zip(jax.tree.leaves(split), start)]
  scale = max([np.max(np.abs(d)) for d in moved] + [1e-30])
  for a, b in zip(moved, moved_split):
    if not np.allclose(b, a, rtol=1e-3, atol=1e-5 * scale):
      raise ValueError(
          f"optimizer updates each device's chunk of a leaf differently from the whole leaf (relative difference "
          f"{np.max(np.abs(a - b)) / scale:.3g} on a probe): it computes something over a whole leaf or tree, such as "
          "optax.lamb's trust ratio or optax.clip_by_global_norm's norm, which ZeRO stages 1-3 would silently "
          "change. Use zero_stage=0 with this optimizer, or jaxdp.clip_by_global_norm for clipping."
      )


def _to_host(x: Any) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def gather_state(state: TrainState) -> TrainState:
  """The full, unsharded state as numpy arrays, with stage 0's structure whatever the stage.

  Every :class:`FlatShards` becomes an array of its original shape. In a
  multi-process run every process receives the full arrays (call it on every
  process). Use it to export, checkpoint across layouts, or compare stages.
  """

  def full(x):
    if is_flat_shards(x):
      return unflatten_leaf(FlatShards(_to_host(x.flat), x.shape, x.stage))
    return _to_host(x)

  return jax.tree.map(full, state, is_leaf=is_flat_shards)


# Inside shard_map over the data axis ---------------------------------------------------------


def my_chunk(tree: Any, axis_name: str, stage: int) -> Any:
  """This device's :class:`FlatShards` chunk of every leaf of a replicated ``tree``."""
  n, index = lax.axis_size(axis_name), lax.axis_index(axis_name)

  def chunk(x):
    padded = flatten_leaf(x, n, stage)
    size = padded.flat.size // n
    return FlatShards(lax.dynamic_slice_in_dim(padded.flat, index * size, size), x.shape, stage)

  return jax.tree.map(chunk, tree)


def _all_gather_replicated(x: jax.Array, axis_name: str) -> jax.Array:
  # The gathered value is the same on every device: say so, so that shard_map may return it as P().
  try:
    return lax.all_gather(x, axis_name, tiled=True, to="invarying")  # JAX 0.10 spelling
  except ValueError:
    return lax.all_gather(x, axis_name, tiled=True, to="invariant")


def gather_chunks(tree: Any, axis_name: str) -> Any:
  """The full leaves from every device's :class:`FlatShards` chunk (one all-gather each)."""

  def gather(x):
    if not is_flat_shards(x):
      return x
    return unflatten_leaf(FlatShards(_all_gather_replicated(x.flat, axis_name), x.shape, x.stage))

  return jax.tree.map(gather, tree, is_leaf=is_flat_shards)
