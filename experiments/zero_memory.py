"""Per-device memory, communication and step time of ZeRO stages 0-3, measured against the paper.

Model: MLP 256-1024-1024-10 (ReLU, 1.32M params), per-example softmax
cross-entropy, Adam, fp32. Every width divides by 8 except the 10-class head,
so at N = 8 every leaf splits except the head's bias ``layer2.b`` (10
elements): jaxdp splits each leaf along one dimension that divides by N
(``jaxdp.sharding.layout.zero_dim``) and keeps a leaf with none whole on every device
(no padding). For each device count N (sub-mesh over ``jax.devices()[:N]``)
and stage it measures, from the library's own reports:

* model-state bytes per device (``jaxdp.memory_report(...).training_state``:
  params + optimizer state + gradients), next to the formulas of Rajbhandari
  et al. (2020) with Psi params, fp32 and Adam (K = 8 bytes/param):
  stage 0 (4+4+8)Psi, 1 (4+4)Psi + 8Psi/N, 2 4Psi + (4+8)Psi/N, 3 16Psi/N,
  applied to the parameters of leaves that split, the others counted whole
  (``jaxdp.analysis.scaling.memory_per_device(..., split_params=...)``), and the bytes
  of the leaves that stay whole (``memory_report(...).unsplit``);
* the collectives of the compiled step (``jaxdp.comm_report``): ops and
  bytes per kind, and the bytes each device sends per step (ring traffic),
  next to ``jaxdp.analysis.scaling.collectives``, the model of jaxdp's schedule;
* at the largest N, the median time of a step per stage;
* the widest square MLP (fixed depth, width a multiple of N so that every
  leaf splits) whose model state fits ``--budget-mb`` MiB per device at each
  stage on the largest N: chosen from the formulas, verified with a measured
  ``memory_report`` of that size (compiled, not run);
* with 8 devices, the same memory and communication on a ("data", "model")
  mesh of 4 x 2 (tensor-parallel MLP, Megatron-style: first layer's weight
  P(None, "model") and bias P("model"), second layer's weight P("model",
  None); the head replicated over "model"), next to the model of the data
  axis alone applied to each device's tensor-parallel shard;
* the peak host memory of checkpoint save and restore at stage 3 on 8
  devices, as one process and as a 2-process ``jax.distributed`` job
  (``experiments/checkpoint_memory.py``, each operation in fresh processes;
  ``--checkpoint-processes``).

Communication per step, in Psi elements sent per device (ring algorithms):
all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N each. DDP (stage 0)
all-reduces the gradient: 2(N-1)/N. Stage 1 here all-reduces the gradient
and XLA all-gathers the updated params: 3(N-1)/N (the paper's stage 1 would
reduce-scatter instead). Stage 2 reduce-scatters and all-gathers: 2(N-1)/N.
Stage 3 in the paper all-gathers params for the forward pass, again for the
backward pass and reduce-scatters gradients: 3(N-1)/N; jaxdp gathers once
and keeps the params for the backward pass, so 2(N-1)/N (at the price of
holding the full params during the step). Leaves that stay whole are
all-reduced at every stage. Stages 2-3 also all-reduce a few scalars: the
loss and weight sums and one partial sum of squares per split leaf for the
update's global gradient norm.

The goals (N = 8, the 1-D data mesh), reported PASS/FAIL as measured: stage 3
holds <= 1/7 of stage 0's model state; stage 2 sends stage 0's bytes within
5%; stage 3 sends <= 1.6x stage 0's.

Run from the repository root (sets ``JAX_NUM_CPU_DEVICES=8`` itself unless
already set; writes ``zero_memory.json`` and ``zero_memory.png`` under --out,
default ``out/zero``; ``--publish`` also copies both to ``docs/``):

  .venv/bin/python experiments/zero_memory.py
  .venv/bin/python experiments/zero_memory.py --quick
  .venv/bin/python experiments/zero_memory.py --devices 2,8 --budget-mb 32 --out out/zero

--quick: about 22 s on an idle 2-core CPU machine.
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
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

import jaxdp
from experiments import checkpoint_memory, common
from jaxdp.analysis import scaling
from jaxdp.sharding.layout import ZERO_STAGES

LAYERS = (256, 1024, 1024, 10)
QUICK_LAYERS = (64, 256, 256, 10)
BATCH_PER_DEVICE = 32
DEPTH = 4  # square MLP for the budget question: DEPTH layers of width x width (+ bias)
MIB = 2**20
TP_SHAPE = (4, 2)  # ("data", "model")
PRECISION = scaling.FP32_ADAM
SCALAR_BYTES = 8  # Σ w·l and Σ w, all-reduced with the gradient (alone at stages 2-3)
# Psi elements sent per device per step, as multiples of (N-1)/N.
COMM_PAPER = {0: 2, 1: 2, 2: 2, 3: 3}
COMM_JAXDP = {0: 2, 1: 3, 2: 2, 3: 2}
GOALS = {  # name: (description, measured value -> passes)
    "stage3_memory": ("stage 3 model state <= 1/7 of stage 0's", lambda r: r <= 1 / 7),
    "stage2_comm": ("stage 2 sends stage 0's bytes within 5%", lambda r: abs(r - 1) <= 0.05),
    "stage3_comm": ("stage 3 sends <= 1.6x stage 0's bytes", lambda r: r <= 1.6),
}


def shapes(layers):
  return jax.eval_shape(lambda: common.mlp_params(layers))


def split_of(layers, n, specs=None):
  """``(Psi_s, split leaves)`` of the MLP over ``n`` data-parallel devices (model-split dimensions excluded)."""
  return scaling.split_params_of(shapes(layers), n, specs)


def formula_bytes(layers, n, stage) -> float:
  """The ZeRO paper's model state per device, for the leaves that split; the others whole."""
  psi = common.param_count(layers)
  # The persistent state only (schedule="paper"): what memory_report's training_state measures.
  return scaling.memory_per_device(psi, n, stage, PRECISION, split_params=split_of(layers, n)[0], schedule="paper")


