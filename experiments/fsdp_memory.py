"""Per-device peak memory of layer-wise ZeRO-3 against the whole gather, read off the compiled step (issue 24, item 5).

Model: a stack of L pre-norm MLP blocks at fixed width, run under
``lax.scan``: ``h + gelu(norm(h) @ w1) @ w2`` with ``norm`` an RMS norm with a
learned scale, ``w1`` [D, F], ``w2`` [F, D]; a final norm scale and a head
[D, 1] outside the stack; a per-token squared error on inputs ``x`` [b, T, D].
Adam, float32. The loop body calls ``jaxdp.gather(layer)`` and is
checkpointed with ``jax.checkpoint(body, policy=jaxdp.sharding.layerwise.gather_policy(r))``: the
same loss for every schedule but the last (outside a layer-wise step
``jaxdp.gather`` returns its argument and the policy saves nothing, so every
schedule recomputes the body and saves only each layer's input ``h``).

For L in ``--layers`` at N = 8 simulated devices it compiles (never runs) the
step of each schedule and records the per-device peak of
``compiled.memory_analysis()``: argument + output + temp − alias (the
donated state's outputs alias its arguments, so they count once):

* ``stage0``: plain data parallelism (everything replicated);
* ``stage3``: ZeRO-3 with the whole gather (``jaxdp.data_parallel(mesh, zero_stage=3)``, no ``layers=``: every parameter
  gathered before the forward pass and kept until the backward pass ends);
* ``layerwise``: ZeRO-3 with ``data_parallel(mesh, zero_stage=3, layers="layers")``, ``gather_policy(reshard_after_forward=True)``
  (each layer gathered in the forward loop, dropped, gathered again in the
  backward loop, its gradient reduce-scattered there);
* ``layerwise_no_reshard``: the same with ``gather_policy(reshard_after_forward=False)``
  (each gathered layer kept for its backward pass);

next to the model's whole float32 parameter bytes (``param_bytes``).

Goals, printed PASS/FAIL (``--check``: exit 1 on a FAIL):

(a) the layer-wise peak at the largest L is below the model's whole float32
    parameter bytes (the whole-gather schedule cannot be below them: it holds
    every parameter gathered);
(b) the layer-wise peak's growth per added layer, (peak(L_max) − peak(L_min)) /
    (L_max − L_min), is ≤ 0.6 × the whole-gather stage 3's (the issue's goal
    for the ``--quick`` configuration, whose per-layer activations are small
    next to a layer's parameters; reported for every configuration), and
    ≤ 1.25 × (one layer's sharded state, 16 B per parameter / N for params,
    Adam's two moments and the gradient slice, + its saved activation h,
    4·b·T·D bytes per device);
(c) in the optimized HLO of every layer-wise step (each L), with k the number
    of stacked leaves split over the data axis (here w1, w2 and the norm
    scale: k = 3): inside the while loops (instructions whose metadata
    op_name contains "/while/body/"), exactly k all-gathers in the forward
    loop (op_name without "transpose(") and, with reshard on, k in the
    backward loop (op_name with "transpose("), 0 there with reshard off; each
    forward all-gather's result is one whole layer's leaf (their bytes sum to
    one layer's parameter bytes); outside the loops the all-gathers move at
    most the bytes of the leaves outside the stack (the stack is never
    gathered whole); exactly k reduce-scatters inside the backward loop, none
    in the forward loop, and their per-device result bytes × L equal the
    stacked gradient's bytes per device (stacked parameter bytes / N).

Run from the repository root (sets ``JAX_NUM_CPU_DEVICES=8`` itself unless
already set; writes ``fsdp_memory.json`` and ``fsdp_memory.png`` under --out,
default ``out/fsdp``; ``--publish`` also copies them to ``docs/fsdp_memory.png``
and ``docs/data/fsdp_memory.json``):

  .venv/bin/python experiments/fsdp_memory.py
  .venv/bin/python experiments/fsdp_memory.py --quick --check

--quick: about 24 s on an idle 2-core CPU machine.
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
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jaxdp
from experiments import common
from jaxdp.analysis.reports import hlo_collectives

MIB = 2**20
N_DEVICES = 8
STACK = "layers"
# width D, hidden F, tokens per sequence T, sequences per device b
FULL = {"width": 256, "hidden": 1024, "seq": 64, "batch_per_device": 4}
QUICK = {"width": 128, "hidden": 512, "seq": 8, "batch_per_device": 2}
LAYERS = (4, 8, 16, 32)
SCHEDULES = {  # name: the layout's settings (jaxdp.data_parallel(mesh, ...)) and the loss's reshard_after_forward
    "stage0": {"zero_stage": 0},
    "stage3": {"zero_stage": 3},
    "layerwise": {"zero_stage": 3, "layers": STACK},
    "layerwise_no_reshard": {"zero_stage": 3, "layers": STACK, "reshard_after_forward": False},
}
GROWTH_VS_WHOLE = 0.6
GROWTH_VS_STATE = 1.25


# --------------------------------------------------------------------------
# The model.
# --------------------------------------------------------------------------


def model_params(layers, width, hidden, seed=0):
  """``{"layers": {"scale" [L, D], "w1" [L, D, F], "w2" [L, F, D]}, "norm" [D], "head" [D, 1]}``."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return {
      STACK: {
          "scale": jnp.ones((layers, width), jnp.float32),
          "w1": jax.random.normal(k1, (layers, width, hidden), jnp.float32) / np.sqrt(width),
          "w2": jax.random.normal(k2, (layers, hidden, width), jnp.float32) / np.sqrt(hidden) / layers,
      },
      "norm": jnp.ones((width,), jnp.float32),
      "head": jax.random.normal(k3, (width, 1), jnp.float32) / np.sqrt(width),
  }


