"""Per-device memory, communication and step time of ZeRO stages 0-3, measured against the paper.

Model: MLP 256-1024-1024-10 (ReLU, 1.32M params), per-example softmax
cross-entropy, Adam, fp32. For each device count N (sub-mesh over
``jax.devices()[:N]``) and stage it measures, from the library's own reports:

* model-state bytes per device (``jaxdp.memory_report(...).model_state``:
  params + optimizer state + gradients), next to the formulas of Rajbhandari
  et al. (2020) with Psi params, fp32 and Adam (K = 8 bytes/param):
  stage 0 (4+4+8)Psi, 1 (4+4)Psi + 8Psi/N, 2 4Psi + (4+8)Psi/N, 3 16Psi/N;
* bytes each device sends per step (``jaxdp.comm_report``: ring traffic of the
  compiled HLO's collectives), in fp32 elements per Psi, next to theory;
* at the largest N, the median time of a step per stage;
* the widest square MLP (fixed depth) whose model state fits ``--budget-mb``
  MiB per device at each stage on the largest N: chosen from the formulas,
  verified with a measured ``memory_report`` of that size (compiled, not run).

Communication per step, in Psi elements sent per device (ring algorithms):
all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N each. DDP (stage 0)
all-reduces the gradient: 2(N-1)/N. Stage 1 here all-reduces the gradient
and all-gathers the updated params: 3(N-1)/N (the paper's stage 1 would
reduce-scatter instead). Stage 2 reduce-scatters and all-gathers: 2(N-1)/N.
Stage 3 in the paper all-gathers params for the forward pass, again for the
backward pass and reduce-scatters gradients: 3(N-1)/N; jaxdp gathers once
and keeps the params for the backward pass, so 2(N-1)/N (at the price of
holding the full params during the step).

Run from the repository root (sets ``JAX_NUM_CPU_DEVICES=8`` itself unless
already set; writes ``zero_memory.json`` and ``zero_memory.png`` under --out):

  .venv/bin/python experiments/zero_memory.py
  .venv/bin/python experiments/zero_memory.py --quick
  .venv/bin/python experiments/zero_memory.py --devices 2,8 --budget-mb 32 --out out/zero
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":  # must happen before JAX initialises its backend
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
import optax

import jaxdp
from experiments import common

LAYERS = (256, 1024, 1024, 10)
QUICK_LAYERS = (64, 256, 256, 10)
BATCH_PER_DEVICE = 32
DEPTH = 4  # square MLP for the budget question: DEPTH layers of width x width (+ bias)
MIB = 2**20
# ZeRO paper, fp32 with Adam: (replicated, sharded) bytes per param, so that per-device
# model state = replicated * Psi + sharded * Psi / N.
PAPER_BYTES = {0: (4 + 4 + 8, 0), 1: (4 + 4, 8), 2: (4, 4 + 8), 3: (0, 4 + 4 + 8)}
# Psi elements sent per device per step, as multiples of (N-1)/N.
COMM_PAPER = {0: 2, 1: 2, 2: 2, 3: 3}
COMM_JAXDP = {0: 2, 1: 3, 2: 2, 3: 2}


def paper_bytes(psi, n, stage) -> float:
  replicated, sharded = PAPER_BYTES[stage]
  return replicated * psi + sharded * psi / n


def padding_bound(layers, n, stage) -> float:
  """Most bytes padding can add per device: < 1 element per sharded fp32 array per leaf (+ Adam's int32 count)."""
  leaves = 2 * (len(layers) - 1)
  return PAPER_BYTES[stage][1] * leaves * (n - 1) / n + 4


def setup(layers, n, stage, optimizer):
  mesh = jaxdp.data_mesh(jax.devices()[:n])
  state = jaxdp.init_state(common.mlp_params(layers), optimizer, mesh, zero_stage=stage)
  step = jaxdp.make_train_step(common.mlp_loss, optimizer, mesh, zero_stage=stage)
  return step, state, common.mlp_batch(layers, n * BATCH_PER_DEVICE)


def measure(layers, n, stage, optimizer):
  """Memory and communication of one (N, stage), both read off the same compiled step."""
  step, state, batch = setup(layers, n, stage, optimizer)
  memory = jaxdp.memory_report(step, state, batch)
  comm = jaxdp.comm_report(step, state, batch)  # lower().compile() is cached: no second compile
  psi = common.param_count(layers)
  traffic = sum(c.traffic_bytes for c in comm.values()) / 4 / psi
  return {
      "n": n,
      "stage": stage,
      "model_state": memory.model_state,
      "params": memory.params,
      "opt_state": memory.opt_state,
      "grads": memory.grads,
      "formula": paper_bytes(psi, n, stage),
      "traffic_psi": traffic,
      "traffic_jaxdp_theory": COMM_JAXDP[stage] * (n - 1) / n,
      "traffic_paper_theory": COMM_PAPER[stage] * (n - 1) / n,
      "collectives": {k: c._asdict() for k, c in comm.items()},
  }, (step, state, batch)


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
  """The largest width whose formula bytes plus the padding bound fit ``budget_bytes`` (bisection)."""

  def fits(width):
    layers = square_layers(width)
    return paper_bytes(common.param_count(layers), n, stage) + padding_bound(layers, n, stage) <= budget_bytes

  low, high = 1, 2
  while fits(high):
    low, high = high, high * 2
  while high - low > 1:
    mid = (low + high) // 2
    low, high = (mid, high) if fits(mid) else (low, mid)
  return low


def budget_rows(budget_mb, n, optimizer):
  """Per stage: the widest square MLP that fits, its formula bytes and its measured model state."""
  rows = []
  for stage in jaxdp.ZERO_STAGES:
    width = widest_square_mlp(budget_mb * MIB, n, stage)
    layers = square_layers(width)
    step, state, _ = setup(layers, n, stage, optimizer)
    batch = common.mlp_batch(layers, n)  # one row per device: the memory question is the model state
    measured = jaxdp.memory_report(step, state, batch).model_state
    del state
    rows.append({
        "stage": stage, "width": width, "params": common.param_count(layers),
        "formula": paper_bytes(common.param_count(layers), n, stage), "measured": measured,
        "fits": measured <= budget_mb * MIB,
    })
  return rows


def plot(results, devices, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import NullFormatter, ScalarFormatter

  fig, (memory_ax, comm_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
  for stage in jaxdp.ZERO_STAGES:
    rows = [r for r in results if r["stage"] == stage]
    color = f"C{stage}"
    # The formula as a wide faint dashed band under the measurement: they coincide up to padding.
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


def markdown(results, devices, times, budget, budget_mb):
  n_max = max(devices)
  head = " | ".join(f"N={n}" for n in devices)
  lines = [
      f"Model state per device, MiB, measured (paper formula); traffic and time at N={n_max}:",
      "",
      f"| stage | {head} | sent per step (×Ψ) | vs stage 0 | step (ms) |",
      "|---|" + "---|" * len(devices) + "---|---|---|",
  ]
  by_key = {(r["stage"], r["n"]): r for r in results}
  base = by_key[0, n_max]["traffic_psi"]
  for stage in jaxdp.ZERO_STAGES:
    cells = " | ".join(f"{by_key[stage, n]['model_state'] / MIB:.2f} ({by_key[stage, n]['formula'] / MIB:.2f})" for n in devices)
    r = by_key[stage, n_max]
    ratio = r["traffic_psi"] / base if base else float("nan")
    lines.append(f"| {stage} | {cells} | {r['traffic_psi']:.3f} | {ratio:.2f}× | {times[stage] * 1e3:.1f} |")
  lines += [
      "",
      f"Widest square MLP ({DEPTH} layers of width × width + bias) whose model state fits {budget_mb} MiB per device, N={n_max}:",
      "",
      "| stage | width | params | formula (MiB) | measured (MiB) |",
      "|---|---|---|---|---|",
  ]
  lines += [
      f"| {b['stage']} | {b['width']} | {b['params'] / 1e6:.2f}M | {b['formula'] / MIB:.2f} | {b['measured'] / MIB:.2f} |"
      for b in budget
  ]
  return "\n".join(lines)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", help="comma-separated device counts (default 1,2,4,8; 2,8 with --quick)")
  parser.add_argument("--out", default="out/zero", help="output folder for zero_memory.json and zero_memory.png")
  parser.add_argument("--budget-mb", type=float, default=64, help="per-device model-state budget in MiB (default 64)")
  parser.add_argument("--steps", type=int, default=10, help="timed steps per stage (median reported)")
  parser.add_argument("--quick", action="store_true", help=f"smoke run: MLP {QUICK_LAYERS}, devices 2,8, 3 timed steps, budget/8")
  args = parser.parse_args(argv)
  devices = args.devices or ("2,8" if args.quick else "1,2,4,8")
  args.devices = sorted({int(d) for d in devices.split(",")})
  if max(args.devices) > jax.device_count():
    parser.error(f"--devices asks for {max(args.devices)} devices but {jax.device_count()} exist; set JAX_NUM_CPU_DEVICES.")
  if args.quick:
    args.steps, args.budget_mb = 3, args.budget_mb / 8
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  layers = QUICK_LAYERS if args.quick else LAYERS
  optimizer = optax.adam(1e-3)
  psi = common.param_count(layers)
  print(f"MLP {layers}: Psi = {psi:,} params; Adam, fp32; devices {args.devices}")
  results, compiled = [], {}
  for n in args.devices:
    for stage in jaxdp.ZERO_STAGES:
      row, compiled[stage, n] = measure(layers, n, stage, optimizer)
      results.append(row)
      print(
          f"N={n} stage {stage}: model state {row['model_state'] / MIB:8.3f} MiB (paper {row['formula'] / MIB:8.3f}, "
          f"+{(row['model_state'] / row['formula'] - 1) * 100:.3f}%); sent/step {row['traffic_psi']:.3f} Psi "
          f"(jaxdp theory {row['traffic_jaxdp_theory']:.3f}, paper {row['traffic_paper_theory']:.3f})",
          flush=True,
      )
  n_max = max(args.devices)
  times = {stage: time_steps(*compiled[stage, n_max], args.steps) for stage in jaxdp.ZERO_STAGES}
  for stage, t in times.items():
    print(f"N={n_max} stage {stage}: median step {t * 1e3:.1f} ms over {args.steps} steps")
  budget = budget_rows(args.budget_mb, n_max, optimizer)
  for b in budget:
    print(f"budget {args.budget_mb} MiB, N={n_max}, stage {b['stage']}: width {b['width']} ({b['params']:,} params), "
          f"formula {b['formula'] / MIB:.2f} MiB, measured {b['measured'] / MIB:.2f} MiB, fits: {b['fits']}")
  by_key = {(r["stage"], r["n"]): r for r in results}
  goals = {
      "stage3_over_stage0_memory": by_key[3, n_max]["model_state"] / by_key[0, n_max]["model_state"],
      **{f"stage{s}_over_stage0_comm": by_key[s, n_max]["traffic_psi"] / by_key[0, n_max]["traffic_psi"]
         for s in (1, 2, 3) if by_key[0, n_max]["traffic_psi"]},
  }
  print(f"goals at N={n_max}: " + ", ".join(f"{k} {v:.4f}" for k, v in goals.items()))
  table = markdown(results, args.devices, times, budget, args.budget_mb)
  print("\n" + table + "\n")
  os.makedirs(args.out, exist_ok=True)
  plot(results, args.devices, os.path.join(args.out, "zero_memory.png"))
  out = {"layers": layers, "psi": psi, "devices": args.devices, "results": results, "step_seconds": times,
         "budget_mb": args.budget_mb, "budget": budget, "goals": goals, "markdown": table}
  common.write_json(os.path.join(args.out, "zero_memory.json"), out)
  print(f"wrote {args.out}/zero_memory.json and {args.out}/zero_memory.png")
  return out


if __name__ == "__main__":
  main()
