"""Times one training step of a ~2M-parameter MLP on 1..8 simulated CPU devices.

Model: MLP 784-1024-1024-10 (ReLU), per-example softmax cross-entropy, Adam,
global batch 512 of random data (fixed seed). Compared at each device count k
(sub-mesh over ``jax.devices()[:k]``):

* ``shard_map``: ``jaxdp.make_train_step`` on ``jaxdp.data_parallel(mesh, backend="shard_map")``;
* ``pmap``: the same on ``jaxdp.data_parallel(mesh, backend="pmap")``;
* ``auto-jit``: plain ``jax.jit`` of a single-device step (value_and_grad of
  the weighted-mean loss + optax update) on a batch sharded with
  ``NamedSharding(mesh, P("data"))`` and replicated params: XLA's automatic
  partitioning, what a JAX user would write instead;
* ``single``: the same single-device step on one device with the whole batch.

The methods run interleaved step by step (so drift in the load of a shared
machine hits all of them alike); each step is timed to ``block_until_ready``
after warm-up. From the compiled HLO of the three multi-device steps it counts
the all-reduce ops and the bytes they reduce, next to the gradient bytes.

Run from the repository root (sets ``JAX_NUM_CPU_DEVICES=8`` itself unless
already set; writes JSON under ``out/``):

  .venv/bin/python experiments/benchmark_step.py              # 1,2,4,8 devices, 20 steps
  .venv/bin/python experiments/benchmark_step.py --quick      # smoke run
  .venv/bin/python experiments/benchmark_step.py --publish    # full run, and copy benchmark_step.json to docs/data/

Writes ``benchmark_step.json`` under ``--out`` (default ``out/benchmark_step``;
``out/benchmark_step_quick`` with ``--quick``).

--quick: about 9 s on an idle 2-core CPU machine.
  .venv/bin/python experiments/benchmark_step.py --devices 2,8 --steps 50 --out out/b.json
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":  # must happen before JAX initialises its backend
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jaxdp
from experiments import common

LAYERS = common.MLP_LAYERS
METHODS = ("shard_map", "pmap", "auto_jit", "single")
SHARDED = ("shard_map", "pmap", "auto_jit")  # the methods whose HLO has collectives


def comm_report(hlo_text: str, n_devices: int) -> dict[str, dict[str, int]]:
  """``{kind: {"ops": count, "bytes": bytes}}`` per collective kind, via ``jaxdp.analysis.reports.collectives_from_hlo``."""
  return {
      kind: {"ops": c.count, "bytes": c.bytes}
      for kind, c in jaxdp.analysis.reports.collectives_from_hlo(hlo_text, n_devices).items()
  }


# --------------------------------------------------------------------------
# Model, data and the four steps (the MLP and its data live in experiments/common.py).
# --------------------------------------------------------------------------


def make_data(batch_size: int, seed: int = 0) -> tuple[dict, np.ndarray]:
  """Random inputs and labels (fixed seed) and all-one example weights."""
  return common.mlp_batch(LAYERS, batch_size, seed), np.ones((batch_size,), np.float32)


def plain_step(optimizer: optax.GradientTransformation):
  """The single-device step a JAX user writes: weighted-mean loss, grad, optax update."""

  def step(state: jaxdp.TrainState, batch: dict, weights: jax.Array):
    def mean_loss(params):
      return jnp.sum(weights * common.mlp_loss(params, batch)) / jnp.sum(weights)

    loss, grads = jax.value_and_grad(mean_loss)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return jaxdp.TrainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1), loss

  return jax.jit(step, donate_argnums=0)


class Case:
  """One method at one device count: a step bound to its placed batch, and its state."""

  def __init__(self, name, fn, state, batch, weights, lower):
    self.name, self.fn, self.state = name, fn, state
    self.batch, self.weights, self.lower = batch, weights, lower
    self.out = None

  def hlo(self) -> str:
    return self.lower(self.state, self.batch, self.weights).compile().as_text()

  def __call__(self) -> None:
    self.state, out = self.fn(self.state, self.batch, self.weights)
    jax.block_until_ready((self.state, out))
    self.out = out

  def final_loss(self) -> float:
    return float(self.out["loss"] if isinstance(self.out, dict) else self.out)


def jaxdp_case(backend, devices, params, optimizer, batch, weights) -> Case:
  mesh = jaxdp.data_mesh(devices)
  dp = jaxdp.data_parallel(mesh, backend=backend)
  step = jaxdp.make_train_step(common.mlp_loss, optimizer, dp)
  sharding = NamedSharding(mesh, P("data"))
  batch, weights = jax.device_put((batch, weights), sharding)
  return Case(backend, step, jaxdp.init_state(params, optimizer, dp), batch, weights, step.lower)


def plain_case(name, mesh, params, optimizer, batch, weights) -> Case:
  step = plain_step(optimizer)
  state = jax.device_put(jaxdp.TrainState.create(params, optimizer), NamedSharding(mesh, P()))
  batch, weights = jax.device_put((batch, weights), NamedSharding(mesh, P("data")))
  return Case(name, step, state, batch, weights, step.lower)


def auto_mesh(devices) -> Mesh:
  """A 1-D ``data`` mesh with the Auto axis type: sharding left to XLA's partitioner."""
  return Mesh(np.asarray(devices), ("data",), axis_types=(AxisType.Auto,))


