"""PowerSGD on its own setting: the digits CNN of ``experiments/train_cnn.py`` with SGD + Nesterov momentum 0.9.

Vogels et al. (2019) report parity for PowerSGD rank 2 with error feedback
and a warm-started ``Q`` under SGD with Nesterov momentum 0.9. This part of
``experiments/communication.py`` trains train_cnn's CNN (two convolutions
with exact sync BatchNorm, two dense layers; sklearn's 8×8 digits, 1,437
training and 360 test images, batch 64, dropout 0) on 4 simulated devices,
from one init and one data order per seed:

- ``exact``: jaxdp's default step;
- ``powersgd_rR``: ``reduction=jaxdp.reductions.powersgd(rank=R, start_iter=S)``.

The learning rate warms up over a twentieth of the steps and decays (cosine)
to lr/10 at ``steps``, where ``final_eval_accuracy`` is read; ``tail`` more
steps at lr/10 are seen only by ``steps_to_target_accuracy`` (the first
evaluation whose test accuracy is at least the same seed's exact final one).
Bytes are counted as for the LM (:func:`experiments.communication.lowered_bytes`).
"""

from __future__ import annotations

import os
import sys
import time

if __name__ == "__main__":  # before JAX initialises its backend
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
import optax
from flax import nnx

import jaxdp
from experiments import train_cnn

DEVICES = 4
RANKS = (1, 2, 4)


def make_optimizer(lr: float, steps: int) -> optax.GradientTransformation:
  """SGD with Nesterov momentum 0.9: warm-up over ``steps // 20``, cosine decay to ``lr / 10`` at ``steps``."""
  warmup = max(1, steps // 20)
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr / 10)
  return optax.sgd(schedule, momentum=0.9, nesterov=True)


def _bytes(lower, n: int = DEVICES) -> float:
  from experiments.communication import traffic

  return traffic(lower.as_text(dialect="hlo"), n)


