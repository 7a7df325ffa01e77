"""Smoke test of the benchmark suite's numerics comparison (JAX only) and its timing statistic.

No timing is asserted: speed goals are checked by the benchmarks, never by tests.

Tolerances: one step of a small MLP on 4 devices against a one-device
reference. The gradients of the same rule differ only by float32 round-off
of reordered sums: 1e-5 relative to the largest gradient leaves an order of
magnitude over what was measured (up to 1e-6). The two rules differ by
order 1 on uneven counts.
"""

import jax
import numpy as np
import optax

from experiments import benchmark, common

LAYERS = (8, 16, 3)


def test_numerics_rules_match_their_references():
  sides = benchmark.numerics_jax(counts=(3, 5, 1, 7), layers=LAYERS, lr=1e-3)
  rows = {(r["a"], r["b"]): r for r in benchmark.compare_numerics(sides)}
  assert set(rows) == {
      ("jaxdp_rank_mean", "jax_rank_mean"), ("jaxdp_mean", "jax_concat"), ("jaxdp_rank_mean", "jaxdp_mean")}
  assert rows["jaxdp_rank_mean", "jax_rank_mean"]["grad_rel"] < 1e-5
  assert rows["jaxdp_mean", "jax_concat"]["grad_rel"] < 1e-5
  assert rows["jaxdp_rank_mean", "jaxdp_mean"]["grad_rel"] > 1e-2  # uneven counts: the rules differ


def test_max_abs_diff_and_layout_round_trip():
  params = common.host_copy(common.mlp_params(LAYERS))
  state_dict = {f"{2 * i}.weight": p["w"].T for i, p in enumerate(params.values())}
  state_dict.update({f"{2 * i}.bias": p["b"] for i, p in enumerate(params.values())})
  assert benchmark.max_abs_diff(benchmark.torch_to_jax_params(state_dict), params) == 0.0
  shifted = {k: {"w": v["w"], "b": v["b"] + 0.5} for k, v in params.items()}  # biases are 0: exact
  assert benchmark.max_abs_diff(shifted, params) == 0.5


def test_stats_and_interleaved_timing():
  s = common.stats(np.arange(1.0, 12.0))
  assert (s["median"], s["p10"], s["p90"], s["n"]) == (6.0, 2.0, 10.0, 11)
  calls = []
  runners = {name: (lambda name=name: calls.append(name)) for name in "abcd"}
  runners["b"] = lambda: calls.append("b") or 0.25
  times = common.time_interleaved(runners, steps=29, warmup=1)
  rounds = [calls[i:i + 4] for i in range(0, len(calls), 4)]
  assert len(rounds) == 30 and all(sorted(r) == list("abcd") for r in rounds)  # interleaved, warm-up included
  assert len({tuple(r) for r in rounds}) > 1  # the order changes from round to round
  followers = {after for r in rounds for before, after in zip(r, r[1:]) if before == "d"}
  assert len(followers) == 3  # so "d" is not always followed by the same method
  assert len(times["a"]) == 29 and times["b"] == [250.0] * 29  # a runner may report its own seconds
  r = common.ratio_stats([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
  assert r["ratio"] == 2.0 and r["p10"] == r["p90"] == 2.0


def test_step_cost_variants_do_the_same_maths():
  # The ablation times variants that must all compute the bare step's update: after two steps of a
  # small MLP on 2 devices (SGD: no division by tiny second moments) their parameters agree up to float32
  # round-off of the reordered sums.
  from experiments import step_cost

  w = benchmark.Workload(
      name="mlp", title="small MLP", params=common.host_copy(common.mlp_params(LAYERS)), loss_fn=common.mlp_loss,
      optimizer=optax.sgd(0.1), batch=common.mlp_batch(LAYERS, 16), unit="examples", units_per_step=16)
  row = step_cost.measure(w, 2, steps=1, warmup=1)
  assert set(row["times_ms"]) == set(step_cost.VARIANTS) == set(row["vs_bare"])
  scale = max(float(np.max(np.abs(p))) for p in jax.tree.leaves(common.host_copy(common.mlp_params(LAYERS))))
  assert max(row["param_diff_vs_bare"].values()) < 1e-5 * scale


def test_step_profile_reads_the_compiled_steps_and_their_trace(tmp_path):
  """experiments/step_profile.py --quick: cost analysis, instruction kinds and a per-op profile for both steps.

  The structure is what is checked (no time is asserted): jaxdp's update sits in a conditional the bare step
  does not have, and both spend device time in their all-reduce.
  """
  from experiments import step_profile

  result = step_profile.main(["--quick", "--out", str(tmp_path)])
  assert (tmp_path / "step_profile.json").is_file()
  compiled, profile = result["compiled"], result["profile_ms"]
  assert compiled["jaxdp"]["flops"] > 0 and compiled["bare"]["flops"] > 0
  assert compiled["jaxdp"]["instructions"]["conditional"] == 1 and "conditional" not in compiled["bare"]["instructions"]
  assert profile["jaxdp"]["all-reduce"] > 0 and profile["bare"]["all-reduce"] > 0
  assert any(kind.startswith("in cond: ") for kind in profile["jaxdp"])
  assert not any(kind.startswith("in cond: ") for kind in profile["bare"])
