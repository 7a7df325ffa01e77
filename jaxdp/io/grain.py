"""grain input: a per-process grain dataset batched into the step's `(batch, weights)`, exactly, and resumable.

Each process gives `GrainPipeline` its own grain `MapDataset`,
`IterDataset` or `DataLoader` of single examples (sharded per process,
e.g. with `process_shard`, which cuts as grain's
`ShardByJaxProcess(drop_remainder=False)` does: the remainder to the first
processes). Every step each process takes up to `local devices *
per_device_batch` examples from its iterator, cuts them over its devices as
evenly as possible (the first devices one more), pads every device to
`per_device_batch` rows of weight 0 and builds the global arrays with
`jax.make_array_from_process_local_data`. The processes' counts of examples
are exchanged once per epoch, so every process knows the epoch's number of
steps without a collective per step: a process that runs dry first steps on
with padding only, and the `"mean"` reduction is the exact weighted mean of
the real examples. Every example of every process is used exactly once per
epoch.

The pipeline's position is its grain iterator's own state
(`get_state`/`set_state`) taken at a step boundary, plus the epoch and the
examples consumed: `CheckpointManager.save(..., data=pipeline)` stores one
entry per process, and `restore(..., data=pipeline)` sets it back, so the
run resumes at the next example, none skipped or repeated. Another process
count is refused (grain's iterator states are per process shard).

grain itself is not imported here: the pipeline uses the dataset's
`iter()` and the iterator's `get_state`/`set_state` only
(`pip install jaxdp[grain]` installs grain).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator

import jax
import numpy as np
from jax.sharding import Mesh

from jaxdp.core.checks import check_int, mark_padded
from jaxdp.core.processes import allgather_bytes, assert_same_across_processes
from jaxdp.io.data import (
    addressable_positions,
    check_pad,
    collate_checked,
    first_real_row,
    pad_portions,
    portion_sizes,
)
from jaxdp.sharding.layout import check_mesh_axis, data_rows, data_size, split_along

STATE_FIELDS = ("epoch", "step", "consumed", "num_examples", "process", "processes", "iterator")
"""The fields of `GrainPipeline.get_state` (one process's entry in a checkpoint)."""


def stack(examples: list) -> tuple[Any, np.ndarray]:
  """The default `collate`: the examples' leaves stacked along a new leading axis, weight 1 each."""
  batch = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *examples)
  return batch, np.ones((len(examples),), np.float32)


