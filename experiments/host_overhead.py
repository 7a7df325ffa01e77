"""The host's share of a step call: jaxdp's train and eval steps against a bare jitted step, on a model so small
that every call is dispatch-bound.

The model: a linear model of 3 inputs, its parameters ``L`` leaves (``L / 2`` weight vectors ``[3]`` and biases
``[]``, summed), global batch ``8·N`` rows, batch and weights placed split over ``data`` as a pipeline delivers
them, SGD. Each case (N devices, L leaves) runs, interleaved in one process:

* ``bare``: ``jax.jit(jax.shard_map(...))`` with donation, the same weighted mean (``Σ w·l / Σ w``, one
  all-reduce of the sums and the gradient) and the SGD update; no checks, no metrics but the loss;
* ``jaxdp``: ``jaxdp.make_train_step``, called as a user calls it, ``state, metrics = step(state, batch, w)``;
* ``program``: the one program that call dispatches, called directly on the same arguments: the difference
  to ``jaxdp`` is the wrapper's own Python time per call;
* ``bare_eval`` and ``eval``: a bare jitted weighted-mean forward pass and ``jaxdp.make_eval_step``, and
  ``eval_program``, the eval step's program called directly.

Every method is timed over chained calls (each call gets the state the previous one returned), synced every
10 calls (on CPU an unsynced chain of collectives can hang in XLA's rendezvous), in rounds in a new shuffled
order; a method's time is its best round's. The first call (trace, compile, run; ``make_*`` included) is timed
in fresh processes: one with an empty persistent compilation cache (cold), then a second one that shares it.

Run from the repository root (sets ``JAX_NUM_CPU_DEVICES=8`` itself):

  .venv/bin/python experiments/host_overhead.py                 # N = 1, 2, 8; 2 and 96 leaves; 7 rounds of 200
  .venv/bin/python experiments/host_overhead.py --quick         # 3 rounds of 40 calls; first call: N = 2, 2 leaves
  .venv/bin/python experiments/host_overhead.py --publish       # full run; copies the table into docs/data/

Writes ``host_overhead.json`` and ``host_overhead.md`` under ``--out`` (default ``out/host_overhead``;
``out/host_overhead_quick`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

if __name__ == "__main__":  # must happen before JAX initialises its backend
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdp
from experiments import common

FULL = {"devices": "1,2,8", "leaves": "2,96", "rounds": 7, "calls": 200, "first_devices": "2,8", "first_leaves": "2,96"}
QUICK = {"devices": "1,2,8", "leaves": "2,96", "rounds": 3, "calls": 40, "first_devices": "2", "first_leaves": "2"}
LR = 0.01
SYNC_EVERY = 10
TRAIN, EVAL = ("bare", "jaxdp", "program"), ("bare_eval", "eval", "eval_program")


# The workload --------------------------------------------------------------------------------------------------


def make_params(leaves: int) -> dict:
  """``leaves / 2`` weight vectors ``[3]`` and as many biases ``[]``: the linear model with ``leaves`` leaves."""
  rng = np.random.default_rng(0)
  params = {}
  for i in range(leaves // 2):
    params[f"w{i:03d}"] = rng.normal(size=3).astype(np.float32) / leaves
    params[f"b{i:03d}"] = np.zeros((), np.float32)
  return params


def loss_fn(params: dict, batch: dict) -> jax.Array:
  """Per-example squared error ``[b]`` of the summed linear models."""
  pred = sum(batch["x"] @ params[f"w{k[1:]}"] + params[k.replace("w", "b")] for k in params if k[0] == "w")
  return 0.5 * (pred - batch["y"]) ** 2


def make_data(mesh, n: int) -> tuple[dict, jax.Array]:
  """A global batch of ``8·n`` rows and its weights, split over ``data`` (as a pipeline delivers them)."""
  rng = np.random.default_rng(1)
  rows = 8 * n
  split = NamedSharding(mesh, P("data"))
  batch = {"x": rng.normal(size=(rows, 3)).astype(np.float32), "y": rng.normal(size=rows).astype(np.float32)}
  weights = rng.uniform(0.5, 1.5, size=rows).astype(np.float32)
  return jax.device_put(batch, split), jax.device_put(weights, split)


def bare_train(mesh):
  """The bare step: the weighted mean's sums and gradient all-reduced once, divided, SGD; params donated."""

  def replica(params, batch, weights):
    def sums(p):
      return jnp.sum(weights * loss_fn(p, batch)), jnp.sum(weights)

    (loss, weight), grads = jax.value_and_grad(sums, has_aux=True)(lax.pcast(params, "data", to="varying"))
    loss, weight, grads = lax.psum((loss, weight, grads), "data")
    return jax.tree.map(lambda p, g: p - LR * g / weight, params, grads), loss / weight

  return jax.jit(jax.shard_map(replica, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P())),
                 donate_argnums=0)