def rms_norm(h, scale):
  return h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * scale[None, None]


def block(h, layer):
  layer = jaxdp.gather(layer)  # inside a layer-wise step: this layer's whole leaves; elsewhere: the argument
  return h + jax.nn.gelu(rms_norm(h, layer["scale"]) @ layer["w1"]) @ layer["w2"], None


def make_loss(reshard_after_forward=True):
  """The per-token squared error ``[b, T]``, its loop body checkpointed with ``gather_policy(reshard_after_forward)``."""
  body = jax.checkpoint(block, policy=jaxdp.sharding.layerwise.gather_policy(reshard_after_forward))

  def loss_fn(params, batch):
    h, _ = lax.scan(body, batch["x"], params[STACK])
    return 0.5 * ((rms_norm(h, params["norm"]) @ params["head"])[..., 0] - batch["y"]) ** 2

  return loss_fn


loss_fn = make_loss()


def model_batch(cfg, n, seed=0):
  rng = np.random.default_rng(seed)
  rows = n * cfg["batch_per_device"]
  return {"x": rng.standard_normal((rows, cfg["seq"], cfg["width"]), dtype=np.float32),
          "y": rng.standard_normal((rows, cfg["seq"]), dtype=np.float32)}


# --------------------------------------------------------------------------
# Measurements.
# --------------------------------------------------------------------------


def peak_bytes(analysis) -> int:
  """Per-device peak of a compiled program: arguments + outputs + temporaries, aliased (donated) bytes once."""
  return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes + analysis.temp_size_in_bytes
             - analysis.alias_size_in_bytes)


def compile_step(params, optimizer, mesh, batch, options):
  """The compiled step of one schedule (lowered from a placed state, never run)."""
  options = dict(options)
  loss = make_loss(options.pop("reshard_after_forward", True))
  dp = jaxdp.data_parallel(mesh, **options)  # the layout: the ZeRO stage and the stack
  step = jaxdp.make_train_step(loss, optimizer, dp)
  state = jaxdp.init_state(params, optimizer, dp)
  compiled = step.lower(state, batch).compile()
  del state
  return compiled


def loop_collectives(hlo: str) -> dict:
  """The collectives of optimized HLO text by place: ``{place: {kind: [result bytes, ...]}}``.

  ``place``: "forward" (op_name contains "/while/body/" and no "transpose("), "backward" (both), or
  "outside" (no "/while/body/"). An async op counts once, sized by its ``-done`` result
  (``jaxdp.analysis.reports.hlo_collectives``).
  """
  found = {place: {"all-gather": [], "reduce-scatter": []} for place in ("forward", "backward", "outside")}
  for op in hlo_collectives(hlo):
    if op.kind not in ("all-gather", "reduce-scatter"):
      continue
    if "/while/body/" not in op.line:
      place = "outside"
    else:
      place = "backward" if "transpose(" in op.line else "forward"
    found[place][op.kind].append(op.nbytes)
  return found


