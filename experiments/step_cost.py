"""What each part of jaxdp's step costs over the bare hand-written step: an ablation.

The bare step (``benchmark.bare_step``: ``shard_map``, local mean gradient,
``psum``, divide by N, optax update) is the floor. Each variant below adds one
part of what ``jaxdp.train_step`` does, built from jaxdp's public functions in
a hand-written ``jit(shard_map)`` (state replicated and donated, batch split):

* ``weighted``: ``jaxdp.gradient_step(divide=False)`` (the exact weighted
  sums and their one all-reduce, the loss metric) and the optax update of
  the divided gradient: no norm, no skip;
* ``norm``: ``weighted`` plus ``jaxdp.training.reduction.global_norm`` as a metric (1/N of the
  agreed gradient per device and one 4-byte all-reduce);
* ``skip``: ``weighted`` with the update under ``jaxdp.apply_update``'s
  ``cond``, skipped on zero weight or a non-finite loss (no norm);
* ``train_step``: ``jaxdp.train_step`` itself (norm, skip, every metric);
* ``make_train_step``: the same step as a user calls it, with the host-side
  checks, placement and the read of earlier steps' non-finite flags;
* ``bare_cond``: for reference, the bare step itself with its update under
  ``lax.cond`` (skipped on a non-finite loss), the division by N inside the
  branch as jaxdp's: what XLA's conditional costs without any of jaxdp's code.

All run interleaved (``common.time_interleaved``), ratios to ``bare`` within
one run. Run from the repository root (sets ``JAX_NUM_CPU_DEVICES=8`` itself):

  .venv/bin/python experiments/step_cost.py                 # MLP and LM, 2 and 8 devices, 40 steps
  .venv/bin/python experiments/step_cost.py --quick         # smoke run
  .venv/bin/python experiments/step_cost.py --publish    # full run, and copy step_cost.json to docs/data/

Writes ``step_cost.json`` under ``--out`` (default ``out/step_cost``;
``out/step_cost_quick`` with ``--quick``).

--quick: about 9 s on an idle 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __name__ == "__main__":  # must happen before JAX initialises its backend
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import jaxdp
from experiments import benchmark, common
from jaxdp.training import reduction

VARIANTS = ("bare", "weighted", "norm", "skip", "train_step", "make_train_step", "bare_cond")
FULL = {"devices": "2,8", "models": "mlp,lm", "steps": 40, "warmup": 3}
QUICK = {"devices": "2", "models": "mlp", "steps": 3, "warmup": 1}


def _update(w: benchmark.Workload, state: jaxdp.TrainState, reduced: reduction.ReducedGradient) -> jaxdp.TrainState:
  grads = reduction.divide_gradient(reduced.grads, reduced.grad_divisor)
  updates, opt_state = w.optimizer.update(grads, state.opt_state, state.params)
  return jaxdp.TrainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1, state.model_state)


def replica_steps(w: benchmark.Workload) -> dict:
  """``name -> replica(state, batch) -> (state, metrics)`` for the variants built by hand."""

  def weighted(state, batch):
    reduced = jaxdp.gradient_step(w.loss_fn, state, batch, divide=False)
    return _update(w, state, reduced), {"loss": reduced.loss}

  def norm(state, batch):
    reduced = jaxdp.gradient_step(w.loss_fn, state, batch, divide=False)
    grad_norm = reduction.global_norm(reduced.grads, "data", reduced.grad_divisor)
    return _update(w, state, reduced), {"loss": reduced.loss, "grad_norm": grad_norm}

  def skip(state, batch):
    reduced = jaxdp.gradient_step(w.loss_fn, state, batch, divide=False)
    apply = (reduced.weight > 0) & jnp.isfinite(reduced.loss)
    new = jaxdp.apply_update(w.optimizer, state, reduced.grads, apply, None, reduced.grad_divisor)
    return new, {"loss": reduced.loss}

  def train_step(state, batch):
    return jaxdp.train_step(w.loss_fn, w.optimizer, state, batch)

  return {"weighted": weighted, "norm": norm, "skip": skip, "train_step": train_step}


def hand_case(w: benchmark.Workload, mesh, replica) -> benchmark.Case:
  """``jit(shard_map(replica))`` with the state replicated and donated, the batch split over ``data``."""
  state = jaxdp.init_state(common.host_copy(w.params), w.optimizer, mesh)
  state_specs = jax.tree.map(lambda _: P(), state)
  mapped = jax.shard_map(replica, mesh=mesh, in_specs=(state_specs, P("data")), out_specs=(state_specs, P()))
  step = jax.jit(mapped, donate_argnums=0)
  batch = benchmark._split(mesh, w.batch)
  return benchmark.Case(lambda s: step(s, batch)[0], state, lambda s: jaxdp.gather_state(s).params)


def measure(w: benchmark.Workload, n: int, steps: int, warmup: int) -> dict:
  """Every variant on ``n`` devices, interleaved; median times and ratios to ``bare``."""
  print(f"[{w.short}, {n} device(s)] compiling and timing {warmup} + {steps} rounds", flush=True)
  devices = jax.devices()[:n]
  mesh = jaxdp.data_mesh(devices)
  auto = benchmark.auto_mesh(devices)
  cases = {"bare": benchmark.plain_case(w, auto, benchmark.bare_step(w, auto))}
  cases.update({name: hand_case(w, mesh, replica) for name, replica in replica_steps(w).items()})
  cases["make_train_step"] = benchmark.jaxdp_case(w, devices)
  cases["bare_cond"] = benchmark.plain_case(w, auto, benchmark.bare_step(w, auto, skip_nonfinite=True))
  times = common.time_interleaved(cases, steps, warmup)
  params = {name: case.params() for name, case in cases.items()}
  return {
      "devices": n,
      "times_ms": {name: common.stats(t) for name, t in times.items()},
      "vs_bare": {name: common.ratio_stats(t, times["bare"]) for name, t in times.items()},
      # The same maths: every variant's parameters after the same steps, against the bare step's.
      "param_diff_vs_bare": {name: benchmark.max_abs_diff(p, params["bare"]) for name, p in params.items()},
  }


def table(title: str, rows: list[dict]) -> str:
  head = " | ".join(VARIANTS)
  lines = [f"{title}: step time ÷ bare, ratio of the medians (p10–p90 of the per-round ratios); bare's median in ms",
           "", f"| devices | bare, ms | {head} |", "|---:|---:|" + "---:|" * len(VARIANTS)]
  for r in rows:
    cells = [f"{r['vs_bare'][v]['ratio']:.3f} ({r['vs_bare'][v]['p10']:.2f}–{r['vs_bare'][v]['p90']:.2f})"
             for v in VARIANTS]
    lines.append(f"| {r['devices']} | {r['times_ms']['bare']['median']:.1f} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help=f"smoke run; defaults become {QUICK}")
  p.add_argument("--devices", help=f"comma-separated device counts (default {FULL['devices']})")
  p.add_argument("--models", help=f"workloads: mlp, lm or both (default {FULL['models']})")
  p.add_argument("--steps", type=int, help=f"timed rounds (default {FULL['steps']})")
  p.add_argument("--warmup", type=int, help=f"untimed rounds, the first compiles (default {FULL['warmup']})")
  common.add_output_args(p, "out/step_cost", quick="out/step_cost_quick")
  args = p.parse_args(argv)
  common.check_publish(p, args)
  args = common.fill_defaults(args, FULL, QUICK)
  start = time.perf_counter()
  workloads = {"mlp": benchmark.mlp_workload, "lm": benchmark.lm_workload}
  results = {"machine": common.machine(), "args": vars(args), "models": {}}
  for name in args.models.split(","):
    w = workloads[name]()
    rows = [measure(w, n, args.steps, args.warmup) for n in common.device_counts(args.devices)]
    results["models"][name] = {"title": w.title, "rows": rows}
    print(table(w.title, rows) + "\n", flush=True)
  path = common.write_json(os.path.join(args.out, "step_cost.json"), results)
  print(f"wrote {path}; total {time.perf_counter() - start:.0f} s")
  common.publish(args, {"step_cost.json": "data/step_cost.json"})
  return results


if __name__ == "__main__":
  main()
