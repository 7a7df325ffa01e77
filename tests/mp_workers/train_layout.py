"""Worker: trains the shared problem for a few steps under ``python -m jaxdp.launch``.

Usage: ``train_layout.py OUT_DIR [--checks] [--explicit]``. Rank 0 writes
the final parameters to ``OUT_DIR/params.npz``. With ``--checks`` (a
2-process run) it also checks the cross-process replica assertion, the global
mesh and the input pipeline, and every rank writes
``OUT_DIR/pipeline_rank{r}.npz``. With ``--explicit`` it takes the launcher's
settings out of the environment and passes them to ``initialize`` as
arguments instead. Run without the launcher, it is one plain process.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp import distributed  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import problem  # noqa: E402


def train(mesh):
  opt = optax.sgd(problem.LR, momentum=problem.MOMENTUM)
  state = jaxdp.init_state(problem.init_params(), opt, mesh)
  step = jaxdp.make_train_step(problem.loss_fn, opt, mesh)
  for k in range(problem.STEPS):
    batches, weights = problem.portions(k)
    batch, w = jaxdp.shard_uneven(batches, mesh, weights=weights)
    state, metrics = step(state, batch, w)
  return state


def local_copy(tree):
  """This process's replica of a replicated tree, as numpy."""
  return jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data), tree)


def check_mesh(mesh, info):
  assert mesh.devices.size == info.device_count == jax.device_count(), (mesh, info)
  owners = sorted({d.process_index for d in mesh.devices.flat})
  assert owners == list(range(info.process_count)), owners
  print(f"mesh spans {mesh.devices.size} devices of processes {owners}", flush=True)


def check_replicas(state, mesh, info):
  jaxdp.assert_replicas_equal(state)
  print("assert_replicas_equal passed on the trained state", flush=True)
  # Every device of process 1 holds w + 1e-3: a "replicated" array whose replicas differ.
  w = local_copy(state.params)["w"] + (1e-3 if info.process_index == 1 else 0.0)
  sharding = NamedSharding(mesh, P())
  locals_ = [jax.device_put(w, d) for d in mesh.local_devices]
  bad = jax.make_array_from_single_device_arrays(w.shape, sharding, locals_)
  try:
    jaxdp.assert_replicas_equal({"w": bad})
  except AssertionError as e:
    print(f"assert_replicas_equal raised: {' '.join(str(e).split())}", flush=True)
  else:
    raise SystemExit("assert_replicas_equal did not raise on differing replicas")


def collate(examples):
  ids = np.asarray(examples, np.int32)
  return {"id": ids}, np.ones(len(ids), np.float32)


class RecordingDataset:
  def __init__(self, n):
    self.n, self.reads = n, []

  def __len__(self):
    return self.n

  def __getitem__(self, i):
    self.reads.append(int(i))
    return int(i)


def check_pipeline(mesh, out_dir, info):
  dataset = RecordingDataset(17)
  pipe = jaxdp.DataPipeline(dataset, collate, mesh, per_device_batch=3, seed=5)
  seen, planned = [], []
  for step, (batch, weights) in pipe.iterate(0, pipe.steps_per_epoch):
    plan = pipe.device_indices(step)
    for ids, w in zip(batch["id"].addressable_shards, weights.addressable_shards):
      real = np.asarray(ids.data)[np.asarray(w.data) > 0]
      seen.extend(real.tolist())
    planned.extend(int(i) for p in pipe.local_positions for i in plan[p])
  path = os.path.join(out_dir, f"pipeline_rank{info.process_index}.npz")
  np.savez(path, seen=np.asarray(sorted(seen), np.int64), planned=np.asarray(sorted(planned), np.int64),
           reads=np.asarray(dataset.reads, np.int64), positions=np.asarray(pipe.local_positions, np.int64))
  print(f"pipeline: positions {pipe.local_positions} saw {len(seen)} examples", flush=True)


def initialize_explicitly():
  """``initialize`` with arguments, the ``JAXDP_*`` environment removed first."""
  env = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("JAXDP_")}
  assert distributed.detect_cluster() is None, "the launcher's environment should be gone"
  return distributed.initialize(
      coordinator_address=env[distributed.ENV_COORDINATOR],
      num_processes=int(env[distributed.ENV_NUM_PROCESSES]),
      process_id=int(env[distributed.ENV_PROCESS_ID]),
      num_cpu_devices=int(env[distributed.ENV_DEVICES_PER_PROC]),
      heartbeat_timeout_seconds=10,
  )


def main():
  out_dir = sys.argv[1]
  info = initialize_explicitly() if "--explicit" in sys.argv else distributed.initialize()
  assert distributed.initialize() is info, "a second initialize() must return the first result"
  print(info, flush=True)
  mesh = jaxdp.data_mesh()
  state = train(mesh)
  if "--checks" in sys.argv:
    check_mesh(mesh, info)
    check_replicas(state, mesh, info)
    check_pipeline(mesh, out_dir, info)
  if info.process_index == 0:
    np.savez(os.path.join(out_dir, "params.npz"), **local_copy(state.params))
  print("done", flush=True)


if __name__ == "__main__":
  main()
