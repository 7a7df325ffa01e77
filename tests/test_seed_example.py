"""The seed example's numbers, computed by the experiment's own function.

The expected values are derived here from the model, not copied from the
script: local gradient w − y, global-batch gradient Σ(w − y)/n, DDP's mean of
per-replica means, and one SGD step.
"""

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.fast  # in the smoke run (make test-fast)

from experiments import seed_example


@pytest.fixture(scope="module")
def out():
  return seed_example.run(jax.devices()[:3])


W0, LR = 1.0, seed_example.LR


def _mean_of_all(groups):
  return float(np.mean([W0 - y for g in groups for y in g]))


def _sum_of_all(groups):
  return float(np.sum([W0 - y for g in groups for y in g]))


def _mean_of_means(groups):
  return float(np.mean([np.mean([W0 - y for y in g]) for g in groups]))


def test_local_gradients(out):
  np.testing.assert_allclose(out["local_grad"], [W0 - g[0] for g in seed_example.EVEN], rtol=1e-6)


def test_agreed_gradients(out):
  np.testing.assert_allclose(out["even_mean_grad"], _mean_of_all(seed_example.EVEN), rtol=1e-6)
  np.testing.assert_allclose(out["uneven_mean_grad"], _mean_of_all(seed_example.UNEVEN), rtol=1e-6)
  np.testing.assert_allclose(out["uneven_rank_mean_grad"], _mean_of_means(seed_example.UNEVEN), rtol=1e-6)
  # The point of the example: with uneven portions the two differ.
  assert not np.allclose(out["uneven_mean_grad"], out["uneven_rank_mean_grad"])


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_steps(out, backend):
  np.testing.assert_allclose(out[f"{backend}/none/w"], [W0 - LR * (W0 - g[0]) for g in seed_example.EVEN], rtol=1e-6)
  assert out[f"{backend}/none/replicas_equal"].startswith("no")
  assert float(out[f"{backend}/none/divergence"]) > 0
  for case, groups, mean in [
      ("even_sum", seed_example.EVEN, _sum_of_all),
      ("even_mean", seed_example.EVEN, _mean_of_all),
      ("uneven_mean", seed_example.UNEVEN, _mean_of_all),
      ("uneven_rank_mean", seed_example.UNEVEN, _mean_of_means),
  ]:
    np.testing.assert_allclose(out[f"{backend}/{case}/w"], [W0 - LR * mean(groups)] * 3, rtol=1e-6)
    assert out[f"{backend}/{case}/replicas_equal"] == "yes"
  assert float(out[f"{backend}/even_mean/divergence"]) == 0.0


def test_backends_agree_bitwise(out):
  for key in [k for k in out if k.startswith("shard_map/") and k.endswith("/w")]:
    np.testing.assert_array_equal(out[key], out[key.replace("shard_map/", "pmap/")])


def test_report_prints_computed_values(out):
  text = seed_example.report(out)
  assert seed_example._fmt(out["shard_map/uneven_mean/w"]) in text
  assert seed_example._fmt(out["uneven_rank_mean_grad"][:1]) in text