def hlo_check(compiled, reshard: bool, cfg, layers, n) -> dict:
  """Goal (c) for one layer-wise step: the counts and bytes of its collectives inside and outside the loops."""
  ops = loop_collectives(compiled.as_text())
  shapes = jax.eval_shape(lambda: model_params(layers, cfg["width"], cfg["hidden"]))
  stacked = jax.tree.leaves(shapes[STACK])
  split = [x for x in stacked if any(d % n == 0 for d in x.shape[1:])]  # k: stacked leaves split over the data axis
  k = len(split)
  layer_bytes = sum(common.tree_bytes(jax.ShapeDtypeStruct(x.shape[1:], x.dtype)) for x in split)
  stack_bytes = common.tree_bytes(split)
  other_bytes = common.tree_bytes({key: v for key, v in shapes.items() if key != STACK})
  found = {
      "forward_all_gathers": len(ops["forward"]["all-gather"]),
      "backward_all_gathers": len(ops["backward"]["all-gather"]),
      "forward_all_gather_bytes": sum(ops["forward"]["all-gather"]),
      "outside_all_gather_bytes": sum(ops["outside"]["all-gather"]),
      "forward_reduce_scatters": len(ops["forward"]["reduce-scatter"]),
      "backward_reduce_scatters": len(ops["backward"]["reduce-scatter"]),
      "backward_reduce_scatter_bytes_times_layers": sum(ops["backward"]["reduce-scatter"]) * layers,
  }
  expected = {
      "forward_all_gathers": k,
      "backward_all_gathers": k if reshard else 0,
      "forward_all_gather_bytes": layer_bytes,
      "forward_reduce_scatters": 0,
      "backward_reduce_scatters": k,
      "backward_reduce_scatter_bytes_times_layers": stack_bytes // n,
  }
  ok = all(found[key] == value for key, value in expected.items()) and found["outside_all_gather_bytes"] <= other_bytes
  return {"found": found, "expected": {**expected, "outside_all_gather_bytes_at_most": other_bytes}, "ok": ok}


def measure(cfg, layers, n, optimizer):
  """One row: the whole parameter bytes and each schedule's peak (plus its memory_analysis), and goal (c)."""
  mesh = jaxdp.data_mesh(jax.devices()[:n])
  params = model_params(layers, cfg["width"], cfg["hidden"])
  batch = model_batch(cfg, n)
  row = {"layers": layers, "param_bytes": common.tree_bytes(params), "peak_bytes": {}, "analysis": {}, "hlo": {}}
  for name, options in SCHEDULES.items():
    start = time.perf_counter()
    compiled = compile_step(params, optimizer, mesh, batch, options)
    analysis = compiled.memory_analysis()
    row["peak_bytes"][name] = peak_bytes(analysis)
    row["analysis"][name] = {
        "argument": int(analysis.argument_size_in_bytes), "output": int(analysis.output_size_in_bytes),
        "temp": int(analysis.temp_size_in_bytes), "alias": int(analysis.alias_size_in_bytes),
        "compile_seconds": time.perf_counter() - start,
    }
    if "layers" in options:
      row["hlo"][name] = hlo_check(compiled, options.get("reshard_after_forward", True), cfg, layers, n)
    del compiled
  return row


def layer_state_bytes(cfg, n) -> dict:
  """Per device, what one more layer adds at rest and as a saved activation (the (b) bound's terms)."""
  per_layer = common.tree_bytes(jax.eval_shape(lambda: model_params(1, cfg["width"], cfg["hidden"])[STACK]))
  state = 16 * per_layer // 4 // n  # params + Adam's mu and nu + the gradient slice, float32, split over n
  activation = 4 * cfg["batch_per_device"] * cfg["seq"] * cfg["width"]  # the scan's saved input h
  return {"layer_param_bytes": per_layer, "sharded_state": state, "activation": activation}


