"""Worker: trains a tiny model from a DataPipeline, checkpointing every few steps; resumes if it can.

Usage: ``train_resume.py OUT CKPT --steps T [--zero-stage S] [--every K] [--kill-at K]``.

Runs under ``python -m jaxdp.launch`` or as one plain process. If ``CKPT``
holds a checkpoint it resumes from the latest one (state, PRNG key, pipeline
position), else it starts from scratch; then it trains up to step ``T``,
saving (asynchronously) every ``K`` steps. With ``--kill-at K`` the last rank
SIGKILLs itself right after step ``K`` (a crash, not an exit). Rank 0
appends every step's loss (``float.hex``, so comparisons are bitwise) to
``OUT/losses.jsonl`` and writes the gathered state after a restore to
``OUT/restored.npz`` and at the end to ``OUT/final.npz``.
"""

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp import checkpoint, distributed  # noqa: E402

NUM_EXAMPLES = 13  # with a global batch of 4: every epoch ends with a batch of 1 example (one device gets 0)
GLOBAL_BATCH = 4
D_IN, D_OUT = 5, 3


def dataset() -> list:
  rng = np.random.default_rng(7)
  x = rng.normal(size=(NUM_EXAMPLES, D_IN)).astype(np.float32)
  y = rng.normal(size=(NUM_EXAMPLES, D_OUT)).astype(np.float32)
  return [(x[i], y[i]) for i in range(NUM_EXAMPLES)]


def collate(examples):
  batch = {"x": np.stack([e[0] for e in examples]), "y": np.stack([e[1] for e in examples])}
  return batch, np.ones(len(examples), np.float32)


def init_params() -> dict:
  rng = np.random.default_rng(0)
  return {"w": rng.normal(size=(D_IN, D_OUT)).astype(np.float32), "b": np.zeros((D_OUT,), np.float32)}


def loss_fn(params, batch, key):
  """Per-example squared error of a linear model with dropout on the inputs (so the PRNG key matters)."""
  keep = jax.random.bernoulli(key, 0.8, batch["x"].shape)
  x = jnp.where(keep, batch["x"] / 0.8, 0.0)
  return 0.5 * ((x @ params["w"] + params["b"][None, :] - batch["y"]) ** 2).sum(axis=-1)


def replicated_key(seed: int, mesh) -> jax.Array:
  """The run's PRNG key: a plain process-local key, which the step places on the global mesh itself."""
  del mesh
  return jax.random.key(seed)


def save_gathered(path, state, rng, data_step):
  """Every process gathers (a collective); rank 0 writes."""
  full = jaxdp.gather_state(state)
  if jax.process_index() == 0:
    arrays = {"/".join(str(getattr(e, "key", getattr(e, "name", getattr(e, "idx", e)))) for e in p): np.asarray(x)
              for p, x in jax.tree_util.tree_leaves_with_path(full)}
    np.savez(path, rng=np.asarray(jax.random.key_data(rng)), data_step=np.int64(data_step), **arrays)


def train(mesh, out: str, ckpt_dir: str, *, steps: int, zero_stage: int = 0, every: int = 3, kill_at=None) -> None:
  """Trains to ``steps`` on ``mesh``, resuming from ``ckpt_dir`` if it holds a checkpoint (see the module doc)."""
  n = mesh.shape["data"]
  opt = optax.adam(0.05)
  pipe = jaxdp.DataPipeline(dataset(), collate, mesh, per_device_batch=GLOBAL_BATCH // n, seed=3)
  step = jaxdp.make_train_step(loss_fn, opt, mesh, zero_stage=zero_stage)
  ckpt = checkpoint.CheckpointManager(ckpt_dir, save_interval_steps=every, max_to_keep=2)
  if ckpt.latest_step() is None:
    state, rng, start = jaxdp.init_state(init_params(), opt, mesh, zero_stage=zero_stage), replicated_key(42, mesh), 0
  else:
    restored = ckpt.restore(params=init_params(), optimizer=opt, mesh=mesh, zero_stage=zero_stage)
    state, rng, start = restored.state, restored.rng, restored.data_step
    save_gathered(os.path.join(out, "restored.npz"), state, rng, start)
  print(f"{jax.process_count()} process(es), {n} devices, zero_stage={zero_stage}: "
        f"starting at step {start}", flush=True)
  log = open(os.path.join(out, "losses.jsonl"), "a") if jax.process_index() == 0 else None
  for k, (batch, weights) in pipe.iterate(start, steps - start):
    rng, key = jax.random.split(rng)
    state, metrics = step(state, batch, weights, key)
    done = k + 1
    if log is not None:
      record = {"step": k, "loss": float(metrics["loss"]).hex(), "weight": float(metrics["weight"])}
      log.write(json.dumps(record) + "\n")
      log.flush()
    ckpt.save(done, state, rng=rng, data_step=done, metadata={"zero_stage": zero_stage})
    if done == kill_at and jax.process_index() == jax.process_count() - 1:
      print(f"killing rank {jax.process_index()} after step {done}", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
  ckpt.close()
  if log is not None:
    log.close()
  save_gathered(os.path.join(out, "final.npz"), state, rng, steps)


def parse_args():
  """The worker's command line (also read by train_restart.py)."""
  parser = argparse.ArgumentParser()
  parser.add_argument("out")
  parser.add_argument("ckpt")
  parser.add_argument("--steps", type=int, required=True)
  parser.add_argument("--zero-stage", type=int, default=0)
  parser.add_argument("--every", type=int, default=3)
  parser.add_argument("--kill-at", type=int, default=None)
  return parser.parse_args()


def main():
  args = parse_args()
  distributed.initialize()
  train(jaxdp.data_mesh(), args.out, args.ckpt, steps=args.steps, zero_stage=args.zero_stage, every=args.every,
        kill_at=args.kill_at)
  print("done", flush=True)


if __name__ == "__main__":
  sys.exit(main())
