"""grain input (jaxdp.io.grain): exact batches from per-process grain datasets, checkpointed mid-epoch.

One process in this one (4 of the 8 simulated devices, uneven portions) and two real processes under
``python -m jaxdp.launch`` (worker ``tests/mp_workers/grain_train.py``), each checked against one device
trained on the same global batches, and against the plan: every example exactly once per epoch, in the
order of this process's grain dataset. A run resumed from a checkpoint saved mid-epoch sees exactly the
examples the uninterrupted run saw after that step and ends with the same parameters.

Tolerance: as in tests/test_multiprocess.py (only the order of float32 sums differs from the reference:
ATOL 1e-5, while a dropped or repeated example moves the parameters by more than 1e-3).
"""

import json

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from helpers import grid_mesh, mesh_of
from jaxdp.io.checkpoint import CheckpointManager
from jaxdp.io.grain import GrainPipeline, process_shard
from mp_workers import grain_train as worker
from mp_workers import harness, problem

ATOL = 1e-5
JOB_SECONDS = 150
OPT = optax.sgd(problem.LR, momentum=problem.MOMENTUM)


def _reference(global_batches: list[list[int]]) -> dict:
  """The parameters after one single-device weighted-mean SGD step per global batch of example ids."""
  params = jax.device_put(problem.init_params(), jax.devices()[0])
  opt_state = OPT.init(params)

  @jax.jit
  def step(params, opt_state, batch, weights):
    def loss(params):
      return jnp.sum(weights * problem.loss_fn(params, batch)) / jnp.sum(weights)

    updates, opt_state = OPT.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for ids in global_batches:
    batch, weights = worker.collate([worker.example(i) for i in ids])
    params, opt_state = step(params, opt_state, {"x": batch["x"], "y": batch["y"]}, weights)
  return jax.tree.map(np.asarray, params)


def _assert_params(got: dict, want: dict) -> None:
  for k, w in want.items():
    np.testing.assert_allclose(np.asarray(got[k], np.float32), w, rtol=0, atol=ATOL)
  moved = max(float(np.max(np.abs(want[k] - problem.init_params()[k]))) for k in want)
  assert moved > 1e-2, "the reference must actually train"


def _ids(batch, weights, b: int) -> list[list[int]]:
  return [ids for _, ids in sorted(worker.local_ids(batch, weights, b).items())]


def _train(pipe, mesh, *, epochs, state=None, stop=None, ckpt=None):
  """Trains ``pipe`` to the end of ``epochs`` (or ``stop`` steps); returns (state, per-step per-device ids)."""
  step = jaxdp.make_train_step(problem.loss_fn, OPT, mesh)
  state = jaxdp.init_state(problem.init_params(), OPT, mesh) if state is None else state
  seen = []
  while pipe.epoch < epochs and (stop is None or len(seen) < stop):
    for batch, weights in pipe:
      state, _ = step(state, batch, weights)
      seen.append(_ids(batch, weights, pipe.per_device_batch))
      if stop is not None and len(seen) == stop:
        break
  return state, seen


# --- One process -------------------------------------------------------------------------------------


def test_one_process_every_example_once_in_order_and_trains_like_one_device():
  mesh = mesh_of(4)  # 25 examples, 12 a step: 12, 12, 1 (devices 1, 0, 0, 0)
  pipe = GrainPipeline(lambda e: worker.epoch_dataset(e, 0, 1), mesh, per_device_batch=3, collate=worker.collate)
  assert pipe.steps_per_epoch == 3
  state, seen = _train(pipe, mesh, epochs=2)
  assert len(seen) == 6 and pipe.epoch == 2
  for epoch in range(2):
    order = [int(e["id"]) for e in worker.epoch_dataset(epoch, 0, 1)]
    got = [i for per_device in seen[3 * epoch : 3 * epoch + 3] for ids in per_device for i in ids]
    assert got == order and sorted(got) == list(range(worker.NUM_EXAMPLES))
  assert [len(ids) for ids in seen[2]] == [1, 0, 0, 0]
  _assert_params(jax.tree.map(np.asarray, jaxdp.gather_state(state).params),
                 _reference([[i for ids in s for i in ids] for s in seen]))


def _loader(num_records: int) -> grain.DataLoader:
  sampler = grain.samplers.IndexSampler(num_records=num_records, shard_options=grain.sharding.ShardByJaxProcess(),
                                        shuffle=True, seed=5, num_epochs=1)
  source = [worker.example(i) for i in range(num_records)]
  return grain.DataLoader(data_source=source, sampler=sampler, worker_count=0)