def build_cases(k: int, params, optimizer, batch, weights) -> list[Case]:
  devices, host_copy = jax.devices()[:k], common.host_copy
  return [
      jaxdp_case("shard_map", devices, host_copy(params), optimizer, batch, weights),
      jaxdp_case("pmap", devices, host_copy(params), optimizer, batch, weights),
      plain_case("auto_jit", auto_mesh(devices), host_copy(params), optimizer, batch, weights),
      plain_case("single", auto_mesh(devices[:1]), host_copy(params), optimizer, batch, weights),
  ]


# --------------------------------------------------------------------------
# Measuring and reporting.
# --------------------------------------------------------------------------


def measure(k: int, args, params, optimizer, batch, weights) -> dict:
  """Times every method on ``k`` devices, interleaved step by step, and reads their HLO."""
  cases = build_cases(k, params, optimizer, batch, weights)
  comm = {c.name: comm_report(c.hlo(), k) for c in cases if c.name in SHARDED}
  times = common.time_interleaved({c.name: c for c in cases}, args.steps, args.warmup)
  losses = [c.final_loss() for c in cases]
  return {
      "devices": k,
      "timings_ms": {name: {**common.stats(t), "samples": t} for name, t in times.items()},
      "comm": comm,
      "final_loss": {c.name: c.final_loss() for c in cases},
      "loss_spread": float(np.max(losses) - np.min(losses)),
  }


def check_goals(rows: list[dict], grad_bytes: int, scalar_slack: int = 64) -> dict:
  """The issue's goals: shard_map no slower than auto-jit; all-reduced bytes = gradient + a few scalars."""
  ratio = {r["devices"]: r["timings_ms"]["shard_map"]["median"] / r["timings_ms"]["auto_jit"]["median"] for r in rows}
  extra = {}
  for r in rows:
    if r["devices"] > 1:
      extra[r["devices"]] = {m: r["comm"][m]["all-reduce"]["bytes"] - grad_bytes for m in SHARDED}
  bytes_ok = all(0 <= e <= scalar_slack for row in extra.values() for e in row.values())
  return {
      "shard_map_over_auto_jit_median": ratio,
      "shard_map_no_slower_than_auto_jit": {k: v <= 1.0 for k, v in ratio.items()},
      "all_reduce_extra_bytes": extra,
      "all_reduce_bytes_are_gradient_plus_scalars": bytes_ok,
  }


def markdown_table(rows: list[dict], grad_bytes: int) -> str:
  lines = [
      "| devices | shard_map ms | pmap ms | auto-jit ms | single-device ms "
      "| all-reduce ops (shard_map / pmap / auto-jit) | bytes all-reduced (shard_map / pmap / auto-jit) | gradient bytes |",
      "|---:|---:|---:|---:|---:|:---:|:---:|---:|",
  ]
  for r in rows:
    t, ar = r["timings_ms"], {m: r["comm"][m]["all-reduce"] for m in SHARDED}
    lines.append(
        f"| {r['devices']} | " + " | ".join(common.fmt_ms(t[m]) for m in METHODS)
        + " | " + " / ".join(str(ar[m]["ops"]) for m in SHARDED)
        + " | " + " / ".join(f"{ar[m]['bytes']:,}" for m in SHARDED)
        + f" | {grad_bytes:,} |"
    )
  return "\n".join(lines)


