"""Worker: DiLoCo with one replica group per process, checkpointed mid-period and resumed.

Usage: ``python -m jaxdp.launch --nproc 2 --devices-per-proc 2 -- diloco.py OUT``. The mesh is
``(replica=2, data=2)`` with each process's two devices one group, so the inner steps stay inside a process
and only the outer sync crosses between them (gloo). ``run`` (imported by the test, which runs it in one
process on 4 devices) takes ``STEPS`` DiLoCo steps (``H`` = 2, Adam inside, Nesterov outside) on uneven
weights, with a checkpoint after step ``SAVE_AT`` (mid-period) restored into a fresh step to continue.
Process 0 writes the final state, gathered, to ``OUT/state.npz``.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402

import jaxdp  # noqa: E402

STEPS, SAVE_AT, H, ROWS = 5, 3, 2, 8


def loss_fn(params, batch):
  return (jnp.tanh(batch["x"] @ params["w"]) @ params["v"] - batch["y"]) ** 2


def batches():
  rng = np.random.default_rng(0)
  out = []
  for _ in range(STEPS):
    weights = rng.uniform(0.2, 3.0, ROWS).astype(np.float32)
    weights[rng.integers(ROWS)] = 0.0
    out.append(({"x": rng.normal(size=(ROWS, 3)).astype(np.float32), "y": rng.normal(size=ROWS).astype(np.float32)},
                weights))
  return out


def run(devices, ckpt_dir):
  """The final DiLoCo state (host numpy leaves, in flattening order) of the run on ``devices`` (4 of them)."""
  mesh = Mesh(np.asarray(devices).reshape(2, 2), ("replica", "data"), axis_types=(AxisType.Auto,) * 2)
  layout = jaxdp.data_parallel(mesh, axis_name="data")
  rng = np.random.default_rng(1)
  params = {"w": rng.normal(size=(3, 4)).astype(np.float32), "v": rng.normal(size=4).astype(np.float32)}
  inner = optax.adam(0.05)
  make_step = lambda: jaxdp.make_diloco_step(loss_fn, inner, layout, inner_steps=H)  # noqa: E731
  state, step = jaxdp.init_diloco_state(params, inner, layout), make_step()
  with jaxdp.CheckpointManager(ckpt_dir, enable_async_checkpointing=False) as ckpt:
    for k, (batch, weights) in enumerate(batches()):
      if k == SAVE_AT:  # resume from the checkpoint in a fresh step, as a restarted job would
        ckpt.save(k, state)
        state = ckpt.restore_diloco(params=params, inner_optimizer=inner, layout=layout).state
        step = make_step()
      state, _ = step(state, batch, weights)
  from jax.experimental import multihost_utils

  # Every leaf whole on every process (the groups' entries live on different processes).
  return [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree.leaves(state)]


def main():
  out = sys.argv[1]
  jaxdp.distributed.initialize()
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))  # a group = one process's devices
  leaves = run(devices, os.path.join(out, "ckpt"))
  groups = [{d.process_index for d in row} for row in np.asarray(devices).reshape(2, 2)]
  print(f"groups on processes {groups}", flush=True)
  if jax.process_index() == 0:
    np.savez(os.path.join(out, "state.npz"), *leaves)


if __name__ == "__main__":
  main()
