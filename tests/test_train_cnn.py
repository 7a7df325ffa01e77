"""The CNN experiment end to end: BatchNorm, Dropout, padding and evaluation, N devices against one.

A subset of the digits keeps it fast: 100 training images in global batches
of 32, so every epoch ends with a batch of 4 images over 4 devices (one
each, 7 padding rows per device), and 6 steps cross that batch twice.
Dropout is 0.5 with masks drawn from the example ids (``example_ids="id"``),
so 4 devices draw one device's masks and the runs still agree to round-off.
"""

import json

import jax
import numpy as np
import pytest

from experiments import train_cnn

# Loss values ~2.3 at these steps; float32's ulp there is 2.4e-7. 2e-6 is ~8 ulps: a psum of 4 partial
# sums against one sum, through two exact BatchNorms and two dropouts, over 6 SGD-momentum steps.
LOSS_ATOL = 2e-6
TINY = train_cnn.Config(devices=4, steps=6, batch_size=32, dropout=0.5, progress=False)


pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py: the tests check agreement, not speed


@pytest.fixture(scope="module")
def data():
  train_set, test_set = train_cnn.load_digits(0)
  return train_set[:100], test_set[:50]


@pytest.fixture(scope="module")
def compared(data, tmp_path_factory):
  out = tmp_path_factory.mktemp("cnn")
  return train_cnn.compare(train_cnn.Config(**{**TINY.__dict__, "out": str(out)}), data=data), out


def test_sync_batchnorm_tracks_one_device_and_local_does_not(compared):
  result, _ = compared
  losses = {k: np.array([r["loss"] for r in result["runs"][k]["records"]]) for k in ("single", "sync", "local")}
  np.testing.assert_allclose(losses["sync"], losses["single"], rtol=0, atol=LOSS_ATOL)
  # Per-device statistics are another model: visibly off from the first step (and not by round-off).
  assert np.max(np.abs(losses["local"] - losses["single"])) > 100 * LOSS_ATOL
  assert result["sync"]["max_abs_loss_diff_vs_single"] <= LOSS_ATOL
  assert abs(result["sync"]["eval_loss"] - result["single"]["eval_loss"]) <= 1e-5
  assert result["sync"]["eval_accuracy"] == result["single"]["eval_accuracy"]


def test_padding_rows_never_count(compared):
  """Each step's weight is the number of real images; the epoch's last batch has 4 of 32 rows."""
  result, _ = compared
  examples = [r["examples"] for r in result["runs"]["sync"]["records"]]
  assert examples == [32.0, 32.0, 32.0, 4.0, 32.0, 32.0]
  assert result["sync"]["eval_accuracy"] == result["sync"]["host_eval_accuracy"]  # 50 test images, each once


def test_compare_writes_its_outputs(compared):
  result, out = compared
  saved = json.loads((out / "compare.json").read_text())
  for name in ("single", "sync", "local", "single_reversed", "single_shuffled"):
    assert {"eval_accuracy", "eval_loss", "max_abs_loss_diff_vs_single"} <= set(saved[name])
  assert 0 <= saved["stable_steps"] <= TINY.steps and (out / "loss_curves.png").stat().st_size > 0
  assert saved["dropout"] == 0.5 and saved["sync"]["max_abs_loss_diff_vs_single_first_10"] <= LOSS_ATOL


def test_trained_module_runs_in_ordinary_code(compared, data):
  """jaxdp.adapters.nnx.update gave back a Module that nnx.jit and numpy use on one device, without jax.set_mesh."""
  result, _ = compared
  accuracy = train_cnn.host_accuracy(result["runs"]["sync"]["model"], data[1])
  assert accuracy == pytest.approx(result["sync"]["eval_accuracy"])
