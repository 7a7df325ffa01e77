"""experiments/communication_cnn.py (PowerSGD on the digits CNN, SGD + Nesterov) end to end in a few steps."""

import jax
import pytest

from experiments import communication_cnn

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py: plumbing, not speed


@pytest.fixture(scope="module")
def result():
  return communication_cnn.compare(["exact", "powersgd_r1"], [0, 1], steps=2, tail=1, eval_every=1, start_iter=1,
                                   progress=False)


def test_rows_summarise_the_seeds(result):
  assert [r["method"] for r in result["rows"]] == ["exact", "powersgd_r1"]
  assert len(result["runs"]) == 4 and result["setup"]["seeds"] == [0, 1]
  exact, psgd = result["rows"]
  assert exact["accuracy_gap_vs_exact_per_seed"] == [0.0, 0.0] and exact["bytes_ratio_vs_exact"] == 1.0
  assert len(psgd["accuracy_gap_vs_exact_per_seed"]) == 2
  assert psgd["final_eval_accuracy_min"] <= psgd["final_eval_accuracy_mean"] <= psgd["final_eval_accuracy_max"]
  for run in result["runs"]:
    assert [p["step"] for p in run["curve"]] == [0, 1, 2, 3]
    assert run["final_eval_accuracy"] == run["curve"][2]["eval_accuracy"]  # read at --steps, not after the tail


def test_powersgd_sends_fewer_bytes(result):
  exact, psgd = result["rows"]
  assert 0 < psgd["bytes_per_step"] < exact["bytes_per_step"]
  assert "| `powersgd_r1` |" in communication_cnn.markdown_table(result)
  assert jax.device_count() >= communication_cnn.DEVICES
