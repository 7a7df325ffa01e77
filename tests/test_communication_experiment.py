"""experiments/communication.py end to end in a tiny configuration (8 simulated CPU devices, 4 used)."""

import json
import pathlib
import sysconfig

import jax
import numpy as np
import pytest

import jaxdp
from experiments import communication, train_lm

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py: plumbing, not speed

TINY = train_lm.Config(steps=4, batch_size=8, seq_len=32, layers=1, d_model=16, heads=2, d_ff=32, val_every=4,
                       max_bytes=None, progress=False, out=None)
# float16_dynamic needs jaxdp's dynamic loss scaling, merged from another branch than PowerSGD and DiLoCo.
HAS_LOSS_SCALING = hasattr(jaxdp, "dynamic_loss_scale")
METHODS = (["exact", "bf16", "powersgd_r1", "diloco_h2", "diloco_h2_int8", "onebit_adam"]
           + ["float16_dynamic"] * HAS_LOSS_SCALING)
ROW_KEYS = {"method", "bytes_per_step", "compiled_bytes_per_step", "bytes_per_step_incl_warmup", "final_val_loss",
            "steps_to_target_loss", "loss_gap_vs_exact", "bytes_ratio_vs_exact", "curve", "seconds"}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  """The JSON and plot of a 4-step run (+2 tail steps) of every kind of method on one small stdlib file."""
  folder = tmp_path_factory.mktemp("communication")
  (folder / "corpus.txt").write_bytes((pathlib.Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_bytes())
  config = TINY.__class__(**{**TINY.__dict__, "corpus": str(folder / "corpus.txt")})
  result = communication.compare(config, METHODS, eval_every=2, start_iter=1, tail=2, progress=False)
  result["machine"] = {"device_count": jax.device_count()}
  communication.write_outputs(result, folder / "out")
  return json.loads((folder / "out" / "communication.json").read_text()), folder / "out"


def test_rows_have_every_field_and_the_plot_is_written(written):
  result, out = written
  assert set(result) == {"rows", "setup", "machine"}
  assert [r["method"] for r in result["rows"]] == METHODS
  for row in result["rows"]:
    assert set(row) == ROW_KEYS, row["method"]
    assert [p["step"] for p in row["curve"]] == [0, 2, 4, 6]
    assert all(np.isfinite(p["val_loss"]) for p in row["curve"])
    assert row["final_val_loss"] == row["curve"][2]["val_loss"]  # read at --steps, not after the tail
  # One init: every method's validation loss before its first step is the same.
  assert len({row["curve"][0]["val_loss"] for row in result["rows"]}) == 1
  assert (out / "communication.png").stat().st_size > 0


def test_exact_is_the_reference(written):
  rows = {r["method"]: r for r in written[0]["rows"]}
  exact = rows["exact"]
  assert exact["loss_gap_vs_exact"] == 0.0 and exact["bytes_ratio_vs_exact"] == 1.0
  assert exact["steps_to_target_loss"] is not None and exact["steps_to_target_loss"] <= TINY.steps
  for row in rows.values():
    target = exact["final_val_loss"]
    assert row["loss_gap_vs_exact"] == pytest.approx((row["final_val_loss"] - target) / target)


def test_bytes_per_step(written):
  result = written[0]
  rows = {r["method"]: r for r in result["rows"]}
  # The exact step all-reduces every float32 gradient once over 4 devices: each sends 2 (N-1)/N of its bytes
  # (ring), plus a few scalar sums (the weight, the loss).
  ring = 2 * 3 / 4 * result["setup"]["param_bytes"]
  assert ring <= rows["exact"]["bytes_per_step"] <= ring + 1024
  if HAS_LOSS_SCALING:  # float16 compute, float32 reduction
    assert ring <= rows["float16_dynamic"]["bytes_per_step"] <= ring + 1024
  assert ring / 2 <= rows["bf16"]["bytes_per_step"] < 0.6 * rows["exact"]["bytes_per_step"]
  for name in ("powersgd_r1", "diloco_h2"):
    assert 0 < rows[name]["bytes_per_step"] < rows["exact"]["bytes_per_step"], name
  # DiLoCo on replica=4, data=1: the sync all-reduces the float32 delta (the parameters' bytes) once per H = 2
  # steps; int8 sends a quarter of that (plus its per-block scales).
  assert ring / 2 <= rows["diloco_h2"]["bytes_per_step"] <= ring / 2 + 1024
  assert rows["diloco_h2_int8"]["bytes_per_step"] < rows["diloco_h2"]["bytes_per_step"] / 3
  # PowerSGD's first step is exact, so the average over the run includes one exact step.
  psgd = rows["powersgd_r1"]
  n = TINY.steps
  assert psgd["bytes_per_step_incl_warmup"] == pytest.approx((rows["exact"]["bytes_per_step"]
                                                              + (n - 1) * psgd["bytes_per_step"]) / n)
  # 1-bit Adam: its first onebit_warmup(4) = 1 step exact, then one bit per value (an all-to-all of the signs and a
  # psum of the servers' chunks, 2.25 / 8 of a float32 value's ring bytes at N = 4, plus per-chunk scales).
  onebit = rows["onebit_adam"]
  warm = communication.onebit_warmup(n)
  assert onebit["bytes_per_step"] < rows["exact"]["bytes_per_step"] / 10
  assert onebit["bytes_per_step_incl_warmup"] == pytest.approx((warm * rows["exact"]["bytes_per_step"]
                                                                + (n - warm) * onebit["bytes_per_step"]) / n)


def test_diloco_names_carry_the_outer_learning_rate():
  assert communication.DILOCO.fullmatch("diloco_h50_olr0.5").groups() == ("50", None, "0.5")
  assert communication.DILOCO.fullmatch("diloco_h10_int8_olr1").groups() == ("10", "int8", "1")
  assert communication.DILOCO.fullmatch("diloco_h10").groups() == ("10", None, None)


def test_plot_only_redraws_the_committed_json_without_training(tmp_path):
  """--plot-only: the PNG from docs/data/communication.json, no training; overlapping lines are named on it."""
  committed = pathlib.Path(__file__).parents[1] / "docs" / "data" / "communication.json"
  result = communication.main(["--plot-only", str(committed), "--out", str(tmp_path)])
  assert (tmp_path / "communication.png").stat().st_size > 0
  assert result == json.loads(committed.read_text())
  groups = communication.overlapping_methods(result["rows"])
  assert any("exact" in group and "bf16" in group for group in groups)
