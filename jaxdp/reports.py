"""What a compiled step costs: per-device memory and communication, measured, not modelled.

State bytes are counted from the arrays' ``addressable_shards``; compiled
bytes come from ``memory_analysis()``; collectives are read off the optimized
HLO of the step as XLA will run it (per-device shapes after partitioning).
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxdp.sharding import is_flat_shards, padded_size, zero_stage_of

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather")

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+(?P<op>all-reduce|reduce-scatter|all-gather)(?P<start>-start)?\(",
    re.MULTILINE,
)
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*(?:e\dm\d(?:fn)?)?)\[(?P<dims>[\d,]*)\]")


def _shape_bytes(shape: str) -> list[int]:
  """Byte sizes of the arrays in an HLO shape string (one for an array, several for a tuple)."""
  sizes = []
  for m in _ARRAY.finditer(shape):
    dims = [int(d) for d in m["dims"].split(",") if d]
    sizes.append(math.prod(dims) * _DTYPE_BYTES.get(m["dtype"], 4))
  return sizes


class Collective(NamedTuple):
  """The collectives of one kind in a step.

  Attributes:
    count: number of ops (a tuple-shaped op that reduces several arrays counts once).
    bytes: per-device size of the full buffers involved: the all-reduced
      arrays, the reduce-scatter *inputs*, the all-gather *outputs*.
    traffic_bytes: bytes each device sends under the ring algorithm:
      ``2 (N-1)/N`` of ``bytes`` for an all-reduce, ``(N-1)/N`` for the others.
  """

  count: int
  bytes: int
  traffic_bytes: float


def collectives_from_hlo(hlo: str, n_devices: int) -> dict[str, Collective]:
  """Counts and sizes the all-reduce, reduce-scatter and all-gather ops of optimized HLO text."""
  counts = {kind: 0 for kind in COLLECTIVES}
  sizes = {kind: 0 for kind in COLLECTIVES}
  for m in _OP.finditer(hlo):
    kind, arrays = m["op"], _shape_bytes(m["shape"])
    if m["start"] and kind == "all-gather":
      arrays = arrays[len(arrays) // 2 :]  # async start ops return (operands, results)
    size = sum(arrays)
    counts[kind] += 1
    sizes[kind] += size * n_devices if kind == "reduce-scatter" else size
  share = (n_devices - 1) / n_devices
  return {
      kind: Collective(counts[kind], sizes[kind], sizes[kind] * share * (2 if kind == "all-reduce" else 1))
      for kind in COLLECTIVES
  }


def comm_report(step, state, batch, weights=None, rng=None) -> dict[str, Collective]:
  """The collectives of one step of ``step`` (a :func:`jaxdp.make_train_step` result), from its compiled HLO."""
  hlo = step.lower(state, batch, weights, rng).compile().as_text()
  return collectives_from_hlo(hlo, step.mesh.shape[step.axis_name])


class MemoryReport(NamedTuple):
  """Bytes per device (the first addressable device; all are alike up to padding).

  Attributes:
    params: parameter bytes held at rest (from ``addressable_shards``).
    opt_state: optimizer-state bytes held at rest (from ``addressable_shards``).
    grads: gradient bytes the step materialises per device after reduction:
      the full gradient at stages 0-1, one padded chunk at stages 2-3
      (derived from the layout: gradients are not part of the state).
    model_state: ``params + opt_state + grads``, the quantity of the ZeRO paper.
    argument, output, temp: the compiled step's ``memory_analysis()``.
  """

  params: int
  opt_state: int
  grads: int
  model_state: int
  argument: int
  output: int
  temp: int


def _bytes_on(tree: Any, device) -> int:
  total = 0
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    else:
      total += np.asarray(leaf).nbytes
  return total


def _grad_bytes(params: Any, n: int, stage: int) -> int:
  total = 0
  for leaf in jax.tree.leaves(params, is_leaf=is_flat_shards):
    shape = leaf.shape
    itemsize = np.dtype((leaf.flat if is_flat_shards(leaf) else leaf).dtype).itemsize
    total += (padded_size(shape, n) // n if stage >= 2 else math.prod(shape)) * itemsize
  return total


def memory_report(step, state, batch, weights=None, rng=None) -> MemoryReport:
  """Per-device memory of ``state`` and of one compiled step of ``step``."""
  device = state.step.addressable_shards[0].device if isinstance(state.step, jax.Array) else jax.devices()[0]
  n = step.mesh.shape[step.axis_name]
  params, opt_state = _bytes_on(state.params, device), _bytes_on(state.opt_state, device)
  grads = _grad_bytes(state.params, n, zero_stage_of(state))
  analysis = step.lower(state, batch, weights, rng).compile().memory_analysis()
  return MemoryReport(
      params=params,
      opt_state=opt_state,
      grads=grads,
      model_state=params + opt_state + grads,
      argument=int(analysis.argument_size_in_bytes),
      output=int(analysis.output_size_in_bytes),
      temp=int(analysis.temp_size_in_bytes),
  )