def growth(rows, name) -> float:
  first, last = rows[0], rows[-1]
  return (last["peak_bytes"][name] - first["peak_bytes"][name]) / (last["layers"] - first["layers"])


def goals_of(rows, cfg, n) -> dict:
  terms = layer_state_bytes(cfg, n)
  last = rows[-1]
  slope = {name: growth(rows, name) for name in SCHEDULES}
  bound = GROWTH_VS_STATE * (terms["sharded_state"] + terms["activation"])
  return {
      "a_fits": {
          "text": f"layer-wise peak at L={last['layers']} < the whole float32 params",
          "value": last["peak_bytes"]["layerwise"], "limit": last["param_bytes"],
          "pass": last["peak_bytes"]["layerwise"] < last["param_bytes"]},
      "b_growth_vs_whole": {
          "text": f"layer-wise growth per layer <= {GROWTH_VS_WHOLE} x whole-gather stage 3's",
          "value": slope["layerwise"], "limit": GROWTH_VS_WHOLE * slope["stage3"],
          "pass": slope["layerwise"] <= GROWTH_VS_WHOLE * slope["stage3"]},
      "b_growth_vs_state": {
          "text": f"layer-wise growth per layer <= {GROWTH_VS_STATE} x (layer's sharded state + saved activation)",
          "value": slope["layerwise"], "limit": bound, "pass": slope["layerwise"] <= bound},
      "c_hlo": {
          "text": "layer-wise HLO: k all-gathers per pass inside the loops, reduce-scatter bytes x L = stacked "
                  "gradient bytes / N (every L, both reshard settings)",
          "value": sum(not h["ok"] for r in rows for h in r["hlo"].values()), "limit": 0,
          "pass": all(h["ok"] for r in rows for h in r["hlo"].values())},
  }, slope, terms


# --------------------------------------------------------------------------
# Output.
# --------------------------------------------------------------------------

LABELS = {"stage0": "stage 0", "stage3": "stage 3, whole gather", "layerwise": "layer-wise stage 3",
          "layerwise_no_reshard": "layer-wise, reshard_after_forward=False"}


