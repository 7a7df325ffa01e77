"""A batch that differs on one process must fail on every process, not hang the others.

Process 1 passes ``x`` with 6 features instead of 5. The step checks its
inputs across processes before any collective, so both processes raise a
``ValueError`` naming ``batch`` instead of process 0 blocking in the
gradient all-reduce.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp import distributed  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import problem  # noqa: E402


def main():
  info = distributed.initialize()
  mesh = jaxdp.data_mesh()
  opt = optax.sgd(0.1)
  state = jaxdp.init_state(problem.init_params(), opt, mesh)
  step = jaxdp.make_train_step(problem.loss_fn, opt, mesh)
  batches, weights = problem.portions(0)
  if info.process_index == 1:
    batches = [{"x": np.pad(b["x"], ((0, 0), (0, 1))), "y": b["y"]} for b in batches]
  batch, w = jaxdp.shard_uneven(batches, mesh, weights=weights)
  try:
    step(state, batch, w)
  except ValueError as e:
    print(f"step ValueError on rank {info.process_index}: {e}", flush=True)
    sys.exit(2)
  print("no error", flush=True)


if __name__ == "__main__":
  main()
