"""The numerical cost of bfloat16: train_lm in float32 against bfloat16 compute and bfloat16 reduction.

Three runs of ``experiments/train_lm.py`` from one init on one data order
(4 simulated devices, dropout 0, the default model and 150 steps): float32
throughout; bfloat16 forward/backward with float32 master params and a
float32 all-reduce; bfloat16 forward/backward *and* a bfloat16 all-reduce of
the gradient (half the bytes). The loss, weights and the weighted-mean
division stay float32 in every run. Writes ``precision.json`` and
``precision.png`` under ``--out`` (default ``out/precision``); ``--publish``
also copies them to ``docs/precision.png`` and ``docs/data/precision.json``.

  python experiments/precision.py [--steps 150] [--out out/precision]
  python experiments/precision.py --quick   # 20 steps on a 200 kB corpus

--quick: about 18 s on an idle 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys

if __name__ == "__main__":  # before JAX initialises its backend
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments import common, train_lm  # noqa: E402

FULL = {"steps": 150, "max_bytes": 1_000_000}
QUICK = {"steps": 20, "max_bytes": 200_000}

RUNS = (
    ("float32", "float32", "float32"),
    ("bf16 compute", "bfloat16", "float32"),
    ("bf16 compute + bf16 all-reduce", "bfloat16", "bfloat16"),
)
"""(name, compute dtype, gradient all-reduce dtype)."""


def compare(config: train_lm.Config) -> dict:
  """Trains every run of :data:`RUNS`; returns per-step losses, validation losses and gaps to float32."""
  config = dataclasses.replace(config, dropout=0.0, out=None, ckpt_dir=None)
  data = train_lm.build_dataset(config)
  runs = {}
  for name, compute, reduce in RUNS:
    run = train_lm.train(dataclasses.replace(config, compute_dtype=compute, grad_reduce_dtype=reduce), data=data, desc=name)
    runs[name] = {"loss": [r["loss"] for r in run["records"]], "val_loss": run["summary"]["val_loss"],
                  "tokens_per_s": run["summary"]["tokens_per_s"]}
  base = np.array(runs["float32"]["loss"])
  for run in runs.values():
    loss = np.array(run["loss"])
    run["max_abs_loss_diff_vs_float32"] = float(np.max(np.abs(loss - base)))
    run["final_loss_diff_vs_float32"] = float(loss[-1] - base[-1])
  return runs


def plot(runs: dict, path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  base = np.array(runs["float32"]["loss"])
  for (name, run), style, color in zip(runs.items(), ("-", "--", ":"), ("C0", "C1", "C2")):
    left.plot(run["loss"], style, color=color, label=name)
    if name != "float32":
      right.plot(np.array(run["loss"]) - base, style, color=color, label=name)
  left.set(xlabel="step", ylabel="train loss (nats/byte)", title="byte-level LM, 4 devices")
  right.set(xlabel="step", ylabel="loss − float32 loss", title="cost of bfloat16")
  right.axhline(0, color="gray", lw=0.8)
  left.legend(), right.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help=f"smoke run; defaults become {QUICK}")
  p.add_argument("--steps", type=int, help=f"training steps per run (default {FULL['steps']})")
  p.add_argument("--max-bytes", type=int, help=f"corpus budget in bytes (default {FULL['max_bytes']})")
  p.add_argument("--devices", type=int, default=4)
  p.add_argument("--no-progress", dest="progress", action="store_false")
  common.add_output_args(p, "out/precision", quick="out/precision_quick")
  args = p.parse_args(argv)
  common.check_publish(p, args)
  common.fill_defaults(args, FULL, QUICK)
  config = train_lm.Config(devices=args.devices, steps=args.steps, max_bytes=args.max_bytes, progress=args.progress)
  runs = compare(config)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "precision.json").write_text(json.dumps(runs, indent=2) + "\n")
  plot(runs, out / "precision.png")
  for name, run in runs.items():
    print(f"{name:>32}: final train loss {run['loss'][-1]:.4f}, val loss {run['val_loss']:.4f}, "
          f"max |Δ loss| vs float32 {run['max_abs_loss_diff_vs_float32']:.2e}, {run['tokens_per_s']:.0f} tokens/s")
  common.publish(args, {"precision.png": "precision.png", "precision.json": "data/precision.json"})
  return runs


if __name__ == "__main__":
  main()