def model_collectives(psi, split, leaves, n, stage, model_axis=False):
  """jaxdp's schedule (``jaxdp.analysis.scaling.collectives``): ``{kind: (bytes, ring traffic)}``.

  ``model_axis``: the mesh has a model axis left to the compiler, so stage 0 sums the norm on every
  device instead of all-reducing partial sums (see ``jaxdp.training.reduction.global_norm``).
  """
  ops = scaling.collectives(psi, n, stage, PRECISION, split_params=split, scalar_bytes=SCALAR_BYTES,
                            norm_bytes=scaling.jaxdp_norm_bytes(stage, leaves, model_axis=model_axis))
  return {kind: (sum(op.nbytes for op in ops if op.kind == kind),
                 sum(scaling.ring_traffic(kind, op.nbytes, n) for op in ops if op.kind == kind))
          for kind in scaling.KINDS}


def setup(layers, n, stage, optimizer):
  dp = jaxdp.data_parallel(jaxdp.data_mesh(jax.devices()[:n]), zero_stage=stage)
  state = jaxdp.init_state(common.mlp_params(layers), optimizer, dp)
  step = jaxdp.make_train_step(common.mlp_loss, optimizer, dp)
  return step, state, common.mlp_batch(layers, n * BATCH_PER_DEVICE)


def _comm_fields(comm):
  return {
      "collectives": {k: c._asdict() for k, c in comm.items()},
      "traffic_bytes": sum(c.traffic_bytes for c in comm.values()),
  }


def _memory_fields(memory):
  # The JSON keeps 0.1's field name "model_state" for MemoryReport.training_state.
  return {
      "model_state": memory.training_state, "params": memory.params, "opt_state": memory.opt_state,
      "grads": memory.grads, "temp": memory.temp, "unsplit": dict(memory.unsplit),
      "unsplit_bytes": sum(memory.unsplit.values()),
  }


