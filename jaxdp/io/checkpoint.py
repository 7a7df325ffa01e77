"""Checkpoints: the training state, PRNG key and input position, saved with orbax, shard by shard.

Saving writes every array of the state as it is sharded: the global
`jax.Array`s go to orbax's `StandardSave`, and each process writes the
shards of its own devices (one copy of each replicated shard). No process
ever holds a whole leaf that its layout does not replicate on it: a stage-3
leaf on 8 processes costs each process an eighth of it, in host memory too.
Every leaf keeps its global shape at every ZeRO stage and mesh (see
`jaxdp.sharding.layout`), so a checkpoint is layout-free by construction.

Restoring takes a target layout (params template, optimizer, mesh,
`zero_stage`, tensor-parallel `param_specs`), builds its abstract state
(`jax.ShapeDtypeStruct(shape, dtype, sharding=...)` from
`jaxdp.sharding.layout.make_layout`) and lets orbax read each device's part of
each array straight into that layout (`StandardRestore`). So a checkpoint
restores onto any device count, process count, mesh shape, ZeRO stage or
tensor-parallel split, with the optimizer state moved exactly (never
re-initialised): `jaxdp.gather_state` of the restored state equals that
of the saved one bitwise.

Format (`jaxdp.io.checkpoint` version 2), one orbax step directory per step:

* item `state`: the arrays, through orbax's `StandardCheckpointHandler`
  (tensorstore/OCDBT with JSON metadata), as a nested dict keyed by the leaf
  paths (`params/w`, `opt_state/0/mu/w`, `step`,
  `model_state/batch_stats/mean` when the state has model state, `rng`);
  a zero-size leaf holds no data and is not in it (its record entry restores it);
* item `jaxdp`: JSON (`JsonCheckpointHandler`): the format and version,
  the `data_step` (the input pipeline's position; `TrainState.step` does
  not count steps skipped for zero weight), the PRNG key's implementation,
  the device and process counts saved from, the user's metadata, the
  optimizer state's container types (`opt_state_structure`, e.g.
  `ScaleByAdamState`: leaf paths alone do not tell Adam from AdaBelief),
  and each leaf's path, shape, dtype, `PartitionSpec` saved from (for the
  reader) and checksum.

The checksum composes over shards (see `jaxdp.io.record`): with the
leaf's elements read as unsigned words `w_i` at global flat index `i`,
`H = sum (w_i + 1) * (splitmix64(i) | 1) mod 2**64`. Each process adds the
terms of its shards with `replica_id == 0` and the processes' sums are
added, so it is computed where the data lies, in the layout saved from and
again in the layout restored to, without gathering. Version 1 checkpoints
(gathered state, whole-leaf CRC-32) are refused with a "format version"
error: restore them with the jaxdp version that wrote them.

Nothing is pickled and nothing executes code on load. Restoring validates
the record (every field it reads) and checks it against the target
(structure, shapes, dtypes, optimizer state types) before reading any array,
then every restored array against its shape, dtype and checksum: a
mismatched, truncated or corrupt checkpoint raises `ValueError` and no
part of a state is returned.

Atomicity and retention are orbax's: a step is written to
`<step>.orbax-checkpoint-tmp` and renamed when complete, so a crash during
a save leaves the previous checkpoints intact and the unfinished one is
ignored (and removed when the next manager opens the directory). The list of
steps is re-read from the directory when it is asked for, so a step deleted
by hand is not offered for restoring. A save that fails before its commit,
at whatever point, leaves the manager as if it had never been attempted (its
threads awaited, its temporary directory removed, the list of steps re-read),
so `save(step, ...)` retries it. Its error is raised once: by
`CheckpointManager.save`, or for an asynchronous save failing in
orbax's threads by the next `wait`,
`close` or `save`; no thread
is left behind that would delay the process's exit.

This module holds the orbax lifecycle (saving, restoring, waiting, closing);
the record's format, its checks and the checksums are in
`jaxdp.io.record`.
"""

from __future__ import annotations

import math
import os
import shutil
import threading
import time
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxdp.io import record as record_lib
from jaxdp.core.checks import check_int, check_not_donated, check_optimizer, check_params, check_state
from jaxdp.io.record import RNG
from jaxdp.io.data import DataPipeline
from jaxdp.io.grain import GrainPipeline, gather_states, restore_states
from jaxdp.runtime.distributed import assert_same_across_processes
from jaxdp.sharding.layout import (
    axis_names,
    annotated_model_specs,
    data_size,
    make_layout,
)
from jaxdp.core.loss_scaling import abstract_loss_scale
from jaxdp.sharding.parallel import DataParallel, as_layout
from jaxdp.runtime.diloco import DiLoCoState, abstract_diloco_state, outer_axis_of
from jaxdp.reductions import init_state as reduction_state, resolve
from jaxdp.sharding.legacy import accepts_legacy_keywords
from jaxdp.core.state import TrainState

FORMAT, FORMAT_VERSION = record_lib.FORMAT, record_lib.FORMAT_VERSION
_STATE_ITEM = "state"
_RECORD_ITEM = "jaxdp"
_STRAGGLER_SECONDS = 60.0  # the longest a failed save's own threads are awaited


