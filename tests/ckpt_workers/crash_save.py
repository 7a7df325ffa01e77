"""Worker: saves checkpoint 1, then is SIGKILLed in the middle of saving checkpoint 2.

Usage: ``crash_save.py CKPT MODE``. Checkpoint 1 holds ``params(1)``, the
one of step 2 would hold ``params(2)`` (see :func:`params`). orbax writes
each item of a step into a temporary directory and renames it when it is
complete, then renames the step's temporary directory. The kill comes at
the first of these renames (``MODE=item``: the arrays are written, the step
is not) or at the last (``MODE=step``: every file of step 2 is written and
orbax is about to move it into place, the latest moment a crash can hit).
"""

import os
import signal
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp import checkpoint  # noqa: E402

OPTIMIZER = optax.adam(0.1)


def params(step: int) -> dict:
  return {"w": np.full((4, 3), step, np.float32), "b": np.arange(3, dtype=np.float32) + step}


def kill_on_commit(rename, mode: str):
  """``os.rename`` that SIGKILLs this process instead of committing an orbax temporary directory."""
  prefix = {"item": "", "step": "2."}[mode]

  def patched(src, dst, *args, **kwargs):
    name = os.path.basename(os.fspath(src))
    if "orbax-checkpoint-tmp" in name and name.startswith(prefix):
      print(f"killed while committing {name}", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    return rename(src, dst, *args, **kwargs)

  return patched


def main():
  directory, mode = sys.argv[1:3]
  mesh = jaxdp.data_mesh(jax.devices()[:1])
  ckpt = checkpoint.CheckpointManager(directory, enable_async_checkpointing=False)
  ckpt.save(1, jaxdp.init_state(params(1), OPTIMIZER, mesh), rng=jax.random.key(1), metadata={"step": 1})
  os.rename = kill_on_commit(os.rename, mode)
  ckpt.save(2, jaxdp.init_state(params(2), OPTIMIZER, mesh), rng=jax.random.key(2), metadata={"step": 2})
  print("save 2 completed: the kill did not happen", flush=True)
  sys.exit(3)


if __name__ == "__main__":
  main()
