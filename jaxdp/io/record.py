"""The record of a jaxdp checkpoint: leaf names, checksums, building and validating the JSON record.

What `jaxdp.io.checkpoint` writes next to the arrays, and every check made
on it, with no orbax lifecycle in it (this module never imports
`jaxdp.io.checkpoint`). See `jaxdp.io.checkpoint` for the format.

The checksum (`checksums`) composes over shards, so no process needs a
whole leaf to compute it: for a leaf of `n` elements, read as unsigned
words `w_i` (the element's own bytes: `uint8` to `uint64` by item size;
a 16-byte element is two words) at global flat word index `i`,

    H = sum_i (w_i + 1) * K_i  mod 2**64,   K_i = splitmix64(i) | 1.

Each process adds the terms of the shards it holds with `replica_id == 0`
(each global element lies in exactly one such shard over all processes), the
processes' partial sums are added (mod 2**64), and the result does not
depend on the layout: the same `H` on 2 devices at ZeRO stage 1 and on 8
devices at stage 3 with a model axis. A change of one word by `d` changes
`H` by `d * K_i`, never 0 mod 2**64 as `K_i` is odd; two words swapped
change it unless their `K` coincide. It is an integrity check against
storage faults, not a cryptographic hash.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
import optax

from jaxdp.io.data import steps_per_epoch
from jaxdp.sharding.layout import abstract_state, to_host
from jaxdp.core.state import TrainState

FORMAT = "jaxdp.io.checkpoint"
FORMAT_VERSION = 2
RNG = ("rng",)
MODEL_STATE = "model_state"
MAX_LISTED = 8
_MASK = (1 << 64) - 1
_CHUNK = 1 << 20  # elements per step of the checksum: bounds its temporaries (a few 8 MiB arrays)


# Leaf names --------------------------------------------------------------------------------------


def _entry_name(entry: Any) -> str:
  for attribute in ("key", "name", "idx"):
    if hasattr(entry, attribute):
      return str(getattr(entry, attribute))
  return str(entry)


def named_leaves(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
  """`[(path components, leaf)]` of `tree` in flattening order; paths must be distinct."""
  named, stored = [], {}  # the name orbax stores each leaf under -> (its path components, its key path)
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    for entry in path:
      key = getattr(entry, "key", None)
      if key is not None and type(key).__str__ is object.__str__ and type(key).__repr__ is object.__repr__:
        raise ValueError(
            f"the state's leaf {jax.tree_util.keystr(path)} has a dict key of type {type(key).__name__} whose name "
            "is its memory address (object's default repr), which another process or run cannot match on restore; "
            "use str, int or tuple keys, or give the type a __repr__. Nothing was written."
        )
    components = tuple(_entry_name(e) for e in path)
    # orbax names each array by its path joined with '.': {'x.y': a, 'x': {'y': b}} would be written to one
    # tensorstore array, one value silently overwriting the other (the restore then found the step corrupt).
    name = ".".join(components)
    if name in stored:
      first_components, first_path = stored[name]
      if first_components == components:
        raise ValueError(f"two leaves of the state share the path {'/'.join(components)!r}; use distinct dict keys.")
      raise ValueError(
          f"the state's leaves {jax.tree_util.keystr(first_path)} and {jax.tree_util.keystr(path)} would be stored "
          f"under the same checkpoint name {name!r} (orbax joins the path with '.'); rename a dict key so that no "
          "key containing '.' spells a nested path. Nothing was written."
      )
    stored[name] = (components, path)
    named.append((components, leaf))
  return named


def nested(named: list[tuple[tuple[str, ...], Any]]) -> dict:
  """The nested dict `{component: {...: leaf}}` orbax stores, from `named_leaves`."""
  root: dict = {}
  for components, leaf in named:
    node = root
    for c in components[:-1]:
      node = node.setdefault(c, {})
      if not isinstance(node, dict):
        raise ValueError(f"the state's path {'/'.join(components)!r} runs through a leaf; use distinct dict keys.")
    node[components[-1]] = leaf
  return root


def lookup(tree: dict, components: tuple[str, ...]) -> Any:
  """The entry of nested dict `tree` at path `components` (the inverse of `nested`)."""
  for c in components:
    tree = tree[c]
  return tree


def structure(tree: Any) -> str:
  """The container types of `tree`, e.g. `tuple(ScaleByAdamState(*, dict(*, *), dict(*, *)), EmptyState())`.

  What the leaf paths do not show: optax states of different optimizers can
  have the same fields (Adam's and AdaBelief's `count/mu/nu`). Built from
  class names rather than `str(treedef)`, whose format is JAX's to change.
  """

  def describe(treedef) -> str:
    node = treedef.node_data()
    if node is None:
      return "*"
    return f"{node[0].__name__}({', '.join(describe(c) for c in treedef.children())})"

  return describe(jax.tree.structure(tree))


def is_key_leaf(x: Any) -> bool:
  """Whether `x` (an array or `ShapeDtypeStruct`) holds typed PRNG keys (e.g. `optax.noisy_sgd`'s state)."""
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def stored_struct(x: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
  """What a checkpoint stores for leaf `x`: its own shape and dtype, or a typed key's raw `uint32` data."""
  if is_key_leaf(x):
    x = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(np.shape(x), x.dtype))
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def signature(tree: Any) -> dict:
  """`{"a/b": (shape, dtype name)}` of each leaf as a checkpoint stores it (see `stored_struct`)."""
  stored = {"/".join(c): stored_struct(x) for c, x in named_leaves(tree)}
  return {name: (s.shape, np.dtype(s.dtype).name) for name, s in stored.items()}


def abstract_full_state(params: Any, optimizer: optax.GradientTransformation, model_state: Any) -> TrainState:
  """The state of `params`, `optimizer` and `model_state` as `ShapeDtypeStruct`s."""
  try:
    return abstract_state(params, optimizer, model_state)
  except Exception as e:  # the user's optimizer and params: any failure means they do not fit
    raise ValueError(
        f"optimizer.init fails on params ({type(e).__name__}: {e}); pass the params template of the model."
    ) from e


# The PRNG key ------------------------------------------------------------------------------------


def is_typed_key(rng: Any) -> bool:
  """Whether `rng` is a typed key (else raw `uint32` key data); raises for anything else."""
  dtype = getattr(rng, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return True
  if dtype is not None and np.dtype(dtype) == np.uint32:
    return False
  raise ValueError(
      f"rng must be a PRNG key (jax.random.key(seed)) or raw uint32 key data (jax.random.PRNGKey(seed)), "
      f"got {type(rng).__name__} of dtype {dtype}; pass the key your loop carries, or rng=None."
  )


def _small_to_host(x: Any) -> np.ndarray:
  """A copy of `x` (a replicated or process-local value, such as a key) on the host."""
  if isinstance(x, jax.Array) and x.sharding.is_fully_replicated and x.sharding.has_addressable_devices:
    return np.array(x.addressable_shards[0].data)  # one device's copy: never assembled from shards
  return np.array(to_host(x))


def key_to_host(rng: Any) -> tuple[np.ndarray | None, str | None]:
  """`(raw key data as numpy, implementation name or None for a raw uint32 key)`."""
  if rng is None:
    return None, None
  if is_typed_key(rng):
    return _small_to_host(jax.random.key_data(rng)), str(jax.random.key_impl(rng))
  return _small_to_host(rng), None


def key_data_shape(impl: str | None) -> jax.ShapeDtypeStruct | None:
  """The shape and dtype of a key's raw data under PRNG implementation `impl`; `None` if JAX has no such one."""
  try:
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
  except (ValueError, TypeError):
    return None


# Checksums ---------------------------------------------------------------------------------------


def _odd_keys(index: np.ndarray) -> np.ndarray:
  """`splitmix64(index) | 1` for `uint64` indices (arithmetic mod 2**64), computed in place of a copy."""
  z = index + np.uint64(0x9E3779B97F4A7C15)
  z ^= z >> np.uint64(30)
  z *= np.uint64(0xBF58476D1CE4E5B9)
  z ^= z >> np.uint64(27)
  z *= np.uint64(0x94D049BB133111EB)
  z ^= z >> np.uint64(31)
  z |= np.uint64(1)
  return z


def _words(block: np.ndarray) -> np.ndarray:
  """`block`'s elements as unsigned words, shape `(*block.shape, words per element)`."""
  itemsize = block.dtype.itemsize
  width = min(itemsize, 8)
  if itemsize % width or width not in (1, 2, 4, 8):
    raise ValueError(f"no checksum for dtype {block.dtype} (item size {itemsize})")
  raw = np.ascontiguousarray(block).view(np.uint8).reshape(*block.shape, itemsize)
  return raw.view(np.dtype(f"<u{width}")).reshape(*block.shape, itemsize // width)


def _box_sum(data: np.ndarray, starts: tuple[int, ...], global_shape: tuple[int, ...]) -> int:
  """The checksum terms of `data`, the box of a leaf of `global_shape` that starts at `starts`."""
  if data.size == 0:
    return 0
  if data.ndim == 0:
    data, starts, global_shape = data.reshape(1), (0,), (1,)
  last = data.shape[-1]
  rows = data.reshape(-1, last)  # a view for the contiguous shards these are
  per_word = _words(rows[:1, :1]).shape[-1]
  row_step, column_step = max(1, _CHUNK // last), min(last, _CHUNK)
  sub = np.arange(per_word, dtype=np.uint64)
  total = 0
  for a in range(0, rows.shape[0], row_step):
    b = min(a + row_step, rows.shape[0])
    if data.ndim == 1:
      base = np.zeros((1,), np.uint64)
    else:
      coords = np.unravel_index(np.arange(a, b), data.shape[:-1])
      coords = tuple(c + start for c, start in zip(coords, starts))
      base = np.ravel_multi_index(coords, global_shape[:-1]).astype(np.uint64) * np.uint64(global_shape[-1])
    for c in range(0, last, column_step):
      d = min(c + column_step, last)
      columns = np.arange(starts[-1] + c, starts[-1] + d, dtype=np.uint64)
      index = base[:, None] + columns[None, :]  # global flat element indices of this block
      index = index[:, :, None] if per_word == 1 else index[:, :, None] * np.uint64(per_word) + sub  # of words
      words = _words(rows[a:b, c:d]).astype(np.uint64)
      words += np.uint64(1)
      words *= _odd_keys(index)
      total += int(np.sum(words, dtype=np.uint64))
  return total & _MASK


def _partial_sum(x: Any) -> int:
  """This process's part of leaf `x`'s checksum: its shards with `replica_id == 0` (process 0 for host values)."""
  shape = tuple(np.shape(x))
  if isinstance(x, jax.Array):
    total = 0
    for shard in x.addressable_shards:
      if shard.replica_id == 0:
        starts = tuple(s.indices(n)[0] for s, n in zip(shard.index, shape))
        total += _box_sum(np.asarray(shard.data), starts, shape)
    return total & _MASK
  return _box_sum(np.asarray(x), (0,) * len(shape), shape) if jax.process_index() == 0 else 0


def checksums(leaves: list[Any]) -> list[int]:
  """Each leaf's checksum (see the module docstring), summed over processes; a collective when there are several.

  `leaves` are global `jax.Array`s in any layout, or host values that
  every process holds alike. Reads only this process's shards.
  """
  sums = [_partial_sum(x) for x in leaves]
  if jax.process_count() == 1 or not sums:
    return sums
  from jax.experimental import multihost_utils

  # JAX's default 32-bit mode would truncate uint64: move each sum as two uint32 halves.
  halves = np.array([[s & 0xFFFFFFFF, s >> 32] for s in sums], np.uint32)
  gathered = np.asarray(multihost_utils.process_allgather(halves)).astype(np.uint64)
  return [sum(int(lo) | int(hi) << 32 for lo, hi in gathered[:, i]) & _MASK for i in range(len(sums))]


def checksum_text(value: int) -> str:
  """A checksum as the record spells it: 16 lowercase hex digits."""
  return f"{value:016x}"


# The record --------------------------------------------------------------------------------------


def check_metadata(metadata: Any) -> None:
  """Raises `ValueError` unless `metadata` is JSON with finite numbers, as the record stores it."""
  try:
    json.dumps(metadata, allow_nan=False)
  except (TypeError, ValueError) as e:
    raise ValueError(
        f"metadata must be JSON-serialisable (dicts, lists, strings, finite numbers, bools, None): {e}; "
        "convert arrays with .tolist() and other objects to strings."
    ) from e


def _spec_text(x: Any) -> str | None:
  sharding = getattr(x, "sharding", None)
  spec = getattr(sharding, "spec", None)
  return None if spec is None else str(spec)


def build_record(
    named: list[tuple[tuple[str, ...], Any]],
    sums: list[int],
    *,
    key_impls: dict | None = None,
    opt_state_structure: str,
    data_step: int,
    rng_impl: str | None,
    metadata: Any,
    devices: int,
    data_position: dict | None = None,
    data_states: list | None = None,
    mesh_shape: dict | None = None,
) -> dict:
  """The JSON record of a save of the leaves `named` (state leaves, then the key's data) with checksums `sums`.

  `key_impls`: `{path components: PRNG implementation}` of the state leaves saved as typed keys' raw data.
  """
  key_impls = key_impls or {}
  return {
      "format": FORMAT,
      "version": FORMAT_VERSION,
      "data_step": data_step,
      **({} if data_position is None else {"data_position": data_position}),
      **({} if data_states is None else {"data_states": data_states}),  # a GrainPipeline's, one per process
      "rng_impl": rng_impl,
      "saved_from": {"devices": devices, "processes": jax.process_count(),
                     **({} if mesh_shape is None else {"mesh": mesh_shape})},
      "metadata": metadata,
      "opt_state_structure": opt_state_structure,
      "leaves": [
          {
              "path": list(c),
              "shape": list(np.shape(x)),
              "dtype": np.dtype(x.dtype).name,
              "checksum": checksum_text(s),
              "spec": _spec_text(x),  # the layout saved from (for the reader; restoring ignores it)
              **({"key_impl": key_impls[c]} if c in key_impls else {}),
          }
          for (c, x), s in zip(named, sums)
      ],
  }


# What DataPipeline.position records (a checkpoint saved with pipeline=), besides the boolean "shuffle" (absent from
# checkpoints written before it existed, whose pipelines shuffled).
DATA_POSITION_FIELDS = ("epoch", "example", "num_examples", "seed", "global_batch", "devices")


class BadField(Exception):
  """A field of a jaxdp record that is not what `CheckpointManager.save` writes."""

  def __init__(self, field: str, value: Any, expected: str):
    super().__init__(field, value, expected)
    self.field, self.value, self.expected = field, value, expected


def _require(condition: bool, field: str, value: Any, expected: str) -> None:
  if not condition:
    raise BadField(field, value, expected)


def _is_count(x: Any) -> bool:
  return type(x) is int and x >= 0  # not bool, not a float such as 3.0: JSON keeps the type save() wrote


def _is_dtype_name(x: Any) -> bool:
  """Whether `x` is the name of a numeric numpy dtype (ml_dtypes' bfloat16 included), as save() writes it."""
  if not isinstance(x, str):
    return False
  try:
    dtype = np.dtype(x)
  except Exception:  # numpy parses dtype strings with several parsers, each with its own error
    return False
  return dtype.name == x and dtype.kind not in "OSUMm" and dtype.type is not np.void


def _is_checksum(x: Any) -> bool:
  return isinstance(x, str) and len(x) == 16 and all(c in "0123456789abcdef" for c in x)


def _check_leaf_entry(entry: Any, name: str) -> None:
  _require(isinstance(entry, dict), name, entry, "a dict with path, shape, dtype and checksum")
  path, shape, dtype, checksum = (entry.get(k) for k in ("path", "shape", "dtype", "checksum"))
  ok_path = isinstance(path, list) and path and all(isinstance(c, str) for c in path)  # "" is a dict key
  _require(ok_path, f"{name}.path", path, "a non-empty list of strings")
  _require(isinstance(shape, list) and all(map(_is_count, shape)), f"{name}.shape", shape, "a list of integers >= 0")
  _require(_is_dtype_name(dtype), f"{name}.dtype", dtype, "the name of a numeric numpy dtype, e.g. float32")
  _require(_is_checksum(checksum), f"{name}.checksum", checksum, "16 lowercase hexadecimal digits")
  if "key_impl" in entry:  # a typed PRNG key of the state, stored as its raw data
    impl = entry["key_impl"]
    data = key_data_shape(impl) if isinstance(impl, str) else None
    fits = data is not None and dtype == np.dtype(data.dtype).name and tuple(shape[len(shape) - len(data.shape):]) \
        == data.shape
    _require(fits, f"{name}.key_impl", impl, "a JAX PRNG implementation whose keys' data ends the saved shape")


def _check_rng_impl(impl: Any, key: dict | None) -> None:
  """`impl` must fit the saved key: none without a key, a JAX PRNG whose key data has the saved shape and dtype."""
  if key is None:
    _require(impl is None, "rng_impl", impl, "null, as the checkpoint holds no PRNG key")
  elif impl is None:
    _require(key["dtype"] == "uint32", "rng_impl", impl, f"a PRNG implementation's name, as the key is {key['dtype']}")
  else:
    data = key_data_shape(impl) if isinstance(impl, str) else None
    _require(data is not None, "rng_impl", impl, "null or the name of a JAX PRNG implementation, e.g. threefry2x32")
    shape = tuple(key["shape"])  # one key, or an array of keys (save accepts both): the key data ends the shape
    fits = shape[len(shape) - len(data.shape):] == data.shape and key["dtype"] == np.dtype(data.dtype).name
    _require(fits, "rng_impl", impl, f"an implementation whose keys' data is {key['dtype']}{key['shape']}, as saved")


def _consistent_position(p: dict, data_step: int) -> bool:
  """Whether `p` is what `DataPipeline.position(data_step)` gives for some pipeline."""
  if p["devices"] < 1 or p["global_batch"] < 1 or p["num_examples"] < 1:
    return False
  epoch_steps = steps_per_epoch(p["num_examples"], p["global_batch"])
  return (p["example"] < p["num_examples"] and p["example"] % p["global_batch"] == 0
          and data_step == p["epoch"] * epoch_steps + p["example"] // p["global_batch"])


def check_record(record: dict) -> None:
  """Raises `BadField` for the first field read from `record` that save() could not have written."""
  _require(_is_count(record.get("data_step")), "data_step", record.get("data_step"), "an integer >= 0")
  if "data_position" in record:
    position = record["data_position"]
    _require(isinstance(position, dict) and set(position) - {"shuffle"} == set(DATA_POSITION_FIELDS)
             and all(_is_count(position[k]) for k in DATA_POSITION_FIELDS)
             and isinstance(position.get("shuffle", True), bool), "data_position", position,
             f"an object of integers >= 0: {', '.join(DATA_POSITION_FIELDS)}, and an optional boolean shuffle")
    _require(_consistent_position(position, record["data_step"]), "data_position", position,
             f"the position of data_step {record['data_step']} (a whole number of batches into an epoch of a "
             "non-empty dataset)")
  if "data_states" in record:
    states = record["data_states"]
    _require(isinstance(states, list) and len(states) > 0 and all(isinstance(x, dict) for x in states),
             "data_states", states, "a non-empty list of objects, one GrainPipeline position per process")
  leaves = record.get("leaves")
  _require(isinstance(leaves, list) and len(leaves) > 0, "leaves", leaves, "a non-empty list of leaf entries")
  seen = {}
  for i, entry in enumerate(leaves):
    _check_leaf_entry(entry, f"leaves[{i}]")
    path = tuple(entry["path"])
    _require(path not in seen, f"leaves[{i}].path", entry["path"], f"a path of its own, not leaves[{seen.get(path)}]'s")
    seen[path] = i
  _check_rng_impl(record.get("rng_impl"), leaves[seen[RNG]] if RNG in seen else None)
  structure_ = record.get("opt_state_structure")
  _require(isinstance(structure_, str), "opt_state_structure", structure_, "a string")


def _differences(found: dict, expected: dict, found_name: str, expected_name: str) -> list[str]:
  """One line per leaf path that is missing, unexpected, or of another shape or dtype."""
  lines = []
  for name, want in expected.items():
    got = found.get(name)
    if got is None:
      lines.append(f"{name}: missing from {found_name} ({expected_name} has shape {tuple(want[0])}, dtype {want[1]})")
    elif tuple(got[0]) != tuple(want[0]):
      lines.append(f"{name}: shape {tuple(got[0])} in {found_name}, {tuple(want[0])} in {expected_name}")
    elif got[1] != want[1]:
      lines.append(f"{name}: dtype {got[1]} in {found_name}, {want[1]} in {expected_name}")
  for name, got in found.items():
    if name not in expected:
      lines.append(f"{name}: in {found_name} (shape {tuple(got[0])}, dtype {got[1]}) but not in {expected_name}")
  return lines


def listing(lines: list[str]) -> str:
  """`lines` indented for an error message, the first `MAX_LISTED` of them."""
  more = [f"... and {len(lines) - MAX_LISTED} more"] if len(lines) > MAX_LISTED else []
  return "\n  " + "\n  ".join(lines[:MAX_LISTED] + more)


def check_against(record: dict, expected: Any, where: str, *, train_state: Any = None, prefix: tuple = (),
                  opt_state: Any = None) -> None:
  """Refuses a target (an abstract state) that does not fit the checkpoint's record; reads no array.

  `expected` is a `jaxdp.TrainState`, or a tree holding one (`train_state`, at the leaf path
  `prefix`: a DiLoCo state's `inner`); `opt_state`: the optimizer states whose container types the record
  holds (default `train_state.opt_state`).
  """
  train_state = expected if train_state is None else train_state
  opt_state = train_state.opt_state if opt_state is None else opt_state
  at = len(prefix)
  saved_model_state = ["/".join(e["path"]) for e in record["leaves"]
                       if tuple(e["path"][:at]) == tuple(prefix) and e["path"][at:at + 1] == [MODEL_STATE]]
  expected_model_state = train_state.model_state
  if saved_model_state and not jax.tree.leaves(expected_model_state):
    raise ValueError(
        f"{where} holds model state ({', '.join(saved_model_state[:3])}"
        f"{', ...' if len(saved_model_state) > 3 else ''}) but restore got model_state=None; pass its template "
        "as model_state= (the model state given to jaxdp.init_state, e.g. flax's batch_stats, or "
        "jax.ShapeDtypeStructs of it)."
    )
  if jax.tree.leaves(expected_model_state) and not saved_model_state:
    raise ValueError(
        f"{where} holds no model state (it was saved from a TrainState with model_state=None) but "
        "restore got a model_state= template; restore it with model_state=None."
    )
  found = {"/".join(e["path"]): (e["shape"], e["dtype"]) for e in record["leaves"] if tuple(e["path"]) != RNG}
  lines = _differences(found, signature(expected), "the checkpoint", "the target")
  saved_keys = {"/".join(e["path"]) for e in record["leaves"] if "key_impl" in e}
  for c, x in named_leaves(expected):
    name = "/".join(c)
    if name in found and is_key_leaf(x) != (name in saved_keys):
      held, wanted = ("raw uint32 data", "typed PRNG keys") if is_key_leaf(x) else ("typed PRNG keys", "raw data")
      lines.append(f"{name}: {held} in the checkpoint, {wanted} in the target")
  if lines:
    raise ValueError(
        f"{where} does not match the target state (params and model_state templates and "
        f"optimizer); restore with the model and optimizer it was saved with:{listing(lines)}"
    )
  saved, target = record["opt_state_structure"], structure(opt_state)
  if saved != target:
    raise ValueError(
        f"{where} holds the state of another optimizer: its optimizer state is {saved}, the "
        f"target optimizer's (optimizer.init(params)) is {target}; restore with the optimizer it was saved with."
    )


def failed_leaves(record: dict, arrays: dict[tuple[str, ...], Any]) -> list[str]:
  """The paths of the restored `arrays` whose shape, dtype or checksum differs from the record's (a collective)."""
  entries = [(tuple(e["path"]), e) for e in record["leaves"]]
  sums = checksums([arrays[c] for c, _ in entries])
  return [
      "/".join(c) for (c, e), s in zip(entries, sums)
      if tuple(arrays[c].shape) != tuple(e["shape"]) or np.dtype(arrays[c].dtype).name != e["dtype"]
      or checksum_text(s) != e["checksum"]
  ]