def process_shard(dataset: Any, index: int | None = None, count: int | None = None) -> Any:
  """This process's contiguous shard of a grain `MapDataset` (or any sliceable sequence with `len`).

  The cut of grain's `ShardByJaxProcess(drop_remainder=False)`
  (`grain.sharding.even_split`): `N` examples over `P` processes give
  each `N // P` and the first `N % P` one more, no example dropped.
  (grain 0.2.18's `DataLoader` with an `IndexSampler` under those options
  reads only `N // P` per process: the remainder is never read; slice a
  `MapDataset` with this instead.)

  Args:
    dataset: the whole (e.g. shuffled) dataset, the same on every process.
    index: the shard, default `jax.process_index()`.
    count: the number of shards, default `jax.process_count()`.

  Returns:
    `dataset[start:stop]`, this shard's examples in order.
  """
  count = jax.process_count() if count is None else check_int(count, "count", 1, "pass the number of shards.")
  index = jax.process_index() if index is None else check_int(index, "index", 0, "shards count from 0.")
  if index >= count:
    raise ValueError(f"index={index} must be < count={count}.")
  n = len(dataset)
  start = index * (n // count) + min(index, n % count)
  return dataset[start : start + n // count + (index < n % count)]


def _iterator_state(iterator: Any) -> str:
  """The grain iterator's state as JSON text: a `DatasetIterator`'s dict, or a `DataLoaderIterator`'s bytes."""
  state = iterator.get_state()
  if isinstance(state, bytes):
    return json.dumps({"bytes": state.decode()})
  return json.dumps({"state": state})


def _set_iterator_state(iterator: Any, text: str) -> None:
  saved = json.loads(text)
  iterator.set_state(saved["bytes"].encode() if "bytes" in saved else saved["state"])


def _first_example(dataset: Any) -> Any:
  """The dataset's first example, or `None` if it is empty; by index when it has one (no iterator started)."""
  if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
    return dataset[0] if len(dataset) else None
  return next(iter(dataset), None)


class GrainPipeline:
  """Batches this process's grain dataset over its devices; every process ends each epoch after the same step.

  Example (each process builds its own):

  ```python
  source = grain.MapDataset.source(records)
  pipe = GrainPipeline(lambda epoch: process_shard(source.shuffle(seed=epoch)), mesh, per_device_batch=8)
  for epoch in range(epochs):
    for batch, weights in pipe:            # one epoch
      state, metrics = step(state, batch, weights)
  ```

  Iterating yields the rest of the current epoch; the next iteration starts
  the next epoch (a fresh iterator of `dataset(epoch)`, or of the same
  dataset). A step takes this process's next `min(len(local_positions) *
  per_device_batch, examples left)` examples in the iterator's order and
  cuts them contiguously over its devices in mesh order, as evenly as
  possible (the first devices one more), each padded to `per_device_batch`
  rows of weight 0 (copies of a real row under `pad="copy"`). The epoch has
  `max` over the processes of `ceil(examples / (local devices * b))`
  steps; a process with fewer examples steps on with padding only.

  Attributes:
    n_devices: devices along `axis_name`.
    per_device_batch: rows per device; every batch has `n_devices * per_device_batch` rows.
    local_positions: the mesh positions this process fills.
    num_examples: this process's examples per epoch.
    epoch: the current epoch, from 0.
    step: the steps drawn in the current epoch.
    consumed: this process's examples placed in the current epoch.
    steps_per_epoch: the current epoch's number of steps (the same on every process).
  """

  def __init__(
      self,
      dataset: Any,
      mesh: Mesh,
      *,
      per_device_batch: int,
      collate: Callable[[list], tuple[Any, Any]] | None = None,
      num_examples: int | None = None,
      template: Any = None,
      axis_name: str | tuple[str, ...] = "data",
      pad: str = "copy",
      read_options: Any = None,
  ):
    """Builds the pipeline (a collective: every process builds its own at the same point).

    Args:
      dataset: this process's grain `MapDataset`, `IterDataset` or
        `DataLoader` of single (unbatched) examples, or a function
        `epoch -> dataset` (a new shuffle per epoch). `iter()` of it must
        give an iterator with grain's `get_state`/`set_state`.
      mesh: the mesh to place batches on.
      per_device_batch: rows per device `b >= 1`.
      collate: `collate(examples) -> (batch, weights)` as for
        `DataPipeline` (numpy leaves with leading size `len(examples)`,
        weights `[k]` or `[k, t]`, finite and `>= 0`); default
        `stack`, weight 1 per example.
      num_examples: this process's examples per epoch; default
        `len(dataset)` (a `MapDataset` has one; give it for an
        `IterDataset` or a `DataLoader`). An iterator that ends before
        it, or holds more, raises (an example would be lost).
      template: one example shaped like the others, for the shapes of a
        device's portion when it has no example; default this process's
        first example of epoch 0 (read once: by index from a `MapDataset`,
        else from a fresh iterator). Needed
        by a process whose dataset is empty. Under `pad="copy"` its padding
        rows copy a real row of their own device, or this example: the
        batches are the same in a run resumed from a checkpoint.
      axis_name: the data-parallel axis, or a tuple of axes.
      pad: what padding rows hold, `"copy"` (default) or `"zeros"`.
      read_options: for a `MapDataset`, the `grain.ReadOptions` of its
        iterator (`dataset.to_iter_dataset(read_options)`); default
        grain's own (`iter(dataset)`: 16 prefetch threads, 500 examples
        ahead). `grain.ReadOptions(num_threads=0)` reads in the calling
        thread, which costs less per example when reading is cheap.
    """
    check_mesh_axis(mesh, axis_name)
    self.pad = check_pad(pad)
    collate = stack if collate is None else collate
    if not callable(collate):
      raise ValueError(f"collate must be callable, got {type(collate).__name__}; pass collate(examples) -> (batch, weights).")
    self.mesh, self.axis_name, self.collate = mesh, axis_name, collate
    self.per_device_batch = check_int(per_device_batch, "per_device_batch", 1, "give every device at least one row.")
    self.n_devices = data_size(mesh, axis_name)
    self.local_positions = addressable_positions(mesh, axis_name)
    if not self.local_positions:
      raise ValueError("mesh has no device of this process; build the pipeline on a mesh that includes local devices.")
    me = jax.process_index()
    shared = [i for i in self.local_positions if any(d.process_index != me for d in data_rows(mesh, axis_name)[i])]
    if shared:
      raise ValueError(
          f"data-axis positions {shared} of this mesh hold devices of several processes; a GrainPipeline fills each "
          "position from one process's dataset. Lay the mesh out so that each data-axis position belongs to one "
          "process, e.g. jax.make_mesh with the data axis outermost."
      )
    self._sharding = split_along(mesh, axis_name)
    self._source = dataset if callable(dataset) and not hasattr(dataset, "__iter__") else (lambda epoch: dataset)
    self._num_examples_arg = None if num_examples is None else check_int(
        num_examples, "num_examples", 0, "pass this process's examples per epoch.")
    self._read_options = read_options
    self._empty = self._spare = None  # an empty portion, and the row a device with no example copies
    if template is None:  # this process's first example (of epoch 0, also in a run that then resumes)
      template = _first_example(self._source(0))
    if template is not None:
      probe = collate_checked(collate, [template])
      self._empty, self._spare = jax.tree.map(lambda x: x[:0], probe), first_real_row(*probe)
    assert_same_across_processes({"per_device_batch": self.per_device_batch, "devices": self.n_devices,
                                  "pad": self.pad}, "GrainPipeline arguments")
    self.epoch = 0
    self._start(0, None)

  # --- Epochs ------------------------------------------------------------------------------------

  def _dataset_size(self, dataset: Any) -> int:
    if self._num_examples_arg is not None:
      return self._num_examples_arg
    if not hasattr(dataset, "__len__"):
      raise ValueError(
          f"dataset is a {type(dataset).__name__} without len(); pass num_examples=<this process's examples per "
          "epoch> (for a DataLoader: the examples its sampler gives this process in one epoch)."
      )
    return check_int(len(dataset), "len(dataset)", 0, "pass a dataset of this process's examples.")

  def _start(self, consumed: int, iterator_state: str | None, step: int = 0) -> None:
    """Opens the current epoch's iterator (at `iterator_state` if given) and agrees on its steps."""
    dataset = self._source(self.epoch)
    self.num_examples = self._dataset_size(dataset)
    if not hasattr(dataset, "__iter__"):
      raise ValueError(f"dataset must be a grain dataset or DataLoader (iterable), got {type(dataset).__name__}.")
    if self._read_options is None:
      self._iterator = iter(dataset)
    elif hasattr(dataset, "to_iter_dataset"):
      self._iterator = iter(dataset.to_iter_dataset(self._read_options))
    else:
      raise ValueError(f"read_options apply to a grain MapDataset, got a {type(dataset).__name__}; pass read_options=None.")
    if iterator_state is not None:
      if not hasattr(self._iterator, "set_state"):
        raise ValueError(f"the dataset's iterator ({type(self._iterator).__name__}) has no set_state; pass a grain dataset.")
      _set_iterator_state(self._iterator, iterator_state)
    elif not hasattr(self._iterator, "get_state"):
      raise ValueError(
          f"the dataset's iterator ({type(self._iterator).__name__}) has no get_state, so its position cannot be "
          "checkpointed; pass a grain MapDataset, IterDataset or DataLoader."
      )
    self.step, self.consumed = step, consumed
    left = self.num_examples - consumed
    if left < 0:
      raise ValueError(f"the saved position ({consumed} examples consumed) is past this epoch's {self.num_examples}.")
    counts = self._gather([left, len(self.local_positions)])
    per_step = self.per_device_batch
    self._remaining_steps = max(-(-rem // (local * per_step)) for rem, local in counts)
    self.steps_per_epoch = step + self._remaining_steps
    if self.num_examples == 0 and self._empty is None and self._remaining_steps:
      raise ValueError(
          "this process's dataset has no example this epoch, so it cannot learn the shapes of its padding; pass "
          "template=<one example shaped like every process's examples> (it is never trained on)."
      )

  @staticmethod
  def _gather(value: list[int]) -> list[list[int]]:
    """Every process's `value`, in process order."""
    if jax.process_count() == 1:
      return [value]
    return [json.loads(b) for b in allgather_bytes(json.dumps(value).encode())]

  # --- Steps -------------------------------------------------------------------------------------

  def _take(self, k: int) -> list:
    taken = []
    for _ in range(k):
      try:
        taken.append(next(self._iterator))
      except StopIteration:
        raise ValueError(
            f"this process's dataset ended after {self.consumed + len(taken)} examples in epoch {self.epoch}, but it "
            f"has {self.num_examples} (num_examples or len(dataset)); pass its true count."
        ) from None
    return taken

  def _check_exhausted(self) -> None:
    try:
      next(self._iterator)
    except StopIteration:
      return
    raise ValueError(
        f"this process's dataset holds more than its {self.num_examples} examples (num_examples or len(dataset)) in "
        f"epoch {self.epoch}: the rest would never be trained on. Pass its true count, or a dataset of one epoch "
        "(no repeat)."
    )

  def next_portions(self) -> dict[int, tuple[Any, np.ndarray]] | None:
    """This process's padded host portions `{position: (batch, weights)}` of the next step, or `None` at the
    end of the epoch (the next call starts the next epoch)."""
    if self.step >= self.steps_per_epoch:
      self.epoch += 1
      self._start(0, None)
      return None
    k = min(len(self.local_positions) * self.per_device_batch, self.num_examples - self.consumed)
    taken = self._take(k)
    if taken and self.consumed + k == self.num_examples:
      self._check_exhausted()
    portions, start = {}, 0
    for position, size in zip(self.local_positions, portion_sizes(len(taken), len(self.local_positions))):
      part, start = taken[start : start + size], start + int(size)
      portions[position] = collate_checked(self.collate, part, self._empty) if part else self._empty
    self.step += 1
    self.consumed += len(taken)
    return pad_portions(portions, self.per_device_batch, self.pad, self._spare)

  def __iter__(self) -> Iterator[tuple[Any, jax.Array]]:
    while (portions := self.next_portions()) is not None:
      yield self._place(portions)

  def _place(self, portions: dict) -> tuple[Any, jax.Array]:
    """The global `(batch, weights)` of this process's portions (in mesh order) and the other processes'."""
    rows = self.per_device_batch
    local = [portions[p] for p in self.local_positions]

    def place(*blocks):
      data = np.concatenate(blocks)
      return jax.make_array_from_process_local_data(self._sharding, data, (self.n_devices * rows, *data.shape[1:]))

    placed = jax.tree.map(place, *local)
    mark_padded(placed[0])
    return placed

  # --- State -------------------------------------------------------------------------------------

  def get_state(self) -> dict:
    """This process's position, JSON-serialisable: `{field: value}` for `STATE_FIELDS`.

    Taken between steps: the iterator's state is that after the examples of the steps drawn, so
    `set_state` resumes at the next example.
    """
    at_end = self.step >= self.steps_per_epoch
    return {
        "epoch": self.epoch + 1 if at_end else self.epoch,
        "step": 0 if at_end else self.step,
        "consumed": 0 if at_end else self.consumed,
        "num_examples": self.num_examples,
        "process": jax.process_index(),
        "processes": jax.process_count(),
        # At an epoch's start the position is the epoch alone (a fresh iterator of its dataset).
        "iterator": None if at_end or self.step == 0 else _iterator_state(self._iterator),
    }

  def set_state(self, state: dict) -> None:
    """Resumes at a position from `get_state` (a collective: every process sets its own entry).

    Raises:
      ValueError: a position of another process count or process (grain's iterator state is per shard), or of
        another dataset size; nothing is changed then.
    """
    if not isinstance(state, dict) or set(state) != set(STATE_FIELDS):
      raise ValueError(f"state must be a GrainPipeline.get_state() dict with fields {STATE_FIELDS}, got {state!r:.200}.")
    if state["processes"] != jax.process_count() or state["process"] != jax.process_index():
      raise ValueError(
          f"the saved grain position is process {state['process']}'s of {state['processes']} processes, and this is "
          f"process {jax.process_index()} of {jax.process_count()}: grain's iterator state belongs to one process's "
          "shard, so it cannot resume exactly on another process count. Resume on the saving run's "
          f"{state['processes']} processes, or start the data at the next epoch (a new GrainPipeline)."
      )
    epoch = check_int(state["epoch"], "state['epoch']", 0, "epochs count from 0.")
    before = (self.epoch, self.step, self.consumed, self._iterator, self.num_examples, self.steps_per_epoch,
              self._remaining_steps)
    self.epoch = epoch
    try:
      self._start(state["consumed"], state["iterator"], state["step"])
      if state["iterator"] is not None and self.num_examples != state["num_examples"]:
        raise ValueError(
            f"the saved grain position is in an epoch of {state['num_examples']} examples on this process, and "
            f"this dataset has {self.num_examples}: resuming would skip or repeat examples. Resume with the same data."
        )
    except BaseException:
      (self.epoch, self.step, self.consumed, self._iterator, self.num_examples, self.steps_per_epoch,
       self._remaining_steps) = before
      raise


def is_grain_pipeline(data: Any) -> bool:
  """Whether `data` is a `GrainPipeline` (what `CheckpointManager` saves one entry per process of)."""
  return isinstance(data, GrainPipeline)


def gather_states(pipeline: GrainPipeline) -> list[dict]:
  """Every process's `GrainPipeline.get_state`, in process order (a collective)."""
  mine = pipeline.get_state()
  if jax.process_count() == 1:
    return [mine]
  return [json.loads(b) for b in allgather_bytes(json.dumps(mine).encode())]


def restore_states(pipeline: Any, states: Any, where: str, check_only: bool = False) -> None:
  """Sets `pipeline` to this process's entry of `states` (saved by `gather_states`), or refuses.

  With `check_only`, only refuses (before a restore reads any array): `pipeline` is not a
  `GrainPipeline`, or `states` are of another process count.
  """
  if not isinstance(pipeline, GrainPipeline):
    raise ValueError(
        f"{where} holds a GrainPipeline's position (one entry per process); restore it with "
        "data=<the GrainPipeline of the run>, or without data= to leave the input to you."
    )
  if len(states) != jax.process_count():
    raise ValueError(
        f"{where} holds the grain positions of {len(states)} processes, and this run has {jax.process_count()}: "
        "grain's iterator state belongs to one process's shard, so the data cannot resume exactly on another process "
        f"count. Resume on {len(states)} processes, or restore without data= and start the data at a new epoch."
    )
  if not check_only:
    pipeline.set_state(states[jax.process_index()])