def bare_eval(mesh):
  """The bare forward pass: the weighted mean loss (one all-reduce of its two sums)."""

  def replica(params, batch, weights):
    loss, weight = lax.psum((jnp.sum(weights * loss_fn(params, batch)), jnp.sum(weights)), "data")
    return loss / weight, weight

  return jax.jit(jax.shard_map(replica, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P())))


# Timing ----------------------------------------------------------------------------------------------------


def chained(call, state, calls: int):
  """``run()`` making ``calls`` chained calls ``state = call(state)``, synced every :data:`SYNC_EVERY`."""
  box = [state]

  def run():
    s = box[0]
    for i in range(calls):
      s = call(s)
      if i % SYNC_EVERY == SYNC_EVERY - 1:
        jax.block_until_ready(s)
    box[0] = jax.block_until_ready(s)

  return run


def runners(n: int, leaves: int, calls: int) -> dict:
  """The six methods of one case, each a ``run()`` of ``calls`` chained calls. ``program`` chains the flat
  leaves the program takes and returns: rebuilding the state's tree is the wrapper's work."""
  mesh = jaxdp.data_mesh(jax.devices()[:n])
  params, opt = make_params(leaves), optax.sgd(LR)
  batch, weights = make_data(mesh, n)
  state = jaxdp.init_state(params, opt, mesh)
  step, evaluate = jaxdp.make_train_step(loss_fn, opt, mesh), jaxdp.make_eval_step(loss_fn, mesh)
  state, _ = step(state, batch, weights)  # compiles; the next call's state is then the known one
  program, args, *_ = step._prepare(state, batch, weights, None)
  own = jax.tree.leaves(jaxdp.init_state(params, opt, mesh))  # placed as the step places it, flat as it takes it
  eval_state = jaxdp.init_state(params, opt, mesh)
  evaluate(eval_state, batch, weights)
  eval_program, eval_args = evaluate._prepare(eval_state, batch, weights, "means")
  bare, bare_forward = bare_train(mesh), bare_eval(mesh)
  replicated = NamedSharding(mesh, P())
  fresh = lambda: jax.device_put(jax.tree.map(np.copy, params), replicated)  # noqa: E731
  held = fresh()
  methods = {
      "bare": chained(lambda p: bare(p, batch, weights)[0], fresh(), calls),
      "jaxdp": chained(lambda s: step(s, batch, weights)[0], state, calls),
      "program": chained(lambda leaves: program(leaves, *args[1:])[0], own, calls),
      "bare_eval": chained(lambda c: (c[0], bare_forward(c[0], batch, weights)), (held, None), calls),
      "eval": chained(lambda c: (c[0], evaluate(c[0], batch, weights)), (eval_state, None), calls),
      "eval_program": chained(lambda c: (c[0], eval_program(*eval_args)), (eval_state, None), calls),
  }
  return methods


