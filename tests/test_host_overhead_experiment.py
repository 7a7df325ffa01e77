"""Smoke test of experiments/host_overhead.py: a reduced run writes its JSON and table. No time is asserted."""

import json

from experiments import host_overhead


def test_a_reduced_run_writes_the_json_and_the_table(tmp_path):
  host_overhead.main(["--devices", "2", "--leaves", "2", "--rounds", "1", "--calls", "10", "--first-devices", "",
                      "--out", str(tmp_path)])
  results = json.loads((tmp_path / "host_overhead.json").read_text())
  (case,) = results["cases"]
  assert (case["devices"], case["leaves"]) == (2, 2)
  assert set(case["us_per_call"]) == {*host_overhead.TRAIN, *host_overhead.EVAL}
  assert all(t > 0 for t in case["us_per_call"].values())
  assert "| 2 | 2 |" in (tmp_path / "host_overhead.md").read_text()


def test_the_first_call_is_timed_for_every_method():
  (times,) = host_overhead.first_calls([(2, 4)]).values()
  methods = {"bare", "jaxdp", "bare_eval", "eval"}
  assert methods <= set(times) and all(t > 0 for name, t in times.items() if name in methods)
  assert times["jaxdp_compile"] > 0  # one program compiled (or read back from the suite's cache)


def test_the_methods_do_the_same_maths():
  """The bare step and jaxdp's make the same SGD step on the weighted mean (float32 round-off apart)."""
  import jax
  import numpy as np
  import optax

  import jaxdp

  mesh = jaxdp.data_mesh(jax.devices()[:2])
  params = host_overhead.make_params(4)
  batch, weights = host_overhead.make_data(mesh, 2)
  state, _ = jaxdp.make_train_step(host_overhead.loss_fn, optax.sgd(host_overhead.LR), mesh)(
      jaxdp.init_state(params, optax.sgd(host_overhead.LR), mesh), batch, weights)
  bare, _ = host_overhead.bare_train(mesh)(jax.device_put(params, jaxdp.sharding.layout.replicated(mesh)), batch, weights)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), state.params, bare)
  means = jaxdp.make_eval_step(host_overhead.loss_fn, mesh)(state, batch, weights)
  loss, _ = host_overhead.bare_eval(mesh)(state.params, batch, weights)
  np.testing.assert_allclose(float(means["loss"]), float(loss), rtol=1e-6)