@pytest.mark.parametrize("kind, stop", [("MapDataset", 2), ("MapDataset", 4), ("DataLoader", 2)])
def test_a_checkpoint_mid_epoch_resumes_at_the_next_example(kind, stop, tmp_path):
  """Saved after 2 of epoch 0's 4 steps (8, 8, 8 and 1 examples), or after its last one."""
  mesh = mesh_of(2)
  if kind == "MapDataset":
    def make():
      return GrainPipeline(lambda e: worker.epoch_dataset(e, 0, 1), mesh, per_device_batch=4, collate=worker.collate)
  else:
    def make():  # no len(): the count is given; every epoch iterates the loader afresh
      return GrainPipeline(_loader(worker.NUM_EXAMPLES), mesh, per_device_batch=4, collate=worker.collate,
                           num_examples=worker.NUM_EXAMPLES)
  whole, seen = _train(make(), mesh, epochs=2)
  first = make()
  state, before = _train(first, mesh, epochs=2, stop=stop)
  with CheckpointManager(tmp_path, enable_async_checkpointing=False) as ckpt:
    ckpt.save(stop, state, data=first)
    saved = json.loads(json.dumps(first.get_state()))
    resumed = make()
    restored = ckpt.restore(params=problem.init_params(), optimizer=OPT, layout=mesh, data=resumed)
  assert restored.data_step == stop and resumed.get_state() == saved
  assert (resumed.epoch, resumed.step, resumed.consumed) == ((0, 2, 16) if stop == 2 else (1, 0, 0))
  state, after = _train(resumed, mesh, epochs=2, state=restored.state)
  assert before + after == seen  # no example skipped or repeated, the same batches
  for a, b in zip(jax.tree.leaves(jaxdp.gather_state(whole).params), jax.tree.leaves(jaxdp.gather_state(state).params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_process_shard_gives_the_remainder_to_the_first_shards():
  """As grain's ShardByJaxProcess(drop_remainder=False) documents: 11 over 3 is 4, 4, 3, contiguous."""
  shards = [list(process_shard(list(range(11)), i, 3)) for i in range(3)]
  assert shards == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
  assert list(process_shard(grain.MapDataset.range(11), 2, 3)) == [8, 9, 10]
  with pytest.raises(ValueError, match="index=3 must be < count=3"):
    process_shard(list(range(11)), 3, 3)


def test_bad_inputs_are_refused_with_the_fix():
  mesh = mesh_of(2)
  ds = grain.MapDataset.range(5).map(lambda i: {"x": np.float32(i)})
  with pytest.raises(ValueError, match="num_examples"):
    GrainPipeline(ds.to_iter_dataset(), mesh, per_device_batch=2)
  short = GrainPipeline(ds, mesh, per_device_batch=2, num_examples=7)
  with pytest.raises(ValueError, match="ended after 5 examples.*has 7"):
    list(short)
  long = GrainPipeline(ds, mesh, per_device_batch=2, num_examples=4)
  with pytest.raises(ValueError, match="more than its 4 examples"):
    list(long)
  with pytest.raises(ValueError, match="per_device_batch"):
    GrainPipeline(ds, mesh, per_device_batch=0)
  pipe = GrainPipeline(ds, mesh, per_device_batch=2)
  other = {**pipe.get_state(), "processes": 2}
  with pytest.raises(ValueError, match="2 processes.*cannot resume exactly on another process count"):
    pipe.set_state(other)
  assert pipe.get_state()["processes"] == 1  # untouched
  empty = GrainPipeline(grain.MapDataset.range(0), mesh, per_device_batch=2)  # no step: nothing to pad
  assert empty.steps_per_epoch == 0 and list(empty) == [] and empty.epoch == 1


def test_a_grain_checkpoint_needs_its_pipeline_kind(tmp_path):
  mesh = mesh_of(2)
  ds = grain.MapDataset.range(6).map(worker.example)
  pipe = GrainPipeline(ds, mesh, per_device_batch=2, collate=worker.collate)
  state, _ = _train(pipe, mesh, epochs=1, stop=1)
  with CheckpointManager(tmp_path, enable_async_checkpointing=False) as ckpt:
    ckpt.save(1, state, data=pipe)
    data = jaxdp.DataPipeline([worker.example(i) for i in range(6)], worker.collate, mesh, per_device_batch=2)
    with pytest.raises(ValueError, match="saved with a GrainPipeline's position; a DataPipeline cannot"):
      ckpt.restore(params=problem.init_params(), optimizer=OPT, layout=mesh, data=data)
    assert ckpt.restore(params=problem.init_params(), optimizer=OPT, layout=mesh).data_step == 1
    ckpt.save(2, state, force=True)
    with pytest.raises(ValueError, match="without a GrainPipeline's position"):
      ckpt.restore(params=problem.init_params(), optimizer=OPT, layout=mesh, data=pipe)


# --- Two real processes ----------------------------------------------------------------------------------


def _launch(out, ckpt, *options):
  out.mkdir(exist_ok=True)
  result = harness.launch(["--nproc", "2", "--devices-per-proc", "2", "--grace-period", "2", "--timeout", "120"],
                          [harness.WORKERS / "grain_train.py", out, ckpt, *options], timeout=JOB_SECONDS)
  harness.assert_no_leftovers(str(out))
  assert result.returncode == 0, f"job failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
  return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], result


def _global(ranks) -> list[list[int]]:
  """Per step, the real ids of every mesh position, in mesh order."""
  steps = len(ranks[0]["ids"])
  assert len(ranks[1]["ids"]) == steps
  return [[i for q in range(4) for r in ranks if str(q) in r["ids"][s] for i in r["ids"][s][str(q)]]
          for s in range(steps)]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
  """The whole run (saving after step 2, mid-epoch) and the run resumed from that checkpoint."""
  root = tmp_path_factory.mktemp("grain")
  ckpt = root / "ckpt"
  whole = _launch(root / "whole", ckpt, "--save-at", "2")
  resumed = _launch(root / "resumed", ckpt, "--resume")
  return whole, resumed, ckpt


def test_two_processes_train_like_one_device(two_process_runs):
  (ranks, result), _, _ = two_process_runs
  assert [r["positions"] for r in ranks] == [[0, 1], [2, 3]]
  steps = _global(ranks)
  assert len(steps) == 6  # 13 and 12 examples, 6 a step on each process: 3 steps an epoch
  for epoch in range(worker.EPOCHS):
    for p, r in enumerate(ranks):  # each process: its own shard, in its grain order
      own = [i for s in r["ids"][3 * epoch : 3 * epoch + 3] for q in r["positions"] for i in s[str(q)]]
      assert own == [int(e["id"]) for e in worker.epoch_dataset(epoch, p, 2)]
    assert sorted(i for s in steps[3 * epoch : 3 * epoch + 3] for i in s) == list(range(worker.NUM_EXAMPLES))
  assert [len(ranks[p]["ids"][2][str(q)]) for p, q in ((0, 0), (0, 1), (1, 2), (1, 3))] == [1, 0, 0, 0]
  assert ranks[0]["params"] == ranks[1]["params"]
  _assert_params(ranks[0]["params"], _reference(steps))
  print(f"\n2 processes x 2 devices, {len(steps)} steps: {result.seconds:.1f} s")


def test_two_processes_resume_mid_epoch_with_no_example_skipped_or_repeated(two_process_runs):
  (whole, _), (resumed, _), _ = two_process_runs
  assert [r["start"] for r in resumed] == [2, 2]
  assert _global(resumed) == _global(whole)[2:]
  assert resumed[0]["params"] == resumed[1]["params"]
  for k in whole[0]["params"]:
    np.testing.assert_allclose(np.asarray(resumed[0]["params"][k]), np.asarray(whole[0]["params"][k]), rtol=0,
                               atol=1e-6)


def test_another_process_count_is_refused(two_process_runs):
  _, _, ckpt_dir = two_process_runs
  mesh = mesh_of(4)
  pipe = GrainPipeline(lambda e: worker.epoch_dataset(e, 0, 1), mesh, per_device_batch=3, collate=worker.collate)
  with CheckpointManager(ckpt_dir, enable_async_checkpointing=False) as ckpt:
    with pytest.raises(ValueError, match="grain positions of 2 processes, and this run has 1.*Resume on 2 processes"):
      ckpt.restore(params=problem.init_params(), optimizer=OPT, layout=mesh, data=pipe)
    # The state itself restores onto any layout; the data is then the caller's.
    assert ckpt.restore(params=problem.init_params(), optimizer=OPT, layout=mesh).data_step == 2
  assert pipe.get_state()["consumed"] == 0  # untouched


def test_a_two_axis_mesh_replicates_the_batch_over_the_other_axis():
  mesh = grid_mesh((2, 2), ("data", "model"))
  pipe = GrainPipeline(grain.MapDataset.range(7).map(worker.example), mesh, per_device_batch=2,
                       collate=worker.collate)
  batches = list(pipe)
  assert len(batches) == 2 and pipe.steps_per_epoch == 2  # 4 and 3 examples: devices 2, 2 then 2, 1
  seen = []
  for batch, weights in batches:
    assert batch["x"].sharding.spec == jax.P("data") and batch["x"].shape == (4, problem.D_IN)
    ids, w = np.asarray(batch["id"]), np.asarray(weights)
    seen += ids[w > 0].tolist()
  assert seen == list(range(7))

