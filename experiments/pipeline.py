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

1F1B rows (``"1f1b"``): a stage runs nothing in an idle cell (each tick it runs
one forward pass, one backward pass, which applies the block once to
recompute its forward pass from the saved input, or neither), so the host
callback counts only real work units (checked: ``2·M`` per stage), and the
bubble is ``1 − units / (P · ticks)`` with ``ticks`` the trip count of the
compiled step's pipeline loop (the ``while`` whose body holds the
``collective-permute``), read from the optimized HLO; that count is checked
against the schedule's length for every row.

Two more sections (not run with ``--row``):

* ``memory``: GPipe against 1F1B at a fixed microbatch size (``MICRO_ROWS``
  rows per microbatch, the batch ``M·MICRO_ROWS``, width ``MEMORY_WIDTH``,
  data = 1) for M = P, 2P, 4P: ``temp_bytes`` of the compiled step. 1F1B's
  must stay flat in M (within 10% of its M = P value) and be below GPipe's
  at M = 4P.
* ``zero``: ZeRO stages 1, 2 and 3 (``gather="step"`` and ``"layer"``) with a
  pipeline on ``("stage", "data") = (2, 4)``, M = 4, width ``ZERO_WIDTH`` (the
  weights outweigh the activations): peak bytes, and the bytes all-gathered
  per step (each all-gather's output bytes times the trip counts of the
  loops around it, from the HLO; an op inside a conditional's branch, as
  under 1F1B, is counted every tick, so that figure is a bound).

Every row of every section is checked against one device (1e-6).

Run from the repository root (sets ``JAX_NUM_CPU_DEVICES=8`` itself unless
already set; writes ``pipeline.json`` and ``pipeline.png`` under --out,
default ``out/pipeline``; ``--publish`` also copies them to
``docs/data/pipeline.json`` and ``docs/pipeline.png``):

  .venv/bin/python experiments/pipeline.py            # 36 rows (4 skipped), 12 memory, 12 ZeRO rows
  .venv/bin/python experiments/pipeline.py --quick    # 6 rows, 6 memory rows, 6 ZeRO rows
  .venv/bin/python experiments/pipeline.py --row gpipe:2:4:2 --row circular:4:8:1

--quick: about 3 minutes on a loaded 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
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
QUICK_GRID = [("gpipe", 2, 2, 2), ("gpipe", 4, 1, 1), ("circular", 2, 4, 1), ("circular", 4, 4, 2),
              ("1f1b", 2, 4, 2), ("1f1b", 4, 4, 1)]
# Activation memory against M at a fixed microbatch size (the batch grows with M): GPipe against 1F1B.
MICRO_ROWS, MEMORY_WIDTH = 16, 64
MEMORY_GRID = [(s, p, k * p) for s in ("gpipe", "1f1b") for p in (2, 4) for k in (1, 2, 4)]
QUICK_MEMORY_GRID = [(s, 2, m) for s in ("gpipe", "1f1b") for m in (2, 4, 8)]
# ZeRO with a pipeline: a model whose weights outweigh its activations, on ("stage", "data") = (2, 4), M = 4.
ZERO_WIDTH, ZERO_P, ZERO_DATA, ZERO_M = 64, 2, 4, 4
ZERO_GRID = [(s, z, g) for s in ("gpipe", "circular", "1f1b") for z, g in
             ((1, "step"), (2, "step"), (3, "step"), (3, "layer"))]
QUICK_ZERO_GRID = [("gpipe", 1, "step"), ("gpipe", 2, "step"), ("gpipe", 3, "step"), ("gpipe", 3, "layer"),
                   ("1f1b", 3, "step"), ("1f1b", 3, "layer")]


# --------------------------------------------------------------------------
# The model, its data and the single-device reference.
# --------------------------------------------------------------------------


def init_params(seed: int = 0, width: int = WIDTH) -> dict:
  k_in, k_blocks, k_out = jax.random.split(jax.random.key(seed), 3)
  scale = lambda fan_in: 1.0 / np.sqrt(fan_in)  # noqa: E731
  return {
      "w_in": jax.random.normal(k_in, (IN, width)) * scale(IN),
      STACK: {"w": jax.random.normal(k_blocks, (LAYERS, width, width)) * scale(width),
              "b": jnp.full((LAYERS, width), 0.01)},
      "w_out": jax.random.normal(k_out, (width, CLASSES)) * scale(width),
  }


