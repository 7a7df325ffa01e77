"""Checkpoints: the training state, PRNG key and input position, saved with orbax.

A checkpoint holds the *gathered* state: every leaf at its full shape, with
the pytree structure of ZeRO stage 0 (what :func:`jaxdp.gather_state`
returns), whatever the layout it was saved from. Restoring takes a target
layout (params template, optimizer, mesh, ``zero_stage``) and builds the
state for it directly from the host arrays, each process placing only its own
shards. So a checkpoint restores onto any device count, process count or
ZeRO stage, with the optimizer state moved exactly, never re-initialised.

Why not save the sharded arrays and restore through an abstract target of
``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``: orbax can re-split a
global array over other devices, but not change its global shape, and the
global shape of a ZeRO leaf depends on the device count (it is flattened and
padded to a multiple of ``N``, see :mod:`jaxdp.sharding`). A stage-3 leaf
saved on 2 devices has no shape to restore on 3 devices; the full-shape
stage-0 form is the one layout-free representation. The price: saving copies
the full state to the host of every process (the ZeRO shards are gathered,
once per process), and process 0 writes it. That is what a replicated
(stage-0) run already holds on every device.

Format (``jaxdp.checkpoint`` version 1), one orbax step directory per step:

* item ``state``: the arrays, through orbax's ``StandardCheckpointHandler``
  (tensorstore/OCDBT with JSON metadata), as a nested dict keyed by the leaf
  paths (``params/w``, ``opt_state/0/mu/w``, ``step``,
  ``model_state/batch_stats/mean`` when the state has model state, ``rng``);
* item ``jaxdp``: JSON (``JsonCheckpointHandler``): the format, the
  ``data_step`` (the input pipeline's position; ``TrainState.step`` does not
  count steps skipped for zero weight), the PRNG key's implementation, the
  layout saved from, the user's metadata, the optimizer state's container
  types (``opt_state_structure``, e.g. ``ScaleByAdamState``: leaf paths alone
  do not tell Adam from AdaBelief; absent from checkpoints of older jaxdp
  versions, which then skip that check), and each leaf's path, shape, dtype
  and CRC-32.

Nothing is pickled and nothing executes code on load. Restoring validates
the record (every field it reads), checks it against the target (structure,
shapes, dtypes, optimizer state types) before reading any array, and every
array against its CRC-32 after reading, before anything is placed on a
device: a mismatched, truncated or corrupt checkpoint raises ``ValueError``
and never restores part of a state.

Atomicity and retention are orbax's: a step is written to
``<step>.orbax-checkpoint-tmp`` and renamed when complete, so a crash during
a save leaves the previous checkpoints intact and the unfinished one is
ignored (and removed when the next manager opens the directory). The list of
steps is re-read from the directory when it is asked for, so a step deleted
by hand is not offered for restoring. An asynchronous save that fails raises
its error at the next :meth:`CheckpointManager.wait`, :meth:`~CheckpointManager.close`
or :meth:`~CheckpointManager.save`, and leaves no thread behind that would
delay the process's exit.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding

from jaxdp._checks import check_int, check_state
from jaxdp.mesh import check_mesh_axis, replicated, split_along
from jaxdp.sharding import (
    FlatShards,
    _to_host,
    abstract_zero_state,
    check_zero_stage,
    gather_state,
    is_flat_shards,
    zero_stage_of,
)
from jaxdp.state import TrainState

FORMAT = "jaxdp.checkpoint"
FORMAT_VERSION = 1
_STATE_ITEM = "state"
_RECORD_ITEM = "jaxdp"
_RNG = ("rng",)
_MODEL_STATE = "model_state"
_MAX_LISTED = 8


class Restored(NamedTuple):
  """What :meth:`CheckpointManager.restore` returns.

  Attributes:
    state: the :class:`jaxdp.TrainState` in the requested layout, ready for
      ``make_train_step(..., zero_stage=...)`` on the requested mesh.
    rng: the saved PRNG key (a typed key if a typed key was saved, else the
      raw ``uint32`` key data), replicated on the mesh; ``None`` if none was saved.
    data_step: the input pipeline's position: pass it to
      ``DataPipeline.iterate(start_step=data_step)``.
    step: the checkpoint's step.
    metadata: the user metadata saved with it (as ``json.loads`` returns it), or ``None``.
  """

  state: TrainState
  rng: jax.Array | None
  data_step: int
  step: int
  metadata: Any


# Leaf names ---------------------------------------------------------------------------------


def _entry_name(entry: Any) -> str:
  for attribute in ("key", "name", "idx"):
    if hasattr(entry, attribute):
      return str(getattr(entry, attribute))
  return str(entry)


def _named_leaves(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
  """``[(path components, leaf)]`` of ``tree`` in flattening order; paths must be distinct."""
  named, seen = [], set()
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    components = tuple(_entry_name(e) for e in path)
    if components in seen:
      raise ValueError(f"two leaves of the state share the path {'/'.join(components)!r}; use distinct dict keys.")
    seen.add(components)
    named.append((components, leaf))
  return named


def _nested(named: list[tuple[tuple[str, ...], Any]]) -> dict:
  """The nested dict ``{component: {...: leaf}}`` orbax stores, from ``_named_leaves``."""
  root: dict = {}
  for components, leaf in named:
    node = root
    for c in components[:-1]:
      node = node.setdefault(c, {})
      if not isinstance(node, dict):
        raise ValueError(f"the state's path {'/'.join(components)!r} runs through a leaf; use distinct dict keys.")
    node[components[-1]] = leaf
  return root


def _lookup(tree: dict, components: tuple[str, ...]) -> Any:
  for c in components:
    tree = tree[c]
  return tree


def _crc32(x: np.ndarray) -> int:
  return zlib.crc32(np.ascontiguousarray(x).reshape(-1).view(np.uint8))


def _device_count(state: TrainState) -> int:
  """The number of devices ``state`` is placed on (1 for host arrays)."""
  sharding = getattr(jax.tree.leaves(state)[0], "sharding", None)
  return len(sharding.device_set) if sharding is not None else 1


def _describe(components: tuple[str, ...], x: Any) -> dict:
  return {"path": list(components), "shape": list(np.shape(x)), "dtype": np.dtype(x.dtype).name}


def _structure(tree: Any) -> str:
  """The container types of ``tree``, e.g. ``tuple(ScaleByAdamState(*, dict(*, *), dict(*, *)), EmptyState())``.

  What the leaf paths do not show: optax states of different optimizers can
  have the same fields (Adam's and AdaBelief's ``count/mu/nu``). Built from
  class names rather than ``str(treedef)``, whose format is JAX's to change.
  """

  def describe(treedef) -> str:
    node = treedef.node_data()
    if node is None:
      return "*"
    return f"{node[0].__name__}({', '.join(describe(c) for c in treedef.children())})"

  return describe(jax.tree.structure(tree))


# The PRNG key --------------------------------------------------------------------------------


def _is_typed_key(rng: Any) -> bool:
  """Whether ``rng`` is a typed key (else raw ``uint32`` key data); raises for anything else."""
  dtype = getattr(rng, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return True
  if dtype is not None and np.dtype(dtype) == np.uint32:
    return False
  raise ValueError(
      f"rng must be a PRNG key (jax.random.key(seed)) or raw uint32 key data (jax.random.PRNGKey(seed)), "
      f"got {type(rng).__name__} of dtype {dtype}; pass the key your loop carries, or rng=None."
  )


def _key_to_host(rng: Any) -> tuple[np.ndarray | None, str | None]:
  """``(raw key data as numpy, implementation name or None for a raw uint32 key)``."""
  if rng is None:
    return None, None
  if _is_typed_key(rng):
    return np.array(_to_host(jax.random.key_data(rng))), str(jax.random.key_impl(rng))
  return np.array(_to_host(rng)), None


def _key_from_host(data: np.ndarray, impl: str | None, mesh: Mesh) -> jax.Array:
  placed = _from_host(data, replicated(mesh))
  return placed if impl is None else jax.random.wrap_key_data(placed, impl=impl)


def _key_data_shape(impl: str | None) -> jax.ShapeDtypeStruct | None:
  """The shape and dtype of a key's raw data under PRNG implementation ``impl``; ``None`` if JAX has no such one."""
  try:
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
  except (ValueError, TypeError):
    return None


