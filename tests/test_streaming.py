"""Streams of unknown length: every example once, every process stopping after the same step.

The protocol is checked on simulated processes (pipelines that fill another
process's mesh positions and hand back host portions, their flags summed
here as the step's all-reduce would) over many stream lengths; the placed
batches and the training they give are checked against ``shard_uneven`` on
1-4 devices; and real 2-process jobs under ``python -m jaxdp.launch`` train
on streams of different lengths and are compared with a single-device
reference.

Tolerance of the real-process comparison: the same float32 examples, only
summed in another order (per device, then across processes, against one sum
on one device), as in ``tests/test_step_properties.py``: a few ulps per step,
far below what a dropped or repeated example moves (> 1e-3).
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxdp
from helpers import mesh_of as _mesh
from jaxdp.io.data import StreamingPipeline, process_positions
from mp_workers import harness, problem
from mp_workers import streaming as worker

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py: plumbing and float32 agreement

RTOL, ATOL = 1e-5, 2e-6
JOB_SECONDS = 90  # a generous bound on one launched job


def _steps(counts, local_batch: int) -> int:
  """Steps the loop runs: the longest stream's, and one (all padding) when every stream is empty."""
  return max(1, *(-(-n // local_batch) for n in counts))


def collate_ids(examples: list) -> tuple[dict, np.ndarray]:
  """Example ``i`` is the int ``i``; x is never 0 on a real row, so padding is recognisable."""
  assert examples, "the pipeline must not call collate on an empty portion"
  ids = np.asarray(examples, np.int32)
  return {"id": ids, "x": np.stack([ids + 1, -(ids + 1)], 1).astype(np.float32)}, np.ones(len(ids))


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _report_sum(stream, has_more) -> None:
  """What the step would report: the sum over devices (here on the host, without a step)."""
  stream.report(int(np.sum(np.asarray(has_more))))


# --- Batches and the end of the loop, one process ---------------------------------------------------


@settings(max_examples=60)
@given(n=st.integers(0, 40), k=st.integers(1, 8), b=st.integers(1, 4), pad=st.sampled_from(["copy", "zeros"]))
def test_every_example_once_and_the_loop_ends_after_the_last_data_step(n, k, b, pad):
  mesh = _mesh(k)
  stream = StreamingPipeline((i for i in range(n)), collate_ids, mesh, per_device_batch=b, template=0, pad=pad)
  steps, seen = _steps([n], k * b), []
  spare = collate_ids([0])[0]["x"]  # the template's row: what a device copies before this process has any
  for s, (batch, weights, has_more) in enumerate(stream):
    _report_sum(stream, has_more)
    for leaf in jax.tree.leaves((batch, weights, has_more)):
      assert leaf.sharding == NamedSharding(mesh, P("data"))
    assert has_more.shape == (k,) and has_more.dtype == jnp.int32
    batch, weights, has_more = _host((batch, weights, has_more))
    assert weights.shape == (k * b,) and weights.dtype == np.float32
    # 1 on every device until the stream is dry after this step, then 0: known when the batch is built.
    assert has_more.tolist() == [int(s < steps - 1)] * k
    sizes = []
    if weights[0] > 0:  # device 0 has a row whenever any device has: empty devices copy it, as do later dry steps
      spare = batch["x"][:1]
    for d in range(k):
      rows = slice(d * b, (d + 1) * b)
      real = int(np.sum(weights[rows] > 0))
      np.testing.assert_array_equal(weights[rows], [1.0] * real + [0.0] * (b - real))
      assert np.all(batch["x"][rows][:real])
      padding = batch["x"][rows][real:]
      if pad == "zeros":
        assert not np.any(padding)
      else:  # copies of the device's own first row, else of another device's
        np.testing.assert_array_equal(padding, np.repeat(batch["x"][rows][:1] if real else spare, b - real, axis=0))
      seen.extend(batch["id"][rows][:real].tolist())
      sizes.append(real)
    # Full local batches until the last data step, which is spread evenly, extras first.
    if s < steps - 1:
      assert sizes == [b] * k
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
  assert stream.steps == steps and stream.done and stream.consumed == n
  assert seen == list(range(n))  # stream order, each example once: the first (the shape probe) included
  with pytest.raises(StopIteration):  # and it stays ended
    next(stream)


def test_two_axis_mesh_replicates_batch_and_flags_over_the_other_axis():
  devices = np.asarray(jax.devices()[:8]).reshape(4, 2)
  mesh = Mesh(devices, ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  stream = StreamingPipeline(range(11), collate_ids, mesh, per_device_batch=2)
  assert stream.local_positions == (0, 1, 2, 3)
  batch, weights, has_more = next(stream)
  assert has_more.shape == (4,) and has_more.sharding == NamedSharding(mesh, P("data"))
  for shard in has_more.addressable_shards:  # both devices of a data position hold its flag
    assert shard.data.tolist() == [1]
  _report_sum(stream, has_more)
  _, weights, has_more = next(stream)
  assert np.asarray(has_more).tolist() == [0] * 4 and np.asarray(weights).tolist() == [1, 0, 1, 0, 1, 0, 0, 0]  # 3 left: 1, 1, 1, 0


# --- Simulated processes: streams of different lengths ----------------------------------------------


@settings(max_examples=40)
@given(n_devices=st.sampled_from([2, 4, 6, 8]), b=st.integers(1, 3), data=st.data())
def test_processes_with_streams_of_different_lengths_stop_after_the_same_step(n_devices, b, data):
  n_processes = data.draw(st.sampled_from([p for p in range(2, n_devices + 1) if n_devices % p == 0]))
  counts = data.draw(st.lists(st.integers(0, 15), min_size=n_processes, max_size=n_processes))
  firsts = np.cumsum([0, *counts])
  pipes = [
      StreamingPipeline(iter(range(firsts[p], firsts[p + 1])), collate_ids, _mesh(n_devices), per_device_batch=b,
                        template=0, positions=process_positions(n_devices, n_processes, p))
      for p in range(n_processes)
  ]
  local_batch = b * n_devices // n_processes
  seen = [[] for _ in pipes]
  while True:
    portions = [pipe.next_portions() for pipe in pipes]
    if portions[0] is None:
      assert all(p is None for p in portions), "every process ends at the same step"
      break
    assert all(p is not None for p in portions), "every process ends at the same step"
    merged = {q: portion for process in portions for q, portion in process.items()}
    assert sorted(merged) == list(range(n_devices))
    for p, (process, ids) in enumerate(zip(portions, seen)):
      for batch, weights, _ in process.values():
        ids.extend(batch["id"][weights > 0].tolist())
      flags = {int(flag[0]) for _, _, flag in process.values()}
      assert flags == {int(len(ids) < counts[p])}  # 1 on its devices exactly while its stream has more
    count = sum(int(flag[0]) for _, _, flag in merged.values())  # the step's all-reduce
    for pipe in pipes:
      pipe.report(count)
  assert [pipe.steps for pipe in pipes] == [_steps(counts, local_batch)] * n_processes
  for p, ids in enumerate(seen):  # each process consumed exactly its own stream, in order
    assert ids == list(range(firsts[p], firsts[p + 1])) and pipes[p].consumed == counts[p]


# --- Training: the same as shard_uneven on the same portions ----------------------------------------


def _linear_loss(params, batch):
  return 0.5 * (batch["x"] @ params["w"] + params["c"] - batch["y"]) ** 2


def _regression_example(i: int) -> dict:
  rng = np.random.default_rng(i)
  return {"x": rng.normal(size=(3,)).astype(np.float32), "y": np.float32(rng.normal()), "w": np.float32(1 + i % 3)}


def _collate_regression(examples: list) -> tuple[dict, np.ndarray]:
  batch = {k: np.stack([e[k] for e in examples]) for k in ("x", "y")}
  return batch, np.stack([e["w"] for e in examples])


@functools.cache
def _steps_for(k: int):
  opt = optax.sgd(0.1, momentum=0.9)
  return opt, jaxdp.make_train_step(_linear_loss, opt, _mesh(k))


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [0, 3, 17])  # empty; under one global batch (k >= 2); a ragged last batch
def test_training_on_a_stream_equals_shard_uneven_steps_on_the_same_portions(k, n):
  b, mesh = 2, _mesh(k)
  opt, step = _steps_for(k)
  params = {"w": np.linspace(-1, 1, 3).astype(np.float32), "c": np.float32(0.5)}
  examples = (_regression_example(i) for i in range(n))
  stream = StreamingPipeline(examples, _collate_regression, mesh, per_device_batch=b, template=_regression_example(0))
  # Two states: the step donates its input.
  state, reference = jaxdp.init_state(params, opt, mesh), jaxdp.init_state(params, opt, mesh)
  for batch, weights, has_more in stream:
    state, metrics = step(state, batch, weights, has_more=has_more)
    stream.report(metrics["has_more"])
    assert int(metrics["has_more"]) == int(np.sum(np.asarray(has_more)))
    # The reference: the real rows of each device, unpadded, placed by shard_uneven.
    host_batch, host_weights = _host((batch, weights))
    portions, portion_weights = [], []
    for d in range(k):
      real = slice(d * b, d * b + int(np.sum(host_weights[d * b : (d + 1) * b] > 0)))
      portions.append(jax.tree.map(lambda x: x[real], host_batch))
      portion_weights.append(host_weights[real])
    reference, _ = step(reference, *jaxdp.shard_uneven(portions, mesh, weights=portion_weights))
  assert stream.steps == _steps([n], k * b) and stream.consumed == n
  assert int(state.step) == -(-n // (k * b))  # the all-padding step of an empty stream is skipped
  for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(reference.params)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
  if n == 0:
    np.testing.assert_array_equal(np.asarray(state.params["w"]), params["w"])


def test_a_process_with_data_never_waits_for_the_count(monkeypatch):
  """The reported count is read only once this process's stream is dry: here once, after the last step."""
  opt, step = _steps_for(2)
  mesh = _mesh(2)
  state = jaxdp.init_state({"w": np.ones(3, np.float32), "c": np.float32(0)}, opt, mesh)
  stream = StreamingPipeline((_regression_example(i) for i in range(9)), _collate_regression, mesh, per_device_batch=2)
  reported, read = [], []
  device_get = jax.device_get

  def recording_get(x):
    read.extend(i for i, r in enumerate(reported) if r is x)
    return device_get(x)

  monkeypatch.setattr(jax, "device_get", recording_get)
  for batch, weights, has_more in stream:
    state, metrics = step(state, batch, weights, has_more=has_more)
    reported.append(metrics["has_more"])
    stream.report(metrics["has_more"])
  assert stream.steps == 3 and read == [2]


# --- The protocol and bad arguments -----------------------------------------------------------------


def test_forgetting_report_raises_and_the_loop_can_go_on():
  stream = StreamingPipeline(range(10), collate_ids, _mesh(2), per_device_batch=2)
  with pytest.raises(RuntimeError, match="report"):
    stream.report(1)  # no step yet
  _, _, has_more = next(stream)
  with pytest.raises(RuntimeError, match=r"step 0's has_more was not reported"):
    next(stream)
  _report_sum(stream, has_more)
  with pytest.raises(RuntimeError, match="no step awaiting"):
    stream.report(2)  # twice
  ids = []
  for batch, weights, has_more in stream:
    _report_sum(stream, has_more)
    ids.extend(np.asarray(batch["id"])[np.asarray(weights) > 0].tolist())
  assert ids == list(range(4, 10)) and stream.steps == 3


@pytest.mark.parametrize(
    "value, match",
    [(1.0, "integer scalar"), (np.ones(2, np.int32), "integer scalar"), (jnp.float32(2), "integer scalar"),
     (0, r"lies in \[2, 2\]"), (3, r"lies in \[2, 2\]")],
)
def test_report_rejects_what_cannot_be_the_count(value, match):
  stream = StreamingPipeline(range(10), collate_ids, _mesh(2), per_device_batch=2)
  next(stream)  # 6 examples left: both devices have more, so the count must be 2
  with pytest.raises(ValueError, match=match):
    stream.report(value)
  stream.report(jnp.int32(2))  # the rejected value left the step awaiting its report


def test_reset_starts_a_new_epoch_and_an_empty_one_needs_no_template():
  stream = StreamingPipeline(iter(range(3)), collate_ids, _mesh(2), per_device_batch=2)
  for _, _, has_more in stream:
    _report_sum(stream, has_more)
  assert (stream.epoch, stream.steps, stream.done) == (0, 1, True)
  stream.reset(iter([]))  # the shapes came from epoch 0's first example
  batches = []
  for batch, weights, has_more in stream:
    _report_sum(stream, has_more)
    batches.append(np.asarray(weights))
  assert (stream.epoch, stream.steps, stream.consumed) == (1, 1, 0) and not np.any(batches[0])
  stream.reset(range(5, 10))
  ids = []
  for batch, weights, has_more in stream:
    _report_sum(stream, has_more)
    ids.extend(np.asarray(batch["id"])[np.asarray(weights) > 0].tolist())
  assert ids == [5, 6, 7, 8, 9] and (stream.epoch, stream.steps) == (2, 2)


def test_bad_arguments_name_the_problem():
  mesh = _mesh(2)
  with pytest.raises(ValueError, match="template="):
    StreamingPipeline(iter([]), collate_ids, mesh, per_device_batch=2)
  with pytest.raises(ValueError, match="iterable"):
    StreamingPipeline(5, collate_ids, mesh, per_device_batch=2)
  with pytest.raises(ValueError, match="per_device_batch"):
    StreamingPipeline(range(3), collate_ids, mesh, per_device_batch=0)
  with pytest.raises(ValueError, match="callable"):
    StreamingPipeline(range(3), None, mesh, per_device_batch=1)
  with pytest.raises(ValueError, match="axis_name"):
    StreamingPipeline(range(3), collate_ids, mesh, per_device_batch=1, axis_name="batch")
  with pytest.raises(ValueError, match="outside the mesh"):
    StreamingPipeline(range(3), collate_ids, mesh, per_device_batch=1, positions=[2])
  with pytest.raises(ValueError, match="repeat"):
    StreamingPipeline(range(3), collate_ids, mesh, per_device_batch=1, positions=[1, 1])
  with pytest.raises(ValueError, match="positions is empty"):
    StreamingPipeline(range(3), collate_ids, mesh, per_device_batch=1, positions=[])
  with pytest.raises(RuntimeError, match="next_portions"):
    next(StreamingPipeline(range(3), collate_ids, mesh, per_device_batch=1, positions=[1]))


def test_a_template_shaped_unlike_the_examples_is_rejected():
  def tokens(examples):  # pads to the longest example: the template's length differs from the data's
    return {"tok": np.zeros((len(examples), max(examples) + 1), np.int32)}, np.ones(len(examples))

  stream = StreamingPipeline(iter([3, 3]), tokens, _mesh(2), per_device_batch=2, template=0)
  with pytest.raises(ValueError, match="fixed length"):
    next(stream)


# --- Real processes ---------------------------------------------------------------------------------

JOBS = {
    # name: (launcher options, worker options, examples per process, devices per process)
    "2 processes x 1 device, 7 and 19 examples": (
        ["--nproc", "2", "--devices-per-proc", "1"], ["--counts", "7,19"], (7, 19), 1),
    # Process 0's stream is empty: it learns the shapes from the template and steps on padding only.
    "2 processes x 2 devices, 0 and 11 examples": (
        ["--nproc", "2", "--devices-per-proc", "2"], ["--counts", "0,11", "--template"], (0, 11), 2),
}


def _reference(steps: list[list[int]]) -> dict:
  """The parameters after one single-device weighted-mean SGD step per global batch of example ids."""
  opt = optax.sgd(problem.LR, momentum=problem.MOMENTUM)
  params = jax.device_put(problem.init_params(), jax.devices()[0])
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state, batch, weights):
    def loss(params):
      return jnp.sum(weights * problem.loss_fn(params, batch)) / jnp.sum(weights)

    updates, opt_state = opt.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for ids in steps:
    batch, weights = worker.collate([worker.example(i) for i in ids])
    params, opt_state = step(params, opt_state, {"x": batch["x"], "y": batch["y"]}, weights)
  return jax.tree.map(np.asarray, params)


@pytest.mark.parametrize("job", list(JOBS))
def test_real_processes_with_streams_of_different_lengths(job, tmp_path):
  launcher, options, counts, per_process = JOBS[job]
  result = harness.launch([*launcher, "--grace-period", "2", "--timeout", "80"],
                          [harness.WORKERS / "streaming.py", tmp_path, *options], timeout=JOB_SECONDS)
  harness.assert_no_leftovers(str(tmp_path))
  assert result.returncode == 0, f"job failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
  ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
  # Both processes ran the same steps, as many as the longest stream needs, and stopped together.
  steps = _steps(counts, 2 * per_process)
  assert [r["steps"] for r in ranks] == [steps, steps] and [r["consumed"] for r in ranks] == list(counts)
  assert ranks[0]["has_more"] == ranks[1]["has_more"] and ranks[0]["has_more"][-1] == 0
  assert all(c > 0 for c in ranks[0]["has_more"][:-1])
  # Every example exactly once, each process its own stream in order.
  firsts = np.cumsum([0, *counts])
  per_step = [{int(q): ids for r in ranks for q, ids in r["ids"][s].items()} for s in range(steps)]
  for p, r in enumerate(ranks):
    own = [i for s in range(steps) for q in r["positions"] for i in r["ids"][s][str(q)]]
    assert own == list(range(firsts[p], firsts[p + 1]))
  global_batches = [[i for q in sorted(batch) for i in batch[q]] for batch in per_step]
  assert sorted(i for ids in global_batches for i in ids) == list(range(sum(counts)))
  # The replicas agree, and equal one device trained on the same global batches.
  assert ranks[0]["params"] == ranks[1]["params"]
  reference = _reference(global_batches)
  for k, want in reference.items():
    np.testing.assert_allclose(np.asarray(ranks[0]["params"][k], np.float32), want, rtol=RTOL, atol=ATOL)
  moved = max(float(np.max(np.abs(reference[k] - problem.init_params()[k]))) for k in reference)
  assert moved > 1e-2, "the reference must actually train"
  print(f"\n{job}: {steps} steps, {result.seconds:.1f} s")


def test_an_error_while_drawing_a_batch_ends_the_pipeline_loudly():
  """An iterator or collate that raised while a batch was drawn lost the examples already read for it; a caller
  that caught the error and went on ended the pass normally without them (a generator that raised even looked
  like a clean end of the stream). The pipeline now re-raises on every later draw until reset (found by the
  streaming review)."""
  mesh = jaxdp.data_mesh(jax.devices()[:2])

  def collate(rows):
    ids = np.asarray(rows, np.int32)
    return {"id": ids}, np.ones(len(ids), np.float32)

  def flaky():
    for i in range(12):
      if i == 6:
        raise OSError("transient read error")
      yield i

  stream = jaxdp.StreamingPipeline(flaky(), collate, mesh, per_device_batch=2, template=0)
  seen = []
  with pytest.raises(OSError, match="transient"):
    while True:
      batch, weights, has_more = next(stream)
      seen += [int(i) for i in np.asarray(batch["id"])[np.asarray(weights) > 0]]
      stream.report(int(np.sum(np.asarray(has_more))))
  assert seen == [0, 1, 2, 3]
  with pytest.raises(RuntimeError, match=r"failed while drawing step 1's batch \(OSError: transient read error\)"):
    next(stream)
  stream.reset(range(4))  # a fresh iterator starts over
  batch, weights, _ = next(stream)
  assert sorted(int(i) for i in np.asarray(batch["id"])[np.asarray(weights) > 0]) == [0, 1, 2, 3]


def test_stopiteration_or_interrupt_while_drawing_is_no_clean_end():
  """A StopIteration raised inside collate (next() of a lookup that found nothing) left __next__ as StopIteration
  and ended the `for` loop as a complete pass, 4 of 12 examples trained; a Ctrl-C during a draw was not marked, so
  the loop run again ended the pass without the batch's examples (from the review of 16d53e9)."""
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  missing = 6

  def collate(rows):
    ids = np.asarray([next(r for r in range(12) if r == row and r != missing) for row in rows], np.int32)
    return {"id": ids}, np.ones(len(ids), np.float32)

  stream = jaxdp.StreamingPipeline(iter(range(12)), collate, mesh, per_device_batch=2, template=0)
  seen = []
  with pytest.raises(RuntimeError, match="StopIteration while step 1's batch was drawn"):
    for batch, weights, has_more in stream:
      seen += [int(i) for i in np.asarray(batch["id"])[np.asarray(weights) > 0]]
      stream.report(int(np.sum(np.asarray(has_more))))
  assert seen == [0, 1, 2, 3]
  with pytest.raises(RuntimeError, match="failed while drawing step 1's batch"):
    next(stream)

  def interrupted():
    yield from range(6)
    raise KeyboardInterrupt

  stream = jaxdp.StreamingPipeline(interrupted(), collate, mesh, per_device_batch=2, template=0)
  stream.report(int(np.sum(np.asarray(next(stream)[2]))))
  with pytest.raises(KeyboardInterrupt):
    next(stream)
  with pytest.raises(RuntimeError, match=r"KeyboardInterrupt"):  # the loop run again is told, not ended
    next(stream)
