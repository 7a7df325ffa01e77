"""Throughput of the byte-level LM (experiments/train_lm.py) and the cost of gradient accumulation.

Two tables, from the same model and data as ``train_lm.py`` (defaults: 2
layers, d_model 64, seq-len 64, global batch 32 sequences):

* tokens/s of a training run at 1, 2, 4 and 8 simulated devices, same global
  batch (median step time over the steps after the first, which compiles);
* for ``accum_steps`` K = 1, 2, 4, 8 at the same global batch (default 128
  sequences, so that K = 8 still leaves 4 sequences per micro-batch) on 4 devices:
  the median step time, the time per real token relative to K = 1, and the
  all-reduce ops of the compiled step (``jaxdp.comm_report``).

The goals: the all-reduce count is flat in K, and time per token at K stays
within 10% of K = 1.

  python experiments/benchmark_lm.py              # sets JAX_NUM_CPU_DEVICES=8 itself
  python experiments/benchmark_lm.py --quick      # smoke run
  python experiments/benchmark_lm.py --publish    # full run, and copy benchmark_lm.json to docs/data/

Writes ``benchmark_lm.json`` under ``--out`` (default ``out/benchmark_lm``;
``out/benchmark_lm_quick`` with ``--quick``).

--quick: about 20 s on an idle 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":  # must happen before JAX initialises its backend
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxdp  # noqa: E402
from experiments import common, train_lm  # noqa: E402
from experiments.lm import corpus  # noqa: E402
from experiments.lm import model as lm  # noqa: E402


def _setup(config: train_lm.Config, devices, accum_steps: int, data):
  mesh = jaxdp.data_mesh(devices)
  graphdef, params = train_lm.make_model(config)
  optimizer = train_lm.make_optimizer(config)
  step = jaxdp.make_train_step(lm.make_loss_fn(graphdef), optimizer, mesh, accum_steps=accum_steps)
  pipeline = jaxdp.DataPipeline(data, corpus.make_collate(config.seq_len), mesh,
                                per_device_batch=config.batch_size // len(devices), seed=config.seed)
  return step, jaxdp.init_state(params, optimizer, mesh), pipeline


def time_steps(config: train_lm.Config, devices, accum_steps: int, steps: int, data) -> dict:
  """Median seconds per step and real tokens per step, over ``steps`` steps after one warm-up step."""
  print(f"[{len(devices)} device(s), accum_steps {accum_steps}] compiling and timing {steps} steps", file=sys.stderr,
        flush=True)
  step, state, pipeline = _setup(config, devices, accum_steps, data)
  rng = jax.random.key(config.seed)
  batches = [pipeline.batch_at(i) for i in range(steps + 1)]  # loaded up front: time the step, not the host
  tokens = [float(np.sum(weights)) for _, weights in batches[1:]]
  comm = jaxdp.comm_report(step, state, *batches[0], rng=rng)  # before the state is donated
  feed = iter(batches)

  def run():
    nonlocal state
    state, _ = step(state, *next(feed), rng=rng)
    jax.block_until_ready(state)

  times = common.time_steps(run, steps, warmup=1)
  return {
      "devices": len(devices), "accum_steps": accum_steps, "median_s": common.stats(times)["median"] / 1e3,
      "tokens_per_step": float(np.mean(tokens)),
      # From the median step, as the step ms column (a mean over the steps would mix in the slow outliers).
      "tokens_per_s": float(np.mean(tokens) / (common.stats(times)["median"] / 1e3)),
      "all_reduce_ops": comm["all-reduce"].count, "all_reduce_bytes": comm["all-reduce"].bytes,
  }


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--devices", default="1,2,4,8", help="device counts for the throughput table")
  p.add_argument("--accum", default="1,2,4,8", help="accum_steps values for the accumulation table")
  p.add_argument("--accum-devices", type=int, default=4)
  p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
  p.add_argument("--batch-size", type=int, default=32, help="global batch of the throughput table")
  p.add_argument("--accum-batch-size", type=int, default=128, help="global batch of the accumulation table")
  common.add_output_args(p, "out/benchmark_lm", quick="out/benchmark_lm_quick")
  p.add_argument("--quick", action="store_true", help="devices 1,2; accum 1,2; 3 steps")
  args = p.parse_args(argv)
  common.check_publish(p, args)
  if args.quick:
    args.devices, args.accum, args.steps, args.accum_devices, args.accum_batch_size = "1,2", "1,2", 3, 2, 32
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  config = train_lm.Config(batch_size=args.batch_size, dropout=0.1, progress=False, out=None)
  data, _ = train_lm.build_dataset(config)
  throughput = [time_steps(config, jax.devices()[:int(n)], 1, args.steps, data) for n in args.devices.split(",")]
  accum_config = train_lm.Config(batch_size=args.accum_batch_size, dropout=0.1, progress=False, out=None)
  accum_devices = jax.devices()[:args.accum_devices]
  accum = [time_steps(accum_config, accum_devices, int(k), args.steps, data) for k in args.accum.split(",")]
  base = accum[0]["median_s"] / accum[0]["tokens_per_step"]
  print(f"train_lm throughput, global batch {args.batch_size} x {config.seq_len} bytes, median of {args.steps} steps "
        f"({jax.device_count()} simulated {jax.devices()[0].platform} devices on {common.cpu_cores()} cores, jax {jax.__version__}):")
  print("| devices | step ms | tokens/s |\n|---:|---:|---:|")
  for r in throughput:
    print(f"| {r['devices']} | {1e3 * r['median_s']:.1f} | {r['tokens_per_s']:,.0f} |")
  print(f"\ngradient accumulation on {args.accum_devices} devices, global batch {args.accum_batch_size} for every K:")
  print("| accum_steps | step ms | time per token vs K=1 | all-reduce ops | bytes all-reduced |\n|---:|---:|---:|---:|---:|")
  for r in accum:
    rel = r["median_s"] / r["tokens_per_step"] / base
    r["time_per_token_vs_k1"] = rel
    print(f"| {r['accum_steps']} | {1e3 * r['median_s']:.1f} | {rel:.2f} | {r['all_reduce_ops']} | {r['all_reduce_bytes']:,} |")
  flat = len({r["all_reduce_ops"] for r in accum}) == 1
  within = all(r["time_per_token_vs_k1"] <= 1.10 for r in accum)
  print(f"\ngoal: all-reduce count flat in K: {'yes' if flat else 'NO'}; time per token within 10% of K=1: "
        f"{'yes' if within else 'NO'}")
  result = {"throughput": throughput, "accumulation": accum, "goals": {"flat_all_reduce": flat, "within_10pct": within}}
  path = common.write_json(os.path.join(args.out, "benchmark_lm.json"), result)
  print(f"wrote {path}")
  common.publish(args, {"benchmark_lm.json": "data/benchmark_lm.json"})
  return result


if __name__ == "__main__":
  main()