def time_case(n: int, leaves: int, rounds: int, calls: int) -> dict:
  """Best round's µs per call of every method, their ratios and the wrapper's own time."""
  methods = runners(n, leaves, calls)
  times = common.time_interleaved(methods, steps=rounds, warmup=1)  # ms per round of ``calls`` calls
  us = {name: 1e3 * min(t) / calls for name, t in times.items()}
  return {
      "devices": n, "leaves": leaves, "us_per_call": us,
      "train_ratio": us["jaxdp"] / us["bare"], "eval_ratio": us["eval"] / us["bare_eval"],
      "train_own_us": us["jaxdp"] - us["program"],
      "eval_own_us": us["eval"] - us["eval_program"],
  }


# The first call, in fresh processes ----------------------------------------------------------------------------


PHASES = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}


def first_calls(cases: list[tuple[int, int]]) -> dict:
  """In this (fresh) process: seconds of each case's first bare call and first jaxdp train and eval calls, and
  of their tracing, lowering and compiling (``compile`` includes reading the persistent cache)."""
  jax.jit(lambda x: x + 1)(jnp.ones(2)).block_until_ready()  # the backend's own start, outside every time
  jaxdp.make_train_step, jaxdp.make_eval_step  # noqa: B018 (imports their modules: a process's start, not a call)
  phases: dict = {}
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **_: event in PHASES and phases.__setitem__(
          PHASES[event], phases.get(PHASES[event], 0.0) + duration))
  out = {}
  for n, leaves in cases:
    mesh = jaxdp.data_mesh(jax.devices()[:n])
    params, opt = make_params(leaves), optax.sgd(LR)
    batch, weights = make_data(mesh, n)
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    state = jax.block_until_ready(jaxdp.init_state(params, opt, mesh))
    kept = jax.block_until_ready(jaxdp.init_state(params, opt, mesh))  # for evaluation: the steps donate theirs
    calls = {
        "bare": lambda: bare_train(mesh)(placed, batch, weights),
        "jaxdp": lambda: jaxdp.make_train_step(loss_fn, opt, mesh)(state, batch, weights),
        "bare_eval": lambda: bare_eval(mesh)(kept.params, batch, weights),
        "eval": lambda: jaxdp.make_eval_step(loss_fn, mesh)(kept, batch, weights),
    }
    times = {}
    for name, call in calls.items():
      phases.clear()
      start = time.perf_counter()
      jax.block_until_ready(call())
      times[name] = time.perf_counter() - start
      times.update({f"{name}_{phase}": seconds for phase, seconds in phases.items()})
    out[f"{n}x{leaves}"] = times
  return out


def use_cache(cache_dir: str) -> None:
  """JAX's persistent compilation cache in ``cache_dir``, for every program (by default only those that took
  over a second to compile are written)."""
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def first_calls_in_processes(cases: list[tuple[int, int]]) -> dict:
  """:func:`first_calls` in a process with an empty cache (cold), then in another that shares it (cached)."""
  spec = ",".join(f"{n}x{leaves}" for n, leaves in cases)
  with tempfile.TemporaryDirectory() as cache:
    out = {}
    for kind in ("cold", "cached"):
      done = subprocess.run([sys.executable, __file__, "--first-call", spec, "--cache", cache], check=True,
                            capture_output=True, text=True, env={**os.environ, "JAX_NUM_CPU_DEVICES": "8"})
      out[kind] = json.loads(done.stdout.strip().splitlines()[-1])
  return out


# Report ----------------------------------------------------------------------------------------------------


def _phases(times: dict, name: str) -> str:
  return " / ".join(f"{times.get(f'{name}_{phase}', 0.0):.2f}" for phase in ("trace", "lower", "compile"))