def _operation_threads(before: set) -> list[threading.Thread]:
  """The threads started since `before` that run one save's writes (not orbax's long-lived executors).

  orbax runs each write of a save in a `threading.Thread` subclass of its own; its executors and event
  loops, which live on, are plain threads.
  """
  return [t for t in threading.enumerate() if t not in before and type(t) is not threading.Thread]


def _join(threads: list[threading.Thread]) -> None:
  """Waits (boundedly) for a save's threads, without raising its failure.

  Also for a failed save: when one write fails orbax leaves the others running, and they would write into
  (even re-create) the temporary directory of a retry of the same step. `threading.Thread.join` itself, not
  the threads' own `join`: orbax's write threads re-raise the save's failure from every `join`, and its
  finalising thread raises it from the first `join` of each calling thread, which would take it from
  `CheckpointManager.wait` (the one call that reports it) whenever a thread was still alive.
  """
  deadline = time.monotonic() + _STRAGGLER_SECONDS
  for thread in threads:
    threading.Thread.join(thread, timeout=max(0.0, deadline - time.monotonic()))


class Restored(NamedTuple):
  """What `CheckpointManager.restore` returns.

  Attributes:
    state: the `jaxdp.TrainState` in the requested layout, ready for
      `make_train_step(..., zero_stage=...)` on the requested mesh.
    rng: the saved PRNG key (a typed key if a typed key was saved, else the
      raw `uint32` key data), replicated on the mesh; `None` if none was saved.
    data_step: the input pipeline's position: pass it to
      `DataPipeline.iterate(start_step=data_step)`.
    step: the checkpoint's step.
    metadata: the user metadata saved with it (as `json.loads` returns it), or `None`.
  """

  state: TrainState
  rng: jax.Array | None
  data_step: int
  step: int
  metadata: Any


def _check_pipeline(pipeline: Any) -> None:
  if pipeline is not None and not isinstance(pipeline, (DataPipeline, GrainPipeline)):
    raise TypeError(
        f"data must be a jaxdp.DataPipeline, a jaxdp.io.grain.GrainPipeline or None, got {type(pipeline).__name__}; "
        "a StreamingPipeline has no position to save (a stream is read once), so resuming one is up to its source."
    )


def _resumed_data_step(record: dict, pipeline: DataPipeline | None, mesh: Mesh, axis_name: Any, where: str) -> int:
  """The `data_step` to resume from: the saved one, converted to `pipeline`'s batches, or refused if ambiguous."""
  if isinstance(pipeline, GrainPipeline):  # its position is set once the state is read (restore_states)
    if "data_states" not in record:
      raise ValueError(
          f"{where} was saved without a GrainPipeline's position (save(..., data=pipeline)), so a GrainPipeline "
          "cannot resume from it; restore without data= and start the data at a new epoch."
      )
    restore_states(pipeline, record["data_states"], where, check_only=True)
    return record["data_step"]
  if "data_states" in record:
    if pipeline is not None:
      raise ValueError(
          f"{where} was saved with a GrainPipeline's position; a DataPipeline cannot resume from it. Restore with "
          "data=<the run's GrainPipeline>, or without data=."
      )
    return record["data_step"]
  position = record.get("data_position")
  if position is not None:
    if pipeline is not None:
      return pipeline.step_at(position)
    if data_size(mesh, axis_name) != position["devices"]:
      raise ValueError(
          f"{where} was saved with a DataPipeline on {position['devices']} data-parallel devices (global batch "
          f"{position['global_batch']}), and this mesh has {data_size(mesh, axis_name)}: its data_step "
          f"{record['data_step']} counts batches of another size unless per_device_batch changed to match. Pass "
          "restore(..., pipeline=pipeline) to resume at the same example."
      )
  elif pipeline is not None and _saved_data_size(record, pipeline.axis_name) != pipeline.n_devices:
    raise ValueError(
        f"{where} was saved without pipeline= from {_saved_data_size(record, pipeline.axis_name)} data-parallel "
        f"devices, and the pipeline has {pipeline.n_devices}: its data_step {record['data_step']} counts batches of a "
        "size it did not record, so it cannot be converted. Resume on the saving run's devices (and save with "
        "pipeline= from then on), or start the data from step 0."
    )
  return record["data_step"]


def _check_compression_record(record: dict, reduction: Any, replicas: int, where: str) -> None:
  """Refuses a restore whose `reduction=` does not fit the checkpoint's reduction state, or another replica
  count."""
  saved = [e for e in record["leaves"] if e["path"][0] == "compression"]
  if saved and not reduction.stateful:
    raise ValueError(
        f"{where} holds a reduction's state (compression/..., e.g. PowerSGD's); pass the reduction it was made "
        "with as restore(..., reduction=jaxdp.reductions.powersgd(...))."
    )
  if reduction.compression is not None and not saved:
    raise ValueError(f"{where} holds no reduction state; restore it with reduction=None.")
  errors = [e for e in saved if e["path"][1] == "error"]
  if errors and errors[0]["shape"][0] != replicas:
    raise ValueError(
        f"{where} holds the error feedback of {errors[0]['shape'][0]} replicas, but the mesh has {replicas} "
        "data-parallel replicas; the error feedback is per replica. Restore onto the device count it was saved "
        "from, or restore there and start the compression afresh on the new one."
    )


