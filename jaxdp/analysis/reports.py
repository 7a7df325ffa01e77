"""What a compiled step costs: per-device memory and communication, measured, not modelled.

State bytes are counted from the arrays' `addressable_shards`; compiled
bytes come from `memory_analysis()`; collectives are read off the optimized
HLO of the step as XLA will run it (per-device shapes after partitioning).
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxdp.sharding.layout import data_size, zero_axis


COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")

_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,<=]*)\]")
_OPCODE = re.compile(r"(all-reduce|reduce-scatter|all-gather|all-to-all)(-start|-done)?")
_OPERAND = re.compile(r"%([\w.\-]+)")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
# ``mesh[...] {'axis'}``, also with ``device_ids=(...)`` in between (which holds no brace).
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}")


def _group_size(line: str) -> int | None:
  """How many devices one op of this HLO line spans (its `replica_groups`), or `None` if unstated.

  The three spellings: `{{0,2,4,6},{1,3,5,7}}`, iota `[2,4]<=[8]` (2
  groups of 4) and `mesh['axis_0'=4,'axis_1'=2] {'axis_1'}` (optionally
  with `device_ids=([2,4]T(1,0))` before the braces).
  """
  if match := _GROUPS_LIST.search(line):
    return len([d for d in match.group(1).split(",") if d])
  if match := _GROUPS_IOTA.search(line):
    return int(match.group(2))
  if match := _GROUPS_MESH.search(line):
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", match.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", match.group(2)) if a in sizes)
  return None


def _dtype_bits(dtype: str) -> int:
  """Bits per element of an HLO element type: `f32` 32, `bf16` 16, `pred` 8, `token` 0."""
  if dtype == "pred":
    return 8
  match = re.match(r"[a-z]+?(\d+)", dtype)
  return int(match.group(1)) if match else 0


def _shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string: `f32[1024,1024]{1,0}`, `f32[]` or a tuple of them."""
  bits = 0
  for dtype, dims in _SHAPE.findall(shape):
    bits += math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d) * _dtype_bits(dtype)
  return (bits + 7) // 8


def _shape_end(rhs: str) -> int:
  """Where the result shape at the start of `rhs` ends (tuple shapes nest parentheses)."""
  if not rhs.startswith("("):
    return rhs.find(" ") if " " in rhs else len(rhs)
  depth = 0
  for i, char in enumerate(rhs):
    depth += {"(": 1, ")": -1}.get(char, 0)
    if depth == 0:
      return i + 1
  return len(rhs)


def _collective(line: str) -> dict | None:
  """The collective an HLO instruction line `%name = SHAPE opcode(...)` defines, else `None`."""
  lhs, eq, rhs = line.partition("=")
  if not eq or not lhs.split():
    return None
  rhs = rhs.lstrip()
  end = _shape_end(rhs)
  rest = rhs[end:].lstrip()
  match = _OPCODE.fullmatch(rest.split("(", 1)[0])
  if not match:
    return None
  operand = _OPERAND.search(rest)
  return {
      "kind": match.group(1),
      "phase": (match.group(2) or "-sync")[1:],
      "name": lhs.split()[-1].lstrip("%"),
      "operand": operand.group(1) if operand else "",
      "shape": rhs[:end],
      "group": _group_size(rest),
  }


class HloCollective(NamedTuple):
  """One collective op of optimized HLO text.

  Attributes:
    kind: `"all-reduce"`, `"reduce-scatter"`, `"all-gather"` or `"all-to-all"`.
    nbytes: bytes of its per-device result (of the `-done` op for an async pair).
    group: how many devices it spans (its `replica_groups`), `None` where the HLO does not say.
    line: the HLO line that starts it (the sync op, or the `-start` of an async pair), with its metadata.
  """

  kind: str
  nbytes: int
  group: int | None
  line: str


def hlo_collectives(hlo: str) -> list[HloCollective]:
  """Every all-reduce, reduce-scatter, all-gather and all-to-all of optimized HLO text, in program order.

  An async `-start`/`-done` pair counts once. Counts are static: an op in a loop body appears once.
  """
  found = [(op, line) for line in hlo.splitlines() if (op := _collective(line))]
  done_shapes = {op["operand"]: op["shape"] for op, _ in found if op["phase"] == "done"}
  ops = []
  for op, line in found:
    if op["phase"] == "done":
      continue
    shape = done_shapes.get(op["name"], op["shape"]) if op["phase"] == "start" else op["shape"]
    ops.append(HloCollective(op["kind"], _shape_bytes(shape), op["group"], line))
  return ops


class Collective(NamedTuple):
  """The collectives of one kind in a step (static counts: an op in a loop body counts once).

  Attributes:
    count: number of ops (a tuple-shaped op that reduces several arrays counts once).
    bytes: per-device size of the full buffers involved: the all-reduced
      arrays, the reduce-scatter *inputs*, the all-gather *outputs*.
    traffic_bytes: bytes each device sends under the ring algorithm:
      `2 (G-1)/G` of `bytes` for an all-reduce, `(G-1)/G` for the
      others, with `G` the devices each op spans (its `replica_groups`).
  """

  count: int
  bytes: int
  traffic_bytes: float


def collectives_from_hlo(hlo: str, n_devices: int) -> dict[str, Collective]:
  """Counts and sizes the all-reduce, reduce-scatter, all-gather and all-to-all ops of optimized HLO text.

  Each op's ring traffic uses the size of its own device group (its
  `replica_groups`: a model-axis op spans the model axis, not the data
  axis); `n_devices` where the HLO does not say.
  """
  counts = {kind: 0 for kind in COLLECTIVES}
  sizes = {kind: 0 for kind in COLLECTIVES}
  traffic = {kind: 0.0 for kind in COLLECTIVES}
  for kind, size, group, _ in hlo_collectives(hlo):
    group = group or n_devices
    full = size * group if kind == "reduce-scatter" else size  # a reduce-scatter's result is one chunk
    counts[kind] += 1
    sizes[kind] += full
    traffic[kind] += full * (group - 1) / group * (2 if kind == "all-reduce" else 1)
  return {kind: Collective(counts[kind], sizes[kind], traffic[kind]) for kind in COLLECTIVES}


