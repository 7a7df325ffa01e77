"""The pipeline experiment (experiments/pipeline.py) on four of its rows, in process.

One GPipe row with a data axis, one circular row without, a circular row with M < P that the library
refuses (the experiment lists it as skipped), and a 1F1B row; and 1F1B's activation memory against GPipe's. The bubble is counted in the running program and must equal the
formula exactly (both are ratios of small integers); the parameters after 5 Adam steps must be within 1e-6
relative of a plain single-device loop.
"""

import json

import numpy as np
import pytest

from experiments import pipeline

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py: agreement and counts, not speed

ROWS = ["gpipe:2:2:2", "circular:2:4:1", "circular:2:1:1", "1f1b:2:4:1"]
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
      ("gpipe", 2, 2, 1, 2), ("circular", 2, 4, 2, 1), ("1f1b", 2, 4, 1, 1)]
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
    assert row["ticks"] == row["iterations"]  # the compiled loop's trip count is the schedule's length
    if row["schedule"] == "1f1b":
      # Only real work runs: M forward and M backward passes (the backward recomputes the block) per stage.
      assert row["ticks"] == 2 * (m + p - 1)
      assert row["executed_per_stage"] == {str(s): 2 * m * pipeline.LAYERS // p for s in range(p)}
    else:
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


def test_one_f_one_b_activation_memory_at_m_4p_is_below_gpipes():
  # A fixed microbatch size, M = 4P: GPipe keeps every iteration's activations, 1F1B at most P stage inputs.
  import optax
  rows = {schedule: pipeline.run_memory_row(schedule, 2, 8, optax.adam(pipeline.LR)) for schedule in ("gpipe", "1f1b")}
  assert rows["1f1b"]["temp_bytes"] < rows["gpipe"]["temp_bytes"]
  assert not pipeline.check_memory(list(rows.values()))
  assert all(r["max_rel_param_diff_vs_single"] <= pipeline.TOLERANCE for r in rows.values())
