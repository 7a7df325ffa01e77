"""Getting data onto the devices: uneven per-device portions padded with zero weight.

Two entry points: :func:`shard_uneven` places portions the caller already
has; :class:`DataPipeline` decides which examples each device gets (an
epoch-shuffled, resumable plan) and loads only this process's portions.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxdp._checks import batch_size, check_int
from jaxdp.mesh import check_mesh_axis, split_along


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
  pad = [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
  return np.pad(x, pad)


def _pad_portion(batch: Any, weights: np.ndarray, rows: int) -> tuple[Any, np.ndarray]:
  """One device's ``(batch, weights)`` padded with zero rows (weight 0) to ``rows`` rows."""
  return jax.tree.map(lambda x: _pad_rows(x, rows), batch), _pad_rows(weights, rows)


def _place_blocks(blocks: Mapping[int, np.ndarray], n: int, sharding) -> jax.Array:
  """The global array ``[n * rows, ...]`` whose block ``i`` (along the leading axis) is ``blocks[i]``.

  Only the blocks of this process's devices need to be present.
  """
  # make_array_from_callback rather than make_array_from_process_local_data: the
  # callback is handed the global index of each *addressable* shard and returns
  # exactly that device's block, so a process needs (and touches) only its own
  # portions, whatever the order of the processes' devices along the axis and
  # whatever other mesh axes the batch is replicated over. The process-local
  # variant would need this process's rows concatenated in the device order it
  # infers from the sharding, a layout we would have to reproduce by hand.
  first = next(iter(blocks.values()))
  rows = first.shape[0]

  def block(index: tuple[slice, ...]) -> np.ndarray:
    return blocks[(index[0].start or 0) // rows][(slice(None), *index[1:])]

  return jax.make_array_from_callback((n * rows, *first.shape[1:]), sharding, block)


def _place_portions(portions: Mapping[int, Any], n: int, sharding) -> Any:
  """Places equally shaped per-device pytrees ``{mesh position: tree}`` as global arrays."""
  positions = list(portions)
  return jax.tree.map(
      lambda *blocks: _place_blocks(dict(zip(positions, blocks)), n, sharding), *(portions[p] for p in positions)
  )


def shard_uneven(
    batches: Sequence[Any],
    mesh: Mesh,
    *,
    weights: Sequence[Any] | None = None,
    axis_name: str = "data",
) -> tuple[Any, jax.Array]:
  """Pads uneven per-device portions with zero-weight rows and places them on the mesh.

  Args:
    batches: one pytree per device of ``mesh[axis_name]``, in mesh order. All
      have the same structure, trailing shapes and dtypes; the leading sizes
      may differ and may be 0.
    mesh: the mesh to place on.
    weights: ``None`` (one weight per real row) or one array per device with
      leading size equal to that device's row count, e.g. ``[n_i]`` example
      weights or ``[n_i, t]`` token masks. Values must be finite and ``>= 0``
      (checked here, on the host, so the step needs no value checks).
    axis_name: the data-parallel axis.

  Returns:
    ``(batch, weights)``: global arrays with leading size ``n_devices *
    max_len`` split over ``axis_name`` (``max_len`` is the largest portion,
    at least 1). Padding rows are zeros with weight 0, so the ``"mean"``
    reduction gives exactly the gradient of the real rows. ``weights`` is
    float32 ``[n_devices * max_len]`` or ``[n_devices * max_len, t]``.
  """
  check_mesh_axis(mesh, axis_name)
  n = mesh.shape[axis_name]
  batches = list(batches)
  if len(batches) != n:
    raise ValueError(f"batches has {len(batches)} entries but mesh axis {axis_name!r} has {n} devices; pass one pytree per device.")
  structures = {jax.tree.structure(b) for b in batches}
  if len(structures) > 1:
    raise ValueError("batches entries have different pytree structures; give every device the same structure.")
  host = [jax.tree.map(np.asarray, b) for b in batches]
  sizes = [batch_size(b, name=f"batches[{i}]") for i, b in enumerate(host)]
  for i, b in enumerate(host[1:], start=1):
    for a, c in zip(jax.tree.leaves(host[0]), jax.tree.leaves(b)):
      if a.shape[1:] != c.shape[1:] or a.dtype != c.dtype:
        raise ValueError(
            f"batches[{i}] has a leaf of trailing shape {c.shape[1:]} and dtype {c.dtype}, but batches[0] has "
            f"{a.shape[1:]} and {a.dtype}; only the leading sizes may differ."
        )
  if weights is None:
    host_weights = [np.ones((s,), np.float32) for s in sizes]
  else:
    host_weights = _check_weights(weights, sizes)
  rows = max(max(sizes), 1)
  portions = {i: _pad_portion(b, w, rows) for i, (b, w) in enumerate(zip(host, host_weights))}
  return _place_portions(portions, n, split_along(mesh, axis_name))


def _check_weights(weights: Sequence[Any], sizes: list[int]) -> list[np.ndarray]:
  weights = [np.asarray(w, np.float32) for w in weights]
  if len(weights) != len(sizes):
    raise ValueError(f"weights has {len(weights)} entries but batches has {len(sizes)}; pass one weight array per device.")
  trailing = {w.shape[1:] for w in weights}
  if len(trailing) > 1:
    raise ValueError(f"weights entries have different trailing shapes {sorted(trailing)}; use one shape, e.g. [n_i] or [n_i, t].")
  for i, (w, s) in enumerate(zip(weights, sizes)):
    if w.ndim not in (1, 2) or w.shape[0] != s:
      raise ValueError(f"weights[{i}] has shape {w.shape} but batches[{i}] has {s} rows; use [{s}] or [{s}, t].")
    if not np.all(np.isfinite(w)):
      raise ValueError(f"weights[{i}] has non-finite values; weights must be finite and >= 0 (0 for padding).")
    if np.any(w < 0):
      raise ValueError(f"weights[{i}] has negative values (min {w.min()}); weights must be >= 0 (0 for padding).")
  return weights


# The input pipeline. The plan is pure and the same in every process:
#
# * epoch e visits the examples in the order epoch_permutation(N, seed, e);
# * step s is batch i = s % S of epoch s // S (S = ceil(N / G), G = n_devices * b),
#   i.e. positions [i*G, min((i+1)*G, N)) of that order;
# * a batch's positions are cut into n_devices contiguous portions, in mesh order
#   along the data axis. A full batch gives every device b examples; the last,
#   with r = N - (S-1)*G examples, is spread as evenly as possible: every device
#   gets r // n_devices and the first r % n_devices one more (at most b).
#
# So every example is used exactly once per epoch (no duplicates, no dropped tail),
# and the global batch of a step, concatenated in device order, depends only on
# (N, seed, G): not on how G is split over devices or processes.

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
  """splitmix64's finaliser on a uint64 array: a bijection with full avalanche."""
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def epoch_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
  """The order in which epoch ``epoch`` visits the examples.

  A function of ``(num_examples, seed, epoch)`` only, computed with integer
  arithmetic (a keyed splitmix64 hash of each index, then a sort), so it is the
  same in every process and does not change with the numpy version: a run
  resumed from a checkpoint replays exactly the same order.

  Args:
    num_examples: the size of the dataset, ``>= 1``.
    seed: the shuffling seed, ``0 <= seed < 2**64``.
    epoch: the epoch, ``0 <= epoch < 2**64``.

  Returns:
    int64 ``[num_examples]``, a permutation of ``range(num_examples)``.
  """
  num_examples = check_int(num_examples, "num_examples", 1, "the dataset must not be empty.")
  seed = check_int(seed, "seed", 0, "use a non-negative integer seed.")
  epoch = check_int(epoch, "epoch", 0, "epochs count from 0.")
  if seed >= 2**64 or epoch >= 2**64:
    raise ValueError(f"seed and epoch must be < 2**64, got seed={seed}, epoch={epoch}.")
  key = _mix(_mix(np.array([seed], np.uint64)) ^ (_mix(np.array([epoch], np.uint64)) + _GOLDEN))
  # _mix is a bijection, so the keys are distinct and the order has no ties.
  return np.argsort(_mix(np.arange(num_examples, dtype=np.uint64) ^ key)).astype(np.int64)


def _portion_sizes(count: int, n_devices: int) -> np.ndarray:
  """``count`` examples spread over ``n_devices`` as evenly as possible, extras first."""
  return count // n_devices + (np.arange(n_devices) < count % n_devices)


def _split_batch(order: np.ndarray, n_devices: int, per_device_batch: int, index: int) -> list[np.ndarray]:
  """The example indices of each device in batch ``index`` of an epoch visiting ``order``."""
  global_batch = n_devices * per_device_batch
  batch = order[index * global_batch : (index + 1) * global_batch]
  return np.split(batch, np.cumsum(_portion_sizes(len(batch), n_devices))[:-1])


def _steps_per_epoch(num_examples: int, n_devices: int, per_device_batch: int) -> int:
  return -(-num_examples // (n_devices * per_device_batch))


def device_indices(num_examples: int, n_devices: int, per_device_batch: int, seed: int, step: int) -> list[np.ndarray]:
  """The dataset indices each device loads at ``step``: the pipeline's plan, without a mesh.

  Args:
    num_examples: the size of the dataset.
    n_devices: the number of devices along the data axis.
    per_device_batch: rows per device ``b``; no device gets more.
    seed: the shuffling seed.
    step: the global step, counted from 0 across epochs.

  Returns:
    ``n_devices`` int64 arrays, in mesh order, each of length ``<= b``. Over
    the ``ceil(num_examples / (n_devices * b))`` steps of an epoch they hold
    every index exactly once.
  """
  num_examples = check_int(num_examples, "num_examples", 1, "the dataset must not be empty.")
  n_devices = check_int(n_devices, "n_devices", 1, "pass the size of the mesh's data axis.")
  per_device_batch = check_int(per_device_batch, "per_device_batch", 1, "give every device at least one row.")
  step = check_int(step, "step", 0, "steps count from 0.")
  epoch, index = divmod(step, _steps_per_epoch(num_examples, n_devices, per_device_batch))
  return _split_batch(epoch_permutation(num_examples, seed, epoch), n_devices, per_device_batch, index)


def process_positions(n_devices: int, n_processes: int, process_index: int) -> range:
  """The mesh positions a process owns when each holds a contiguous, equal group of devices.

  The usual layout (``jax.devices()`` lists devices by process); use it to
  simulate a multi-process split without processes. A real run asks the mesh:
  :func:`addressable_positions`.
  """
  n_processes = check_int(n_processes, "n_processes", 1, "pass the number of processes.")
  if n_devices % n_processes:
    raise ValueError(f"n_processes={n_processes} does not divide n_devices={n_devices}; give every process as many devices.")
  process_index = check_int(process_index, "process_index", 0, "processes count from 0.")
  if process_index >= n_processes:
    raise ValueError(f"process_index={process_index} must be < n_processes={n_processes}.")
  per_process = n_devices // n_processes
  return range(process_index * per_process, (process_index + 1) * per_process)


def addressable_positions(mesh: Mesh, axis_name: str = "data") -> tuple[int, ...]:
  """The positions along ``mesh[axis_name]`` that have a device of this process.

  These are the portions this process must load. On a mesh with more axes, a
  position counts if any device in its slice (over the other axes) is local.
  """
  check_mesh_axis(mesh, axis_name)
  devices = np.moveaxis(mesh.devices, mesh.axis_names.index(axis_name), 0).reshape(mesh.shape[axis_name], -1)
  me = jax.process_index()
  return tuple(i for i, row in enumerate(devices) if any(d.process_index == me for d in row))


def _collated(collate: Callable, examples: list, template: tuple[Any, np.ndarray] | None) -> tuple[Any, np.ndarray]:
  """``collate(examples)`` as numpy, checked against the zero-row ``template`` (if any)."""
  out = collate(examples)
  if not isinstance(out, tuple) or len(out) != 2:
    raise ValueError(f"collate must return a tuple (batch, weights), got {type(out).__name__}.")
  batch, weights = jax.tree.map(np.asarray, out[0]), np.asarray(out[1], np.float32)
  k = len(examples)
  for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
    if leaf.ndim == 0 or leaf.shape[0] != k:
      raise ValueError(
          f"collate's batch{jax.tree_util.keystr(path)} has shape {leaf.shape} for {k} examples; "
          f"every leaf needs a leading axis of size {k}."
      )
  if weights.ndim not in (1, 2) or weights.shape[0] != k:
    raise ValueError(f"collate's weights have shape {weights.shape} for {k} examples; return [{k}] or [{k}, t].")
  if not np.all(np.isfinite(weights)) or np.any(weights < 0):
    raise ValueError("collate's weights must be finite and >= 0 (0 masks a row or token).")
  if template is not None and _row_signature((batch, weights)) != _row_signature(template):
    raise ValueError(
        "collate returned a batch whose structure, trailing shapes or dtypes differ from those of example 0 "
        f"({_row_signature((batch, weights))} vs {_row_signature(template)}); "
        "pad variable-length fields to a fixed length so every portion stacks into one global array."
    )
  return batch, weights


def _row_signature(portion: Any) -> tuple:
  leaves, treedef = jax.tree.flatten(portion)
  return treedef, tuple((x.shape[1:], str(x.dtype)) for x in leaves)


class DataPipeline:
  """An epoch-shuffled, resumable input pipeline that splits every global batch over the devices.

  Every example of ``dataset`` is used exactly once per epoch: no duplicates
  (unlike PyTorch's ``DistributedSampler``) and no dropped tail. Each device
  gets up to ``per_device_batch`` examples per step; the last batch of an epoch
  is spread as evenly as possible over the devices (the first ``r % n_devices``
  get one more) and padded with zero rows of weight 0, so ``reduction="mean"``
  gives exactly the gradient of the real examples. The order is a function of
  ``(seed, epoch)`` only (:func:`epoch_permutation`) and ``batch_at(step)`` is
  what iteration yields at ``step``, so a run resumes from a step counter.

  In a multi-process run each process loads only the examples of its own
  devices (:func:`addressable_positions`), plus example 0 once, at
  construction, to learn the shapes of an empty portion. ``collate`` must give
  every portion the same trailing shapes and dtypes (pad variable-length
  fields to a fixed length). Loading is synchronous; it overlaps the device
  work of the previous step because JAX dispatches steps asynchronously.

  Example::

    pipe = DataPipeline(dataset, collate, mesh, per_device_batch=32, seed=0)
    for step, (batch, weights) in pipe.iterate(start_step=int(state.step)):
      state, metrics = train_step(state, batch, weights)

  Attributes:
    steps_per_epoch: ``ceil(len(dataset) / (n_devices * per_device_batch))``.
    n_devices: devices along ``axis_name``.
    global_batch: ``n_devices * per_device_batch``, the leading size of every batch.
    local_positions: the mesh positions whose portions this process loads.
  """

  def __init__(
      self,
      dataset: Sequence[Any],
      collate: Callable[[list], tuple[Any, Any]],
      mesh: Mesh,
      *,
      per_device_batch: int,
      seed: int = 0,
      axis_name: str = "data",
  ):
    """Builds the pipeline and checks ``collate`` on example 0.

    Args:
      dataset: any indexable with ``len`` (a list, a memory-mapped array, a
        grain data source): ``dataset[i]`` is one example or document.
      collate: ``collate(examples) -> (batch, weights)``: numpy pytree whose
        leaves have leading size ``len(examples)``, and weights ``[k]`` or
        ``[k, t]`` (e.g. token masks), finite and ``>= 0``. Never called with
        an empty list.
      mesh: the mesh to place batches on.
      per_device_batch: rows per device ``b``, ``>= 1``.
      seed: the shuffling seed, ``>= 0``.
      axis_name: the data-parallel axis; batches are split along it and
        replicated over any other axis.
    """
    check_mesh_axis(mesh, axis_name)
    if not callable(collate):
      raise ValueError(f"collate must be callable, got {type(collate).__name__}; pass collate(examples) -> (batch, weights).")
    self.dataset, self.collate, self.mesh, self.axis_name = dataset, collate, mesh, axis_name
    self.num_examples = check_int(len(dataset), "len(dataset)", 1, "pass a non-empty dataset.")
    self.per_device_batch = check_int(per_device_batch, "per_device_batch", 1, "give every device at least one row.")
    self.seed = check_int(seed, "seed", 0, "use a non-negative integer seed.")
    self.n_devices = mesh.shape[axis_name]
    self.global_batch = self.n_devices * self.per_device_batch
    self.steps_per_epoch = _steps_per_epoch(self.num_examples, self.n_devices, self.per_device_batch)
    self.local_positions = addressable_positions(mesh, axis_name)
    if not self.local_positions:
      raise ValueError("mesh has no device of this process; build the pipeline on a mesh that includes local devices.")
    self._sharding = split_along(mesh, axis_name)
    probe = _collated(collate, [dataset[0]], None)
    self._empty = jax.tree.map(lambda x: x[:0], probe)  # the portion of a device with no examples
    self._cached_order: tuple[int, np.ndarray] | None = None

  def _order(self, epoch: int) -> np.ndarray:
    if self._cached_order is None or self._cached_order[0] != epoch:
      self._cached_order = (epoch, epoch_permutation(self.num_examples, self.seed, epoch))
    return self._cached_order[1]

  def device_indices(self, step: int) -> list[np.ndarray]:
    """Each device's dataset indices at ``step`` (see :func:`device_indices`)."""
    step = check_int(step, "step", 0, "steps count from 0.")
    epoch, index = divmod(step, self.steps_per_epoch)
    return _split_batch(self._order(epoch), self.n_devices, self.per_device_batch, index)

  def _portion(self, indices: np.ndarray) -> tuple[Any, np.ndarray]:
    if len(indices) == 0:
      portion = self._empty
    else:
      portion = _collated(self.collate, [self.dataset[int(i)] for i in indices], self._empty)
    return _pad_portion(*portion, self.per_device_batch)

  def load(self, step: int, positions: Sequence[int] | None = None) -> dict[int, tuple[Any, np.ndarray]]:
    """The padded host portions ``{position: (batch, weights)}`` of ``step``.

    Reads ``dataset`` only at the indices of ``positions`` (default: this
    process's :attr:`local_positions`); pass :func:`process_positions` to see
    what another process of a simulated multi-process run would load.
    """
    positions = self.local_positions if positions is None else tuple(positions)
    bad = [p for p in positions if not 0 <= p < self.n_devices]
    if bad:
      raise ValueError(f"positions {bad} are outside the mesh axis of {self.n_devices} devices.")
    indices = self.device_indices(step)
    return {p: self._portion(indices[p]) for p in positions}

  def batch_at(self, step: int) -> tuple[Any, jax.Array]:
    """The global ``(batch, weights)`` of ``step``, as :meth:`iterate` yields it.

    Returns:
      Global arrays with leading size :attr:`global_batch`, sharded
      ``NamedSharding(mesh, P(axis_name))`` as :func:`shard_uneven` returns
      them; ``weights`` is float32 ``[global_batch]`` or ``[global_batch, t]``
      with 0 on padding rows.
    """
    return _place_portions(self.load(step), self.n_devices, self._sharding)

  def iterate(self, start_step: int = 0, num_steps: int | None = None) -> Iterator[tuple[int, tuple[Any, jax.Array]]]:
    """Yields ``(step, (batch, weights))`` from ``start_step``, across epochs.

    Args:
      start_step: the first step, e.g. the step counter of a checkpoint.
      num_steps: how many steps to yield; ``None`` for ever.
    """
    start = check_int(start_step, "start_step", 0, "steps count from 0.")
    if num_steps is None:
      steps = itertools.count(start)
    else:
      steps = range(start, start + check_int(num_steps, "num_steps", 0, "or None to iterate for ever."))
    return ((step, self.batch_at(step)) for step in steps)
