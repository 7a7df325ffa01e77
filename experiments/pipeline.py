"""Pipeline parallelism over a ``stage`` axis: the bubble counted in the running program, memory, exactness.

Model: a functional MLP, input projection 8 -> 16 (tanh), a stack of
``L = 8`` residual tanh layers of width 16 (``params["blocks"]``, leading
layer axis) run with ``jaxdp.scan_layers``, a 4-class head; per-example
softmax cross-entropy with uneven weights (some 0, padding rows included),
global batch 32, Adam. For each schedule (GPipe; circular with R = 2
repeats), stage count P in {2, 4}, microbatches M in {1, P, 2P} and data
axis of size 1 or 2 (mesh ``("stage", "data")`` over the first P·D of the
8 simulated devices) it trains 5 steps of ``jaxdp.make_train_step`` on the
layout ``jaxdp.data_parallel(mesh, layers="blocks", pipeline=jaxdp.pipeline(M,
schedule, repeats=R))`` and records:

* ``bubble_measured``: the fraction of the stage-iterations that did no work,
  counted in the program that runs. The loss's layer function ``f`` calls a
  host callback (``jax.debug.callback``) on every execution, tagged with its
  stage (``lax.axis_index("stage")``): that counts every layer application
  each stage executes, idle ones included (the runtime feeds idle cells a
  copy of a real microbatch and masks the result). The carry holds a
  per-row counter that ``f`` increments; only real work reaches the output,
  so the loss's metric ``layers_applied`` (each row's count after the stack)
  gives the useful applications: M microbatches × that count, per data
  shard. ``bubble_measured = 1 − useful / executed``, counted over the 5
  training steps that run (the callback takes a value of the carry: JAX
  hoists loop-invariant work out of a differentiated scan, and a callback
  on the stage index alone would run once per step). It is checked against
  ``jaxdp.sharding.pipelining.bubble_formula``, (P−1)/(M+P−1) for GPipe and
  (P−1)/(R·M+P−1) for the circular schedule, and against the count of idle
  cells of ``jaxdp.sharding.pipelining.schedule_table`` (``bubble_table``).
* ``peak_bytes``: per device, the compiled training step's
  ``memory_analysis()`` temp + argument bytes (``temp_bytes`` and
  ``argument_bytes`` apart).
* ``max_rel_param_diff_vs_single``: after 5 steps, the largest over the
  parameter leaves of ‖θ − θ_ref‖ / ‖θ_ref‖, where θ_ref comes from one
  device running the same model with a plain Python loop over the layers,
  ``jax.grad`` of Σ w·l / Σ w over the whole batch and the same optax update.

The circular schedule needs M ≥ P (``jaxdp.sharding.pipelining.check_schedule``), so
its M = 1 rows are not run (listed under ``skipped`` in the JSON).

Run from the repository root (sets ``JAX_NUM_CPU_DEVICES=8`` itself unless
already set; writes ``pipeline.json`` and ``pipeline.png`` under --out,
default ``out/pipeline``; ``--publish`` also copies them to
``docs/data/pipeline.json`` and ``docs/pipeline.png``):

  .venv/bin/python experiments/pipeline.py            # all 20 rows
  .venv/bin/python experiments/pipeline.py --quick    # 4 rows
  .venv/bin/python experiments/pipeline.py --row gpipe:2:4:2 --row circular:4:8:1

--quick: 12 s on an idle 2-core CPU machine; the full run 39 s there.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time

if __name__ == "__main__":  # must happen before JAX initialises its backend
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, Mesh

import jaxdp
from experiments import common
from jaxdp.sharding import pipelining

IN, WIDTH, CLASSES, LAYERS = 8, 16, 4, 8
BATCH = 32  # global rows: divides by every data size (1, 2) × M (1..8)
STEPS = 5
REPEATS = 2  # the circular schedule's R
LR = 1e-2
TOLERANCE = 1e-6  # relative parameter difference to one device after STEPS steps
STACK = "blocks"
FULL_GRID = [(s, p, m, d) for s in pipelining.SCHEDULES for p in (2, 4) for m in (1, p, 2 * p) for d in (1, 2)]
QUICK_GRID = [("gpipe", 2, 2, 2), ("gpipe", 4, 1, 1), ("circular", 2, 4, 1), ("circular", 4, 4, 2)]


# --------------------------------------------------------------------------
# The model, its data and the single-device reference.
# --------------------------------------------------------------------------


def init_params(seed: int = 0) -> dict:
  k_in, k_blocks, k_out = jax.random.split(jax.random.key(seed), 3)
  scale = lambda fan_in: 1.0 / np.sqrt(fan_in)  # noqa: E731
  return {
      "w_in": jax.random.normal(k_in, (IN, WIDTH)) * scale(IN),
      STACK: {"w": jax.random.normal(k_blocks, (LAYERS, WIDTH, WIDTH)) * scale(WIDTH),
              "b": jnp.full((LAYERS, WIDTH), 0.01)},
      "w_out": jax.random.normal(k_out, (WIDTH, CLASSES)) * scale(WIDTH),
  }


def make_batch(seed: int = 0) -> tuple[dict, np.ndarray]:
  """``({"x", "y"}, weights)``: uneven weights in [0, 2], about one row in five at 0 (padding)."""
  rng = np.random.default_rng(seed)
  batch = {"x": rng.standard_normal((BATCH, IN), dtype=np.float32),
           "y": rng.integers(0, CLASSES, BATCH).astype(np.int32)}
  weights = rng.uniform(0.0, 2.0, BATCH).astype(np.float32)
  weights[rng.random(BATCH) < 0.2] = 0.0
  return batch, weights


def layer(h, block):
  return h + jnp.tanh(h @ block["w"] + block["b"][None, :])


def head(params, h, y):
  logits = h @ params["w_out"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def make_loss(counter: collections.Counter | None = None):
  """The pipelined loss: the stack through ``jaxdp.scan_layers``; with ``counter``, f's executions are counted.

  The carry is ``{"h": [rows, WIDTH], "applied": [rows]}``: every leaf has the rows on dim 0, as a pipeline
  cuts it into microbatches. ``applied`` counts the layers applied to each row (the useful work).
  """
  lock = threading.Lock()

  def record(stage, _):
    with lock:
      counter[int(stage)] += 1

  def f(carry, block, _):
    if counter is not None:
      # The carry's value as an argument keeps the call in the loop: JAX hoists loop-invariant work out of a
      # differentiated scan, and a call on the stage index alone would run once per step.
      jax.debug.callback(record, lax.axis_index("stage"), carry["applied"][0])
    return {"h": layer(carry["h"], block), "applied": carry["applied"] + 1.0}, None

  def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w_in"])
    carry = {"h": h, "applied": jnp.zeros(h.shape[:1], h.dtype)}
    carry, _ = jaxdp.scan_layers(f, carry, params[STACK])
    return jaxdp.LossOutput(head(params, carry["h"], batch["y"]), metrics={"layers_applied": carry["applied"]})

  return loss_fn


def reference_params(params, batch, weights, optimizer, steps: int = STEPS):
  """One device, the whole batch, a Python loop over the layers: ``steps`` updates of Σ w·l / Σ w."""

  def loss(params):
    h = jnp.tanh(batch["x"] @ params["w_in"])
    for i in range(LAYERS):
      h = layer(h, jax.tree.map(lambda a: a[i], params[STACK]))
    return jnp.sum(weights * head(params, h, batch["y"])) / jnp.sum(weights)

  @jax.jit
  def update(params, opt_state):
    grads = jax.grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = optimizer.init(params)
  for _ in range(steps):
    params, opt_state = update(params, opt_state)
  return params


def max_rel_diff(params, reference) -> float:
  """The largest ‖a − b‖ / ‖b‖ over the leaves (float64 on the host)."""
  diffs = jax.tree.map(lambda a, b: np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                       / np.linalg.norm(np.asarray(b, np.float64)), params, reference)
  return float(max(jax.tree.leaves(diffs)))


# --------------------------------------------------------------------------
# One row.
# --------------------------------------------------------------------------


def stage_mesh(stages: int, data: int) -> Mesh:
  devices = np.asarray(jax.devices()[: stages * data]).reshape(stages, data)
  return Mesh(devices, ("stage", "data"), axis_types=(AxisType.Auto,) * 2)


def run_row(schedule, stages, microbatches, data, params, batch, weights, reference, optimizer) -> dict:
  repeats = REPEATS if schedule == "circular" else 1
  mesh = stage_mesh(stages, data)
  plan = jaxdp.pipeline(microbatches, schedule, repeats=repeats)
  dp = jaxdp.data_parallel(mesh, layers=STACK, pipeline=plan)  # the layout: the stacks over "stage"
  state = jaxdp.init_state(params, optimizer, dp)
  executed = collections.Counter()
  step = jaxdp.make_train_step(make_loss(executed), optimizer, dp)
  memory = step.lower(state, batch, weights).compile().memory_analysis()
  for _ in range(STEPS):
    state, metrics = step(state, batch, weights)
  trained = jax.device_get(state.params)
  jax.effects_barrier()  # every callback has run
  calls = sum(executed.values()) / STEPS  # layer applications executed per step, over every stage and data shard
  useful = microbatches * float(metrics["layers_applied"]) * data  # M microbatches × layers per row, per shard
  table = pipelining.schedule_table(stages, microbatches, repeats)
  return {
      "schedule": schedule, "P": stages, "M": microbatches, "R": repeats, "data": data,
      "bubble_measured": 1.0 - useful / calls, "bubble_formula": pipelining.bubble_formula(stages, microbatches, repeats),
      "bubble_table": pipelining.bubble_fraction(table), "iterations": int(table.shape[0]),
      "executed_per_stage": {str(s): executed[s] / (STEPS * data) for s in sorted(executed)},
      "layers_applied_per_row": float(metrics["layers_applied"]),
      "peak_bytes": int(memory.temp_size_in_bytes + memory.argument_size_in_bytes),
      "temp_bytes": int(memory.temp_size_in_bytes), "argument_bytes": int(memory.argument_size_in_bytes),
      "final_loss": float(metrics["loss"]), "max_rel_param_diff_vs_single": max_rel_diff(trained, reference),
  }


def check_row(row) -> list[str]:
  """What is wrong with a row: the bubble off its formula, or the parameters off one device's."""
  problems = []
  if not np.isclose(row["bubble_measured"], row["bubble_formula"], rtol=0, atol=1e-12):
    problems.append(f"bubble measured {row['bubble_measured']:.6f} != formula {row['bubble_formula']:.6f}")
  if row["layers_applied_per_row"] != LAYERS:
    problems.append(f"each row went through {row['layers_applied_per_row']} layers, not {LAYERS}")
  if not row["max_rel_param_diff_vs_single"] <= TOLERANCE:
    problems.append(f"parameters {row['max_rel_param_diff_vs_single']:.2e} from one device's (> {TOLERANCE:g})")
  return problems


