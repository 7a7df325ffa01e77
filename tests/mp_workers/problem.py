"""The training problem shared by the multi-process workers and the tests' single-device reference.

Pure numpy data (the same in every process, from fixed seeds) and a tiny
linear model, so a worker and the test compute the same thing.
"""

import numpy as np

N_DEVICES = 4  # every layout trains on 4 devices in all
STEPS = 3
LR = 0.1
MOMENTUM = 0.9
D_IN, D_OUT = 5, 3
# Uneven per-device example counts, one list per step, in mesh order (0 included on purpose).
PORTION_SIZES = ((3, 0, 5, 2), (1, 4, 2, 6), (5, 5, 0, 1))


def init_params() -> dict:
  rng = np.random.default_rng(0)
  return {
      "w": rng.normal(size=(D_IN, D_OUT)).astype(np.float32),
      "b": np.zeros((D_OUT,), np.float32),
  }


def portions(step: int) -> tuple[list[dict], list[np.ndarray]]:
  """Per-device batches and per-example weights of ``step``, in mesh order."""
  rng = np.random.default_rng(100 + step)
  batches, weights = [], []
  for n in PORTION_SIZES[step]:
    x = rng.normal(size=(n, D_IN)).astype(np.float32)
    y = rng.normal(size=(n, D_OUT)).astype(np.float32)
    batches.append({"x": x, "y": y})
    weights.append(rng.uniform(0.5, 2.0, size=(n,)).astype(np.float32))
  return batches, weights


def loss_fn(params, batch):
  """Per-example squared error, ``[b]``."""
  pred = batch["x"] @ params["w"] + params["b"][None, :]
  return 0.5 * ((pred - batch["y"]) ** 2).sum(axis=-1)
