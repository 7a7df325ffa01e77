"""Getting data onto the devices: uneven per-device portions padded with zero weight.

Three entry points: `shard_uneven` places portions the caller already
has; `DataPipeline` decides which examples each device gets (an
epoch-shuffled, resumable plan) and loads only this process's portions;
`StreamingPipeline` batches per-process streams of unknown, unequal
lengths and ends the loop on every process at the same step.

Every batch they make (and `split_batch`'s) comes with its weights and
is correct only with them: a step or evaluation step given such a batch
with `weights=None` refuses it (recognised by the identity of its arrays,
an O(leaves) check made only when no weights are given), where `None`
would give its padding rows weight 1. A batch of your own without weights
still means weight 1 for every row.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxdp.core.checks import batch_size, check_batch_values, check_int, mark_padded
from jaxdp.runtime.distributed import assert_same_across_processes
from jaxdp.sharding.layout import check_mesh_axis, data_rows, data_size, global_array, split_along


PADS = ("copy", "zeros")
"""What padding rows hold: `"copy"` (default), copies of a real row; `"zeros"`, zeros. Weight 0 either way."""


def check_pad(pad: Any) -> str:
  """`pad` if it is one of `PADS`, else a `ValueError` naming the argument and the choices."""
  if not isinstance(pad, str) or pad not in PADS:
    raise ValueError(
        f"pad must be one of {PADS}, got {pad!r}: 'copy' (default) fills padding rows with copies of a real row, "
        "'zeros' with zeros; their weight is 0 either way."
    )
  return pad


def _real_row(batch: Any, weights: np.ndarray) -> Any | None:
  """One row of a portion as a one-row pytree (the first with a positive weight, else row 0); `None` if empty."""
  k = weights.shape[0]
  if k == 0:
    return None
  positive = np.flatnonzero(np.any(weights.reshape(k, -1) > 0, axis=1))
  i = int(positive[0]) if positive.size else 0
  return jax.tree.map(lambda x: x[i : i + 1], batch)


def _pad_rows(x: np.ndarray, rows: int, fill: np.ndarray | None = None) -> np.ndarray:
  if fill is None:
    return np.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
  return np.concatenate([x, np.repeat(fill, rows - x.shape[0], axis=0)])


def _pad_portion(batch: Any, weights: np.ndarray, rows: int, fill: Any = None) -> tuple[Any, np.ndarray]:
  """One device's `(batch, weights)` padded to `rows` rows of weight 0.

  The padding rows are copies of `fill` (a one-row pytree shaped like `batch`), or zeros if it is `None`.
  Copies, because a padding row is still computed on: a zero row can be NaN under a length mask (softmax over
  no position), and although weight 0 keeps it out of the sums, the backward pass multiplies 0 by that NaN.
  """
  if fill is None:
    return jax.tree.map(lambda x: _pad_rows(x, rows), batch), _pad_rows(weights, rows)
  return jax.tree.map(lambda x, f: _pad_rows(x, rows, f), batch, fill), _pad_rows(weights, rows)


def _padded(portions: Mapping[int, tuple[Any, np.ndarray]], rows: int, pad: str, spare: Any = None) -> dict:
  """`{position: (batch, weights)}` padded to `rows` rows, as `pad` says.

  Under `"copy"` a portion pads with copies of its own real row; an empty one with copies of `spare` (a
  one-row pytree) if given, else of the first non-empty portion's row; with no row anywhere, zeros (then every
  weight is 0 and the step skips the batch).
  """
  if pad == "zeros":
    return {p: _pad_portion(b, w, rows) for p, (b, w) in portions.items()}
  own = {p: _real_row(b, w) for p, (b, w) in portions.items()}
  if spare is None:
    spare = next((row for row in own.values() if row is not None), None)
  return {p: _pad_portion(b, w, rows, spare if own[p] is None else own[p]) for p, (b, w) in portions.items()}


def _place_blocks(blocks: Mapping[int, np.ndarray], n: int, sharding) -> jax.Array:
  """The global array `[n * rows, ...]` whose block `i` (along the leading axis) is `blocks[i]`.

  Only the blocks of this process's devices need to be present.
  """
  # A process builds only its own devices' blocks (see jaxdp.sharding.layout.global_array).
  first = next(iter(blocks.values()))
  rows = first.shape[0]

  def block(index: tuple[slice, ...]) -> np.ndarray:
    return blocks[(index[0].start or 0) // rows][(slice(None), *index[1:])]

  return global_array((n * rows, *first.shape[1:]), sharding, block)


def _place_portions(portions: Mapping[int, Any], n: int, sharding) -> Any:
  """Places equally shaped per-device `{mesh position: (batch, weights, ...)}` as global arrays; the batch is
  recorded as padded, so that a step refuses it without its weights."""
  positions = list(portions)
  placed = jax.tree.map(
      lambda *blocks: _place_blocks(dict(zip(positions, blocks)), n, sharding), *(portions[p] for p in positions)
  )
  mark_padded(placed[0])
  return placed


def shard_uneven(
    batches: Sequence[Any],
    mesh: Mesh,
    *,
    weights: Sequence[Any] | None = None,
    axis_name: str = "data",
    rows: int | None = None,
    pad: str = "copy",
) -> tuple[Any, jax.Array]:
  """Pads uneven per-device portions with weight-0 rows and places them on the mesh.

  Args:
    batches: one pytree per device of `mesh[axis_name]`, in mesh order. All
      have the same structure, trailing shapes and dtypes; the leading sizes
      may differ and may be 0.
    mesh: the mesh to place on.
    weights: `None` (one weight per real row) or one array per device with
      leading size equal to that device's row count, e.g. `[n_i]` example
      weights or `[n_i, t]` token masks. Values must be finite and `>= 0`
      (checked here, on the host, so the step needs no value checks).
    axis_name: the data-parallel axis.
    rows: rows per device after padding, at least the largest portion;
      default: the largest portion (at least 1). Pass a fixed size (e.g. the
      per-device batch, a multiple of `accum_steps`) to give every batch,
      the last of an epoch included, the same shape: one compiled step, and
      micro-batches that split evenly.
    pad: what padding rows hold. `"copy"` (default): copies of a real row
      of the same device (its first of positive weight), or, for a device
      with no rows, of another device's; `"zeros"`: zeros. A batch with
      no rows at all is padded with zeros (there is nothing to copy; its
      total weight is 0, so the step skips it).

  Returns:
    `(batch, weights)`: global arrays with leading size `n_devices *
    max_len` split over `axis_name` (`max_len` is `rows`, by default the
    largest portion, at least 1). Padding rows have weight 0, so the `"mean"`
    reduction gives exactly the gradient of the real rows. They hold copies
    of real rows by default because the model still runs on them: a zero
    row can give NaN (a length mask over no position), and the gradient of
    a weight-0 row is 0 times that NaN, i.e. NaN. `weights` is float32
    `[n_devices * max_len]` or `[n_devices * max_len, t]`. The batch is
    correct only with them: the steps refuse it without weights (a
    `ValueError` naming `weights`), where `weights=None` would count
    the padding rows as real ones.
  """
  check_mesh_axis(mesh, axis_name)
  check_pad(pad)
  n = data_size(mesh, axis_name)
  if isinstance(batches, (np.ndarray, jax.Array, Mapping)) or not isinstance(batches, Sequence):
    raise TypeError(
        f"batches must be a list with one pytree per device (its portion), got {type(batches).__name__}; to split "
        "one global batch over the devices, use jaxdp.split_batch(batch, mesh, weights=...), or place it yourself "
        f"with jax.device_put(batch, NamedSharding(mesh, P({axis_name!r}))) if it splits evenly."
    )
  batches = list(batches)
  if len(batches) != n:
    raise ValueError(f"batches has {len(batches)} entries but mesh axis {axis_name!r} has {n} devices; pass one pytree per device.")
  structures = {jax.tree.structure(b) for b in batches}
  if len(structures) > 1:
    raise ValueError("batches entries have different pytree structures; give every device the same structure.")
  host = [jax.tree.map(np.asarray, b) for b in batches]
  sizes = [batch_size(b, name=f"batches[{i}]") for i, b in enumerate(host)]
  for i, b in enumerate(host):
    check_batch_values(b, f"batches[{i}]")
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
  if rows is None:
    rows = max(max(sizes), 1)
  else:
    rows = check_int(rows, "rows", max(max(sizes), 1), "pad to at least the largest portion (and 1).")
  portions = _padded(dict(enumerate(zip(host, host_weights))), rows, pad)
  return _place_portions(portions, n, split_along(mesh, axis_name))


def split_batch(
    batch: Any,
    mesh: Mesh,
    *,
    weights: Any = None,
    axis_name: str = "data",
    rows: int | None = None,
    pad: str = "copy",
) -> tuple[Any, jax.Array]:
  """Splits one global batch over the devices of `mesh[axis_name]`, whatever their number, and places it.

  Device `i` gets a contiguous run of rows, in order; `B` rows over
  `N` devices give every device `B // N` and the first `B % N` one
  more (128 over 3: 43, 43, 42). The shorter portions are padded as
  `shard_uneven` pads them, with weight 0, so the step's
  `reduction="mean"` gradient is exactly that of the weighted mean over
  the `B` rows, as on one device.

  Args:
    batch: a pytree of arrays with a common leading (batch) size `B >= 0`.
    mesh: the mesh to place on.
    weights: `None` (weight 1 per row), or `[B]` example weights or
      `[B, t]` token masks, finite and `>= 0`.
    axis_name: the data-parallel axis.
    rows: rows per device after padding (see `shard_uneven`);
      default `ceil(B / N)` (at least 1). Pass a multiple of
      `accum_steps` when the step accumulates.
    pad: what padding rows hold, `"copy"` (default) or `"zeros"` (see
      `shard_uneven`).

  Returns:
    `(batch, weights)` as `shard_uneven` returns them: global
    arrays with leading size `N * rows` split over `axis_name`, ready
    for the step; `weights` float32, 0 on padding rows. Pass both: the
    steps refuse this batch without its weights.
  """
  check_mesh_axis(mesh, axis_name)
  check_pad(pad)
  host = jax.tree.map(np.asarray, batch)
  total = batch_size(host)
  if weights is not None:
    weights = np.asarray(weights)
    if weights.ndim not in (1, 2) or weights.shape[0] != total:
      raise ValueError(
          f"weights has shape {weights.shape} but batch has {total} rows; pass [{total}] or [{total}, t], or None."
      )
  n = data_size(mesh, axis_name)
  cuts = np.cumsum(_portion_sizes(total, n))[:-1]
  portions = [jax.tree.map(lambda x: x[start:stop], host) for start, stop in zip([0, *cuts], [*cuts, total])]
  per_device_weights = None if weights is None else np.split(weights, cuts)
  return shard_uneven(portions, mesh, weights=per_device_weights, axis_name=axis_name, rows=rows, pad=pad)


_SMALLEST_WEIGHT = float(np.finfo(np.float32).tiny)
_LARGEST_WEIGHT = float(np.finfo(np.float32).max)


def _float32_weights(w: Any, name: str) -> np.ndarray:
  """`w` as float32, refusing values that float32 (on the devices) cannot hold: checked before the cast.

  Non-finite or negative weights; weights in (0, float32's smallest normal), which devices flush to 0 (the
  rows silently dropped; a float64 1e-50 would already be 0 after the cast); weights above float32's largest.
  """
  w = np.asarray(w)
  w = w.astype(np.float64) if w.dtype != np.float64 else w
  if not np.all(np.isfinite(w)):
    raise ValueError(f"{name} has non-finite values; weights must be finite and >= 0 (0 for padding).")
  if np.any(w < 0):
    raise ValueError(f"{name} has negative values (min {w.min()}); weights must be >= 0 (0 for padding).")
  tiny = (w > 0) & (w < _SMALLEST_WEIGHT)
  if np.any(tiny):
    raise ValueError(
        f"{name} has {int(np.sum(tiny))} weights below {_SMALLEST_WEIGHT:.3g} (float32's smallest normal number), "
        "which accelerators and XLA's CPU backend flush to 0; scale the weights up (only their ratios matter under "
        "reduction='mean') or set them to 0."
    )
  huge = w > _LARGEST_WEIGHT
  if np.any(huge):
    raise ValueError(
        f"{name} has {int(np.sum(huge))} weights above {_LARGEST_WEIGHT:.3g} (float32's largest number), which would become inf on the "
        "devices; scale the weights down (only their ratios matter under reduction='mean')."
    )
  return w.astype(np.float32)


def _check_weights(weights: Sequence[Any], sizes: list[int]) -> list[np.ndarray]:
  weights = [np.asarray(w) for w in weights]
  if len(weights) != len(sizes):
    raise ValueError(f"weights has {len(weights)} entries but batches has {len(sizes)}; pass one weight array per device.")
  trailing = {w.shape[1:] for w in weights}
  if len(trailing) > 1:
    raise ValueError(f"weights entries have different trailing shapes {sorted(trailing)}; use one shape, e.g. [n_i] or [n_i, t].")
  for i, (w, s) in enumerate(zip(weights, sizes)):
    if w.ndim not in (1, 2) or w.shape[0] != s:
      raise ValueError(f"weights[{i}] has shape {w.shape} but batches[{i}] has {s} rows; use [{s}] or [{s}, t].")
  return [_float32_weights(w, f"weights[{i}]") for i, w in enumerate(weights)]


# The input pipeline. The plan is pure and the same in every process:
#
# * epoch e visits the examples in the order epoch_permutation(N, seed, e);
# * step s is batch i = s % S of epoch s // S (S = ceil(N / G); G = n_devices * b, or any G given
#   as global_batch_size), i.e. positions [i*G, min((i+1)*G, N)) of that order;
# * a batch's positions are cut into n_devices contiguous portions, in mesh order
#   along the data axis, as evenly as possible: r examples (G, or fewer in an
#   epoch's last batch) give every device r // n_devices and the first
#   r % n_devices one more (at most b = ceil(G / n_devices), the rows per device).
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
  """The order in which epoch `epoch` visits the examples.

  A function of `(num_examples, seed, epoch)` only, computed with integer
  arithmetic (a keyed splitmix64 hash of each index, then a sort), so it is the
  same in every process and does not change with the numpy version: a run
  resumed from a checkpoint replays exactly the same order.

  Args:
    num_examples: the size of the dataset, `>= 1`.
    seed: the shuffling seed, `0 <= seed < 2**64`.
    epoch: the epoch, `0 <= epoch < 2**64`.

  Returns:
    int64 `[num_examples]`, a permutation of `range(num_examples)`.
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
  """`count` examples spread over `n_devices` as evenly as possible, extras first."""
  return count // n_devices + (np.arange(n_devices) < count % n_devices)