def make_batch(seed: int = 0, rows: int = BATCH) -> tuple[dict, np.ndarray]:
  """``({"x", "y"}, weights)``: uneven weights in [0, 2], about one row in five at 0 (padding)."""
  rng = np.random.default_rng(seed)
  batch = {"x": rng.standard_normal((rows, IN), dtype=np.float32),
           "y": rng.integers(0, CLASSES, rows).astype(np.int32)}
  weights = rng.uniform(0.0, 2.0, rows).astype(np.float32)
  weights[rng.random(rows) < 0.2] = 0.0
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


def ticks_of(hlo: str) -> int:
  """The trip count of the compiled step's pipeline loop: the ``while`` whose body sends activations between
  stages (``collective-permute``), read from the optimized HLO."""
  bodies, _ = _computations(hlo)
  for lines in bodies.values():
    for line in lines:
      trips, body = _TRIPS.search(line), re.search(r"\bbody=%([\w.\-]+)", line)
      if " while(" in line and trips and body and any("collective-permute" in op for op in bodies[body.group(1)]):
        return int(trips.group(1))
  raise ValueError("no pipeline loop (a while with a collective-permute) in the HLO")


_REF = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _computations(hlo: str) -> tuple[dict, str]:
  """``({computation: its lines}, the entry computation's name)`` of optimized HLO text."""
  comps, current, entry = collections.defaultdict(list), None, None
  for line in hlo.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      current = (line.split()[1] if line.startswith("ENTRY") else line.split()[0]).lstrip("%")
      entry = current if line.startswith("ENTRY") else entry
    elif current is not None:
      comps[current].append(line)
  return comps, entry


def gathered_per_step(hlo: str) -> dict:
  """The all-gathers of the compiled step: ``ops`` (static count) and ``bytes_per_step``, each op's output bytes
  times the trip counts of the loops around it (``known_trip_count`` of each ``while``; an op inside a
  conditional's branch is counted every time the conditional runs, so a bound there: ``in_conditional``)."""
  comps, entry = _computations(hlo)
  times, branched = collections.Counter(), set()

  def visit(name, count, branch):
    times[name] += count
    if branch:
      branched.add(name)
    for line in comps.get(name, []):
      trips = _TRIPS.search(line)
      for role, callee in _REF.findall(line):
        visit(callee, count * (int(trips.group(1)) if role == "body" and trips else 1), branch)
      for group in _BRANCHES.findall(line):
        for callee in group.split(","):
          visit(callee.strip().lstrip("%"), count, True)

  visit(entry, 1, False)
  ops, total, conditional = 0, 0, False
  for name, lines in comps.items():
    for op in jaxdp.analysis.reports.hlo_collectives("\n".join(lines)):
      if op.kind == "all-gather":
        ops, total = ops + 1, total + op.nbytes * times[name]
        conditional |= name in branched
  return {"ops": ops, "bytes_per_step": int(total), "in_conditional": conditional}


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


def train_layout(schedule, stages, microbatches, data, params, batch, weights, reference, optimizer, *,
                 zero_stage=0, gather="step", executed=None) -> dict:
  """Trains STEPS steps on the layout; its compiled step's memory, ticks and all-gathers, and the parameters'
  distance to one device's."""
  repeats = REPEATS if schedule == "circular" else 1
  mesh = stage_mesh(stages, data)
  plan = jaxdp.pipeline(microbatches, schedule, repeats=repeats, gather=gather)
  dp = jaxdp.data_parallel(mesh, layers=STACK, pipeline=plan, zero_stage=zero_stage)  # the stacks over "stage"
  state = jaxdp.init_state(params, optimizer, dp)
  step = jaxdp.make_train_step(make_loss(executed), optimizer, dp)
  compiled = step.lower(state, batch, weights).compile()
  memory, hlo = compiled.memory_analysis(), compiled.as_text()
  for _ in range(STEPS):
    state, metrics = step(state, batch, weights)
  trained = jax.device_get(jaxdp.gather_state(state).params)
  jax.effects_barrier()  # every callback has run
  gathered = gathered_per_step(hlo)
  return {
      "schedule": schedule, "P": stages, "M": microbatches, "R": repeats, "data": data,
      "zero_stage": zero_stage, "gather": gather, "ticks": ticks_of(hlo) if stages > 1 else None,
      "layers_applied_per_row": float(metrics["layers_applied"]),
      "peak_bytes": int(memory.temp_size_in_bytes + memory.argument_size_in_bytes),
      "temp_bytes": int(memory.temp_size_in_bytes), "argument_bytes": int(memory.argument_size_in_bytes),
      "all_gather_ops": gathered["ops"], "all_gather_bytes_per_step": gathered["bytes_per_step"],
      "all_gather_in_conditional": gathered["in_conditional"],
      "final_loss": float(metrics["loss"]), "max_rel_param_diff_vs_single": max_rel_diff(trained, reference),
  }


