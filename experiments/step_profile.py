"""Where jaxdp's step time goes, next to the bare step: XLA's cost analysis and a per-op profile.

For one workload at N devices, jaxdp's step as a user calls it
(``jaxdp.make_train_step``) and the bare hand-written step
(``benchmark.bare_step``):

* **compiled HLO**: XLA's ``cost_analysis()`` (flops, bytes accessed) and
  the entry computation's instructions by kind (fusions by fusion kind,
  plain dots, collectives, conditionals, copies);
* **per-op profile**: ``jax.profiler`` traces ``--steps`` steps of each
  method (one trace each, so the instruction names do not mix); the device
  time of every entry instruction is summed over the devices and divided by
  the steps, then grouped by kind (a conditional counts its whole branch).
  The profiler's own overhead inflates small ops, and a conditional's own
  event may overlap its branch's: compare the two methods, kind by kind.

The host side of jaxdp's call (validation, placement, the read of earlier
steps' non-finite flags) is what ``experiments/step_cost.py`` measures as
``make_train_step`` against ``train_step``: the same compiled step with and
without it. (Timing the call's return does not isolate it: on XLA CPU a call
returns after launching the devices' programs, part of which runs first.)

Run from the repository root (sets ``JAX_NUM_CPU_DEVICES=8`` itself)::

  .venv/bin/python experiments/step_profile.py                      # MLP, 8 devices
  .venv/bin/python experiments/step_profile.py --model lm --devices 2
  .venv/bin/python experiments/step_profile.py --quick              # smoke run
  .venv/bin/python experiments/step_profile.py --publish    # full run, and copy step_profile.json to docs/data/

Writes ``step_profile.json`` under ``--out`` (default ``out/step_profile``;
``out/step_profile_quick`` with ``--quick``).

--quick: about 5 s on an idle 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

if __name__ == "__main__":  # must happen before JAX initialises its backend
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

from experiments import benchmark, common

FULL = {"devices": 8, "model": "mlp", "steps": 20, "warmup": 3}
QUICK = {"devices": 2, "model": "mlp", "steps": 2, "warmup": 1}
METHODS = ("jaxdp", "bare")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*? ([a-z][a-z0-9\-]*)\(")


def _computation(hlo: str, header: str) -> list[str]:
  """The instruction lines of the computation whose header line starts with ``header``."""
  start = hlo.index("\n" + header) + 1
  body = hlo[start:hlo.index("\n}", start)]
  return body.splitlines()[1:]


def _kinds(lines: list[str], prefix: str = "") -> dict[str, str]:
  kinds = {}
  for line in lines:
    match = _INSTRUCTION.match(line)
    if not match or match.group(2) in ("parameter", "get-tuple-element", "tuple", "bitcast", "constant"):
      continue
    name, opcode = match.groups()
    fusion = re.search(r"kind=(\w+)", line)
    kinds[name] = prefix + (f"{opcode} ({fusion.group(1)})" if opcode == "fusion" and fusion else opcode)
  return kinds


def entry_kinds(hlo: str) -> dict[str, str]:
  """``{instruction name: kind}`` of the entry computation and of its conditionals' branches.

  The kind is the opcode (with its kind for a fusion); instructions inside a conditional's branches are
  profiled as their own events, so they are kept, as ``"in cond: <kind>"``.
  """
  entry = _computation(hlo, "ENTRY")
  kinds = _kinds(entry)
  for line in entry:
    branches = re.search(r"branch_computations=\{([^}]*)\}", line)
    for branch in branches.group(1).split(", ") if branches else ():
      kinds.update(_kinds(_computation(hlo, branch + " "), prefix="in cond: "))
  return kinds


def compiled_summary(compiled) -> dict:
  """``cost_analysis()``'s flops and bytes, and the entry instructions counted by kind."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  kinds = {name: kind for name, kind in entry_kinds(compiled.as_text()).items() if not kind.startswith("in cond")}
  return {
      "flops": float(cost.get("flops", float("nan"))),
      "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
      "instructions": dict(sorted(collections.Counter(kinds.values()).items())),
  }