def measure(layers, n, stage, optimizer):
  """Memory and communication of one (N, stage), both read off the same compiled step."""
  step, state, batch = setup(layers, n, stage, optimizer)
  memory = jaxdp.memory_report(step, state, batch)
  comm = jaxdp.comm_report(step, state, batch)
  psi = common.param_count(layers)
  split, leaves = split_of(layers, n)
  row = {"n": n, "stage": stage, **_memory_fields(memory), **_comm_fields(comm),
         "formula": formula_bytes(layers, n, stage), "split_params": split, "split_leaves": leaves,
         "traffic_jaxdp_theory": COMM_JAXDP[stage] * (n - 1) / n,
         "traffic_paper_theory": COMM_PAPER[stage] * (n - 1) / n,
         "model": model_collectives(psi, split, leaves, n, stage)}
  row["traffic_psi"] = row["traffic_bytes"] / 4 / psi
  row["model_traffic_bytes"] = sum(t for _, t in row["model"].values())
  return row, (step, state, batch)


# --------------------------------------------------------------------------
# Tensor parallelism: a ("data", "model") mesh.
# --------------------------------------------------------------------------


def tp_specs(layers):
  """Megatron's MLP block on the first two layers (column- then row-parallel); the rest replicated."""
  specs = {f"layer{i}": {"w": P(), "b": P()} for i in range(len(layers) - 1)}
  specs["layer0"] = {"w": P(None, "model"), "b": P("model")}
  specs["layer1"] = {"w": P("model", None), "b": P()}
  return specs


def tp_local_shapes(layers, model_size):
  """Each device's tensor-parallel shard of the params (what the data axis then splits or reduces)."""
  specs = tp_specs(layers)

  def local(x, spec):
    entries = tuple(spec) + (None,) * (len(x.shape) - len(spec))
    return jax.ShapeDtypeStruct(tuple(d // model_size if e else d for d, e in zip(x.shape, entries)), x.dtype)

  return jax.tree.map(local, shapes(layers), specs)


def measure_tp(layers, stage, optimizer):
  mesh = Mesh(np.array(jax.devices()[: np.prod(TP_SHAPE)]).reshape(TP_SHAPE), ("data", "model"))
  n_data, n_model = TP_SHAPE
  specs = tp_specs(layers)
  dp = jaxdp.data_parallel(mesh, zero_stage=stage, param_specs=specs)
  state = jaxdp.init_state(common.mlp_params(layers), optimizer, dp)
  step = jaxdp.make_train_step(common.mlp_loss, optimizer, dp)
  batch = common.mlp_batch(layers, n_data * BATCH_PER_DEVICE)
  memory = jaxdp.memory_report(step, state, batch)
  comm = jaxdp.comm_report(step, state, batch)
  local = tp_local_shapes(layers, n_model)
  psi_local = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(local))
  split, leaves = scaling.split_params_of(local, n_data, specs)
  return {"stage": stage, **_memory_fields(memory), **_comm_fields(comm), "psi_local": psi_local,
          "split_params": split, "split_leaves": leaves,
          "model": model_collectives(psi_local, split, leaves, n_data, stage, model_axis=True)}


# --------------------------------------------------------------------------
# Timing and the budget question.
# --------------------------------------------------------------------------


def time_steps(step, state, batch, steps, warmup=2) -> float:
  """Median seconds per step after ``warmup`` steps (the first compiles, or reuses the compiled step)."""

  def run():
    nonlocal state
    state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))

  return common.stats(common.time_steps(run, steps, warmup))["median"] / 1e3


def square_layers(width):
  return (width,) * (DEPTH + 1)