# --------------------------------------------------------------------------
# Output.
# --------------------------------------------------------------------------


def plot(rows, path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (bubble_ax, memory_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
  for i, ((schedule, p), group) in enumerate(sorted(_groups(rows).items())):
    color, marker = f"C{i}", "o" if schedule == "gpipe" else "s"
    group = sorted(group, key=lambda r: (r["data"], r["M"]))
    for data in sorted({r["data"] for r in group}):
      g = [r for r in group if r["data"] == data]
      ms = [r["M"] for r in g]
      label = f"{schedule}{' R=%d' % g[0]['R'] if g[0]['R'] > 1 else ''}, P={p}, data={data}"
      if data == min(r["data"] for r in group):  # the bubble does not depend on the data axis
        bubble_ax.plot(ms, [r["bubble_measured"] for r in g], marker, color=color, ms=7, label=f"{label.rsplit(',', 1)[0]} measured")
        m_fine = np.arange(min(ms), max(ms) + 1)
        bubble_ax.plot(m_fine, [pipelining.bubble_formula(p, m, g[0]["R"]) for m in m_fine], "-", color=color, lw=1, alpha=0.6)
      memory_ax.plot(ms, [r["peak_bytes"] / 1024 for r in g], marker + ("-" if data == 1 else "--"), color=color, ms=5,
                     label=label)
  bubble_ax.set(xlabel="microbatches M", ylabel="idle fraction of stage-iterations",
                title="bubble: measured (markers), (P−1)/(R·M+P−1) (lines)")
  memory_ax.set(xlabel="microbatches M", ylabel="per-device temp + argument KiB", title="peak memory of the compiled step")
  for ax in (bubble_ax, memory_ax):
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _groups(rows):
  groups = collections.defaultdict(list)
  for r in rows:
    groups[r["schedule"], r["P"]].append(r)
  return groups


def markdown(rows) -> str:
  lines = ["| schedule | P | M | R | data | bubble measured | (P−1)/(R·M+P−1) | peak KiB per device | max rel. param diff |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['schedule']} | {r['P']} | {r['M']} | {r['R']} | {r['data']} | {r['bubble_measured']:.4f} | "
                 f"{r['bubble_formula']:.4f} | {r['peak_bytes'] / 1024:.1f} | {r['max_rel_param_diff_vs_single']:.1e} |")
  return "\n".join(lines)


def parse_row(spec: str) -> tuple[str, int, int, int]:
  try:
    schedule, p, m, d = spec.split(":")
    return schedule, int(p), int(m), int(d)
  except ValueError:
    raise argparse.ArgumentTypeError(f"--row {spec!r} is not SCHEDULE:P:M:DATA (e.g. gpipe:2:4:2)") from None


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help=f"smoke run: the rows {QUICK_GRID}")
  parser.add_argument("--row", type=parse_row, action="append", default=None,
                      help="run only this row, SCHEDULE:P:M:DATA (repeatable)")
  common.add_output_args(parser, "out/pipeline", quick="out/pipeline_quick")
  args = parser.parse_args(argv)
  common.check_publish(parser, args)
  if args.publish and args.row:
    parser.error("--publish writes the committed files under docs/: run every row (no --row).")
  grid = args.row or (QUICK_GRID if args.quick else FULL_GRID)
  for schedule, p, m, d in grid:
    if schedule not in pipelining.SCHEDULES:
      parser.error(f"--row: unknown schedule {schedule!r}; use one of {', '.join(pipelining.SCHEDULES)}")
    if p * d > jax.device_count():
      parser.error(f"--row {schedule}:{p}:{m}:{d} needs {p * d} devices but {jax.device_count()} exist; "
                   "set JAX_NUM_CPU_DEVICES.")
    if BATCH % (d * m) or LAYERS % (p * (REPEATS if schedule == "circular" else 1)):
      parser.error(f"--row {schedule}:{p}:{m}:{d}: the batch of {BATCH} rows must divide by data × M and the "
                   f"{LAYERS} layers by P (× R = {REPEATS} when circular).")
  args.grid = grid
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  start = time.perf_counter()
  optimizer = optax.adam(LR)
  params, (batch, weights) = init_params(), make_batch()
  reference = jax.device_get(reference_params(params, batch, weights, optimizer))
  rows, skipped, failures = [], [], {}
  for schedule, p, m, d in args.grid:
    repeats = REPEATS if schedule == "circular" else 1
    if repeats > 1 and m < p:
      skipped.append({"schedule": schedule, "P": p, "M": m, "R": repeats, "data": d,
                      "why": "the circular schedule needs M >= P"})
      print(f"{schedule} P={p} M={m} data={d}: skipped (the circular schedule needs M >= P)", flush=True)
      continue
    tic = time.perf_counter()
    row = run_row(schedule, p, m, d, params, batch, weights, reference, optimizer)
    rows.append(row)
    problems = check_row(row)
    if problems:
      failures[f"{schedule}:{p}:{m}:{d}"] = problems
    print(f"{schedule} P={p} M={m} R={repeats} data={d}: bubble {row['bubble_measured']:.4f} (formula "
          f"{row['bubble_formula']:.4f}), peak {row['peak_bytes'] / 1024:.1f} KiB, param diff "
          f"{row['max_rel_param_diff_vs_single']:.1e} [{time.perf_counter() - tic:.1f} s]"
          + ("" if not problems else " FAIL: " + "; ".join(problems)), flush=True)
  table = markdown(rows)
  print("\n" + table + "\n")
  os.makedirs(args.out, exist_ok=True)
  if rows:
    plot(rows, os.path.join(args.out, "pipeline.png"))
  seconds = time.perf_counter() - start
  out = {"model": {"in": IN, "width": WIDTH, "classes": CLASSES, "layers": LAYERS, "batch": BATCH, "steps": STEPS,
                   "optimizer": f"adam({LR})"},
         "tolerance": TOLERANCE, "rows": rows, "skipped": skipped, "failures": failures, "passed": not failures,
         "markdown": table, "machine": common.machine(), "seconds": seconds}
  common.write_json(os.path.join(args.out, "pipeline.json"), out)
  print(f"wrote {args.out}/pipeline.json and {args.out}/pipeline.png in {seconds:.0f} s; "
        + ("every row PASSES" if not failures else f"{len(failures)} row(s) FAIL"))
  common.publish(args, {"pipeline.json": "data/pipeline.json", "pipeline.png": "pipeline.png"})
  return out


if __name__ == "__main__":
  main()
