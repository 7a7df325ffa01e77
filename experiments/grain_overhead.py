"""The grain adapter's cost against DataPipeline on the LM experiment: ms per training step, and per batch alone.

The model, corpus, collate, optimizer and step are experiments/train_lm.py's (its --quick sizes by default).
Two inputs deliver the same number of examples a step: ``DataPipeline`` over the list of chunks, and
``jaxdp.io.grain.GrainPipeline`` over ``grain.MapDataset.source(chunks).shuffle(seed)`` (this process's
shard, ``process_shard``). Interleaved in one process, in rounds of a new order each:

* ``step``: ``steps`` training steps fed by the input, chained, synced at the end of the round;
* ``batch``: the input alone, ``steps`` batches drawn and placed (no step).

``GrainPipeline`` reads through grain's default iterator (16 prefetch threads, 500 examples ahead);
``GrainPipeline(threads=0)`` with ``read_options=grain.ReadOptions(num_threads=0)`` (in the calling thread).

A method's figure is its best round's mean (the machine is shared; the best round is the least disturbed).

  .venv/bin/python experiments/grain_overhead.py            # 4 devices, 5 rounds of 30 steps
  .venv/bin/python experiments/grain_overhead.py --quick    # a smaller model, 2 rounds of 5 steps (a smoke run)

Prints a table and writes ``grain_overhead.json`` under ``--out`` (default ``out/grain_overhead``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import time

if __name__ == "__main__":  # must happen before JAX initialises its backend
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grain  # noqa: E402
import jax  # noqa: E402

import jaxdp  # noqa: E402
from experiments import train_lm  # noqa: E402
from experiments.lm import corpus  # noqa: E402
from experiments.lm import model as lm  # noqa: E402
from jaxdp.io.data import DataPipeline  # noqa: E402
from jaxdp.io.grain import GrainPipeline, process_shard  # noqa: E402


def _inputs(chunks, collate, mesh, per_device: int, seed: int):
  """``{name: () -> iterator of (batch, weights)}``, each a fresh, endless stream."""
  def data_pipeline():
    pipe = DataPipeline(chunks, collate, mesh, per_device_batch=per_device, seed=seed)
    return (batch for _, batch in pipe.iterate())

  def grain_pipeline(read_options=None):
    source = grain.MapDataset.source(chunks)
    pipe = GrainPipeline(lambda epoch: process_shard(source.shuffle(seed=seed + epoch)), mesh,
                         per_device_batch=per_device, collate=collate, read_options=read_options)
    while True:
      yield from pipe

  return {"DataPipeline": data_pipeline, "GrainPipeline": grain_pipeline,
          "GrainPipeline(threads=0)": lambda: grain_pipeline(grain.ReadOptions(num_threads=0))}


SMOKE = {"max_bytes": 50_000, "layers": 1, "d_model": 16, "heads": 2, "d_ff": 32}
"""--quick: a smaller model and corpus than train_lm's --quick, for the tests' smoke run (not a measurement)."""


def measure(devices: int, steps: int, rounds: int, seed: int = 0, quick: bool = False) -> dict:
  sizes = {**train_lm.QUICK, **(SMOKE if quick else {})}
  config = train_lm.Config(**sizes, devices=devices, dropout=0.0, progress=False)
  mesh = jaxdp.data_mesh(jax.devices()[:devices])
  chunks, _ = train_lm.build_dataset(config)
  collate = corpus.make_collate(config.seq_len)
  definition, params = train_lm.make_model(config)
  optimizer = train_lm.make_optimizer(config)
  step = jaxdp.make_train_step(lm.make_loss_fn(definition), optimizer, mesh)
  per_device = config.batch_size // devices
  makers = _inputs(chunks, collate, mesh, per_device, seed)
  streams = {name: make() for name, make in makers.items()}
  state = jaxdp.init_state(params, optimizer, mesh)
  for stream in streams.values():  # compile, and warm both inputs
    state, metrics = step(state, *next(stream))
  jax.block_until_ready(metrics)
  times: dict[str, list[float]] = {f"{name} {kind}": [] for name in streams for kind in ("step", "batch")}
  order = list(times)
  for _ in range(rounds):
    random.shuffle(order)
    for method in order:
      name, kind = method.rsplit(" ", 1)
      stream = streams[name]
      start = time.perf_counter()
      for _ in range(steps):
        batch = next(stream)
        if kind == "step":
          state, metrics = step(state, *batch)
      jax.block_until_ready(metrics if kind == "step" else batch)
      times[method].append((time.perf_counter() - start) / steps * 1e3)
  best = {method: min(t) for method, t in times.items()}
  return {"devices": devices, "steps": steps, "rounds": rounds, "examples": len(chunks),
          "batch_size": config.batch_size, "ms_best": best, "ms_rounds": times,
          "step_ratio": {name: best[f"{name} step"] / best["DataPipeline step"] for name in streams}}


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--steps", type=int, default=None, help="steps per round (30; 5 with --quick)")
  parser.add_argument("--rounds", type=int, default=None, help="rounds (5; 2 with --quick)")
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--out", default="out/grain_overhead")
  args = parser.parse_args(argv)
  steps = args.steps or (5 if args.quick else 30)
  rounds = args.rounds or (2 if args.quick else 5)
  result = measure(args.devices, steps, rounds, quick=args.quick)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "grain_overhead.json").write_text(json.dumps(result, indent=2))
  print(f"LM experiment, {args.devices} devices, global batch {result['batch_size']}, best of {rounds} rounds of "
        f"{steps} (ms):")
  for method, ms in sorted(result["ms_best"].items()):
    print(f"  {method:32s} {ms:8.2f}")
  for name, ratio in result["step_ratio"].items():
    print(f"  {name} / DataPipeline per step: {ratio:.3f}")
  return result


if __name__ == "__main__":
  main()