def _split_batch(order: np.ndarray, n_devices: int, global_batch: int, index: int) -> list[np.ndarray]:
  """Each device's example indices in batch `index` (`global_batch` examples) of an epoch visiting `order`."""
  batch = order[index * global_batch : (index + 1) * global_batch]
  return np.split(batch, np.cumsum(_portion_sizes(len(batch), n_devices))[:-1])


def steps_per_epoch(num_examples: int, global_batch: int) -> int:
  """Steps that visit `num_examples` examples once, `global_batch` a step (the last step may take fewer)."""
  return -(-num_examples // global_batch)


def _batch_sizes(n_devices: int, per_device_batch: int | None, global_batch_size: int | None) -> tuple[int, int]:
  """`(rows per device, examples per step)` from exactly one of the two ways to give a batch size.

  `per_device_batch=b`: `(b, n_devices * b)`. `global_batch_size=G`: `(ceil(G / n_devices), G)`, the
  `G` examples of a step split as evenly as possible (128 over 3 devices: 43, 43, 42).
  """
  if (per_device_batch is None) == (global_batch_size is None):
    raise ValueError(
        "pass exactly one of per_device_batch (rows per device; every step takes n_devices * per_device_batch "
        "examples) and global_batch_size (examples per step, split over the devices as evenly as possible), got "
        f"per_device_batch={per_device_batch!r}, global_batch_size={global_batch_size!r}."
    )
  if global_batch_size is None:
    rows = check_int(per_device_batch, "per_device_batch", 1, "give every device at least one row.")
    return rows, n_devices * rows
  total = check_int(global_batch_size, "global_batch_size", 1, "a step takes at least one example.")
  return -(-total // n_devices), total


def device_indices(
    num_examples: int, n_devices: int, per_device_batch: int | None, seed: int, step: int, *,
    global_batch_size: int | None = None,
) -> list[np.ndarray]:
  """The dataset indices each device loads at `step`: the pipeline's plan, without a mesh.

  Args:
    num_examples: the size of the dataset.
    n_devices: the number of devices along the data axis.
    per_device_batch: rows per device `b`, so `G = n_devices * b`
      examples a step; or `None` with `global_batch_size`.
    seed: the shuffling seed.
    step: the global step, counted from 0 across epochs.
    global_batch_size: `G` examples a step, any `G >= 1` (then
      `per_device_batch=None`); devices get `ceil(G / n_devices)` at most.

  Returns:
    `n_devices` int64 arrays, in mesh order, each of length at most
    `ceil(G / n_devices)`: each step's `G` examples (fewer in an epoch's
    last step) cut as evenly as possible, the first devices taking one more.
    Over the `ceil(num_examples / G)` steps of an epoch they hold every
    index exactly once.
  """
  num_examples = check_int(num_examples, "num_examples", 1, "the dataset must not be empty.")
  n_devices = check_int(n_devices, "n_devices", 1, "pass the size of the mesh's data axis.")
  _, total = _batch_sizes(n_devices, per_device_batch, global_batch_size)
  step = check_int(step, "step", 0, "steps count from 0.")
  epoch, index = divmod(step, steps_per_epoch(num_examples, total))
  return _split_batch(epoch_permutation(num_examples, seed, epoch), n_devices, total, index)


def process_positions(n_devices: int, n_processes: int, process_index: int) -> range:
  """The mesh positions a process owns when each holds a contiguous, equal group of devices.

  The usual layout (`jax.devices()` lists devices by process); use it to
  simulate a multi-process split without processes. A real run asks the mesh:
  `addressable_positions`.
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
  """The positions along `mesh[axis_name]` that have a device of this process.

  These are the portions this process must load. On a mesh with more axes, a
  position counts if any device in its slice (over the other axes) is local.
  """
  check_mesh_axis(mesh, axis_name)
  devices = data_rows(mesh, axis_name)
  me = jax.process_index()
  return tuple(i for i, row in enumerate(devices) if any(d.process_index == me for d in row))


def _collated(collate: Callable, examples: list, template: tuple[Any, np.ndarray] | None) -> tuple[Any, np.ndarray]:
  """`collate(examples)` as numpy, checked against the zero-row `template` (if any)."""
  out = collate(examples)
  if not isinstance(out, tuple) or len(out) != 2:
    raise ValueError(f"collate must return a tuple (batch, weights), got {type(out).__name__}.")
  batch, weights = jax.tree.map(np.asarray, out[0]), np.asarray(out[1])
  k = len(examples)
  for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
    if leaf.ndim == 0 or leaf.shape[0] != k:
      raise ValueError(
          f"collate's batch{jax.tree_util.keystr(path)} has shape {leaf.shape} for {k} examples; "
          f"every leaf needs a leading axis of size {k}."
      )
  if weights.ndim not in (1, 2) or weights.shape[0] != k:
    raise ValueError(f"collate's weights have shape {weights.shape} for {k} examples; return [{k}] or [{k}, t].")
  weights = _float32_weights(weights, "collate's weights")
  check_batch_values(batch, "collate's batch")
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
  """An epoch-shuffled (or ordered), resumable input pipeline that splits every global batch over the devices.

  Every example of `dataset` is used exactly once per epoch: no duplicates
  (unlike PyTorch's `DistributedSampler`) and no dropped tail. A step takes
  `global_batch` examples (`n_devices * per_device_batch`, or any
  `global_batch_size`), fewer in the last step of an epoch, spread as evenly
  as possible over the devices (`r` examples: the first `r % n_devices`
  devices get one more) and padded to `per_device_batch` rows of weight
  0, so `reduction="mean"` gives exactly the gradient of the real examples.
  Padding rows copy a real row (`pad="copy"`, see `shard_uneven`): the
  device's own first, or example 0 of the dataset for a device with no
  example in the step (the same row whichever process loads it). The order is
  a function of `(seed, epoch)` only (`epoch_permutation`; the
  dataset's own order with `shuffle=False`) and
  `batch_at(step)` is what iteration yields at `step`, so a run resumes
  from a step counter.

  In a multi-process run each process loads only the examples of its own
  devices (`addressable_positions`), plus example 0 once, at
  construction, for the shapes and padding of an empty portion. `collate`
  must give every portion the same trailing shapes and dtypes (pad
  variable-length fields to a fixed length). Loading is synchronous; it overlaps the device
  work of the previous step because JAX dispatches steps asynchronously.

  Example:

  ```python
  pipe = DataPipeline(dataset, collate, mesh, per_device_batch=32, seed=0)
  for step, (batch, weights) in pipe.iterate(start_step=start):  # start: the loop's own count, saved
    state, metrics = train_step(state, batch, weights)            # as a checkpoint's data_step
  ```

  Resume from the loop's count of batches (`Restored.data_step`), not from
  `state.step`: a step skipped for a NaN or zero weight does not advance
  `state.step`, so resuming from it would train on some batches twice.
  Pass the pipeline to `CheckpointManager.save`/`restore` (`pipeline=`):
  the count is then kept as a position in examples (`position`) and
  converted for another global batch (`step_at`).

  Attributes:
    steps_per_epoch: `ceil(len(dataset) / global_batch)`.
    n_devices: devices along `axis_name`.
    global_batch: examples per step: `global_batch_size`, or `n_devices *
      per_device_batch`.
    per_device_batch: rows per device (padding included): as given, or
      `ceil(global_batch_size / n_devices)`. Every batch has leading size
      `n_devices * per_device_batch`.
    local_positions: the mesh positions whose portions this process loads.
  """

  def __init__(
      self,
      dataset: Sequence[Any],
      collate: Callable[[list], tuple[Any, Any]],
      mesh: Mesh,
      *,
      per_device_batch: int | None = None,
      global_batch_size: int | None = None,
      seed: int = 0,
      axis_name: str | tuple[str, ...] = "data",
      pad: str = "copy",
      shuffle: bool = True,
  ):
    """Builds the pipeline and checks `collate` on example 0.

    Args:
      dataset: any indexable with `len` (a list, a memory-mapped array, a
        grain data source): `dataset[i]` is one example or document.
      collate: `collate(examples) -> (batch, weights)`: numpy pytree whose
        leaves have leading size `len(examples)`, and weights `[k]` or
        `[k, t]` (e.g. token masks), finite and `>= 0`. Never called with
        an empty list.
      mesh: the mesh to place batches on.
      per_device_batch: rows per device `b`, `>= 1`: a step takes
        `n_devices * b` examples. Give this or `global_batch_size`.
      global_batch_size: examples per step `G`, `>= 1`, whether or not
        `n_devices` divides it (128 over 3 devices: 43, 43, 42, padded to
        43 rows each); the weighted mean over the `G` examples is exact.
        Give this or `per_device_batch`.
      seed: the shuffling seed, `>= 0`.
      axis_name: the data-parallel axis, or a tuple of axes (`("replica",
        "data")` on a hybrid mesh); batches are split along it and
        replicated over any other axis.
      pad: what padding rows hold, `"copy"` (default) or `"zeros"` (see
        `shard_uneven`).
      shuffle: `True` (default): each epoch visits the examples in the
        order `epoch_permutation` gives for `(seed, epoch)`;
        `False`: in the dataset's own order, every epoch (`seed` then
        unused), e.g. to compare against an existing run that reads its data
        in order. Either way every example is used once per epoch and the
        last, uneven batch is padded with weight-0 rows.
    """
    check_mesh_axis(mesh, axis_name)
    if not isinstance(shuffle, bool):
      raise TypeError(f"shuffle must be True or False, got {type(shuffle).__name__}; pass shuffle=False to keep "
                      "the dataset's order.")
    self.shuffle = shuffle
    self.pad = check_pad(pad)
    if not callable(collate):
      raise ValueError(f"collate must be callable, got {type(collate).__name__}; pass collate(examples) -> (batch, weights).")
    self.dataset, self.collate, self.mesh, self.axis_name = dataset, collate, mesh, axis_name
    if isinstance(dataset, Mapping) and set(dataset) != set(range(len(dataset))):
      raise ValueError(
          f"dataset is a {type(dataset).__name__} (keys {list(dataset)[:4]}...): len() would count its keys and "
          "dataset[i] look up key i. Pass a sequence of examples, e.g. [dict(zip(d, row)) for row in zip(*d.values())] "
          "for a dict of columns d, or a list/array indexable by example number."
      )
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
      raise ValueError(
          f"dataset must be indexable with a length (a list, an array, a grain data source), got "
          f"{type(dataset).__name__}; for a stream of unknown length use jaxdp.StreamingPipeline."
      )
    self.num_examples = check_int(len(dataset), "len(dataset)", 1, "pass a non-empty dataset.")
    self.n_devices = data_size(mesh, axis_name)
    self.per_device_batch, self.global_batch = _batch_sizes(self.n_devices, per_device_batch, global_batch_size)
    self.seed = check_int(seed, "seed", 0, "use a non-negative integer seed.")
    if self.seed >= 2**64:
      raise ValueError(f"seed must be < 2**64 (the shuffle's key is 64 bits), got {self.seed}.")
    self.steps_per_epoch = steps_per_epoch(self.num_examples, self.global_batch)
    self.local_positions = addressable_positions(mesh, axis_name)
    if not self.local_positions:
      raise ValueError("mesh has no device of this process; build the pipeline on a mesh that includes local devices.")
    self._sharding = split_along(mesh, axis_name)
    # Every process loads its own devices' portions of one shared plan: a seed or dataset length that differs
    # between processes would train some examples twice and others never, silently (the shapes still agree).
    assert_same_across_processes(
        {"len(dataset)": self.num_examples, "seed": self.seed, "per_device_batch": self.per_device_batch,
         "global_batch": self.global_batch, "devices": self.n_devices, "pad": self.pad, "shuffle": self.shuffle},
        "DataPipeline arguments")
    probe = _collated(collate, [dataset[0]], None)
    self._empty = jax.tree.map(lambda x: x[:0], probe)  # the portion of a device with no examples
    # An empty portion's padding copies example 0, not a row of another device of the step: that row may be
    # another process's to load, and the batch must not depend on which process loads what.
    self._spare = _real_row(*probe)
    self._cached_order: tuple[int, np.ndarray] | None = None

  def _order(self, epoch: int) -> np.ndarray:
    if self._cached_order is None or self._cached_order[0] != epoch:
      order = epoch_permutation(self.num_examples, self.seed, epoch) if self.shuffle else np.arange(self.num_examples)
      self._cached_order = (epoch, order)
    return self._cached_order[1]

  def device_indices(self, step: int) -> list[np.ndarray]:
    """Each device's dataset indices at `step` (see `device_indices`)."""
    step = check_int(step, "step", 0, "steps count from 0.")
    epoch, index = divmod(step, self.steps_per_epoch)
    return _split_batch(self._order(epoch), self.n_devices, self.global_batch, index)

  def position(self, step: int) -> dict:
    """Where `step` starts in the data, in examples rather than batches (what a checkpoint records).

    `{"epoch", "example", "num_examples", "seed", "shuffle", "global_batch", "devices"}`: `example` examples of
    `epoch`'s order come before `step`. A step count alone means nothing without the global batch it
    counts: `step_at` converts a position into the step of a pipeline with another batch size.
    """
    step = check_int(step, "step", 0, "steps count from 0.")
    epoch, index = divmod(step, self.steps_per_epoch)
    return {"epoch": epoch, "example": index * self.global_batch, "num_examples": self.num_examples,
            "seed": self.seed, "shuffle": self.shuffle, "global_batch": self.global_batch, "devices": self.n_devices}

  def step_at(self, position: dict) -> int:
    """This pipeline's step that starts at `position` (from `position`, maybe of another global batch).

    Raises:
      ValueError: if `position` is of another dataset length or seed (the epochs' orders differ: some
        examples would be trained twice and others never), or falls inside one of this pipeline's batches
        (its `example` is not a multiple of `global_batch`).
    """
    saved = {"shuffle": True, **position}  # positions saved before shuffle= existed were shuffled
    for name, mine in (("num_examples", self.num_examples), ("seed", self.seed), ("shuffle", self.shuffle)):
      if saved[name] != mine:
        raise ValueError(
            f"the saved data position is of a pipeline with {name}={saved[name]}, this one has {mine}: the "
            "epochs' orders differ, so resuming would train some examples twice and others never. Resume with "
            "the same dataset, seed and shuffle."
        )
    epoch, example = position["epoch"], position["example"]
    if example % self.global_batch:
      raise ValueError(
          f"the saved data position is example {example} of epoch {epoch} (after batches of "
          f"{position['global_batch']}), inside a batch of this pipeline's global batch {self.global_batch} "
          f"(over {self.n_devices} devices). Resume with a global batch "
          f"that divides {example} (the saving run's was {position['global_batch']}), or from a checkpoint at the "
          "start of an epoch."
      )
    return epoch * self.steps_per_epoch + example // self.global_batch

  def _portion(self, indices: np.ndarray) -> tuple[Any, np.ndarray]:
    if len(indices) == 0:
      return self._empty
    return _collated(self.collate, [self.dataset[int(i)] for i in indices], self._empty)

  def load(self, step: int, positions: Sequence[int] | None = None) -> dict[int, tuple[Any, np.ndarray]]:
    """The padded host portions `{position: (batch, weights)}` of `step`.

    Reads `dataset` only at the indices of `positions` (default: this
    process's `local_positions`); pass `process_positions` to see
    what another process of a simulated multi-process run would load.
    """
    positions = self.local_positions if positions is None else tuple(positions)
    bad = [p for p in positions if not 0 <= p < self.n_devices]
    if bad:
      raise ValueError(f"positions {bad} are outside the mesh axis of {self.n_devices} devices.")
    indices = self.device_indices(step)
    return _padded({p: self._portion(indices[p]) for p in positions}, self.per_device_batch, self.pad, self._spare)

  def batch_at(self, step: int) -> tuple[Any, jax.Array]:
    """The global `(batch, weights)` of `step`, as `iterate` yields it.

    Returns:
      Global arrays with leading size `R = n_devices * per_device_batch`,
      sharded `NamedSharding(mesh, P(axis_name))` as `shard_uneven`
      returns them; `weights` is float32 `[R]` or `[R, t]` with 0 on
      padding rows.
    """
    return _place_portions(self.load(step), self.n_devices, self._sharding)

  def iterate(self, start_step: int = 0, num_steps: int | None = None) -> Iterator[tuple[int, tuple[Any, jax.Array]]]:
    """Yields `(step, (batch, weights))` from `start_step`, across epochs.

    Args:
      start_step: the first step, e.g. the step counter of a checkpoint.
      num_steps: how many steps to yield; `None` for ever.
    """
    start = check_int(start_step, "start_step", 0, "steps count from 0.")
    assert_same_across_processes({"start_step": start, "num_steps": num_steps}, "DataPipeline.iterate arguments")
    if num_steps is None:
      steps = itertools.count(start)
    else:
      steps = range(start, start + check_int(num_steps, "num_steps", 0, "or None to iterate for ever."))
    return ((step, self.batch_at(step)) for step in steps)


# Streams of unknown length (what PyTorch's Join is for). Each process reads its own stream; a
# device whose process has run dry gets zero-weight padding, and each device passes a count, 1 if
# its process's stream has an example after this step, that the step sums inside its own
# all-reduce. The sum of step s is 0 exactly when every stream is dry after step s, and every
# process reads the same sum, so all of them end after the same step with no extra collective.


class _Lookahead:
  """An iterator with a one-example lookahead: whether more follows is known without losing an example."""

  def __init__(self, examples: Iterable[Any]):
    if isinstance(examples, Mapping):
      raise ValueError(
          f"examples is a {type(examples).__name__}: iterating it gives its keys, not examples. Pass an iterable of "
          "examples, e.g. (dict(zip(d, row)) for row in zip(*d.values())) for a dict of columns d."
      )
    try:
      self._it: Iterator[Any] | None = iter(examples)
    except TypeError:
      raise ValueError(f"examples must be an iterable or iterator of examples, got {type(examples).__name__}.") from None
    self._head: list = []  # the next example, once read

  def more(self) -> bool:
    """Whether the stream holds another example (reads it ahead, once)."""
    if not self._head and self._it is not None:
      try:
        self._head.append(next(self._it))
      except StopIteration:
        self._it = None  # never ask again: some iterators yield more after a StopIteration
    return bool(self._head)

  def peek(self) -> Any:
    """The next example, still to be taken; only after `more` returned True."""
    return self._head[0]

  def take(self, k: int) -> list:
    """Up to `k` examples, in stream order."""
    taken = []
    while len(taken) < k and self.more():
      taken.append(self._head.pop())
    return taken


def _count(value: Any) -> int | None:
  """`value` as an int when it is already on the host; `None` for a `jax.Array` (reading it could wait)."""
  if isinstance(value, jax.Array):
    return None
  return int(np.asarray(value))


class StreamingPipeline:
  """Batches per-process streams of unknown, unequal length; every process stops after the same step.

  Each process passes its own stream of examples (a generator over its
  files, a socket reader, ...); nobody needs to know how long any stream is.
  Each step the process takes up to `len(local_positions) * per_device_batch`
  examples, in stream order, and cuts them into contiguous portions, one per
  local device in mesh order, as evenly as possible (`k` examples over
  `L` devices: the first `k % L` get one more, as in
  `DataPipeline`'s last batch; the whole local batch is read before
  it is split, so this needs no extra lookahead). Portions are
  padded with rows of weight 0, so a process whose stream has run dry
  keeps stepping with padding only, and `reduction="mean"` is exactly the
  gradient of the real examples. Padding rows copy a real row (`pad="copy"`,
  see `shard_uneven`): the device's own, else one of this process's
  other devices in the step, else the last real row this process placed (for
  a process with no example yet, the template's or first example's row). Every example is used once; none is
  repeated or dropped. If reading the stream or `collate` raises while a
  batch is drawn, the examples read for it are lost: the error propagates,
  and every later draw raises too until `reset`, so the pass cannot
  end as if it were complete.

  With each batch comes `has_more`, int32 `[n_devices]` split over
  `axis_name`: 1 on every device of a process whose stream has an example
  after this step (one example is read ahead to know), else 0. Passed to the
  step, it is summed over devices inside the step's own all-reduce into
  `metrics["has_more"]`, the same on every process. Hand that back with
  `report` after every step; iteration ends after the first step whose
  count is 0, i.e. right after the last step that carried data, on every
  process at once (if every stream starts empty, after one all-padding step,
  which the step skips because its weight is 0):

  ```python
  stream = StreamingPipeline(my_examples, collate, mesh, per_device_batch=8)
  for batch, weights, has_more in stream:
    state, metrics = step(state, batch, weights, has_more=has_more)
    stream.report(metrics["has_more"])
  ```

  `report` does not read the count. Drawing the next batch reads it
  only when this process's own stream is dry: a process with data left
  knows the count is at least its own devices' and prepares the next batch
  while the device still runs the step. A dry process has only padding to
  prepare, and must wait for the count of the step it just dispatched
  before it can tell whether to dispatch another (running one padding step
  ahead instead would waste a step at the end of every pass).

  The count must come from a step that reduces over `axis_name`: any
  reduction but `"none"`, which leaves it per replica.

  Shapes: an empty portion needs the shapes of a collated example. The
  pipeline takes them from `template` if given, else from the first
  example of the stream (read at construction and kept, not lost). A
  process whose stream may be empty must pass `template`; every process
  must collate to the same trailing shapes and dtypes, which the step checks
  across processes.

  Attributes:
    n_devices: devices along `axis_name`.
    global_batch: `n_devices * per_device_batch`, the leading size of every batch.
    local_positions: the mesh positions whose portions this pipeline fills.
    steps: the steps drawn in the current pass (the loop ran `steps` steps once it ended).
    consumed: this process's examples placed in the current pass.
    epoch: the pass, counted from 0; `reset` starts the next one.
  """

  def __init__(
      self,
      examples: Iterable[Any],
      collate: Callable[[list], tuple[Any, Any]],
      mesh: Mesh,
      *,
      per_device_batch: int,
      template: Any = None,
      axis_name: str = "data",
      positions: Sequence[int] | None = None,
      pad: str = "copy",
  ):
    """Builds the pipeline and checks `collate` on the template example.

    Args:
      examples: this process's examples, any iterable or iterator, of any
        length (0 included, with `template`); read once, in order.
      collate: `collate(examples) -> (batch, weights)`, as for
        `DataPipeline`: numpy leaves with leading size
        `len(examples)`, weights `[k]` or `[k, t]`, finite and `>= 0`.
        Never called with an empty list.
      mesh: the mesh to place batches on.
      per_device_batch: rows per device `b`, `>= 1`.
      template: one example shaped like every process's examples, for the
        shapes of an empty portion; required when this process's stream is
        empty. It is never trained on, but a process that has no example
        yet pads with copies of it, so make it a valid example (under a
        length mask, not of length 0).
      axis_name: the data-parallel axis, or a tuple of axes (`("replica",
        "data")` on a hybrid mesh); batches are split along it and
        replicated over any other axis.
      positions: the mesh positions to fill, default this process's
        (`addressable_positions`). Others, e.g. from
        `process_positions`, simulate one process of a multi-process
        run: such a pipeline only gives host portions (`next_portions`).
      pad: what padding rows hold, `"copy"` (default) or `"zeros"` (see
        `shard_uneven`).

    Raises:
      ValueError: a bad argument, or an empty stream without `template`.
    """
    check_mesh_axis(mesh, axis_name)
    self.pad = check_pad(pad)
    if not callable(collate):
      raise ValueError(f"collate must be callable, got {type(collate).__name__}; pass collate(examples) -> (batch, weights).")
    self.collate, self.mesh, self.axis_name = collate, mesh, axis_name
    self.per_device_batch = check_int(per_device_batch, "per_device_batch", 1, "give every device at least one row.")
    self.n_devices = data_size(mesh, axis_name)
    self.global_batch = self.n_devices * self.per_device_batch
    own = addressable_positions(mesh, axis_name)
    me = jax.process_index()
    shared = [i for i in own if any(d.process_index != me for d in data_rows(mesh, axis_name)[i])]
    if positions is None and shared:
      # Each process fills its positions from its own stream: one position filled by two processes would hold
      # different examples on its replicas, and their has_more counts would differ (one process stops early).
      raise ValueError(
          f"data-axis positions {shared} of this mesh hold devices of several processes; a StreamingPipeline fills "
          "each position from one process's stream. Lay the mesh out so that each data-axis position (its devices "
          "along the other axes) belongs to one process, e.g. jax.make_mesh with the data axis outermost."
      )
    self.local_positions = own if positions is None else self._checked_positions(positions)
    if not self.local_positions:
      raise ValueError("mesh has no device of this process; build the pipeline on a mesh that includes local devices.")
    self._places = self.local_positions == own  # only this process's own positions can be placed here
    self._sharding = split_along(mesh, axis_name)
    self.epoch = 0
    self._start(examples)
    if template is None:
      if not self._stream.more():
        raise ValueError(
            "this process's stream of examples is empty, so it cannot learn the shapes of a portion from its first "
            "example; pass template=<one example shaped like every process's examples> (it is never trained on)."
        )
      template = self._stream.peek()
    probe = _collated(collate, [template], None)
    self._empty = jax.tree.map(lambda x: x[:0], probe)  # the portion of a device with no examples
    self._spare = _real_row(*probe)  # what an empty portion copies when no device of this process has a row

  def _checked_positions(self, positions: Sequence[int]) -> tuple[int, ...]:
    checked = tuple(check_int(p, "positions entry", 0, "mesh positions count from 0.") for p in positions)
    if not checked:
      raise ValueError("positions is empty; give the mesh positions to fill, or None for this process's.")
    bad = [p for p in checked if p >= self.n_devices]
    if bad:
      raise ValueError(f"positions {bad} are outside the mesh axis of {self.n_devices} devices.")
    if len(set(checked)) != len(checked):
      raise ValueError(f"positions {list(checked)} repeat a position; give each position once.")
    return tuple(sorted(checked))  # mesh order: the stream fills them in that order

  def reset(self, examples: Iterable[Any]) -> None:
    """Starts the next pass (epoch) over `examples`, a new stream of any length.

    Every process must call it at the same point of the loop (typically after
    the previous pass ended); what is left of the previous stream is dropped.
    The shapes learnt at construction still apply, so an empty stream needs
    no template here.
    """
    self._start(examples)
    self.epoch += 1

  def _start(self, examples: Iterable[Any]) -> None:
    self._stream = _Lookahead(examples)
    self.steps = self.consumed = 0
    self._local_more = True  # this process's stream had an example after the last step drawn
    self._awaiting_report = False
    self._reported: Any = None
    self._done = False
    self._failed: str | None = None  # the error that lost examples of a batch being drawn

  @property
  def done(self) -> bool:
    """Whether the current pass has ended (on every process alike)."""
    return self._done

  def report(self, has_more: Any) -> None:
    """Hands over `metrics["has_more"]` of the step just run; call once after every step.

    The value is kept, not read (reading a device value would wait for the
    step): see the class docstring for when it is read.

    Args:
      has_more: the step's reduced count, an integer scalar (a `jax.Array`
        as the step returns it, or a host integer).

    Raises:
      RuntimeError: no step is awaiting a report (called twice, or before
        the first batch).
      ValueError: not an integer scalar, or (for a host value) not a count
        this pipeline's own flags allow.
    """
    if not self._awaiting_report:
      raise RuntimeError(
          "report() was called with no step awaiting it; call it exactly once after each step, "
          "with that step's metrics['has_more']."
      )
    dtype = getattr(has_more, "dtype", None)
    dtype = np.asarray(has_more).dtype if dtype is None else np.dtype(dtype)
    if np.shape(has_more) != () or not np.issubdtype(dtype, np.integer):
      raise ValueError(
          f"has_more must be the step's integer scalar metrics['has_more'], got shape {np.shape(has_more)} and "
          f"dtype {dtype}; pass has_more=... to the step and report what it returns."
      )
    value = _count(has_more)
    if value is not None:
      self._check_count(value)
    self._reported = has_more
    self._awaiting_report = False

  def _check_count(self, value: int) -> int:
    # Each of this process's devices counted 1 if its stream has more, and no count exceeds the axis.
    low = len(self.local_positions) if self._local_more else 0
    if not low <= value <= self.n_devices:
      raise ValueError(
          f"has_more={value} cannot be the summed count of the step fed this pipeline's has_more: it lies in "
          f"[{low}, {self.n_devices}] here; report metrics['has_more'] of that step."
      )
    return value

  def _last_count(self) -> int:
    """The reported count of the last step, read (and waited for) now."""
    value = _count(self._reported)
    if value is None:
      value = self._check_count(int(jax.device_get(self._reported)))
    return value

  def next_portions(self) -> dict[int, tuple[Any, np.ndarray, np.ndarray]] | None:
    """The next step's padded host portions, or `None` once the pass has ended.

    Iteration is this, placed on the mesh; use it directly to inspect or
    simulate (a pipeline built with other processes' `positions`). It
    follows the same protocol: `report` must come between two calls.

    Returns:
      `{position: (batch, weights, has_more)}` for `local_positions`:
      `batch` and `weights` with `per_device_batch` rows (padding rows
      of weight 0 after the real ones), `has_more` int32 `[1]`.

    Raises:
      RuntimeError: the previous step was not reported.
    """
    if self._awaiting_report:
      raise RuntimeError(
          f"step {self.steps - 1}'s has_more was not reported: call stream.report(metrics['has_more']) after every "
          "step, before drawing the next batch; without it the processes cannot agree on when to stop."
      )
    if self._failed is not None:
      raise RuntimeError(
          f"this pipeline failed while drawing step {self.steps}'s batch ({self._failed}); the examples it had "
          "read for that batch are gone from the stream, so going on would end the pass without them. This pass "
          "cannot be completed: restore the checkpoint saved before it, or restart the pass on every process with a "
          "fresh iterator (stream.reset(examples), or a new pipeline; a generator that raised is finished), knowing "
          "that the steps already drawn in it are then trained twice."
      )
    if self._done:
      return None
    # Only a dry process reads (and so waits for) the last count: one with data knows it is > 0.
    if self.steps and not self._local_more and self._last_count() == 0:
      self._done = True
      return None
    try:
      taken = self._stream.take(len(self.local_positions) * self.per_device_batch)
      self._local_more = self._stream.more()
      flag = np.full((1,), int(self._local_more), np.int32)
      portions, start = {}, 0
      for position, size in zip(self.local_positions, _portion_sizes(len(taken), len(self.local_positions))):
        part, start = taken[start : start + size], start + size
        portions[position] = _collated(self.collate, part, self._empty) if part else self._empty
      if taken:  # the first position has a row whenever any has (extras go first): a dry step later copies it
        self._spare = _real_row(*portions[self.local_positions[0]])
      padded = _padded(portions, self.per_device_batch, self.pad, None if taken else self._spare)
      portions = {position: (*padded[position], flag) for position in self.local_positions}
    except BaseException as e:  # examples read from the stream would be lost without a word: the pipeline is done
      # (Ctrl-C too: a loop run again after it would go on without them.)
      self._failed = f"{type(e).__name__}: {e}"
      if isinstance(e, StopIteration):  # out of __next__ it would end a for loop as a complete pass (cf. PEP 479)
        raise RuntimeError(f"collate or the stream raised StopIteration while step {self.steps}'s batch was drawn; "
                           "the pass is not complete") from e
      raise
    self.steps += 1
    self.consumed += len(taken)
    self._awaiting_report = True
    return portions

  def __iter__(self) -> StreamingPipeline:
    return self

  def __next__(self) -> tuple[Any, jax.Array, jax.Array]:
    """The next `(batch, weights, has_more)` as global arrays split over `axis_name`."""
    if not self._places:
      own = addressable_positions(self.mesh, self.axis_name)
      raise RuntimeError(
          f"this pipeline fills positions {self.local_positions}, not this process's {own}, so it cannot place "
          "batches; use next_portions(), or build it without positions."
      )
    portions = self.next_portions()
    if portions is None:
      raise StopIteration
    return _place_portions(portions, self.n_devices, self._sharding)


# The pieces other input adapters (jaxdp.io.grain) build on: the same cut, checks and padding as the pipelines above.


def portion_sizes(count: int, n_devices: int) -> np.ndarray:
  """`count` examples spread over `n_devices` as evenly as possible, the first `count % n_devices` one more."""
  return _portion_sizes(count, n_devices)


def collate_checked(collate: Callable, examples: list, template: Any = None) -> tuple[Any, np.ndarray]:
  """`collate(examples)` as numpy `(batch, weights)`, checked as the pipelines check it (leading sizes, finite
  float32 weights `>= 0`, and the trailing shapes and dtypes of the zero-row portion `template` if given)."""
  return _collated(collate, examples, template)


def pad_portions(portions: Mapping[int, tuple[Any, np.ndarray]], rows: int, pad: str, spare: Any = None) -> dict:
  """`{position: (batch, weights)}` padded to `rows` rows of weight 0, as `shard_uneven` pads them.

  Under `pad="copy"` a portion pads with copies of its own first real row, an empty one with copies of
  `spare` (a one-row batch pytree, `first_real_row`) if given, else of the first non-empty portion's row.
  """
  return _padded(portions, rows, check_pad(pad), spare)


def first_real_row(batch: Any, weights: np.ndarray) -> Any | None:
  """The first row of positive weight (else row 0) of a portion's `batch`, as a one-row pytree; `None` if it
  has no rows. What `pad_portions` copies into padding rows."""
  return _real_row(batch, weights)
