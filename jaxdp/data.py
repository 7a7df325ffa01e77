"""Getting data onto the devices: uneven per-device portions padded with zero weight.

Two entry points: :func:`shard_uneven` places portions the caller already
has; :class:`DataPipeline` decides which examples each device gets (an
epoch-shuffled, resumable plan) and loads only this process's portions.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxdp._checks import batch_size
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
