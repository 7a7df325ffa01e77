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
  paths (``params/w``, ``opt_state/0/mu/w``, ``step``, ``rng``);
* item ``jaxdp``: JSON (``JsonCheckpointHandler``): the format, the
  ``data_step`` (the input pipeline's position; ``TrainState.step`` does not
  count steps skipped for zero weight), the PRNG key's implementation, the
  layout saved from, the user's metadata, and each leaf's path, shape, dtype
  and CRC-32.

Nothing is pickled and nothing executes code on load. Restoring checks the
record against the target (structure, shapes, dtypes) before reading any
array, and every array against its CRC-32 after reading, before anything is
placed on a device: a mismatched, truncated or corrupt checkpoint raises
``ValueError`` and never restores part of a state.

Atomicity and retention are orbax's: a step is written to
``<step>.orbax-checkpoint-tmp`` and renamed when complete, so a crash during
a save leaves the previous checkpoints intact and the unfinished one is
ignored (and removed when the next manager opens the directory).
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdp._checks import check_int, check_state
from jaxdp.mesh import check_mesh_axis
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
  placed = _from_host(data, NamedSharding(mesh, P()))
  return placed if impl is None else jax.random.wrap_key_data(placed, impl=impl)


# Placing a full state on a layout ----------------------------------------------------------


def _from_host(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """The global array with this process's shards of host array ``x``, in fresh buffers."""
  # A copy per shard: no device buffer may alias ``x`` or another device's buffer (steps donate them).
  return jax.make_array_from_callback(x.shape, sharding, lambda index: np.array(x[index], copy=True))


def _place_leaf(x: np.ndarray, target: Any, mesh: Mesh, axis_name: str) -> Any:
  if is_flat_shards(target):
    flat = np.zeros(target.flat.shape, x.dtype)
    flat[: x.size] = x.reshape(-1)
    return FlatShards(_from_host(flat, NamedSharding(mesh, P(axis_name))), target.shape, target.stage)
  return _from_host(x, NamedSharding(mesh, P()))


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


def _abstract_full_state(params: Any, optimizer: optax.GradientTransformation) -> TrainState:
  """The stage-0 state of ``params`` and ``optimizer`` as ``ShapeDtypeStruct``s."""
  if any(is_flat_shards(x) for x in jax.tree.leaves(params, is_leaf=is_flat_shards)):
    raise ValueError(
        "params holds ZeRO FlatShards; pass the full parameter tree (the initial params, "
        "jax.eval_shape of the model's init, or jaxdp.gather_state(state).params)."
    )
  try:
    return abstract_zero_state(params, optimizer, 1, 0)
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
    optimizer: the optax optimizer the state belongs to.
    mesh: the mesh to place the state on.
    zero_stage: the layout wanted (see :func:`jaxdp.init_state`).
    axis_name: the data-parallel axis.

  Returns:
    A :class:`jaxdp.TrainState` of fresh buffers, placed as
    ``make_train_step(..., zero_stage=zero_stage)`` on ``mesh`` expects.

  Raises:
    ValueError: if ``full_state`` does not match ``optimizer.init(full_state.params)``
      in structure, shapes or dtypes, or if the optimizer's state under
      ``zero_stage`` is not a re-layout of its stage-0 state (e.g. a factored
      optimizer whose state depends on the parameters' shapes).
  """
  check_state(full_state, "full_state")
  check_mesh_axis(mesh, axis_name)
  check_zero_stage(zero_stage)
  expected = _abstract_full_state(full_state.params, optimizer)
  lines = _differences(_signature(full_state), _signature(expected), "full_state", "optimizer.init(full_state.params)")
  if lines or jax.tree.structure(full_state) != jax.tree.structure(expected):
    raise ValueError(
        "full_state is not a full stage-0 state of this optimizer; pass jaxdp.gather_state(state) of a state "
        f"built with the same params and optimizer:{_listing(lines or ['the pytree structures differ'])}"
    )
  return _place_full_leaves(jax.tree.leaves(full_state), full_state.params, optimizer, mesh, zero_stage, axis_name)


def _place_full_leaves(leaves: list, params: Any, optimizer, mesh: Mesh, zero_stage: int, axis_name: str) -> TrainState:
  """The state of ``zero_stage`` from the stage-0 state's leaves (host arrays, in flattening order)."""
  layout = abstract_zero_state(params, optimizer, mesh.shape[axis_name], zero_stage)
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
    """The steps of the complete checkpoints, oldest first (unfinished saves are not listed)."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or ``None`` if there is none."""
    return self._manager.latest_step()

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
    rng_data, rng_impl = _key_to_host(rng)
    arrays = _named_leaves(jax.tree.map(np.array, gather_state(state)))
    if rng_data is not None:
      arrays.append((_RNG, rng_data))
    record = self._record(arrays, state, data_step, rng_impl, metadata)
    args = ocp.args.Composite(
        **{_STATE_ITEM: ocp.args.StandardSave(_nested(arrays)), _RECORD_ITEM: ocp.args.JsonSave(record)}
    )
    return bool(self._manager.save(step, args=args, force=force))

  @staticmethod
  def _record(arrays, state: TrainState, data_step: int, rng_impl: str | None, metadata: Any) -> dict:
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

    Returns:
      A :class:`Restored` ``(state, rng, data_step, step, metadata)``.

    Raises:
      FileNotFoundError: if there is no (such) complete checkpoint.
      ValueError: if the checkpoint does not match the target (naming each
        leaf whose presence, shape or dtype differs), was not written by
        :mod:`jaxdp.checkpoint`, or is truncated or corrupt. Nothing is
        placed on a device before every array has been read and checked.
    """
    check_mesh_axis(mesh, axis_name)
    check_zero_stage(zero_stage)
    step = self._resolve_step(step)
    expected = _abstract_full_state(params, optimizer)
    record = self._read_record(step)
    self._check_against(record, expected, step)
    arrays = self._read_arrays(step, record)
    leaves = [arrays[c] for c, _ in _named_leaves(expected)]
    state = _place_full_leaves(leaves, params, optimizer, mesh, zero_stage, axis_name)
    rng = _key_from_host(arrays[_RNG], record["rng_impl"], mesh) if _RNG in arrays else None
    return Restored(state, rng, int(record["data_step"]), step, record["metadata"])

  def metadata(self, step: int | None = None) -> Any:
    """The user metadata saved with checkpoint ``step`` (default: the latest), without reading any array."""
    return self._read_record(self._resolve_step(step))["metadata"]

  def data_step(self, step: int | None = None) -> int:
    """The input pipeline's position saved with checkpoint ``step`` (default: the latest)."""
    return int(self._read_record(self._resolve_step(step))["data_step"])

  def _resolve_step(self, step: int | None) -> int:
    steps = self.all_steps()
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
    return record

  def _check_against(self, record: dict, expected: TrainState, step: int) -> None:
    found = {"/".join(e["path"]): (e["shape"], e["dtype"]) for e in record["leaves"] if tuple(e["path"]) != _RNG}
    lines = _differences(found, _signature(expected), "the checkpoint", "the target")
    if lines:
      raise ValueError(
          f"{self._where(step)} does not match the target state (params template and optimizer); restore with "
          f"the model and optimizer it was saved with:{_listing(lines)}"
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
    """Blocks until every save in flight is complete (finalised on disk)."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for saves in flight and releases orbax's resources."""
    self._manager.close()