def _is_diloco(record: dict) -> bool:
  """Whether a checkpoint's record is of a DiLoCo state (its leaves under `inner/` and `outer_params/`)."""
  return any(e["path"][0] == "outer_params" for e in record["leaves"])


def _mesh_shape(state: TrainState) -> dict | None:
  """`{axis: size}` of the mesh `state` is placed on, or `None` (host arrays, single-device shardings)."""
  mesh = getattr(getattr(jax.tree.leaves(state)[0], "sharding", None), "mesh", None)
  return None if mesh is None else {str(name): int(size) for name, size in mesh.shape.items()}


def _saved_data_size(record: dict, axis_name: Any) -> int:
  """The data-parallel device count a checkpoint was saved from, for `axis_name`; its total device count for a
  record without its mesh or whose mesh lacks those axes."""
  saved = record["saved_from"]
  mesh = saved.get("mesh")
  names = axis_names(axis_name)
  if isinstance(mesh, dict) and all(isinstance(mesh.get(n), int) for n in names):
    return math.prod(mesh[n] for n in names)
  return saved["devices"]


def _device_count(state: TrainState) -> int:
  """The number of devices `state` is placed on (1 for host arrays)."""
  sharding = getattr(jax.tree.leaves(state)[0], "sharding", None)
  return len(sharding.device_set) if sharding is not None else 1


def _savable(x: Any) -> Any:
  """A leaf as orbax saves it: a global `jax.Array` as it is; a host or process-local value as numpy.

  A process-local array (fully addressable in a multi-process job) is a
  value every process holds whole already; orbax writes numpy from one process.
  """
  if isinstance(x, jax.Array) and (jax.process_count() == 1 or not x.is_fully_addressable):
    return x
  return np.asarray(x)


def _is_empty(x: Any) -> bool:
  """Whether `x` has a zero-size shape: orbax refuses to save such an array, and it holds no data to save."""
  return math.prod(np.shape(x)) == 0


def _empty_array(target: jax.ShapeDtypeStruct) -> jax.Array:
  """The zero-size array of `target`'s shape and dtype, placed with its sharding (what its checkpoint holds)."""
  empty = np.zeros(target.shape, target.dtype)
  return jax.make_array_from_callback(target.shape, target.sharding, lambda index: empty[index])