def widest_square_mlp(budget_bytes, n, stage) -> int:
  """The largest width, a multiple of ``n`` (every leaf splits), whose formula bytes fit (bisection).

  4 bytes are kept for Adam's step count, a scalar held whole on every device.
  """

  def fits(width):
    return formula_bytes(square_layers(width), n, stage) + 4 <= budget_bytes

  low, high = 1, 2  # in units of n
  while fits(high * n):
    low, high = high, high * 2
  while high - low > 1:
    mid = (low + high) // 2
    low, high = (mid, high) if fits(mid * n) else (low, mid)
  return low * n


def budget_rows(budget_mb, n, optimizer):
  """Per stage: the widest square MLP that fits, its formula bytes and its measured model state."""
  rows = []
  for stage in ZERO_STAGES:
    width = widest_square_mlp(budget_mb * MIB, n, stage)
    layers = square_layers(width)
    step, state, _ = setup(layers, n, stage, optimizer)
    batch = common.mlp_batch(layers, n)  # one row per device: the memory question is the model state
    measured = jaxdp.memory_report(step, state, batch).training_state
    del state
    rows.append({
        "stage": stage, "width": width, "params": common.param_count(layers),
        "formula": formula_bytes(layers, n, stage), "measured": measured,
        "fits": measured <= budget_mb * MIB,
    })
  return rows


# --------------------------------------------------------------------------
# Output.
# --------------------------------------------------------------------------