def profile(case: benchmark.Case, kinds: dict[str, str], steps: int) -> dict[str, float]:
  """Device time per step (ms, summed over devices) of each kind of entry instruction, from a trace."""
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder, create_perfetto_trace=True):
      for _ in range(steps):
        case()
    path = glob.glob(os.path.join(folder, "**", "*perfetto_trace.json.gz"), recursive=True)[-1]
    with gzip.open(path) as f:
      trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  per_kind = collections.Counter()
  for event in events:
    if event.get("ph") == "X" and event.get("name") in kinds:
      per_kind[kinds[event["name"]]] += event.get("dur", 0) / 1e3 / steps
  return dict(per_kind.most_common())


def measure(model: str, n: int, steps: int, warmup: int) -> dict:
  w = {"mlp": benchmark.mlp_workload, "lm": benchmark.lm_workload}[model]()
  devices = jax.devices()[:n]
  mesh = benchmark.auto_mesh(devices)
  cases = {"jaxdp": benchmark.jaxdp_case(w, devices), "bare": benchmark.plain_case(w, mesh, benchmark.bare_step(w, mesh))}
  print(f"[{w.short}, {n} device(s)] compiling, then profiling {steps} steps", flush=True)
  common.time_interleaved(cases, 0, warmup)  # compile and warm up
  compiled = {name: cases[name].lower(cases[name].state).compile() for name in METHODS}
  summary = {name: compiled_summary(compiled[name]) for name in METHODS}
  kinds = {name: entry_kinds(compiled[name].as_text()) for name in METHODS}
  return {
      "title": w.title,
      "devices": n,
      "steps": steps,
      "compiled": summary,
      "profile_ms": {name: profile(cases[name], kinds[name], steps) for name in METHODS},
  }


def markdown(result: dict) -> str:
  lines = [f"## {result['title']}, {result['devices']} devices, {result['steps']} profiled steps", ""]
  c = result["compiled"]
  lines += ["| | jaxdp | bare |", "|---|---:|---:|",
            f"| flops (cost_analysis) | {c['jaxdp']['flops']:,.0f} | {c['bare']['flops']:,.0f} |",
            f"| bytes accessed (cost_analysis) | {c['jaxdp']['bytes_accessed']:,.0f} | {c['bare']['bytes_accessed']:,.0f} |"]
  for kind in sorted(set(c["jaxdp"]["instructions"]) | set(c["bare"]["instructions"])):
    lines.append(f"| entry `{kind}` instructions | {c['jaxdp']['instructions'].get(kind, 0)} | "
                 f"{c['bare']['instructions'].get(kind, 0)} |")
  p = result["profile_ms"]
  lines += ["", "Device time per step, ms, summed over devices (profiled):", "", "| kind | jaxdp | bare |",
            "|---|---:|---:|"]
  for kind in sorted(set(p["jaxdp"]) | set(p["bare"]), key=lambda k: -(p["jaxdp"].get(k, 0) + p["bare"].get(k, 0))):
    lines.append(f"| `{kind}` | {p['jaxdp'].get(kind, 0):.2f} | {p['bare'].get(kind, 0):.2f} |")
  lines.append(f"| sum of the events | {sum(p['jaxdp'].values()):.2f} | {sum(p['bare'].values()):.2f} |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help=f"smoke run; defaults become {QUICK}")
  p.add_argument("--devices", type=int, help=f"device count (default {FULL['devices']})")
  p.add_argument("--model", choices=("mlp", "lm"), help=f"workload (default {FULL['model']})")
  p.add_argument("--steps", type=int, help=f"profiled steps (default {FULL['steps']})")
  p.add_argument("--warmup", type=int, help=f"untimed steps, the first compiles (default {FULL['warmup']})")
  common.add_output_args(p, "out/step_profile", quick="out/step_profile_quick")
  args = p.parse_args(argv)
  common.check_publish(p, args)
  args = common.fill_defaults(args, FULL, QUICK)
  result = {"machine": common.machine(), "args": vars(args),
            **measure(args.model, args.devices, args.steps, args.warmup)}
  print(markdown(result), flush=True)
  path = common.write_json(os.path.join(args.out, "step_profile.json"), result)
  print(f"wrote {path}")
  common.publish(args, {"step_profile.json": "data/step_profile.json"})
  return result


if __name__ == "__main__":
  main()