class CheckpointManager:
  """Saves the training state every `save_interval_steps` steps and keeps the last `max_to_keep`.

  A thin layer over `orbax.checkpoint.CheckpointManager` that stores the
  state shard by shard, restorable onto any layout (see `jaxdp.io.checkpoint`),
  together with the PRNG key, the input pipeline's position and JSON metadata. In a
  multi-process job every process creates the manager on the same (shared)
  directory and calls `save` and `restore` at the same steps.

  Example:

  ```python
  with jaxdp.CheckpointManager(path, save_interval_steps=100, max_to_keep=3) as ckpt:
    if ckpt.latest_step() is None:
      state, rng, start = jaxdp.init_state(params, opt, mesh), jax.random.key(0), 0
    else:
      state, rng, start, _, _ = ckpt.restore(params=params, optimizer=opt, mesh=mesh)
    for step, (batch, weights) in pipe.iterate(start, num_steps - start):
      rng, key = jax.random.split(rng)
      state, metrics = train_step(state, batch, weights, key)
      ckpt.save(step + 1, state, rng=rng)
  ```

  Args:
    directory: where the step directories go; created if missing.
    save_interval_steps: `save` writes only steps that are multiples
      of it (unless forced).
    max_to_keep: how many of the newest checkpoints to keep; `None` keeps all.
    enable_async_checkpointing: `save` returns once the shards are on
      the host and writes them in a background thread; call `wait`
      before relying on a save, and `close` (or use `with`) before
      the process exits, else the last save is lost (never half-written).
      A background save that fails raises its error at the next
      `wait`, `close` or `save`, once; the manager is then
      as if it had never been attempted, and `save` retries that step.
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
        # orbax's default also writes the first save of a directory whatever its step: only due steps, and a
        # step at a preemption sync point (checked by orbax at every call, as JAX requires).
        save_decision_policy=ocp.checkpoint_managers.AnySavePolicy([
            ocp.checkpoint_managers.FixedIntervalPolicy(self.save_interval_steps),
            ocp.checkpoint_managers.PreemptionCheckpointingPolicy(),
        ]),
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
    self._current: int | None = None  # the step this manager last restored or wrote: the run it is on
    self._save_threads: list[threading.Thread] = []
    self._asynchronous = enable_async_checkpointing
    # The asynchronous save in flight, as (its step, self._current before it, whether its directory existed), until
    # wait() reports how it ended.
    self._pending: tuple[int, int | None, bool] | None = None

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def all_steps(self) -> list[int]:
    """The steps of the complete checkpoints, oldest first (unfinished or failed saves are never listed).

    Read from the directory, so a step removed by hand is not listed. A save
    in flight is waited for first (for up to a minute; orbax records its
    step before it is on disk, and a step is listed only once its directory
    is committed); its failure, if it fails, is left for `wait`,
    `close` or the next `save` to raise.
    """
    _join(self._save_threads)
    self._refresh()
    return sorted(s for s in self._manager.all_steps() if os.path.isdir(self._step_path(s)))

  def _step_path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))  # orbax's default step names (no prefix, no padding)

  def _remove_unfinished(self, step: int) -> None:
    """Removes what a failed save of `step` left (`<step>.orbax-checkpoint-tmp[-...]`), so it can be retried.

    orbax would write the retry into the failed save's files. Runs after `wait`: no save of this manager
    is in flight. One process removes them, and the others wait for it (a shared directory).
    """
    if jax.process_index() == 0:
      self._remove_tmp(step)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      multihost_utils.sync_global_devices(f"jaxdp.CheckpointManager.save:{step}")

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or `None` if there is none (see `all_steps`)."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def _refresh(self, wait: bool = False) -> None:
    """Re-reads the list of steps from the directory; with `wait`, after the save in flight (raising its failure).

    orbax lists the directory once, when the manager opens, and then only
    tracks its own saves: a step deleted meanwhile would still be the latest.
    The list is not re-read during an asynchronous save, whose step orbax
    tracks for retention (`max_to_keep`) before it is on disk; every
    process finishes a save together (orbax syncs them), so all processes
    re-read the same directory contents.
    """
    if wait:
      self.wait()
    if not self._saving():
      self._manager.reload()

  def _saving(self) -> bool:
    """Whether an asynchronous save of this manager is still being written.

    jaxdp's own record, not orbax's `is_saving_in_progress()`: orbax leaves that set for ever after a save that
    failed in its calling thread, and the list would never be re-read again.
    """
    return self._pending is not None and any(t.is_alive() for t in self._save_threads)

  def _undo(self, step: int, current: int | None, existed: bool, error: BaseException, asynchronous: bool) -> None:
    """Leaves the manager as if the failed save of `step` had never been attempted, and notes so on `error`.

    Its threads are awaited (not raising again), what it wrote is removed (`<step>.orbax-checkpoint-tmp`, by
    one process), `current` (the step of the run before it) is restored and the list of steps is re-read from
    the directory. A failure after the step's directory was committed (orbax removing the checkpoints
    `max_to_keep` drops) leaves the step, which is complete, as the one this manager last wrote.
    """
    _join(self._save_threads)
    self._save_threads, self._pending = [], None
    committed = not existed and os.path.isdir(self._step_path(step))
    self._current = step if committed else current
    try:
      if not committed and jax.process_index() == 0:
        self._remove_tmp(step)
      self._manager.reload()
    except Exception:  # noqa: BLE001 - e.g. the directory is gone; the save's own failure is the one raised
      pass
    if committed:
      error.add_note(
          f"jaxdp.CheckpointManager: step {step} was written and committed in {self.directory}; what failed came "
          "after its commit (orbax removing the older checkpoints that max_to_keep drops), so some of those may "
          "remain, or be partly removed."
      )
    else:
      error.add_note(
          f"jaxdp.CheckpointManager: {'an asynchronous' if asynchronous else 'the'} save of step {step} into "
          f"{self.directory} failed, so that step was not written; the earlier checkpoints are intact. Retry it "
          f"with save({step}, ...)."
      )

  def _remove_tmp(self, step: int) -> None:
    prefix = f"{step}.orbax-checkpoint-tmp"
    for name in os.listdir(self.directory):
      if name == prefix or name.startswith(prefix + "-"):
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def should_save(self, step: int) -> bool:
    """Whether `save` at `step` (not forced) writes a checkpoint."""
    return self._manager.should_save(check_int(step, "step", 0, "steps count from 0."))

  @accepts_legacy_keywords("save", ("self", "step", "state"), layout_argument=None)
  def save(
      self,
      step: int,
      state: TrainState,
      *,
      rng: jax.Array | None = None,
      data_step: int | None = None,
      data: DataPipeline | None = None,
      metadata: Any = None,
      force: bool = False,
  ) -> bool:
    """Saves `state` as checkpoint `step` if `step` is due (a multiple of `save_interval_steps`) or forced.

    A collective in a multi-process job: call it on every process with the
    same arguments (a save that is written first checks that the processes
    agree on `step`, `data_step` and `force`: a `ValueError` on every
    process; calls that write nothing cost no communication). Each process
    writes its own shards; none gathers a leaf.
    The shards are copied to the host before it returns, so the step may
    donate `state` right after, even with asynchronous saving.

    Args:
      step: the checkpoint's number, usually the number of loop steps done.
      state: the `jaxdp.TrainState`, in any layout (or on the host).
      rng: the PRNG key the loop carries (typed or raw `uint32`), or `None`.
      data_step: the input pipeline's position to resume from (the
        `start_step` of `DataPipeline.iterate`); default `step`.
      data: the `jaxdp.DataPipeline` that `data_step` counts
        batches of: its position is then recorded in examples
        (`DataPipeline.position`), so that `restore(...,
        pipeline=)` resumes at the same example with another global batch
        (another device count) or refuses. A step count alone is only right
        for the same global batch. Or a `jaxdp.io.grain.GrainPipeline`:
        every process's position (its grain iterator's state) is recorded,
        one entry per process.
      metadata: JSON-serialisable user data (a config, metrics).
      force: save even if `step` is not a multiple of `save_interval_steps`.

    Returns:
      Whether a checkpoint was written (or, asynchronously, started):
      `False` for a step not due (neither a multiple of
      `save_interval_steps` nor a preemption sync point), or for the step
      this manager restored or last wrote (the same state again). A save
      that failed wrote nothing: retrying its step writes it (`True`).

    Raises:
      ValueError: if `step` is not after the latest checkpoint's (and is
        not the step this manager restored or last wrote): e.g. a run that
        went back to an older checkpoint, or started afresh in a directory
        with checkpoints. Written, it would not be the one a restart
        restores; skipped, as orbax would, the run's saves would be lost
        until its steps passed the old ones. Drop the abandoned checkpoints
        with `discard_after` first, or save into another directory.
    """
    step = check_int(step, "step", 0, "steps count from 0.")
    if isinstance(state, DiLoCoState):  # the groups' states, the outer state and the period's counters
      check_state(state.inner, "state.inner")
      opt_states = (state.inner.opt_state, state.outer_opt_state)
    else:
      check_state(state)
      opt_states = state.opt_state
    data_step = step if data_step is None else check_int(data_step, "data_step", 0, "pass the pipeline's next step.")
    pipeline = data
    _check_pipeline(pipeline)
    record_lib.check_metadata(metadata)
    if rng is not None:
      record_lib.is_typed_key(rng)
    latest = self._manager.latest_step()  # orbax's list (no directory listing per call: this runs every step)
    if latest is not None and step <= latest and step != self._current:
      on = "" if self._current is None else f" (this run restored or saved step {self._current})"
      raise ValueError(
          f"step {step} is not after the latest checkpoint in {self.directory}, step {latest}{on}: a restart would "
          f"restore step {latest}, not this run's state, and orbax would skip this run's saves until its steps passed "
          f"{latest}. If this run continues from an older checkpoint, drop the newer ones first: "
          f"ckpt.discard_after({step - 1 if self._current is None else self._current}); or save into another "
          "directory."
      )
    if force and step in self._manager.all_steps():
      raise ValueError(f"step {step} already has a checkpoint in {self.directory}; save under a new step.")
    if step == self._current:
      return False  # the checkpoint this run restored or wrote, again: nothing new to write
    if not (force or self.should_save(step)):
      return False
    check_not_donated(state)  # here, not on every call: most calls of a training loop write nothing
    # A save is a collective: processes that disagree on it would wait for each other for ever. Checked only when
    # writing (the all-gather waits for the step in flight); with one process the check returns at once.
    assert_same_across_processes({"step": step, "force": force, "data_step": data_step}, "CheckpointManager.save")
    self.wait()  # orbax would too; here a failed previous save raises with jaxdp's note, before any work
    self._remove_unfinished(step)
    rng_data, rng_impl = record_lib.key_to_host(rng)
    # A typed PRNG key (e.g. optax.noisy_sgd's) is stored as its raw data, with its implementation recorded.
    key_impls = {c: str(jax.random.key_impl(x)) for c, x in record_lib.named_leaves(state) if record_lib.is_key_leaf(x)}
    named = [(c, _savable(jax.random.key_data(x) if c in key_impls else x)) for c, x in record_lib.named_leaves(state)]
    if rng_data is not None:
      named.append((RNG, rng_data))
    record = record_lib.build_record(
        named,
        record_lib.checksums([x for _, x in named]),
        key_impls=key_impls,
        opt_state_structure=record_lib.structure(opt_states),
        data_step=data_step,
        rng_impl=rng_impl,
        metadata=metadata,
        devices=_device_count(state),
        data_position=pipeline.position(data_step) if isinstance(pipeline, DataPipeline) else None,
        data_states=gather_states(pipeline) if isinstance(pipeline, GrainPipeline) else None,
        mesh_shape=_mesh_shape(state),
    )
    stored = [(c, x) for c, x in named if not _is_empty(x)]  # the record alone restores a zero-size leaf
    args = ocp.args.Composite(
        **{_STATE_ITEM: ocp.args.StandardSave(record_lib.nested(stored)), _RECORD_ITEM: ocp.args.JsonSave(record)}
    )
    before, current, existed = set(threading.enumerate()), self._current, os.path.isdir(self._step_path(step))
    try:
      written = bool(self._manager.save(step, args=args, force=force))
    except Exception as e:
      self._save_threads = _operation_threads(before)
      self._undo(step, current, existed, e, asynchronous=False)
      raise
    self._save_threads = _operation_threads(before)  # those of an asynchronous save, awaited if it fails
    if written:
      self._current = step
      self._pending = (step, current, existed) if self._asynchronous else None
    return written

  def discard_after(self, step: int) -> list[int]:
    """Deletes every checkpoint newer than `step`; returns their steps. A collective in a multi-process job.

    For a run that goes back to an older checkpoint (e.g. step 2 of 1-4,
    after a divergence): restore it, then discard the abandoned steps, so
    that `save` can write the new run's steps 3, 4, ... and a restart
    restores them, not the abandoned ones.
    """
    step = check_int(step, "step", 0, "steps count from 0.")
    self._refresh(wait=True)
    newer = [s for s in sorted(self._manager.all_steps()) if s > step]
    for s in reversed(newer):  # newest first: an interruption leaves a prefix of the old run, never a gap
      self._manager.delete(s)
    if self._current is not None and self._current > step:
      self._current = None
    return newer

  @accepts_legacy_keywords("restore", ("self", "step"))
  def restore(
      self,
      step: int | None = None,
      *,
      params: Any,
      optimizer: optax.GradientTransformation,
      layout: Any = None,
      model_state: Any = None,
      reduction: Any = None,
      data: DataPipeline | None = None,
) -> Restored:
    """Restores checkpoint `step` (default: the latest) onto the layout described by the target.

    The layout need not be the one saved from: another device count, process
    count, mesh shape, ZeRO stage or tensor-parallel split gives the same
    `jaxdp.gather_state`. A collective in a multi-process job; each
    process reads only the parts of the arrays its devices hold.

    Args:
      step: the checkpoint to restore; `None` for the latest complete one.
      params: the model's parameter tree (arrays or `jax.ShapeDtypeStruct`s,
        in any layout; structure, shapes and dtypes are used, and their
        splits over the mesh's model axes when they are `NamedSharding`
        arrays or `ShapeDtypeStruct`s with such a sharding on a mesh with
        `mesh`'s axis names), as given to `jaxdp.init_state`.
      optimizer: the optax optimizer of the run.
      layout: the `jaxdp.DataParallel` to restore onto (a `Mesh` or
        `None` as for `jaxdp.init_state`): its ZeRO stage, stacks of
        layers and pipeline stage axis place the state as the step expects;
        its `param_specs` (default: read off `params`) the model-axis
        splits. Any checkpoint restores onto any layout.
      model_state: the model state's structure (arrays or `ShapeDtypeStruct`s,
        as given to `jaxdp.init_state`) if the checkpoint was saved
        from a state with model state, else `None`. Placed replicated.
      reduction: the reduction the state was made with
        (`jaxdp.init_state`'s), for a state whose `compression`
        holds its state (PowerSGD's, a user reduction's), else `None`.
        That state is per replica: a checkpoint restores onto the same
        number of data-parallel replicas only (a `ValueError` otherwise).
      data: the `jaxdp.DataPipeline` the run resumes with. For a
        checkpoint saved with `data=`, `data_step` is then this
        pipeline's step at the saved example (`DataPipeline.step_at`:
        a `ValueError` if another dataset length or seed, or if the
        example falls inside one of its batches). Without it, such a
        checkpoint restored onto another number of data-parallel devices is
        refused (its `data_step` counts batches of another size unless
        `per_device_batch` changed to match, which nothing here can see).
        A checkpoint saved without `data=` restored with it onto
        another number of data-parallel devices is refused too (read off
        the saved mesh; for a record without one, the total device count is
        what is compared). A `jaxdp.io.grain.GrainPipeline` is set to this
        process's saved position (its next example is the one after the
        saved step's), once the state is read; a checkpoint of another
        process count, or without a grain position, is refused.

    Returns:
      A `Restored` `(state, rng, data_step, step, metadata)`. The
      state's `loss_scale` (`jaxdp.core.loss_scaling`) is restored when the
      checkpoint holds one, else `None`.

    Raises:
      FileNotFoundError: if there is no (such) complete checkpoint.
      ValueError: if the checkpoint does not match the target (naming each
        leaf whose presence, shape or dtype differs, a `model_state=` given
        for a checkpoint without model state or missing for one with it, or
        an optimizer state of other types), was not written by
        `jaxdp.io.checkpoint` (version 2), or is truncated or corrupt. No
        array is read before the record and the target are checked, and
        nothing is returned before every array has passed its checksum.
    """
    check_params(params)
    check_optimizer(optimizer)  # else optimizer.init's failure would be blamed on params
    layout, resolved, pipeline = as_layout(layout), resolve(reduction), data
    mesh, axis_name, zero_stage, layers = layout.mesh, layout.axis_name, layout.zero_stage, layout.layers
    param_specs, stage_axis = layout.param_specs, layout.stage_axis
    _check_pipeline(pipeline)
    params, model_specs = annotated_model_specs(params, param_specs, mesh, axis_name)  # as init_state reads them
    step = self._resolve_step(step)
    expected = record_lib.abstract_full_state(params, optimizer, model_state)
    replicas = data_size(mesh, axis_name)
    expected = expected._replace(compression=jax.eval_shape(lambda p: reduction_state(resolved, p, layout),
                                                            expected.params))
    record = self._read_record(step)
    if _is_diloco(record):
      raise ValueError(
          f"{self._where(step)} holds a DiLoCo state (saved from a jaxdp.runtime.diloco.DiLoCoState); restore it "
          "with ckpt.restore_diloco(params=, inner_optimizer=, layout=, outer_optimizer=).")
    if any(e["path"][0] == "loss_scale" for e in record["leaves"]):  # a dynamic loss scale's two scalars
      expected = expected._replace(loss_scale=abstract_loss_scale())
    _check_compression_record(record, resolved, replicas, self._where(step))
    record_lib.check_against(record, expected, self._where(step))
    data_step = _resumed_data_step(record, pipeline, mesh, axis_name, self._where(step))
    shardings = make_layout(expected, mesh, axis_name, zero_stage, model_specs, layers, stage_axis).shardings(mesh)
    entries = {tuple(e["path"]): e for e in record["leaves"]}
    layout = dict(zip((c for c, _ in record_lib.named_leaves(expected)), jax.tree.leaves(shardings)))
    # A typed key's raw data is read replicated (its data has one more axis than the key), then wrapped and placed.
    target = [
        (c, record_lib.stored_struct(x, NamedSharding(mesh, P()) if record_lib.is_key_leaf(x) else layout[c]))
        for c, x in record_lib.named_leaves(expected)
    ]
    if RNG in entries:
      key, replicated = entries[RNG], NamedSharding(mesh, P())
      target.append((RNG, jax.ShapeDtypeStruct(tuple(key["shape"]), np.dtype(key["dtype"]), sharding=replicated)))
    arrays = self._read_arrays(step, record, target)
    self._current = step
    leaves = [
        jax.device_put(jax.random.wrap_key_data(arrays[c], impl=entries[c]["key_impl"]), layout[c])
        if record_lib.is_key_leaf(x) else arrays[c]
        for c, x in record_lib.named_leaves(expected)
    ]
    state = jax.tree.unflatten(jax.tree.structure(expected), leaves)
    rng = None
    if RNG in arrays:
      impl = record["rng_impl"]
      rng = arrays[RNG] if impl is None else jax.random.wrap_key_data(arrays[RNG], impl=impl)
    if isinstance(pipeline, GrainPipeline):
      restore_states(pipeline, record["data_states"], self._where(step))
    return Restored(state, rng, data_step, step, record["metadata"])

  @accepts_legacy_keywords("restore_diloco", ("self", "step"))
  def restore_diloco(
      self,
      step: int | None = None,
      *,
      params: Any,
      inner_optimizer: optax.GradientTransformation,
      layout: Any,
      outer_optimizer: optax.GradientTransformation | None = None,
      model_state: Any = None,
      precision: Any = None,
      reduction: Any = None,
      data: DataPipeline | None = None,
  ) -> Restored:
    """Restores a checkpoint of a `jaxdp.runtime.diloco.DiLoCoState` (saved with `save`).

    The arguments are `jaxdp.init_diloco_state`'s (and `data` as for
    `restore`); the state comes back placed as that function places
    it, bitwise the saved one: continuing from it is the run that was never
    interrupted. The number of replica groups (the size of the outer axis)
    must be the one saved from: each group's parameters and inner optimizer
    state are its own between syncs, and no rule maps R groups onto R'. The
    devices within a group may differ (the group's state is replicated
    over them; a stateful reduction's per-replica state, PowerSGD's
    errors, needs as many devices per group).

    Returns:
      A `Restored` whose `state` is the `DiLoCoState`.

    Raises:
      FileNotFoundError: no (such) complete checkpoint.
      ValueError: a checkpoint of a `TrainState` (use `restore`),
        another group count, or anything `restore` refuses.
    """
    check_params(params)
    check_optimizer(inner_optimizer, "inner_optimizer")
    _check_pipeline(data)
    expected = abstract_diloco_state(params, inner_optimizer, layout, outer_optimizer=outer_optimizer,
                                     model_state=model_state, precision=precision, reduction=reduction)
    outer_axis = outer_axis_of(layout)
    mesh = jax.tree.leaves(expected)[0].sharding.mesh
    step = self._resolve_step(step)
    record = self._read_record(step)
    where = self._where(step)
    if not _is_diloco(record):
      raise ValueError(f"{where} holds a jaxdp.TrainState, not a DiLoCo state; restore it with ckpt.restore(...).")
    groups = next(e["shape"][0] for e in record["leaves"] if e["path"] == ["period_weight"])
    if groups != mesh.shape[outer_axis]:
      raise ValueError(
          f"{where} holds the state of {groups} DiLoCo replica groups, but the mesh's outer axis {outer_axis!r} has "
          f"{mesh.shape[outer_axis]}: each group's parameters and inner optimizer state are its own between syncs, "
          f"so they restore onto {groups} groups only. Restore onto a mesh with {outer_axis}={groups} (the devices "
          "per group may differ), or start a run of another group count from the outer parameters "
          "(jaxdp.init_diloco_state(restored.state.outer_params, ...))."
      )
    record_lib.check_against(record, expected, where, train_state=expected.inner, prefix=("inner",),
                             opt_state=(expected.inner.opt_state, expected.outer_opt_state))
    data_axes = layout.axis_name if isinstance(layout, DataParallel) else "data"  # as make_diloco_step reads it
    data_step = _resumed_data_step(record, data, mesh, (outer_axis, *axis_names(data_axes)), where)
    state, rng = self._read_state(step, record, expected)
    return Restored(state, rng, data_step, step, record["metadata"])

  def _read_state(self, step: int, record: dict, expected: Any) -> tuple[Any, jax.Array | None]:
    """The state of `expected` (`ShapeDtypeStruct`s with shardings) read from checkpoint `step`, and its key."""
    entries = {tuple(e["path"]): e for e in record["leaves"]}
    named = record_lib.named_leaves(expected)
    mesh = jax.tree.leaves(expected)[0].sharding.mesh
    target = [(c, record_lib.stored_struct(x, NamedSharding(mesh, P()) if record_lib.is_key_leaf(x) else x.sharding))
              for c, x in named]
    if RNG in entries:
      key = entries[RNG]
      target.append((RNG, jax.ShapeDtypeStruct(tuple(key["shape"]), np.dtype(key["dtype"]),
                                               sharding=NamedSharding(mesh, P()))))
    arrays = self._read_arrays(step, record, target)
    self._current = step
    leaves = [jax.device_put(jax.random.wrap_key_data(arrays[c], impl=entries[c]["key_impl"]), x.sharding)
              if record_lib.is_key_leaf(x) else arrays[c] for c, x in named]
    rng = None
    if RNG in arrays:
      impl = record["rng_impl"]
      rng = arrays[RNG] if impl is None else jax.random.wrap_key_data(arrays[RNG], impl=impl)
    return jax.tree.unflatten(jax.tree.structure(expected), leaves), rng

  def metadata(self, step: int | None = None) -> Any:
    """The user metadata saved with checkpoint `step` (default: the latest), without reading any array."""
    return self._read_record(self._resolve_step(step))["metadata"]

  def data_step(self, step: int | None = None) -> int:
    """The input pipeline's position saved with checkpoint `step` (default: the latest)."""
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
          f"jaxdp.io.checkpoint, or is truncated. Complete steps: {self.all_steps()}; restore another with step=."
      ) from e
    if not isinstance(record, dict) or record.get("format") != FORMAT:
      raise ValueError(f"{self._where(step)} was not written by jaxdp.io.checkpoint (no {FORMAT!r} record).")
    if record.get("version") != FORMAT_VERSION:
      raise ValueError(
          f"{self._where(step)} has format version {record.get('version')!r}; this jaxdp reads version "
          f"{FORMAT_VERSION}. Restore it with the jaxdp version that wrote it."
      )
    try:
      record_lib.check_record(record)
    except record_lib.BadField as bad:
      value = repr(bad.value)
      raise ValueError(
          f"{self._where(step)} is corrupt: its jaxdp record's field {bad.field} is "
          f"{value if len(value) <= 80 else value[:77] + '...'}, expected {bad.expected}. Complete steps: "
          f"{self.all_steps()}; restore another with step=."
      ) from None
    return record

  def _read_arrays(self, step: int, record: dict, target: list) -> dict[tuple[str, ...], jax.Array]:
    """Every array of the checkpoint, read into the shardings of `target` and checked against the record."""
    stored = [(c, x) for c, x in target if not _is_empty(x)]
    try:
      args = ocp.args.Composite(**{_STATE_ITEM: ocp.args.StandardRestore(record_lib.nested(stored))})
      tree = self._manager.restore(step, args=args)[_STATE_ITEM]
      arrays = {c: record_lib.lookup(tree, c) for c, _ in stored}
      arrays.update({c: _empty_array(x) for c, x in target if _is_empty(x)})
    except Exception as e:  # orbax and tensorstore raise many kinds; all mean "unreadable"
      raise ValueError(
          f"{self._where(step)} could not be read ({type(e).__name__}: {e}); it is truncated or corrupt. "
          f"Complete steps: {self.all_steps()}; restore another with step=."
      ) from e
    bad = record_lib.failed_leaves(record, arrays)
    if bad:
      raise ValueError(
          f"{self._where(step)} is corrupt: {', '.join(bad[:record_lib.MAX_LISTED])} fail their shape, dtype or "
          f"checksum check. Complete steps: {self.all_steps()}; restore another with step=."
      )
    return arrays

  def wait(self) -> None:
    """Blocks until every save in flight is complete (finalised on disk).

    Raises:
      Exception: the error of an asynchronous save that failed (an `OSError`
        such as `NotADirectoryError`, ...), once. That step is not written
        (the manager is as if it had never been attempted: `save(step, ...)`
        writes it and returns `True`); the earlier checkpoints are intact.
        A failure after the step's commit (orbax removing the checkpoints
        `max_to_keep` drops) is raised once too, and the step is kept.
    """
    try:
      self._manager.wait_until_finished()
    except Exception as e:
      pending, self._pending = self._pending, None
      if pending is None:  # not a save this manager started (orbax raised anyway): nothing to undo
        _join(self._save_threads)
        e.add_note(f"jaxdp.CheckpointManager: a save into {self.directory} failed; the earlier checkpoints are intact.")
        raise
      self._undo(*pending, e, asynchronous=True)
      raise
    self._pending = None

  def close(self) -> None:
    """Waits for saves in flight (raising a failed one's error, see `wait`) and releases orbax's resources."""
    try:
      self.wait()
    finally:
      # orbax's close() waits first and would stop there on a failed save, leaving its checkpointer and metadata
      # stores open; the failure is raised once per thread, so after wait() this close() runs to the end.
      self._manager.close()
