"""Worker: trains from a grain MapDataset sharded per process, checkpointing the grain position mid-epoch.

Usage: ``grain_train.py OUT CKPT [--resume] [--save-at K]``.

Every process shards the same shuffled ``grain.MapDataset`` of
:data:`NUM_EXAMPLES` examples with ``jaxdp.io.grain.process_shard`` (a new
shuffle each epoch) and trains :data:`EPOCHS` epochs through a
``GrainPipeline``. With ``--save-at K`` the run saves a checkpoint (state and
every process's grain position) after its ``K``-th step, mid-epoch, and goes
on. With ``--resume`` it restores the latest checkpoint in ``CKPT`` instead
of starting afresh and trains to the end. Every rank writes
``OUT/rank{r}.json``: the data step it started from, the real example ids
each of its mesh positions received at each step, and the final parameters.

The test imports :func:`example`, :func:`collate` and :func:`epoch_dataset`
to check the plan and build the single-device reference.
"""

import json
import os
import sys

import numpy as np

try:
  from mp_workers import problem  # imported by the tests
except ImportError:  # run as a script by the launcher
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import problem

NUM_EXAMPLES = 25  # over 2 processes: 13 and 12; 6 a step per process (2 devices x 3), so the last step of an
PER_DEVICE_BATCH = 3  # epoch has 1 example on process 0 (devices: 1, 0) and none on process 1 (padding only)
EPOCHS = 2


def example(i: int) -> dict:
  """Example ``i``: a fixed function of ``i``, so the test can rebuild it."""
  rng = np.random.default_rng(2000 + i)
  return {
      "id": np.int32(i),
      "x": rng.normal(size=(problem.D_IN,)).astype(np.float32),
      "y": rng.normal(size=(problem.D_OUT,)).astype(np.float32),
      "w": np.float32(rng.uniform(0.5, 2.0)),
  }


def collate(examples: list) -> tuple[dict, np.ndarray]:
  batch = {k: np.stack([e[k] for e in examples]) for k in ("id", "x", "y")}
  return batch, np.stack([e["w"] for e in examples])


def epoch_dataset(epoch: int, index: int | None = None, count: int | None = None):
  """This process's grain dataset of ``epoch``: the shuffled examples, cut as ShardByJaxProcess cuts them."""
  import grain

  from jaxdp.io.grain import process_shard

  source = grain.MapDataset.range(NUM_EXAMPLES).shuffle(seed=10 + epoch).map(example)
  return process_shard(source, index, count)


def _arg(name: str, default: str) -> str:
  return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def local_ids(batch, weights, b: int) -> dict[int, list[int]]:
  """The real example ids on each of this process's mesh positions (padding rows have weight 0, at the end)."""
  ids = {}
  for id_shard, w_shard in zip(batch["id"].addressable_shards, weights.addressable_shards):
    w, got = np.asarray(w_shard.data), np.asarray(id_shard.data)
    real = int(np.sum(w > 0))
    assert np.all(w[:real] > 0) and not np.any(w[real:]), w
    ids[(w_shard.index[0].start or 0) // b] = got[:real].tolist()
  return ids


def main():
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import optax

  import jaxdp
  from jaxdp.io.checkpoint import CheckpointManager
  from jaxdp.io.grain import GrainPipeline
  from jaxdp.runtime import distributed

  out_dir, ckpt_dir = sys.argv[1], sys.argv[2]
  save_at = int(_arg("--save-at", "-1"))
  info = distributed.initialize()
  mesh = jaxdp.data_mesh()
  opt = optax.sgd(problem.LR, momentum=problem.MOMENTUM)
  step = jaxdp.make_train_step(problem.loss_fn, opt, mesh)
  pipe = GrainPipeline(epoch_dataset, mesh, per_device_batch=PER_DEVICE_BATCH, collate=collate)
  with CheckpointManager(ckpt_dir, enable_async_checkpointing=False) as ckpt:
    if "--resume" in sys.argv:
      state, _, done, _, _ = ckpt.restore(params=problem.init_params(), optimizer=opt, layout=mesh, data=pipe)
    else:
      state, done = jaxdp.init_state(problem.init_params(), opt, mesh), 0
    start, ids = done, []
    while pipe.epoch < EPOCHS:
      for batch, weights in pipe:
        state, _ = step(state, batch, weights)
        ids.append(local_ids(batch, weights, PER_DEVICE_BATCH))
        done += 1
        if done == save_at:
          ckpt.save(done, state, data=pipe, force=True)

  params = jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data).tolist(), state.params)
  record = {"rank": info.process_index, "start": start, "positions": list(pipe.local_positions), "ids": ids,
            "params": params}
  with open(os.path.join(out_dir, f"rank{info.process_index}.json"), "w") as f:
    json.dump(record, f)
  print(f"trained steps {start}..{done}", flush=True)


if __name__ == "__main__":
  main()