def run(method: str, seed: int, *, steps: int, tail: int, eval_every: int, start_iter: int, lr: float, data,
        batch_size: int = 64) -> dict:
  """One CNN run: its test-accuracy curve, final accuracy and bytes per step (compressed program for PowerSGD)."""
  mesh = jaxdp.data_mesh(jax.devices()[:DEVICES])
  train_set, test_set = data
  model = train_cnn.CNN(bn_axis="data", dropout=0.0, rngs=nnx.Rngs(seed))
  definition, params, model_state = jaxdp.adapters.nnx.split(model)
  optimizer = make_optimizer(lr, steps)
  loss_fn = jaxdp.adapters.nnx.loss_fn(definition, train_cnn.classification_loss)
  options = {}
  if method.startswith("powersgd_r"):
    rank = int(method.removeprefix("powersgd_r"))
    options["reduction"] = jaxdp.reductions.powersgd(rank=rank, start_iter=start_iter)
  elif method != "exact":
    raise ValueError(f"unknown CNN method {method!r}; choose from exact, powersgd_rR")
  state = jaxdp.init_state(params, optimizer, mesh, model_state=model_state, **options)
  step = jaxdp.make_train_step(loss_fn, optimizer, mesh, example_ids="id", **options)
  pipeline = jaxdp.DataPipeline(train_set, train_cnn.collate, mesh, per_device_batch=batch_size // DEVICES, seed=seed)
  eval_step = jaxdp.make_eval_step(loss_fn, mesh)
  eval_pipeline = jaxdp.DataPipeline(test_set, train_cnn.collate, mesh,
                                     per_device_batch=-(-len(test_set) // (4 * DEVICES)), seed=0)

  def evaluate(state) -> float:
    batches = (d for _, d in eval_pipeline.iterate(num_steps=eval_pipeline.steps_per_epoch))
    return float(eval_step.evaluate(state, batches)["accuracy"])

  rng = jax.random.key(seed)  # dropout is 0; the nnx model still takes a key
  curve, per_step, start = [], None, time.perf_counter()
  for i, (batch, weights) in pipeline.iterate(num_steps=steps + tail):
    if per_step is None:
      if "reduction" in options:  # the compressed program (start_iter=0); the first start_iter steps are exact
        hot = jaxdp.reductions.powersgd(rank=rank, start_iter=0)
        hot_step = jaxdp.make_train_step(loss_fn, optimizer, mesh, example_ids="id", reduction=hot)
        hot_state = jaxdp.init_state(params, optimizer, mesh, model_state=model_state, reduction=hot)
        per_step = _bytes(hot_step.lower(hot_state, batch, weights, rng))
      else:
        per_step = _bytes(step.lower(state, batch, weights, rng))
      curve.append({"step": 0, "eval_accuracy": evaluate(state)})
    state, _ = step(state, batch, weights, rng)
    if (i + 1) % eval_every == 0 or i + 1 in (steps, steps + tail):
      curve.append({"step": i + 1, "eval_accuracy": evaluate(state)})
  final = next(p["eval_accuracy"] for p in curve if p["step"] == steps)
  return {"method": method, "seed": seed, "bytes_per_step": per_step, "final_eval_accuracy": final, "curve": curve,
          "seconds": time.perf_counter() - start}


def compare(methods, seeds, *, steps: int, tail: int, eval_every: int, start_iter: int, lr: float = 0.05,
            progress: bool = True) -> dict:
  """Every method of ``methods`` for every seed of ``seeds``; ``{"runs", "rows", "setup"}`` (rows: over seeds)."""
  if jax.device_count() < DEVICES:
    raise SystemExit(f"{DEVICES} devices are needed but {jax.device_count()} exist; set JAX_NUM_CPU_DEVICES={DEVICES}.")
  data = train_cnn.load_digits(0)  # one train/test split; the seed picks the init and the data order
  runs = []
  for seed in seeds:
    for method in methods:
      runs.append(run(method, seed, steps=steps, tail=tail, eval_every=eval_every, start_iter=start_iter, lr=lr,
                      data=data))
      if progress:
        r = runs[-1]
        print(f"  cnn {method} seed {seed}: eval accuracy {r['final_eval_accuracy']:.4f}, "
              f"{r['bytes_per_step'] / 1e3:.1f} kB/step ({r['seconds']:.0f} s)", flush=True)
  _, params, _ = jaxdp.adapters.nnx.split(train_cnn.CNN(bn_axis="data", dropout=0.0, rngs=nnx.Rngs(0)))
  n_params = sum(int(np.size(x)) for x in jax.tree.leaves(params))
  setup = {"model": "train_cnn.CNN (2 conv + sync BatchNorm, 2 dense), dropout 0", "params": n_params,
           "data": "sklearn digits, 1437 train / 360 test (split seed 0)", "devices": DEVICES, "batch_size": 64,
           "steps": steps, "tail_steps": tail, "eval_every": eval_every, "seeds": list(seeds),
           "powersgd_start_iter": start_iter,
           "optimizer": f"sgd lr {lr}, Nesterov momentum 0.9, warm-up {max(1, steps // 20)} steps, cosine decay to "
                        f"lr/10 at step {steps}, then constant"}
  return {"runs": runs, "rows": summarise(runs, methods), "setup": setup}


def summarise(runs: list[dict], methods) -> list[dict]:
  """One row per method: accuracy mean, std and min/max over seeds, gap to exact per seed, steps to target."""
  exact = {r["seed"]: r for r in runs if r["method"] == "exact"}
  rows = []
  for method in methods:
    mine = [r for r in runs if r["method"] == method]
    acc = np.array([r["final_eval_accuracy"] for r in mine])
    gaps = np.array([r["final_eval_accuracy"] - exact[r["seed"]]["final_eval_accuracy"] for r in mine])
    reached = []
    for r in mine:
      target = exact[r["seed"]]["final_eval_accuracy"]
      hit = [p["step"] for p in r["curve"] if p["eval_accuracy"] >= target]
      reached.append(hit[0] if hit else None)
    rows.append({
        "method": method, "bytes_per_step": mine[0]["bytes_per_step"],
        "bytes_ratio_vs_exact": exact[mine[0]["seed"]]["bytes_per_step"] / mine[0]["bytes_per_step"],
        "final_eval_accuracy_mean": float(acc.mean()), "final_eval_accuracy_std": float(acc.std(ddof=1)) if len(acc) > 1 else 0.0,
        "final_eval_accuracy_min": float(acc.min()), "final_eval_accuracy_max": float(acc.max()),
        "accuracy_gap_vs_exact_mean": float(gaps.mean()), "accuracy_gap_vs_exact_per_seed": gaps.tolist(),
        "steps_to_target_accuracy_per_seed": reached,
    })
  return rows


def markdown_table(result: dict) -> str:
  """The CNN rows as a Markdown table (accuracy in percent: mean ± std over seeds, [min, max])."""
  lines = ["| method | kB sent per device and step | fewer bytes than exact | final test accuracy (mean ± std, [min, max]) "
           "| vs exact (points, mean; per seed) | steps to exact's final accuracy (per seed) |",
           "|---|---:|---:|---:|---:|---:|"]
  for row in result["rows"]:
    per_seed = ", ".join(f"{100 * g:+.2f}" for g in row["accuracy_gap_vs_exact_per_seed"])
    reached = ", ".join("–" if s is None else str(s) for s in row["steps_to_target_accuracy_per_seed"])
    lines.append(f"| `{row['method']}` | {row['bytes_per_step'] / 1e3:.1f} | {row['bytes_ratio_vs_exact']:.1f}× | "
                 f"{100 * row['final_eval_accuracy_mean']:.2f} ± {100 * row['final_eval_accuracy_std']:.2f} "
                 f"[{100 * row['final_eval_accuracy_min']:.2f}, {100 * row['final_eval_accuracy_max']:.2f}] | "
                 f"{100 * row['accuracy_gap_vs_exact_mean']:+.2f} ({per_seed}) | {reached} |")
  return "\n".join(lines)


FULL = {"steps": 600, "tail_steps": 100, "eval_every": 50, "start_iter": 10, "seeds": "0,1,2"}
QUICK = {"steps": 20, "tail_steps": 5, "eval_every": 10, "start_iter": 2, "seeds": "0"}


def main(argv=None) -> dict:
  import argparse
  import sys

  from experiments import common

  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help=f"smoke run; defaults become {QUICK}")
  p.add_argument("--steps", type=int, help=f"steps of the schedule (default {FULL['steps']})")
  p.add_argument("--tail-steps", type=int, help=f"steps at lr/10 after --steps (default {FULL['tail_steps']})")
  p.add_argument("--eval-every", type=int, help=f"steps between test evaluations (default {FULL['eval_every']})")
  p.add_argument("--start-iter", type=int, help=f"PowerSGD's exact steps first (default {FULL['start_iter']})")
  p.add_argument("--seeds", help=f"comma-separated init / data-order seeds (default {FULL['seeds']})")
  p.add_argument("--methods", default="exact," + ",".join(f"powersgd_r{r}" for r in RANKS))
  p.add_argument("--no-progress", dest="progress", action="store_false")
  common.add_output_args(p, "out/communication_cnn", quick="out/communication_cnn_quick")
  args = p.parse_args(argv)
  common.check_publish(p, args)
  common.fill_defaults(args, FULL, QUICK)
  start = time.perf_counter()
  result = compare(args.methods.split(","), [int(s) for s in str(args.seeds).split(",")], steps=args.steps,
                   tail=args.tail_steps, eval_every=args.eval_every, start_iter=args.start_iter, progress=args.progress)
  result["setup"]["command"] = "python experiments/communication_cnn.py " + " ".join(sys.argv[1:] if argv is None else argv)
  result["setup"]["wall_seconds"] = time.perf_counter() - start
  result["machine"] = common.machine()
  common.write_json(__import__("pathlib").Path(args.out) / "communication_cnn.json", result)
  print(markdown_table(result))
  print(f"wall time {result['setup']['wall_seconds']:.0f} s; outputs in {args.out}")
  common.publish(args, {"communication_cnn.json": "data/communication_cnn.json"})
  return result


if __name__ == "__main__":
  main()
