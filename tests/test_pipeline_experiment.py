"""The pipeline experiment (experiments/pipeline.py) on three of its rows, in process.

One GPipe row with a data axis, one circular row without, and a circular row with M < P that the library
refuses (the experiment lists it as skipped). The bubble is counted in the running program and must equal the
formula exactly (both are ratios of small integers); the parameters after 5 Adam steps must be within 1e-6
relative of a plain single-device loop.
"""

import json

import numpy as np
import pytest

from experiments import pipeline

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py: agreement and counts, not speed

ROWS = ["gpipe:2:2:2", "circular:2:4:1", "circular:2:1:1"]
FIELDS = {"schedule", "P", "M", "R", "data", "bubble_measured", "bubble_formula", "peak_bytes",
          "max_rel_param_diff_vs_single"}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  out = tmp_path_factory.mktemp("pipeline")
  argv = [arg for row in ROWS for arg in ("--row", row)]
  pipeline.main([*argv, "--out", str(out)])
  return json.loads((out / "pipeline.json").read_text()), out


def test_json_has_a_row_per_run_and_lists_the_refused_one(result):
  written, out = result
  assert (out / "pipeline.png").stat().st_size > 0
  assert [(r["schedule"], r["P"], r["M"], r["R"], r["data"]) for r in written["rows"]] == [
      ("gpipe", 2, 2, 1, 2), ("circular", 2, 4, 2, 1)]
  assert [(s["schedule"], s["P"], s["M"]) for s in written["skipped"]] == [("circular", 2, 1)]
  for row in written["rows"]:
    assert FIELDS <= set(row)
    assert isinstance(row["peak_bytes"], int) and row["peak_bytes"] == row["temp_bytes"] + row["argument_bytes"] > 0


def test_measured_bubble_is_the_formula(result):
  written, _ = result
  for row in written["rows"]:
    p, m, r = row["P"], row["M"], row["R"]
    assert row["bubble_measured"] == pytest.approx((p - 1) / (r * m + p - 1), abs=1e-12)
    assert row["bubble_formula"] == pytest.approx((p - 1) / (r * m + p - 1), abs=1e-12)
    assert row["layers_applied_per_row"] == pipeline.LAYERS
    # Every stage executes one work unit of L/(P·R) layers per iteration, idle or not.
    per_stage = (r * m + p - 1) * pipeline.LAYERS // (p * r)
    assert row["executed_per_stage"] == {str(s): per_stage for s in range(p)}


def test_parameters_equal_one_device_within_float32_round_off(result):
  written, _ = result
  assert written["passed"] and not written["failures"]
  assert all(0 <= row["max_rel_param_diff_vs_single"] <= 1e-6 for row in written["rows"])
  assert all(np.isfinite(row["final_loss"]) for row in written["rows"])


def test_publish_is_refused_with_a_subset_of_rows():
  with pytest.raises(SystemExit):
    pipeline.parse_args(["--row", "gpipe:2:2:1", "--publish"])