def run_row(schedule, stages, microbatches, data, params, batch, weights, reference, optimizer) -> dict:
  """A row of the main table: the bubble counted in the running program."""
  executed = collections.Counter()
  row = train_layout(schedule, stages, microbatches, data, params, batch, weights, reference, optimizer,
                     executed=executed)
  repeats = row["R"]
  calls = sum(executed.values()) / STEPS  # layer applications executed per step, over every stage and data shard
  if schedule == "1f1b":
    # Idle cells run nothing (each tick a stage runs a forward pass, a backward pass or neither, lax.switch), and
    # a backward pass applies the stage's layers once (recomputing its forward from the saved input): each
    # stage's executed units of L/P layers over the stage-ticks of the loop, whose length the HLO gives.
    table = pipelining.one_f_one_b_table(stages, microbatches)
    units = calls / (LAYERS // stages) / data
    bubble = 1.0 - units / (stages * row["ticks"])
    table_bubble = float(np.mean(table.kind == 0))
  else:
    useful = microbatches * row["layers_applied_per_row"] * data  # M microbatches × layers per row, per shard
    bubble = 1.0 - useful / calls
    table = pipelining.schedule_table(stages, microbatches, repeats)
    table_bubble = pipelining.bubble_fraction(table)
  return {
      **row, "bubble_measured": bubble, "bubble_formula": pipelining.bubble_formula(stages, microbatches, repeats),
      "bubble_table": table_bubble,
      "iterations": int(table.kind.shape[0] if schedule == "1f1b" else table.shape[0]),
      "executed_per_stage": {str(s): executed[s] / (STEPS * data) for s in sorted(executed)},
  }


def run_memory_row(schedule, stages, microbatches, optimizer) -> dict:
  """Activation memory at a fixed microbatch size: the batch is M·MICRO_ROWS rows (data = 1)."""
  params = init_params(width=MEMORY_WIDTH)
  batch, weights = make_batch(rows=microbatches * MICRO_ROWS)
  reference = jax.device_get(reference_params(params, batch, weights, optimizer))
  return train_layout(schedule, stages, microbatches, 1, params, batch, weights, reference, optimizer)


def run_zero_row(schedule, zero_stage, gather, optimizer) -> dict:
  """ZeRO with a pipeline on ("stage", "data") = (ZERO_P, ZERO_DATA): memory and all-gathered bytes per step."""
  params = init_params(width=ZERO_WIDTH)
  batch, weights = make_batch()
  reference = jax.device_get(reference_params(params, batch, weights, optimizer))
  return train_layout(schedule, ZERO_P, ZERO_M, ZERO_DATA, params, batch, weights, reference, optimizer,
                      zero_stage=zero_stage, gather=gather)


def check_row(row) -> list[str]:
  """What is wrong with a row: the bubble off its formula, or the parameters off one device's."""
  problems = []
  if not np.isclose(row["bubble_measured"], row["bubble_formula"], rtol=0, atol=1e-12):
    problems.append(f"bubble measured {row['bubble_measured']:.6f} != formula {row['bubble_formula']:.6f}")
  if row["ticks"] is not None and row["ticks"] != row["iterations"]:
    problems.append(f"the compiled loop runs {row['ticks']} iterations, the schedule has {row['iterations']}")
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


def check_memory(rows) -> dict:
  """1F1B's temp bytes at M = 4P below GPipe's, and flat in M (within 10% of its M = P value)."""
  failures = {}
  by = {(r["schedule"], r["P"], r["M"]): r["temp_bytes"] for r in rows}
  for p in sorted({r["P"] for r in rows}):
    if ("1f1b", p, 4 * p) in by and ("gpipe", p, 4 * p) in by and not by["1f1b", p, 4 * p] < by["gpipe", p, 4 * p]:
      failures[f"memory:P={p}"] = [f"1F1B temp {by['1f1b', p, 4 * p]} B at M = 4P is not below GPipe's "
                                   f"{by['gpipe', p, 4 * p]} B"]
    if ("1f1b", p, 4 * p) in by and ("1f1b", p, p) in by and not by["1f1b", p, 4 * p] <= 1.1 * by["1f1b", p, p]:
      failures[f"memory:flat:P={p}"] = [f"1F1B temp grows from {by['1f1b', p, p]} B at M = P to "
                                        f"{by['1f1b', p, 4 * p]} B at M = 4P"]
  return failures


def memory_markdown(rows) -> str:
  lines = ["| schedule | P | M | batch | temp KiB per device | argument KiB | max rel. param diff |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['schedule']} | {r['P']} | {r['M']} | {r['M'] * MICRO_ROWS} | {r['temp_bytes'] / 1024:.1f} | "
                 f"{r['argument_bytes'] / 1024:.1f} | {r['max_rel_param_diff_vs_single']:.1e} |")
  return "\n".join(lines)


def zero_markdown(rows) -> str:
  lines = ["| schedule | ZeRO stage | gather | peak KiB per device | temp KiB | argument KiB | all-gather ops | "
           "all-gathered KiB per step | max rel. param diff |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    bound = " (bound)" if r["all_gather_in_conditional"] else ""
    lines.append(f"| {r['schedule']} | {r['zero_stage']} | {r['gather'] if r['zero_stage'] == 3 else '—'} | "
                 f"{r['peak_bytes'] / 1024:.1f} | {r['temp_bytes'] / 1024:.1f} | {r['argument_bytes'] / 1024:.1f} | "
                 f"{r['all_gather_ops']} | {r['all_gather_bytes_per_step'] / 1024:.1f}{bound} | "
                 f"{r['max_rel_param_diff_vs_single']:.1e} |")
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
  memory_rows, zero_rows = [], []
  if not args.row:  # the sections of their own: activation memory at a fixed microbatch size, and ZeRO
    for schedule, p, m in (QUICK_MEMORY_GRID if args.quick else MEMORY_GRID):
      row = run_memory_row(schedule, p, m, optimizer)
      memory_rows.append(row)
      if not row["max_rel_param_diff_vs_single"] <= TOLERANCE:
        failures[f"memory:{schedule}:{p}:{m}"] = [f"parameters {row['max_rel_param_diff_vs_single']:.2e} from one "
                                                 "device's"]
      print(f"memory {schedule} P={p} M={m} (batch {m * MICRO_ROWS}): temp {row['temp_bytes'] / 1024:.1f} KiB, "
            f"param diff {row['max_rel_param_diff_vs_single']:.1e}", flush=True)
    failures.update(check_memory(memory_rows))
    for schedule, zero, gather in (QUICK_ZERO_GRID if args.quick else ZERO_GRID):
      row = run_zero_row(schedule, zero, gather, optimizer)
      zero_rows.append(row)
      if not row["max_rel_param_diff_vs_single"] <= TOLERANCE:
        failures[f"zero:{schedule}:{zero}:{gather}"] = [f"parameters {row['max_rel_param_diff_vs_single']:.2e} from "
                                                        "one device's"]
      print(f"zero {schedule} stage {zero} gather={gather}: peak {row['peak_bytes'] / 1024:.1f} KiB, all-gathered "
            f"{row['all_gather_bytes_per_step'] / 1024:.1f} KiB per step, param diff "
            f"{row['max_rel_param_diff_vs_single']:.1e}", flush=True)
  table = markdown(rows)
  print("\n" + table + "\n")
  if memory_rows:
    print(memory_markdown(memory_rows) + "\n")
  if zero_rows:
    print(zero_markdown(zero_rows) + "\n")
  os.makedirs(args.out, exist_ok=True)
  if rows:
    plot(rows, os.path.join(args.out, "pipeline.png"))
  seconds = time.perf_counter() - start
  out = {"model": {"in": IN, "width": WIDTH, "classes": CLASSES, "layers": LAYERS, "batch": BATCH, "steps": STEPS,
                   "optimizer": f"adam({LR})"},
         "tolerance": TOLERANCE, "rows": rows, "skipped": skipped, "failures": failures, "passed": not failures,
         "memory": {"micro_rows": MICRO_ROWS, "width": MEMORY_WIDTH, "rows": memory_rows,
                    "markdown": memory_markdown(memory_rows)},
         "zero": {"width": ZERO_WIDTH, "P": ZERO_P, "data": ZERO_DATA, "M": ZERO_M, "rows": zero_rows,
                  "markdown": zero_markdown(zero_rows)},
         "markdown": table, "machine": common.machine(), "seconds": seconds}
  common.write_json(os.path.join(args.out, "pipeline.json"), out)
  print(f"wrote {args.out}/pipeline.json and {args.out}/pipeline.png in {seconds:.0f} s; "
        + ("every row PASSES" if not failures else f"{len(failures)} row(s) FAIL"))
  common.publish(args, {"pipeline.json": "data/pipeline.json", "pipeline.png": "pipeline.png"})
  return out


if __name__ == "__main__":
  main()