def plot(results, devices, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import NullFormatter, ScalarFormatter

  fig, (memory_ax, comm_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
  for stage in ZERO_STAGES:
    rows = [r for r in results if r["stage"] == stage]
    color = f"C{stage}"
    # The formula as a wide faint dashed band under the measurement: they coincide (+4 bytes of step count).
    memory_ax.plot(devices, [r["formula"] / MIB for r in rows], "--", color=color, lw=4, alpha=0.35, label=f"stage {stage} paper")
    memory_ax.plot(devices, [r["model_state"] / MIB for r in rows], "o-", color=color, ms=4, label=f"stage {stage} measured")
    jitter = 1 + 0.02 * (stage - 1.5)  # stages with equal traffic would hide each other
    comm_ax.plot([d * jitter for d in devices], [r["traffic_psi"] for r in rows], "o-", color=color, ms=4,
                 label=f"stage {stage} measured")
  ns = np.geomspace(min(devices), max(devices), 50)
  comm_ax.plot(ns, 2 * (ns - 1) / ns, "k--", lw=1, label="2(N-1)/N: ring all-reduce, paper stages 0-2")
  comm_ax.plot(ns, 3 * (ns - 1) / ns, "k:", lw=1.5, label="3(N-1)/N: paper stage 3 (jaxdp stage 1)")
  memory_ax.set(yscale="log", ylabel="model state per device (MiB)", title="params + Adam state + grads, fp32")
  comm_ax.set(ylabel="elements sent per device per step / Psi", title="communication (ring traffic of the HLO)")
  for ax in (memory_ax, comm_ax):
    ax.set_xscale("log", base=2)
    ax.set_xticks(devices, [str(d) for d in devices])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("devices N")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if ax is memory_ax else 1)
  memory_ax.yaxis.set_major_formatter(ScalarFormatter())
  memory_ax.yaxis.set_minor_formatter(ScalarFormatter())
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _kinds(collectives):
  return " | ".join(f"{collectives[k]['count']} / {collectives[k]['bytes']:,}" for k in scaling.KINDS)


def _unsplit_names(unsplit):
  return ", ".join(f"{k} ({v:,} B)" for k, v in unsplit.items()) or "none"


def markdown(results, devices, times, budget, budget_mb, tp, goals, layers):
  n_max = max(devices)
  head = " | ".join(f"N={n}" for n in devices)
  by_key = {(r["stage"], r["n"]): r for r in results}
  lines = [
      f"Model state per device, MiB, measured (paper formula, leaves that stay whole counted whole); bytes of "
      f"the leaves that stay whole, traffic and time at N={n_max}:",
      "",
      f"| stage | {head} | unsplit at N={n_max} (bytes) | sent per step (×Ψ) | vs stage 0 | step (ms) |",
      "|---|" + "---|" * len(devices) + "---|---|---|---|",
  ]
  base = by_key[0, n_max]["traffic_psi"]
  for stage in ZERO_STAGES:
    cells = " | ".join(f"{by_key[stage, n]['model_state'] / MIB:.2f} ({by_key[stage, n]['formula'] / MIB:.2f})" for n in devices)
    r = by_key[stage, n_max]
    ratio = r["traffic_psi"] / base if base else float("nan")
    lines.append(f"| {stage} | {cells} | {r['unsplit_bytes']:,} | {r['traffic_psi']:.3f} | {ratio:.2f}× | "
                 f"{times[stage] * 1e3:.1f} |")
  split, leaves = by_key[0, n_max]["split_params"], by_key[0, n_max]["split_leaves"]
  psi = common.param_count(layers)
  lines += [
      "",
      f"Leaves that stay whole at N={n_max} (no dimension divides by {n_max}): "
      f"{_unsplit_names(by_key[3, n_max]['unsplit'])} at stage 3 (params and Adam moments; stages 1-2: the "
      f"moments only). {split:,} of the Ψ = {psi:,} parameters ({leaves} of {len(jax.tree.leaves(shapes(layers)))} "
      "leaves) split.",
      "",
      f"Collectives of the compiled step at N={n_max} (`jaxdp.comm_report`), ops / bytes per kind (bytes: the "
      "all-reduced arrays, reduce-scatter inputs, all-gather outputs), and the bytes each device sends (ring), "
      "measured and as `jaxdp.analysis.scaling.collectives` models them:",
      "",
      "| stage | all-reduce | reduce-scatter | all-gather | sent (MiB) | model sent (MiB) | vs stage 0 |",
      "|---|---|---|---|---|---|---|",
  ]
  base_bytes = by_key[0, n_max]["traffic_bytes"]
  for stage in ZERO_STAGES:
    r = by_key[stage, n_max]
    lines.append(f"| {stage} | {_kinds(r['collectives'])} | {r['traffic_bytes'] / MIB:.4f} | "
                 f"{r['model_traffic_bytes'] / MIB:.4f} | {r['traffic_bytes'] / base_bytes:.4f}× |")
  lines += [
      "",
      f"Widest square MLP ({DEPTH} layers of width × width + bias, width a multiple of {n_max}) whose model "
      f"state fits {budget_mb} MiB per device, N={n_max}:",
      "",
      "| stage | width | params | formula (MiB) | measured (MiB) |",
      "|---|---|---|---|---|",
  ]
  lines += [
      f"| {b['stage']} | {b['width']} | {b['params'] / 1e6:.2f}M | {b['formula'] / MIB:.2f} | {b['measured'] / MIB:.2f} |"
      for b in budget
  ]
  if tp:
    d, m = TP_SHAPE
    t0 = tp[0]
    lines += [
        "",
        f"DP × TP: mesh ('data', 'model') = {d} × {m}, tensor-parallel MLP (layer0 w P(None,'model'), "
        f"b P('model'); layer1 w P('model',None); head replicated over 'model'); {t0['psi_local']:,} params per "
        f"device's model shard. Memory per device (MiB) and collectives (ops / bytes); 'model data-axis bytes' is "
        f"`jaxdp.analysis.scaling.collectives` on the model shard over the {d} data replicas (all-reduce / reduce-scatter / "
        "all-gather; the model axis's activation all-reduce is not modelled). 'sent' is `comm_report`'s ring "
        f"traffic, each op over its own device group (the {d} data replicas, or the {m}-device model axis for "
        "the activations' all-reduce):",
        "",
        "| stage | params | opt state | grads | model state | vs stage 0 | unsplit (bytes) | all-reduce | "
        "reduce-scatter | all-gather | model data-axis bytes | sent (MiB) | vs stage 0 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in tp:
      model = " / ".join(f"{r['model'][k][0]:,}" for k in scaling.KINDS)
      lines.append(
          f"| {r['stage']} | {r['params'] / MIB:.2f} | {r['opt_state'] / MIB:.2f} | {r['grads'] / MIB:.2f} | "
          f"{r['model_state'] / MIB:.2f} | {r['model_state'] / t0['model_state']:.3f}× | {r['unsplit_bytes']:,} | "
          f"{_kinds(r['collectives'])} | {model} | {r['traffic_bytes'] / MIB:.3f} | "
          f"{r['traffic_bytes'] / t0['traffic_bytes']:.2f}× |")
    lines += ["", f"Leaves that stay whole over 'data' at stage 3: {_unsplit_names(tp[3]['unsplit'])}."]
  lines += ["", f"Goals at N={n_max} (1-D data mesh):"]
  lines += [f"- {GOALS[k][0]}: {v:.4f} — **{'PASS' if GOALS[k][1](v) else 'FAIL'}**" for k, v in goals.items()]
  return "\n".join(lines)


def checkpoint_markdown(checkpoints) -> str:
  """The peak host memory of each checkpoint operation per process count (``checkpoint_memory.measure`` rows)."""
  first = next(iter(checkpoints.values()))
  lines = [
      f"Peak host memory of a checkpoint (`experiments/checkpoint_memory.py`): ZeRO stage 3 on 8 devices, state "
      f"{first[0]['state_bytes'] / MIB:.0f} MiB; peak RSS growth of the worst process, MiB (× what each process "
      "holds):",
      "",
      "| processes | held per process (MiB) | " + " | ".join(r["operation"] for r in first) + " |",
      "|---|---|" + "---|" * len(first),
  ]
  for processes, rows in checkpoints.items():
    own = rows[0]["process_bytes"]
    cells = " | ".join(f"{r['peak_rss_increase'] / MIB:.0f} ({r['peak_rss_increase'] / own:.2f}×)" for r in rows)
    lines.append(f"| {processes} | {own / MIB:.0f} | {cells} |")
  return "\n".join(lines)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", help="comma-separated device counts (default 1,2,4,8; 2,8 with --quick)")
  common.add_output_args(parser, "out/zero", quick="out/zero_quick")
  parser.add_argument("--budget-mb", type=float, default=64, help="per-device model-state budget in MiB (default 64)")
  parser.add_argument("--steps", type=int, default=10, help="timed steps per stage (median reported)")
  parser.add_argument("--quick", action="store_true", help=f"smoke run: MLP {QUICK_LAYERS}, devices 2,8, 3 timed steps, budget/8")
  parser.add_argument("--checkpoint-processes", default=None,
                      help="process counts for the checkpoint host-memory table (experiments/checkpoint_memory.py; "
                           "default 1,2; none with --quick; '' to skip)")
  args = parser.parse_args(argv)
  common.check_publish(parser, args)
  if args.checkpoint_processes is None:
    args.checkpoint_processes = "" if args.quick else "1,2"
  args.checkpoint_processes = [int(p) for p in args.checkpoint_processes.split(",") if p]
  devices = args.devices or ("2,8" if args.quick else "1,2,4,8")
  args.devices = sorted({int(d) for d in devices.split(",")})
  if max(args.devices) > jax.device_count():
    parser.error(f"--devices asks for {max(args.devices)} devices but {jax.device_count()} exist; set JAX_NUM_CPU_DEVICES.")
  if args.quick:
    args.steps, args.budget_mb = 3, args.budget_mb / 8
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  start = time.perf_counter()
  layers = QUICK_LAYERS if args.quick else LAYERS
  optimizer = optax.adam(1e-3)
  psi = common.param_count(layers)
  print(f"MLP {layers}: Psi = {psi:,} params; Adam, fp32; devices {args.devices}")
  results, compiled = [], {}
  for n in args.devices:
    for stage in ZERO_STAGES:
      row, compiled[stage, n] = measure(layers, n, stage, optimizer)
      results.append(row)
      print(
          f"N={n} stage {stage}: model state {row['model_state'] / MIB:8.3f} MiB (paper {row['formula'] / MIB:8.3f}, "
          f"+{(row['model_state'] / row['formula'] - 1) * 100:.3f}%), unsplit {row['unsplit_bytes']} B; sent/step "
          f"{row['traffic_psi']:.4f} Psi (model {row['model_traffic_bytes'] / 4 / psi:.4f}; all split: jaxdp "
          f"{row['traffic_jaxdp_theory']:.3f}, paper {row['traffic_paper_theory']:.3f})",
          flush=True,
      )
  n_max = max(args.devices)
  print(f"timing {args.steps} steps per stage on N={n_max}", flush=True)
  times = {stage: time_steps(*compiled[stage, n_max], args.steps) for stage in ZERO_STAGES}
  compiled.clear()
  for stage, t in times.items():
    print(f"N={n_max} stage {stage}: median step {t * 1e3:.1f} ms over {args.steps} steps")
  budget = budget_rows(args.budget_mb, n_max, optimizer)
  for b in budget:
    print(f"budget {args.budget_mb} MiB, N={n_max}, stage {b['stage']}: width {b['width']} ({b['params']:,} params), "
          f"formula {b['formula'] / MIB:.2f} MiB, measured {b['measured'] / MIB:.2f} MiB, fits: {b['fits']}")
  tp = []
  if jax.device_count() >= np.prod(TP_SHAPE):
    tp = [measure_tp(layers, stage, optimizer) for stage in ZERO_STAGES]
    for r in tp:
      print(f"DPxTP {TP_SHAPE} stage {r['stage']}: model state {r['model_state'] / MIB:.3f} MiB, sent/step "
            f"{r['traffic_bytes'] / MIB:.3f} MiB, " + ", ".join(
                f"{k} {c['count']} ops {c['bytes']:,} B (model data axis {r['model'][k][0]:,})"
                for k, c in r["collectives"].items()), flush=True)
  checkpoints = {}
  for processes in args.checkpoint_processes:
    checkpoints[processes] = checkpoint_memory.measure(processes=processes)
    print(f"checkpoint, {processes} process(es): " + ", ".join(
        f"{r['operation']} +{r['peak_rss_increase'] / MIB:.0f} MiB" for r in checkpoints[processes]), flush=True)
  by_key = {(r["stage"], r["n"]): r for r in results}
  base = by_key[0, n_max]
  goals = {
      "stage3_memory": by_key[3, n_max]["model_state"] / base["model_state"],
      "stage2_comm": by_key[2, n_max]["traffic_bytes"] / base["traffic_bytes"] if base["traffic_bytes"] else float("nan"),
      "stage3_comm": by_key[3, n_max]["traffic_bytes"] / base["traffic_bytes"] if base["traffic_bytes"] else float("nan"),
  }
  passed = {k: bool(GOALS[k][1](v)) for k, v in goals.items()}
  table = markdown(results, args.devices, times, budget, args.budget_mb, tp, goals, layers)
  if checkpoints:
    table += "\n\n" + checkpoint_markdown(checkpoints)
  print("\n" + table + "\n")
  os.makedirs(args.out, exist_ok=True)
  plot(results, args.devices, os.path.join(args.out, "zero_memory.png"))
  seconds = time.perf_counter() - start
  out = {"layers": layers, "psi": psi, "devices": args.devices, "results": results, "step_seconds": times,
         "budget_mb": args.budget_mb, "budget": budget, "tp_mesh": TP_SHAPE, "tp": tp, "goals": goals,
         "passed": passed, "checkpoints": checkpoints, "markdown": table, "seconds": seconds}
  common.write_json(os.path.join(args.out, "zero_memory.json"), out)
  print(f"wrote {args.out}/zero_memory.json and {args.out}/zero_memory.png in {seconds:.0f} s")
  common.publish(args, {"zero_memory.json": "zero_memory.json", "zero_memory.png": "zero_memory.png"})
  return out


if __name__ == "__main__":
  main()