def table(results: dict) -> str:
  """The markdown tables of :func:`main`'s results."""
  lines = [
      "| devices | leaves | train ÷ bare | program ÷ bare | train µs: jaxdp / bare | eval ÷ bare forward "
      "| eval µs: jaxdp / bare | wrapper's own µs: train, eval |",
      "|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in results["cases"]:
    us = r["us_per_call"]
    lines.append(
        f"| {r['devices']} | {r['leaves']} | {r['train_ratio']:.2f} | {us['program'] / us['bare']:.2f} | "
        f"{us['jaxdp']:.0f} / {us['bare']:.0f} | {r['eval_ratio']:.2f} | {us['eval']:.0f} / {us['bare_eval']:.0f} "
        f"| {r['train_own_us']:.0f}, {r['eval_own_us']:.0f} |")
  first = results["first_call"]
  if first["cold"]:
    lines += ["", "| first call: devices × leaves | train ÷ bare, cold | train s: cold / cached | cold ÷ cached "
              "| eval s: cold / cached | bare s: cold / cached | jaxdp trace / lower / compile s, cold "
              "| bare trace / lower / compile s, cold |", "|---|---:|---:|---:|---:|---:|---|---|"]
  for case, cold in first["cold"].items():
    cached = first["cached"][case]
    lines.append(
        f"| {case.replace('x', ' × ')} | {cold['jaxdp'] / cold['bare']:.2f} | {cold['jaxdp']:.2f} / "
        f"{cached['jaxdp']:.2f} | {cold['jaxdp'] / cached['jaxdp']:.1f} | {cold['eval']:.2f} / "
        f"{cached['eval']:.2f} | {cold['bare']:.2f} / {cached['bare']:.2f} | {_phases(cold, 'jaxdp')} "
        f"| {_phases(cold, 'bare')} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", help="device counts, e.g. 1,2,8")
  p.add_argument("--leaves", help="parameter leaf counts (even), e.g. 2,96")
  p.add_argument("--rounds", type=int, help="timed rounds per method (best is kept)")
  p.add_argument("--calls", type=int, help="chained calls per round")
  p.add_argument("--first-devices", help="device counts of the first-call cases; '' for none")
  p.add_argument("--first-leaves", help="leaf counts of the first-call cases, e.g. 2,96")
  p.add_argument("--quick", action="store_true", help=f"smoke run; defaults become {QUICK}")
  p.add_argument("--first-call", help=argparse.SUPPRESS)  # internal: run first_calls here, print JSON
  p.add_argument("--cache", help=argparse.SUPPRESS)
  common.add_output_args(p, "out/host_overhead", quick="out/host_overhead_quick")
  args = p.parse_args(argv)
  if args.first_call:
    use_cache(args.cache)
    cases = [tuple(int(v) for v in c.split("x")) for c in args.first_call.split(",")]
    print(json.dumps(first_calls(cases)))
    return {}
  common.fill_defaults(args, FULL, QUICK)
  common.check_publish(p, args)
  leaf_counts = [int(v) for v in args.leaves.split(",")]
  start = time.perf_counter()
  results = {"machine": common.machine(), "load_average": os.getloadavg(), "rounds": args.rounds,
             "calls": args.calls, "cases": []}
  for n in common.device_counts(args.devices):
    for leaves in leaf_counts:
      results["cases"].append(time_case(n, leaves, args.rounds, args.calls))
      print(json.dumps(results["cases"][-1]), flush=True)
  first = [(n, int(leaves)) for n in common.device_counts(args.first_devices)
           for leaves in args.first_leaves.split(",") if leaves.strip()]
  results["first_call"] = first_calls_in_processes(first) if first else {"cold": {}, "cached": {}}
  results["load_average_after"] = os.getloadavg()
  results["seconds"] = time.perf_counter() - start
  out = pathlib.Path(args.out)
  common.write_json(out / "host_overhead.json", results)
  (out / "host_overhead.md").write_text(table(results))
  print(table(results), f"load average {results['load_average']} -> {results['load_average_after']}; "
        f"{results['seconds']:.0f} s", sep="\n")
  common.publish(args, {"host_overhead.json": "data/host_overhead.json", "host_overhead.md": "data/host_overhead.md"})
  return results


if __name__ == "__main__":
  main()
