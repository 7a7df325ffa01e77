"""Worker: processes that disagree on the batch shape, on the config, then on the initial model state.

Each disagreement must raise the same ``ValueError`` on every process. Each
rank prints what it caught, then (after a barrier, so that every rank has
reported) the worker exits with code 2.
"""

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp import distributed  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import problem  # noqa: E402


def report(rank, what, fn):
  try:
    fn()
  except ValueError as e:
    print(f"{what} ValueError on rank {rank}: {' | '.join(str(e).splitlines())}", flush=True)
  else:
    print(f"{what}: no error on rank {rank}", flush=True)


def main():
  info = distributed.initialize()
  rank = info.process_index
  mesh = jaxdp.data_mesh()
  batches, weights = problem.portions(0)
  agreed = jaxdp.shard_uneven(batches, mesh, weights=weights)
  start = time.perf_counter()
  for _ in range(10):
    distributed.assert_same_across_processes(agreed, "batch")
  print(f"agreeing batch passes ({(time.perf_counter() - start) / 10 * 1e3:.1f} ms per check)", flush=True)
  if rank == 1:  # one more example on the device that had the most: max_len 5 -> 6
    batches[2] = {k: np.concatenate([v, v[:1]]) for k, v in batches[2].items()}
    weights[2] = np.concatenate([weights[2], weights[2][:1]])
  batch = jaxdp.shard_uneven(batches, mesh, weights=weights)
  report(rank, "shape", lambda: distributed.assert_same_across_processes(batch, "batch"))
  config = {"lr": 0.1 * (rank + 1), "steps": problem.STEPS, "optimizer": "sgd"}
  report(rank, "config", lambda: distributed.assert_same_across_processes(config, "config"))
  model_state = {"bn": {"mean": np.full((3,), float(rank), np.float32)}}  # process-local values that differ
  optimizer = optax.sgd(problem.LR)
  report(rank, "model_state", lambda: jaxdp.init_state(problem.init_params(), optimizer, mesh, model_state=model_state))
  # A seed per process (a PyTorch habit) trained some examples twice and others never, silently.
  examples = [np.full((2,), i, np.float32) for i in range(13)]
  collate = lambda rows: ({"x": np.stack(rows)}, np.ones(len(rows), np.float32))  # noqa: E731
  report(rank, "pipeline", lambda: jaxdp.DataPipeline(examples, collate, mesh, per_device_batch=2, seed=rank))
  pipe = jaxdp.DataPipeline(examples, collate, mesh, per_device_batch=2, seed=0)
  report(rank, "iterate", lambda: pipe.iterate(start_step=rank))
  # A save at different steps left every process waiting for the others in close(), for ever.
  state = jaxdp.init_state(problem.init_params(), optimizer, mesh)
  with jaxdp.CheckpointManager(os.path.join(sys.argv[1], "ckpt"), enable_async_checkpointing=False) as ckpt:
    report(rank, "save", lambda: ckpt.save(2 + rank, state))
    assert ckpt.all_steps() == []
  # Each data-axis position holds a device of each process: two streams would fill one position.
  import jax
  from jax.sharding import Mesh

  crossed = Mesh(np.array(jax.devices()).reshape(2, 2).T, ("data", "model"))
  report(rank, "streaming", lambda: jaxdp.StreamingPipeline(examples, collate, crossed, per_device_batch=2))
  # pmap over every process's devices failed inside the first step with JAX's "cannot select an axis to squeeze".
  report(rank, "pmap", lambda: jaxdp.make_train_step(problem.loss_fn, optimizer, mesh, backend="pmap"))
  multihost_utils.sync_global_devices("reported")
  sys.exit(2)


if __name__ == "__main__":
  main()