def comm_report(step, state, batch, weights=None, rng=None, *, compiled: bool = True) -> dict[str, Collective]:
  """The collectives of one step of `step` (a `jaxdp.make_train_step` result).

  `compiled=True` reads the compiled HLO: what runs on this backend, after
  XLA combined all-reduces and, on CPU, widened bfloat16 all-reduces to
  float32. `compiled=False` reads the HLO before optimisation: only the
  collectives jaxdp writes itself, in the dtype of `grad_reduce_dtype`
  (the bytes GPU and TPU backends move in bfloat16), not those XLA adds when
  it partitions the program (at ZeRO stages 1-2 the all-gathers of the
  updated parameters, and the norm's per-leaf sums). Counts are static: a
  collective inside a loop body counts once, and one in each branch of a
  conditional counts for each branch.
  """
  lowered = step.lower(state, batch, weights, rng)
  hlo = lowered.compile().as_text() if compiled else lowered.as_text(dialect="hlo")
  return collectives_from_hlo(hlo, data_size(step.mesh, step.axis_name))


class MemoryReport(NamedTuple):
  """Bytes per device (the first addressable device; all are alike up to uneven model-axis splits).

  Attributes:
    params: parameter bytes held at rest (from `addressable_shards`).
    opt_state: optimizer-state bytes held at rest (from `addressable_shards`).
    grads: gradient bytes the step keeps per device after reduction: the
      whole gradient at stages 0-1, each leaf's slice at stages 2-3 (derived
      from the layout: gradients are not part of the state).
    training_state: `params + opt_state + grads`, what the ZeRO paper calls the model states (not
      `TrainState.model_state`, the BatchNorm statistics).
    argument, output, temp: the compiled step's `memory_analysis()`.
    unsplit: `{key path: bytes}` of the state's leaves (parameters at stage
      3, optimizer state at stages 1-3) that the ZeRO stage would split over
      the data axis but that stay whole on every device there, because no
      dimension divides by the device count (see `jaxdp.sharding.layout.zero_dim`).
  """

  params: int
  opt_state: int
  grads: int
  training_state: int
  argument: int
  output: int
  temp: int
  unsplit: dict = {}

  @property
  def model_state(self) -> int:
    """jaxdp 0.1's name of `training_state` (it clashed with `TrainState.model_state`)."""
    warnings.warn("MemoryReport.model_state is MemoryReport.training_state now.", DeprecationWarning, stacklevel=2)
    return self.training_state


def _bytes_per_device(tree: Any, shardings: Any) -> int:
  """Bytes each device holds of `tree` placed with `shardings` (its largest shard: splits may be uneven)."""
  return sum(
      math.prod(sharding.shard_shape(np.shape(x))) * np.dtype(x.dtype).itemsize
      for x, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))
  )


def _grad_bytes(params: Any, grad_specs: Any, model_shardings: Any, mesh) -> int:
  total = 0
  for leaf, spec, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(grad_specs), jax.tree.leaves(model_shardings)):
    split = math.prod(mesh.shape[a] for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e))
    total += math.prod(sharding.shard_shape(np.shape(leaf))) // split * np.dtype(leaf.dtype).itemsize
  return total


def _unsplit(state: Any, layout, axis_name: str, mesh) -> dict:
  stage = layout.zero_stage
  fields = (["params"] if stage == 3 else []) + (["opt_state"] if stage >= 1 else [])
  found = {}
  for field in fields:
    leaves = jax.tree_util.tree_leaves_with_path(getattr(state, field))
    for (path, leaf), spec in zip(leaves, jax.tree.leaves(getattr(layout.specs, field))):
      if np.ndim(leaf) and not any(axis_name in ((e,) if isinstance(e, str) else (e or ())) for e in spec):
        # Per device: the leaf may still be split over a model axis.
        shape = jax.sharding.NamedSharding(mesh, spec).shard_shape(np.shape(leaf))
        found[f"{field}{jax.tree_util.keystr(path)}"] = math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return found


def memory_report(step, state, batch, weights=None, rng=None) -> MemoryReport:
  """Per-device memory of `state` (placed as `step` places it) and of one compiled step of `step`."""
  layout = step.layout(state)
  lowered = step.lower(state, batch, weights, rng)
  shardings = layout.shardings(step.mesh)
  params, opt_state = _bytes_per_device(state.params, shardings.params), _bytes_per_device(state.opt_state, shardings.opt_state)
  # The gradient has its parameter's model-axis split (stage 0's layout) and, at stages 2-3, the data split too.
  model = jax.tree.map(lambda x: jax.sharding.NamedSharding(step.mesh, x), step.layout_at(state, 0).specs.params)
  grads = _grad_bytes(state.params, layout.grad_specs, model, step.mesh)
  analysis = lowered.compile().memory_analysis()
  return MemoryReport(
      params=params,
      opt_state=opt_state,
      grads=grads,
      training_state=params + opt_state + grads,
      argument=int(analysis.argument_size_in_bytes),
      output=int(analysis.output_size_in_bytes),
      temp=int(analysis.temp_size_in_bytes),
      unsplit=_unsplit(state, layout, zero_axis(step.axis_name), step.mesh) if step.mesh.shape[zero_axis(step.axis_name)] > 1 else {},
  )