def plot(rows, cfg, n, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import NullFormatter

  ls = [r["layers"] for r in rows]
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  for i, name in enumerate(SCHEDULES):
    ax.plot(ls, [r["peak_bytes"][name] / MIB for r in rows], "o-", color=f"C{i}", ms=4, label=LABELS[name])
  ax.plot(ls, [r["param_bytes"] / MIB for r in rows], "k--", lw=1.2, label="whole float32 parameters")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xticks(ls, [str(x) for x in ls])
  ax.xaxis.set_minor_formatter(NullFormatter())
  values = [r["peak_bytes"][name] / MIB for r in rows for name in SCHEDULES] + [r["param_bytes"] / MIB for r in rows]
  ticks = [m * 10.0**e for e in range(-3, 7) for m in (1, 2, 5) if min(values) / 1.2 <= m * 10.0**e <= max(values) * 1.2]
  ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
  ax.yaxis.set_minor_formatter(NullFormatter())
  ax.set(xlabel="layers L", ylabel="peak per device (MiB)",
         title=f"compiled step, N={n}, D={cfg['width']}, F={cfg['hidden']}, Adam fp32")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def markdown(rows) -> str:
  lines = ["| L | params (MiB) | stage 0 | stage 3 whole gather | layer-wise | layer-wise, no reshard |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    p = r["peak_bytes"]
    lines.append(f"| {r['layers']} | {r['param_bytes'] / MIB:.1f} | " + " | ".join(
        f"{p[name] / MIB:.1f}" for name in SCHEDULES) + " |")
  return "\n".join(lines)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  common.add_output_args(parser, "out/fsdp", quick="out/fsdp_quick")
  parser.add_argument("--quick", action="store_true",
                      help=f"small width, short sequences ({QUICK}): per-layer activations small next to a layer")
  parser.add_argument("--layers", help=f"comma-separated layer counts (default {','.join(map(str, LAYERS))})")
  parser.add_argument("--width", type=int, help=f"model width D (default {FULL['width']}; {QUICK['width']} with --quick)")
  parser.add_argument("--hidden", type=int, help=f"hidden width F (default {FULL['hidden']}; {QUICK['hidden']} quick)")
  parser.add_argument("--seq", type=int, help=f"tokens per sequence T (default {FULL['seq']}; {QUICK['seq']} quick)")
  parser.add_argument("--batch-per-device", type=int,
                      help=f"sequences per device (default {FULL['batch_per_device']}; {QUICK['batch_per_device']} quick)")
  parser.add_argument("--devices", type=int, default=N_DEVICES, help=f"data-parallel devices N (default {N_DEVICES})")
  parser.add_argument("--check", action="store_true", help="exit with status 1 if a goal fails")
  args = parser.parse_args(argv)
  common.check_publish(parser, args)
  common.fill_defaults(args, FULL, QUICK)
  args.layers = sorted({int(x) for x in (args.layers or ",".join(map(str, LAYERS))).split(",")})
  if len(args.layers) < 2:
    parser.error("--layers needs at least two layer counts (the growth per layer is a difference)")
  common.device_counts([args.devices])
  for name in ("width", "hidden"):
    if getattr(args, name) % args.devices:
      parser.error(f"--{name} {getattr(args, name)} must divide by --devices {args.devices} (every layer splits)")
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  start = time.perf_counter()
  cfg = {k: getattr(args, k) for k in FULL}
  n, optimizer = args.devices, optax.adam(1e-3)
  print(f"stacked MLP blocks D={cfg['width']} F={cfg['hidden']}, T={cfg['seq']}, {cfg['batch_per_device']} "
        f"sequences per device, Adam fp32, N={n}, L in {args.layers}", flush=True)
  rows = []
  for layers in args.layers:
    row = measure(cfg, layers, n, optimizer)
    rows.append(row)
    print(f"L={layers:3d}: params {row['param_bytes'] / MIB:8.2f} MiB; peak per device " + ", ".join(
        f"{name} {row['peak_bytes'][name] / MIB:.2f}" for name in SCHEDULES) + " MiB", flush=True)
  goals, slope, terms = goals_of(rows, cfg, n)
  print("growth per layer (KiB): " + ", ".join(f"{k} {v / 1024:.1f}" for k, v in slope.items()) +
        f"; one layer: params {terms['layer_param_bytes'] / 1024:.1f}, sharded state "
        f"{terms['sharded_state'] / 1024:.1f}, saved activation {terms['activation'] / 1024:.1f}")
  for r in rows:
    for name, h in r["hlo"].items():
      if not h["ok"]:
        print(f"L={r['layers']} {name}: HLO found {h['found']}, expected {h['expected']}")
  table = markdown(rows)
  print("\nPeak per device, MiB:\n\n" + table + "\n")
  for key, g in goals.items():
    print(f"goal {key}: {g['text']}: {g['value'] / 1024:.1f} KiB vs {g['limit'] / 1024:.1f} KiB -- "
          f"{'PASS' if g['pass'] else 'FAIL'}" if key != "c_hlo" else
          f"goal {key}: {g['text']}: {g['value']} step(s) off -- {'PASS' if g['pass'] else 'FAIL'}")
  os.makedirs(args.out, exist_ok=True)
  plot(rows, cfg, n, os.path.join(args.out, "fsdp_memory.png"))
  seconds = time.perf_counter() - start
  out = {"n_devices": n, "rows": rows, "config": {**cfg, "layers": args.layers, "quick": args.quick,
                                                   "optimizer": "adam", "dtype": "float32"},
         "growth_per_layer": slope, "layer_terms": terms, "goals": goals, "markdown": table,
         "machine": common.machine(), "seconds": seconds}
  common.write_json(os.path.join(args.out, "fsdp_memory.json"), out)
  print(f"wrote {args.out}/fsdp_memory.json and {args.out}/fsdp_memory.png in {seconds:.0f} s")
  common.publish(args, {"fsdp_memory.png": "fsdp_memory.png", "fsdp_memory.json": "data/fsdp_memory.json"})
  if args.check and not all(g["pass"] for g in goals.values()):
    raise SystemExit(1)
  return out


if __name__ == "__main__":
  main()