def summary(rows: list[dict], goals: dict, args) -> str:
  ratio = goals["shard_map_over_auto_jit_median"]
  lines = [
      f"Median (p10–p90) ms per step over {args.steps} steps after {args.warmup} warm-up; "
      f"global batch {args.batch}; {jax.device_count()} simulated {jax.default_backend()} devices "
      f"on {common.cpu_cores()} cores; jax {jax.__version__}.",
      "goal: shard_map no slower than auto-jit (median ratio): "
      + ", ".join(f"{k} dev {r:.2f} {'yes' if r <= 1 else 'NO'}" for k, r in ratio.items()),
      "goal: bytes all-reduced = gradient bytes + a few scalars: "
      f"{'yes' if goals['all_reduce_bytes_are_gradient_plus_scalars'] else 'NO'} "
      f"(extra bytes per device count: {goals['all_reduce_extra_bytes']})",
      "final losses agree across methods to within "
      f"{max(r['loss_spread'] for r in rows):.2e}",
  ]
  others = {(r["devices"], m, kind): v for r in rows for m in SHARDED
            for kind, v in r["comm"][m].items() if kind != "all-reduce" and v["ops"]}
  if others:
    lines.append(f"other collectives: {others}")
  return "\n".join(lines)


FULL = {"devices": "1,2,4,8", "steps": 20, "warmup": 3, "batch": 512}
QUICK = {"devices": "1,2", "steps": 3, "warmup": 1, "batch": 64}


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", help=f"comma-separated device counts (default {FULL['devices']})")
  parser.add_argument("--steps", type=int, help=f"timed steps per method after warm-up (default {FULL['steps']})")
  parser.add_argument("--warmup", type=int, help=f"untimed steps per method, the first compiles (default {FULL['warmup']})")
  parser.add_argument("--batch", type=int, help=f"global batch size (default {FULL['batch']})")
  parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
  common.add_output_args(parser, "out/benchmark_step", quick="out/benchmark_step_quick")
  parser.add_argument("--quick", action="store_true", help=f"smoke run; defaults become {QUICK}")
  args = parser.parse_args(argv)
  common.check_publish(parser, args)
  args = common.fill_defaults(args, FULL, QUICK)
  args.device_counts = common.device_counts(args.devices)
  return args


def validate(args) -> None:
  for k in args.device_counts:
    if args.batch % k:
      raise SystemExit(f"--batch {args.batch} does not split evenly over {k} devices.")


def main(argv=None) -> dict:
  args = parse_args(argv)
  validate(args)
  params, optimizer = common.mlp_params(LAYERS), optax.adam(args.lr)
  batch, weights = make_data(args.batch)
  grad_bytes = common.tree_bytes(params)
  rows = []
  for k in args.device_counts:
    print(f"[{k} device(s)] compiling and timing...", file=sys.stderr, flush=True)
    rows.append(measure(k, args, params, optimizer, batch, weights))
  goals = check_goals(rows, grad_bytes)
  print(markdown_table(rows, grad_bytes))
  print()
  print(summary(rows, goals, args))
  result = {
      "config": vars(args),
      "jax_version": jax.__version__,
      "backend": jax.default_backend(),
      "device_count": jax.device_count(),
      "cpu_count": common.cpu_cores(),
      "layers": LAYERS,
      "gradient_bytes": grad_bytes,
      "rows": rows,
      "goals": goals,
  }
  path = common.write_json(os.path.join(args.out, "benchmark_step.json"), result)
  print(f"wrote {path}", file=sys.stderr)
  common.publish(args, {"benchmark_step.json": "data/benchmark_step.json"})
  return result


if __name__ == "__main__":
  main()