# Placing a full state on a layout ----------------------------------------------------------


def _from_host(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """The global array with this process's shards of host array ``x``, in fresh buffers."""
  # A copy per shard: no device buffer may alias ``x`` or another device's buffer (steps donate them).
  return jax.make_array_from_callback(x.shape, sharding, lambda index: np.array(x[index], copy=True))


def _place_leaf(x: np.ndarray, target: Any, mesh: Mesh, axis_name: str) -> Any:
  # The shardings of jaxdp.mesh, so that a restored state is placed exactly as init_state places one.
  if is_flat_shards(target):
    flat = np.zeros(target.flat.shape, x.dtype)
    flat[: x.size] = x.reshape(-1)
    return FlatShards(_from_host(flat, split_along(mesh, axis_name)), target.shape, target.stage)
  return _from_host(x, replicated(mesh))


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


def _listing(lines: list[str]) -> str:
  more = [f"... and {len(lines) - _MAX_LISTED} more"] if len(lines) > _MAX_LISTED else []
  return "\n  " + "\n  ".join(lines[:_MAX_LISTED] + more)


def _signature(tree: Any) -> dict:
  return {"/".join(c): (np.shape(x), np.dtype(x.dtype).name) for c, x in _named_leaves(tree)}


def _abstract_full_state(params: Any, optimizer: optax.GradientTransformation, model_state: Any) -> TrainState:
  """The stage-0 state of ``params``, ``optimizer`` and ``model_state`` as ``ShapeDtypeStruct``s."""
  if any(is_flat_shards(x) for x in jax.tree.leaves(params, is_leaf=is_flat_shards)):
    raise ValueError(
        "params holds ZeRO FlatShards; pass the full parameter tree (the initial params, "
        "jax.eval_shape of the model's init, or jaxdp.gather_state(state).params)."
    )
  try:
    return abstract_zero_state(params, optimizer, 1, 0, model_state)
  except Exception as e:  # the user's optimizer and params: any failure means they do not fit
    raise ValueError(
        f"optimizer.init fails on params ({type(e).__name__}: {e}); pass the params template of the model."
    ) from e


def place_state(
    full_state: TrainState,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    zero_stage: int = 0,
    axis_name: str = "data",
) -> TrainState:
  """Places a full (gathered) state on ``mesh`` in the layout of ``zero_stage``; inverse of :func:`jaxdp.gather_state`.

  The optimizer state is moved as it is (ZeRO chunks are cut from the full
  moments), never re-initialised, so ``gather_state(place_state(full, ...))``
  equals ``full`` exactly, on any device count and stage. Each process places
  only the shards of its own devices; every process must pass the same
  ``full_state``.

  Args:
    full_state: a :class:`jaxdp.TrainState` with the structure of stage 0 and
      full-shape leaves (numpy or JAX), e.g. ``jaxdp.gather_state(state)``.
      Its ``model_state`` (if any) is placed replicated, as at every stage.
    optimizer: the optax optimizer the state belongs to.
    mesh: the mesh to place the state on.
    zero_stage: the layout wanted (see :func:`jaxdp.init_state`).
    axis_name: the data-parallel axis.

  Returns:
    A :class:`jaxdp.TrainState` of fresh buffers, placed as
    ``make_train_step(..., zero_stage=zero_stage)`` on ``mesh`` expects.

  Raises:
    ValueError: if ``full_state`` does not match ``optimizer.init(full_state.params)``
      in structure, shapes, dtypes or state types, or if the optimizer's state under
      ``zero_stage`` is not a re-layout of its stage-0 state (e.g. a factored
      optimizer whose state depends on the parameters' shapes).
  """
  check_state(full_state, "full_state")
  check_mesh_axis(mesh, axis_name)
  check_zero_stage(zero_stage)
  expected = _abstract_full_state(full_state.params, optimizer, full_state.model_state)
  lines = _differences(_signature(full_state), _signature(expected), "full_state", "optimizer.init(full_state.params)")
  if not lines:  # same leaves: the containers may still differ (Adam's state and AdaBelief's)
    lines = [
        f"{field}: {_structure(got)} in full_state, {_structure(want)} in optimizer.init(full_state.params)"
        for field, got, want in zip(TrainState._fields, full_state, expected)
        if _structure(got) != _structure(want)
    ]
  if lines:
    raise ValueError(
        "full_state is not a full stage-0 state of this optimizer; pass jaxdp.gather_state(state) of a state "
        f"built with the same params and optimizer:{_listing(lines)}"
    )
  leaves = jax.tree.leaves(full_state)
  return _place_full_leaves(leaves, full_state.params, full_state.model_state, optimizer, mesh, zero_stage, axis_name)


def _place_full_leaves(
    leaves: list, params: Any, model_state: Any, optimizer, mesh: Mesh, zero_stage: int, axis_name: str
) -> TrainState:
  """The state of ``zero_stage`` from the stage-0 state's leaves (host arrays, in flattening order)."""
  layout = abstract_zero_state(params, optimizer, mesh.shape[axis_name], zero_stage, model_state)
  targets, treedef = jax.tree.flatten(layout, is_leaf=is_flat_shards)
  shapes = [t.shape if is_flat_shards(t) else tuple(t.shape) for t in targets]
  if shapes != [np.shape(x) for x in leaves]:
    raise ValueError(
        f"the optimizer's state under zero_stage={zero_stage} is not a re-layout of its stage-0 state (its leaves "
        "have other shapes), so it cannot be moved between stages; restore with zero_stage=0, or use an "
        "elementwise optimizer (SGD, momentum, Adam) with ZeRO."
    )
  placed = [_place_leaf(np.asarray(x), t, mesh, axis_name) for x, t in zip(leaves, targets)]
  return jax.tree.unflatten(treedef, placed)


# The record ----------------------------------------------------------------------------------


class _BadField(Exception):
  """A field of a jaxdp record that is not what :meth:`CheckpointManager.save` writes."""

  def __init__(self, field: str, value: Any, expected: str):
    super().__init__(field, value, expected)
    self.field, self.value, self.expected = field, value, expected


def _require(condition: bool, field: str, value: Any, expected: str) -> None:
  if not condition:
    raise _BadField(field, value, expected)


def _is_count(x: Any) -> bool:
  return type(x) is int and x >= 0  # not bool, not a float such as 3.0: JSON keeps the type save() wrote


def _is_dtype_name(x: Any) -> bool:
  """Whether ``x`` is the name of a numeric numpy dtype (ml_dtypes' bfloat16 included), as ``_describe`` writes it."""
  if not isinstance(x, str):
    return False
  try:
    dtype = np.dtype(x)
  except Exception:  # numpy parses dtype strings with several parsers, each with its own error
    return False
  return dtype.name == x and dtype.kind not in "OSUMm" and dtype.type is not np.void


def _check_leaf_entry(entry: Any, name: str) -> None:
  _require(isinstance(entry, dict), name, entry, "a dict with path, shape, dtype and crc32")
  path, shape, dtype, crc32 = (entry.get(k) for k in ("path", "shape", "dtype", "crc32"))
  ok_path = isinstance(path, list) and path and all(isinstance(c, str) and c for c in path)
  _require(ok_path, f"{name}.path", path, "a non-empty list of non-empty strings")
  _require(isinstance(shape, list) and all(map(_is_count, shape)), f"{name}.shape", shape, "a list of integers >= 0")
  _require(_is_dtype_name(dtype), f"{name}.dtype", dtype, "the name of a numeric numpy dtype, e.g. float32")
  _require(_is_count(crc32) and crc32 < 2**32, f"{name}.crc32", crc32, "an integer in [0, 2**32)")


def _check_rng_impl(impl: Any, key: dict | None) -> None:
  """``impl`` must fit the saved key: none without a key, a JAX PRNG whose key data has the saved shape and dtype."""
  if key is None:
    _require(impl is None, "rng_impl", impl, "null, as the checkpoint holds no PRNG key")
  elif impl is None:
    _require(key["dtype"] == "uint32", "rng_impl", impl, f"a PRNG implementation's name, as the key is {key['dtype']}")
  else:
    data = _key_data_shape(impl) if isinstance(impl, str) else None
    _require(data is not None, "rng_impl", impl, "null or the name of a JAX PRNG implementation, e.g. threefry2x32")
    fits = tuple(key["shape"]) == data.shape and key["dtype"] == np.dtype(data.dtype).name
    _require(fits, "rng_impl", impl, f"an implementation whose keys' data is {key['dtype']}{key['shape']}, as saved")


def _check_record(record: dict) -> None:
  """Raises :class:`_BadField` for the first field read from ``record`` that save() could not have written."""
  _require(_is_count(record.get("data_step")), "data_step", record.get("data_step"), "an integer >= 0")
  leaves = record.get("leaves")
  _require(isinstance(leaves, list) and len(leaves) > 0, "leaves", leaves, "a non-empty list of leaf entries")
  seen = {}
  for i, entry in enumerate(leaves):
    _check_leaf_entry(entry, f"leaves[{i}]")
    path = tuple(entry["path"])
    _require(path not in seen, f"leaves[{i}].path", entry["path"], f"a path of its own, not leaves[{seen.get(path)}]'s")
    seen[path] = i
  _check_rng_impl(record.get("rng_impl"), leaves[seen[_RNG]] if _RNG in seen else None)
  structure = record.get("opt_state_structure")  # absent from checkpoints of older jaxdp versions
  _require(structure is None or isinstance(structure, str), "opt_state_structure", structure, "a string")


# The manager ---------------------------------------------------------------------------------


def _check_metadata(metadata: Any) -> None:
  try:
    json.dumps(metadata, allow_nan=False)
  except (TypeError, ValueError) as e:
    raise ValueError(
        f"metadata must be JSON-serialisable (dicts, lists, strings, finite numbers, bools, None): {e}; "
        "convert arrays with .tolist() and other objects to strings."
    ) from e


class CheckpointManager:
  """Saves the training state every ``save_interval_steps`` steps and keeps the last ``max_to_keep``.

  A thin layer over ``orbax.checkpoint.CheckpointManager`` that stores the
  state in a layout-free form (see :mod:`jaxdp.checkpoint`) together with
  the PRNG key, the input pipeline's position and JSON metadata. In a
  multi-process job every process creates the manager on the same (shared)
  directory and calls :meth:`save` and :meth:`restore` at the same steps.

  Example::

    with jaxdp.CheckpointManager(path, save_interval_steps=100, max_to_keep=3) as ckpt:
      if ckpt.latest_step() is None:
        state, rng, start = jaxdp.init_state(params, opt, mesh), jax.random.key(0), 0
      else:
        state, rng, start, _, _ = ckpt.restore(params=params, optimizer=opt, mesh=mesh)
      for step, (batch, weights) in pipe.iterate(start, num_steps - start):
        rng, key = jax.random.split(rng)
        state, metrics = train_step(state, batch, weights, key)
        ckpt.save(step + 1, state, rng=rng)

  Args:
    directory: where the step directories go; created if missing.
    save_interval_steps: :meth:`save` writes only steps that are multiples
      of it (unless forced).
    max_to_keep: how many of the newest checkpoints to keep; ``None`` keeps all.
    enable_async_checkpointing: :meth:`save` returns once the arrays are on
      the host and writes them in a background thread; call :meth:`wait`
      before relying on a save, and :meth:`close` (or use ``with``) before
      the process exits, else the last save is lost (never half-written).
      A background save that fails raises its error at the next
      :meth:`wait`, :meth:`close` or :meth:`save`.
  """

  def __init__(
      self,
      directory: str | os.PathLike,
      *,
      save_interval_steps: int = 1,
      max_to_keep: int | None = None,
      enable_async_checkpointing: bool = True,
  ):
    self.directory = os.path.abspath(os.fspath(directory))
    self.save_interval_steps = check_int(save_interval_steps, "save_interval_steps", 1, "save every k >= 1 steps.")
    if max_to_keep is not None:
      max_to_keep = check_int(max_to_keep, "max_to_keep", 1, "keep at least one checkpoint, or None to keep all.")
    if not isinstance(enable_async_checkpointing, bool):
      raise ValueError(f"enable_async_checkpointing must be a bool, got {enable_async_checkpointing!r}.")
    self.max_to_keep = max_to_keep
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=self.save_interval_steps,
        max_to_keep=max_to_keep,
        enable_async_checkpointing=enable_async_checkpointing,
        cleanup_tmp_directories=True,  # unfinished saves of a crashed run
        create=True,
        # orbax's default creates the step's directories in a background thread too, and its other background
        # threads (array and JSON writes) block on an in-process signal that this one sends on success only.
        # When creating them fails, those threads wait out orbax's 300 s coordination timeout, and being
        # non-daemon they hold up the interpreter's exit that long. Created here in save() (a few mkdirs), a
        # failure raises from save() itself and no thread waits on a signal.
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
    )
    handlers = {_STATE_ITEM: ocp.StandardCheckpointHandler(), _RECORD_ITEM: ocp.JsonCheckpointHandler()}
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
    # orbax removes unfinished saves in a background thread that only its next save awaits; await it now, so
    # the directory holds complete steps only once the manager exists (and close() cannot race the thread).
    getattr(self._manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def all_steps(self) -> list[int]:
    """The steps of the complete checkpoints, oldest first (unfinished saves are not listed).

    Read from the directory, so a step removed by hand is not listed. While
    an asynchronous save is in flight its step is listed as orbax records it.
    """
    self._refresh()
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or ``None`` if there is none (see :meth:`all_steps`)."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def _refresh(self, wait: bool = False) -> None:
    """Re-reads the list of steps from the directory; with ``wait``, after the save in flight (raising its failure).

    orbax lists the directory once, when the manager opens, and then only
    tracks its own saves: a step deleted meanwhile would still be the latest.
    The list is not re-read during an asynchronous save, whose step orbax
    tracks for retention (``max_to_keep``) before it is on disk; every
    process finishes a save together (orbax syncs them), so all processes
    re-read the same directory contents.
    """
    if wait:
      self.wait()
    if not self._manager.is_saving_in_progress():
      self._manager.reload()

  def should_save(self, step: int) -> bool:
    """Whether :meth:`save` at ``step`` (not forced) writes a checkpoint."""
    return self._manager.should_save(check_int(step, "step", 0, "steps count from 0."))

  def save(
      self,
      step: int,
      state: TrainState,
      *,
      rng: jax.Array | None = None,
      data_step: int | None = None,
      metadata: Any = None,
      force: bool = False,
  ) -> bool:
    """Saves ``state`` as checkpoint ``step`` if ``step`` is due (a multiple of ``save_interval_steps``) or forced.

    A collective in a multi-process job: call it on every process with the
    same arguments. The state is copied to the host before it returns, so the
    step may donate ``state`` right after, even with asynchronous saving.

    Args:
      step: the checkpoint's number, usually the number of loop steps done.
      state: the :class:`jaxdp.TrainState`, in any layout.
      rng: the PRNG key the loop carries (typed or raw ``uint32``), or ``None``.
      data_step: the input pipeline's position to resume from (the
        ``start_step`` of ``DataPipeline.iterate``); default ``step``.
      metadata: JSON-serialisable user data (a config, metrics).
      force: save even if ``step`` is not a multiple of ``save_interval_steps``.

    Returns:
      Whether a checkpoint was written (or, asynchronously, started). Not
      forced, a step at or below the latest checkpoint's is never written
      (orbax's rule), e.g. after restoring an older checkpoint than the latest.
    """
    step = check_int(step, "step", 0, "steps count from 0.")
    check_state(state)
    data_step = step if data_step is None else check_int(data_step, "data_step", 0, "pass the pipeline's next step.")
    _check_metadata(metadata)
    if rng is not None:
      _is_typed_key(rng)
    if force and step in self._manager.all_steps():
      raise ValueError(f"step {step} already has a checkpoint in {self.directory}; save under a new step.")
    if not (force or self._manager.should_save(step)):
      return False
    self.wait()  # orbax would too; here a failed previous save raises with jaxdp's note, before any work
    rng_data, rng_impl = _key_to_host(rng)
    full = gather_state(state)
    arrays = _named_leaves(jax.tree.map(np.array, full))
    if rng_data is not None:
      arrays.append((_RNG, rng_data))
    record = self._record(arrays, state, _structure(full.opt_state), data_step, rng_impl, metadata)
    args = ocp.args.Composite(
        **{_STATE_ITEM: ocp.args.StandardSave(_nested(arrays)), _RECORD_ITEM: ocp.args.JsonSave(record)}
    )
    return bool(self._manager.save(step, args=args, force=force))

  @staticmethod
  def _record(arrays, state: TrainState, opt_state_structure: str, data_step: int, rng_impl, metadata) -> dict:
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "data_step": data_step,
        "rng_impl": rng_impl,
        "saved_from": {
            "zero_stage": zero_stage_of(state),
            "devices": _device_count(state),
            "processes": jax.process_count(),
        },
        "metadata": metadata,
        # The gathered state's: stage 0's structure, whatever the layout saved from, so any stage restores it.
        "opt_state_structure": opt_state_structure,
        "leaves": [{**_describe(c, x), "crc32": _crc32(x)} for c, x in arrays],
    }

  def restore(
      self,
      step: int | None = None,
      *,
      params: Any,
      optimizer: optax.GradientTransformation,
      mesh: Mesh,
      zero_stage: int = 0,
      axis_name: str = "data",
      model_state: Any = None,
  ) -> Restored:
    """Restores checkpoint ``step`` (default: the latest) onto the layout described by the target.

    The layout need not be the one saved from: another device count, process
    count or ZeRO stage gives the same :func:`jaxdp.gather_state`. A
    collective in a multi-process job; every process reads the arrays and
    places its own shards.

    Args:
      step: the checkpoint to restore; ``None`` for the latest complete one.
      params: the model's parameter tree (arrays or ``jax.ShapeDtypeStruct``s;
        only structure, shapes and dtypes are used), as given to
        :func:`jaxdp.init_state`.
      optimizer: the optax optimizer of the run.
      mesh: the mesh to place the state on.
      zero_stage: the layout wanted (0-3).
      axis_name: the data-parallel axis.
      model_state: the model state's template (arrays or ``ShapeDtypeStruct``s,
        as given to :func:`jaxdp.init_state`) if the checkpoint was saved
        from a state with model state, else ``None``. Placed replicated.

    Returns:
      A :class:`Restored` ``(state, rng, data_step, step, metadata)``.

    Raises:
      FileNotFoundError: if there is no (such) complete checkpoint.
      ValueError: if the checkpoint does not match the target (naming each
        leaf whose presence, shape or dtype differs, a ``model_state=`` given
        for a checkpoint without model state or missing for one with it, or
        an optimizer state of other types), was not written by
        :mod:`jaxdp.checkpoint`, or is truncated or corrupt. Nothing is
        placed on a device before every array has been read and checked.
    """
    check_mesh_axis(mesh, axis_name)
    check_zero_stage(zero_stage)
    step = self._resolve_step(step)
    expected = _abstract_full_state(params, optimizer, model_state)
    record = self._read_record(step)
    self._check_against(record, expected, step)
    arrays = self._read_arrays(step, record)
    leaves = [arrays[c] for c, _ in _named_leaves(expected)]
    state = _place_full_leaves(leaves, params, model_state, optimizer, mesh, zero_stage, axis_name)
    rng = _key_from_host(arrays[_RNG], record["rng_impl"], mesh) if _RNG in arrays else None
    return Restored(state, rng, record["data_step"], step, record["metadata"])

  def metadata(self, step: int | None = None) -> Any:
    """The user metadata saved with checkpoint ``step`` (default: the latest), without reading any array."""
    return self._read_record(self._resolve_step(step))["metadata"]

  def data_step(self, step: int | None = None) -> int:
    """The input pipeline's position saved with checkpoint ``step`` (default: the latest)."""
    return self._read_record(self._resolve_step(step))["data_step"]

  def _resolve_step(self, step: int | None) -> int:
    self._refresh(wait=True)  # a save in flight first: its step is then on disk, or its failure raised
    steps = sorted(self._manager.all_steps())
    if step is None:
      if not steps:
        raise FileNotFoundError(f"no complete checkpoint in {self.directory}; start from jaxdp.init_state instead.")
      return steps[-1]
    step = check_int(step, "step", 0, "steps count from 0.")
    if step not in steps:
      raise FileNotFoundError(f"no complete checkpoint for step {step} in {self.directory}; complete steps: {steps}.")
    return step

  def _where(self, step: int) -> str:
    return f"checkpoint step {step} in {self.directory}"

  def _read_record(self, step: int) -> dict:
    try:
      record = self._manager.restore(step, args=ocp.args.Composite(**{_RECORD_ITEM: ocp.args.JsonRestore()}))
      record = record[_RECORD_ITEM]
    except Exception as e:  # orbax and tensorstore raise many kinds; all mean "unreadable"
      raise ValueError(
          f"{self._where(step)} has no readable jaxdp record ({type(e).__name__}: {e}); it was not written by "
          f"jaxdp.checkpoint, or is truncated. Complete steps: {self.all_steps()}; restore another with step=."
      ) from e
    if not isinstance(record, dict) or record.get("format") != FORMAT:
      raise ValueError(f"{self._where(step)} was not written by jaxdp.checkpoint (no {FORMAT!r} record).")
    if record.get("version") != FORMAT_VERSION:
      raise ValueError(
          f"{self._where(step)} has format version {record.get('version')!r}; this jaxdp reads version "
          f"{FORMAT_VERSION}. Restore it with the jaxdp version that wrote it."
      )
    try:
      _check_record(record)
    except _BadField as bad:
      value = repr(bad.value)
      raise ValueError(
          f"{self._where(step)} is corrupt: its jaxdp record's field {bad.field} is "
          f"{value if len(value) <= 80 else value[:77] + '...'}, expected {bad.expected}. Complete steps: "
          f"{self.all_steps()}; restore another with step=."
      ) from None
    return record

  def _check_against(self, record: dict, expected: TrainState, step: int) -> None:
    """Refuses a target that does not fit the checkpoint, before any array is read."""
    saved_model_state = ["/".join(e["path"]) for e in record["leaves"] if e["path"][0] == _MODEL_STATE]
    if saved_model_state and not jax.tree.leaves(expected.model_state):
      raise ValueError(
          f"{self._where(step)} holds model state ({', '.join(saved_model_state[:3])}"
          f"{', ...' if len(saved_model_state) > 3 else ''}) but restore got model_state=None; pass its template "
          "as model_state= (the model state given to jaxdp.init_state, e.g. flax's batch_stats, or "
          "jax.ShapeDtypeStructs of it)."
      )
    if jax.tree.leaves(expected.model_state) and not saved_model_state:
      raise ValueError(
          f"{self._where(step)} holds no model state (it was saved from a TrainState with model_state=None) but "
          "restore got a model_state= template; restore it with model_state=None."
      )
    found = {"/".join(e["path"]): (e["shape"], e["dtype"]) for e in record["leaves"] if tuple(e["path"]) != _RNG}
    lines = _differences(found, _signature(expected), "the checkpoint", "the target")
    if lines:
      raise ValueError(
          f"{self._where(step)} does not match the target state (params and model_state templates and "
          f"optimizer); restore with the model and optimizer it was saved with:{_listing(lines)}"
      )
    saved, target = record.get("opt_state_structure"), _structure(expected.opt_state)
    if saved is not None and saved != target:
      raise ValueError(
          f"{self._where(step)} holds the state of another optimizer: its optimizer state is {saved}, the "
          f"target optimizer's (optimizer.init(params)) is {target}; restore with the optimizer it was saved with."
      )

  def _read_arrays(self, step: int, record: dict) -> dict[tuple[str, ...], np.ndarray]:
    """Every array of the checkpoint as numpy, checked against the record's shape, dtype and CRC-32."""
    entries = [(tuple(e["path"]), e) for e in record["leaves"]]
    target = _nested([(c, jax.ShapeDtypeStruct(tuple(e["shape"]), np.dtype(e["dtype"]))) for c, e in entries])
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**{_STATE_ITEM: ocp.args.StandardRestore(target)}))
      tree = restored[_STATE_ITEM]
      arrays = {c: np.asarray(_lookup(tree, c)) for c, _ in entries}
    except Exception as e:  # orbax and tensorstore raise many kinds; all mean "unreadable"
      raise ValueError(
          f"{self._where(step)} could not be read ({type(e).__name__}: {e}); it is truncated or corrupt. "
          f"Complete steps: {self.all_steps()}; restore another with step=."
      ) from e
    bad = [
        "/".join(c) for c, e in entries
        if arrays[c].shape != tuple(e["shape"]) or arrays[c].dtype.name != e["dtype"] or _crc32(arrays[c]) != e["crc32"]
    ]
    if bad:
      raise ValueError(
          f"{self._where(step)} is corrupt: {', '.join(bad[:_MAX_LISTED])} fail their shape, dtype or CRC-32 check. "
          f"Complete steps: {self.all_steps()}; restore another with step=."
      )
    return arrays

  def wait(self) -> None:
    """Blocks until every save in flight is complete (finalised on disk).

    Raises:
      Exception: the error of an asynchronous save that failed (an ``OSError``
        such as ``NotADirectoryError``, ...), once. That step is not written;
        the earlier checkpoints are intact.
    """
    try:
      self._manager.wait_until_finished()
    except Exception as e:
      e.add_note(
          f"jaxdp.CheckpointManager: an asynchronous save into {self.directory} failed, so that step was not "
          "written; the earlier checkpoints are intact."
      )
      raise

  def close(self) -> None:
    """Waits for saves in flight (raising a failed one's error, see :meth:`wait`) and releases orbax's resources."""
    try:
      self.wait()
    finally:
      # orbax's close() waits first and would stop there on a failed save, leaving its checkpointer and metadata
      # stores open; the failure is raised once per thread, so after wait() this close() runs to the end.
      self._manager.close()
