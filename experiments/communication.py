"""Less communication, measured: bytes per step against the loss they cost, side by side with the exact step.

Every method trains the byte-level LM of ``experiments/train_lm.py`` (its
model, corpus, AdamW and validation loss) from one init on one data order,
with the same global batch and tokens per step, dropout 0:

- ``exact``: jaxdp's default step, the weighted-mean gradient all-reduced in float32;
- ``bf16``: the same gradient all-reduced in bfloat16 (``precision=jaxdp.precision(reduce_dtype=jnp.bfloat16)``);
- ``powersgd_rR``: PowerSGD of rank R with error feedback
  (``reduction=jaxdp.reductions.powersgd(rank=R, start_iter=S)``; the first S steps exact);
- ``diloco_hH``: DiLoCo (``jaxdp.make_diloco_step``): exact inner steps within a
  replica group, an outer Nesterov step on the groups' averaged delta every H
  steps; ``diloco_hH_bf16`` / ``diloco_hH_int8`` send the delta in bfloat16 / int8;
  ``diloco_hH_olrX``: outer learning rate X instead of the paper's 0.7;
- ``onebit_adam``: 1-bit Adam (``jaxdp.reductions.onebit_adam``, AdamW's settings), its exact warm-up
  a fifth of ``--steps``, then the momentum at one bit per value;
- ``float16_dynamic``: float16 compute with dynamic loss scaling
  (``precision=jaxdp.precision(jnp.float16, loss_scaling=jaxdp.dynamic_loss_scale())``): the exact step's
  bytes, its row shows the quality.

Mesh: 4 simulated CPU devices. exact, bf16, PowerSGD and float16 split the
batch over ``data=4``. DiLoCo runs on ``replica=4, data=1``: each replica group
is one device, so its only cross-device traffic is the outer sync (and the
step's scalar sums); each device gets the same rows as under ``data=4``.

The learning rate warms up over a tenth of ``--steps`` and decays (cosine) to
lr/10 at ``--steps``, where every row's ``final_val_loss`` is read; then
``--tail-steps`` more steps at lr/10, which only ``steps_to_target_loss``
sees (train_lm decays to 0, after which no run could catch up).

``bytes_per_step`` counts the bytes each device sends in the step's collectives
(all-reduce, reduce-scatter, all-gather, all-to-all; ring algorithm, ``traffic_bytes`` of
``jaxdp.analysis.reports.collectives_from_hlo``) in the HLO jaxdp emits, before the backend's
optimisation: the dtype jaxdp communicates in, as GPU and TPU backends move it
(the CPU compiler widens bfloat16 all-reduces to float32; its count is
``compiled_bytes_per_step``). PowerSGD's and 1-bit Adam's is their compressed program (after
``start_iter`` / the warm-up); ``bytes_per_step_incl_warmup`` averages the exact warm-up steps in.
DiLoCo's is averaged over an outer period: ``((H - 1) inner + 1 sync) / H``.
``final_val_loss`` is the validation loss after step ``--steps`` (DiLoCo: of
its outer parameters); ``steps_to_target_loss`` the first evaluation step whose
validation loss is at most exact's final one (``null`` if none);
``loss_gap_vs_exact`` is ``(final - exact_final) / exact_final``. Writes
``communication.json`` (``{"rows", "setup", "machine"}``) and
``communication.png`` (validation loss against steps and against cumulative
bytes) under ``--out`` (default ``out/communication``); ``--publish`` copies them
to ``docs/data/communication.json`` and ``docs/communication.png``.

  python experiments/communication.py [--steps 300] [--out out/communication] [--publish]
  python experiments/communication.py --quick     # 20 (+5) steps on a 200 kB corpus, DiLoCo H = 5
  python experiments/communication.py --methods exact,powersgd_r2,diloco_h50
  python experiments/communication.py --reuse A/communication.json,B/communication.json   # rows already run
  python experiments/communication.py --tradeoff LM.json[,LM2.json] --cnn CNN.json   # the bytes-quality figure

PowerSGD on the digits CNN with SGD + Nesterov (over seeds) is ``experiments/communication_cnn.py``.

--quick: 74 s on an idle 2-core CPU machine (all nine methods). The full run:
6 min 35 s there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import re
import sys
import time
from typing import Any, Callable

if __name__ == "__main__":  # before JAX initialises its backend
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdp  # noqa: E402
from experiments import common, train_lm  # noqa: E402
from experiments.lm import corpus  # noqa: E402
from experiments.lm import model as lm  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402
from jaxdp.io.data import DataPipeline  # noqa: E402

FULL = {"steps": 300, "tail_steps": 50, "max_bytes": 1_000_000, "eval_every": 10, "start_iter": 10, "diloco_h": "10,50"}
QUICK = {"steps": 20, "tail_steps": 5, "max_bytes": 200_000, "eval_every": 10, "start_iter": 2, "diloco_h": "5"}
DEVICES = 4
POWERSGD_RANKS = (1, 2, 4)
DILOCO = re.compile(r"diloco_h(\d+)(?:_(bf16|int8))?(?:_olr(\d+(?:\.\d+)?))?")
"""``diloco_hH``: H inner steps per outer sync, the deltas all-reduced in float32, ``_bf16`` bfloat16, ``_int8`` int8;
``_olrX``: outer learning rate X (default 0.7, the paper's), Nesterov momentum 0.9 either way."""
OUTER_LR = 0.7
DELTA_DTYPES = {None: None, "bf16": jnp.bfloat16, "int8": jnp.int8}


def method_names(diloco_h) -> list[str]:
  """Every method, in table order, with DiLoCo's periods ``diloco_h``."""
  return (["exact", "bf16"] + [f"powersgd_r{r}" for r in POWERSGD_RANKS] + [f"diloco_h{h}" for h in diloco_h]
          + [f"diloco_h{max(diloco_h)}_int8", "float16_dynamic"])


def _need(name: str, method: str):
  """``jaxdp.<name>`` (a dotted path: ``reductions.powersgd``), or a clear error saying which method needs it
  (a jaxdp without it)."""
  try:
    value = jaxdp
    for part in name.split("."):
      value = getattr(value, part)
    return value
  except AttributeError:
    raise RuntimeError(f"method {method!r} needs jaxdp.{name}, which this jaxdp does not have; "
                       f"leave {method!r} out of --methods.") from None


def _check_available(name: str) -> None:
  """Raises :func:`_need`'s error now, before any method trains, if ``name`` needs an API this jaxdp lacks."""
  if name.startswith("powersgd_r"):
    _need("reductions.powersgd", name)
  elif DILOCO.fullmatch(name):
    for api in ("make_diloco_step", "init_diloco_state", "diloco.diloco_params"):
      _need(api, name)
  elif name == "float16_dynamic":
    _need("dynamic_loss_scale", name)
  elif name == "onebit_adam":
    _need("reductions.onebit_adam", name)
  elif name not in ("exact", "bf16"):
    raise ValueError(f"unknown method {name!r}; choose from exact, bf16, powersgd_rR, diloco_hH, diloco_hH_bf16, "
                     "diloco_hH_int8, diloco_hH_olrX, float16_dynamic, onebit_adam")


def traffic(hlo: str, n: int) -> float:
  """Bytes each device sends in the collectives of HLO text (ring algorithm; all kinds)."""
  return float(sum(c.traffic_bytes for c in jaxdp.analysis.reports.collectives_from_hlo(hlo, n).values()))


def lowered_bytes(lowered) -> dict:
  """``{"bytes", "compiled_bytes"}`` of a ``jax.stages.Lowered`` step (before and after XLA's optimisation)."""
  return {"bytes": traffic(lowered.as_text(dialect="hlo"), DEVICES),
          "compiled_bytes": traffic(lowered.compile().as_text(), DEVICES)}


@dataclasses.dataclass
class Method:
  """One way to train: its mesh, state, step, the params it is evaluated on and its bytes per step."""

  name: str
  mesh: Mesh
  axis_name: Any
  state: Any
  step: Callable  # (state, batch, weights) -> (state, metrics)
  params: Callable  # state -> params to evaluate
  step_bytes: Callable  # (state, batch, weights) -> (bytes of step i, compiled bytes of step i) as functions of i
  notes: str = ""


def _mesh(axes: dict[str, int]) -> Mesh:
  devices = np.asarray(jax.devices()[:math.prod(axes.values())]).reshape(tuple(axes.values()))
  return Mesh(devices, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def make_optimizer(config: train_lm.Config) -> optax.GradientTransformation:
  """train_lm's AdamW (warm-up over a tenth of ``config.steps``, cosine decay), decaying to a tenth of the peak.

  train_lm decays to 0, where every run stops moving at its last step; a floor
  of ``lr / 10`` (held after ``config.steps``) lets the tail steps show how
  many more steps a method needs to reach the exact run's final loss.
  """
  return optax.adamw(make_schedule(config), weight_decay=0.01)


def make_schedule(config: train_lm.Config) -> optax.Schedule:
  """:func:`make_optimizer`'s learning rate: warm-up over a tenth of ``config.steps``, cosine decay to lr/10."""
  warmup = max(1, config.steps // 10)
  return optax.warmup_cosine_decay_schedule(0.0, config.lr, warmup, max(config.steps, warmup + 1),
                                            end_value=config.lr / 10)


def onebit_warmup(steps: int) -> int:
  """1-bit Adam's exact warm-up: a fifth of the schedule (Tang et al. use 15-25% of training)."""
  return max(1, steps // 5)


def _exact_steps(name: str, start_iter: int, steps: int) -> int:
  """The steps a method runs exactly before it compresses (PowerSGD's start_iter, 1-bit Adam's warm-up)."""
  if name.startswith("powersgd_r"):
    return start_iter
  return onebit_warmup(steps) if name == "onebit_adam" else 0


def build(name: str, config: train_lm.Config, params, loss_fn, start_iter: int, cache: dict) -> Method:
  """The :class:`Method` called ``name`` (see :func:`method_names`); ``cache`` keeps the exact program's bytes."""
  optimizer = make_optimizer(config)
  if name in ("exact", "bf16", "float16_dynamic", "onebit_adam") or name.startswith("powersgd_r"):
    mesh, axis = _mesh({"data": DEVICES}), "data"
    dp = jaxdp.data_parallel(mesh, axis_name=axis)
    options, notes = {}, ""  # the step's reduction and precision values (the same given to init_state)
    if name == "bf16":
      options["precision"] = jaxdp.precision(reduce_dtype=jnp.bfloat16)
    elif name == "float16_dynamic":
      options["precision"] = jaxdp.precision(jnp.float16, loss_scaling=_need("dynamic_loss_scale", name)())
    elif name.startswith("powersgd_r"):
      rank = int(name.removeprefix("powersgd_r"))
      powersgd = _need("reductions.powersgd", name)
      options["reduction"] = powersgd(rank=rank, start_iter=start_iter)
    elif name == "onebit_adam":  # AdamW's settings; its own optimizer (frozen variance after the warm-up)
      onebit = _need("reductions.onebit_adam", name)(make_schedule(config), warmup_steps=onebit_warmup(config.steps),
                                                    weight_decay=0.01)
      optimizer, options["reduction"] = onebit.optimizer, onebit.reduction
    step = jaxdp.make_train_step(loss_fn, optimizer, dp, **options)
    state = jaxdp.init_state(params, optimizer, dp, **options)

    def step_bytes(state, batch, weights):
      if not (name.startswith("powersgd_r") or name == "onebit_adam"):
        measured = lowered_bytes(step.lower(state, batch, weights))
        if name == "exact":
          cache["exact"] = measured
        return lambda i: measured["bytes"], lambda i: measured["compiled_bytes"]
      # Before start_iter the step runs its exact branch: the exact program's bytes. After, the compressed
      # program's, read from a step built with start_iter=0 (the running step's lax.cond holds both branches,
      # and the HLO text shows the collectives of both).
      if "exact" not in cache:
        cache["exact"] = lowered_bytes(jaxdp.make_train_step(loss_fn, optimizer, dp).lower(
            jaxdp.init_state(params, optimizer, dp), batch, weights))
      warm, exact_steps = cache["exact"], _exact_steps(name, start_iter, config.steps)
      if name == "onebit_adam":  # the same reduction compressing from step 0
        hot_reduction = jaxdp.reductions.onebit.reduction(onebit.settings._replace(warmup_steps=0))
      else:
        hot_reduction = powersgd(rank=rank, start_iter=0)
      hot_step = jaxdp.make_train_step(loss_fn, optimizer, dp, reduction=hot_reduction)
      hot = lowered_bytes(hot_step.lower(
          jaxdp.init_state(params, optimizer, dp, reduction=hot_reduction), batch, weights))
      return ((lambda i: warm["bytes"] if i < exact_steps else hot["bytes"]),
              (lambda i: warm["compiled_bytes"] if i < exact_steps else hot["compiled_bytes"]))

    return Method(name, mesh, axis, state, step, lambda s: s.params, step_bytes, notes)
  if match := DILOCO.fullmatch(name):
    h, delta_dtype = int(match.group(1)), DELTA_DTYPES[match.group(2)]
    outer = optax.sgd(float(match.group(3) or OUTER_LR), momentum=0.9, nesterov=True)
    make_step, init = _need("make_diloco_step", name), _need("init_diloco_state", name)
    outer_params = _need("diloco.diloco_params", name)
    mesh, axis = _mesh({"replica": DEVICES, "data": 1}), ("replica", "data")
    groups = jaxdp.data_parallel(mesh, axis_name="data")  # each group's data axis; "replica" is the outer one
    step = make_step(loss_fn, optimizer, groups, inner_steps=h, delta_dtype=delta_dtype,
                     outer_optimizer=outer)
    state = init(params, optimizer, groups, outer_optimizer=outer)

    def step_bytes(state, batch, weights):
      inner = lowered_bytes(step.lower_inner(state, batch, weights))
      sync = lowered_bytes(step.lower_sync(state, batch, weights))
      return ((lambda i: sync["bytes"] if (i + 1) % h == 0 else inner["bytes"]),
              (lambda i: sync["compiled_bytes"] if (i + 1) % h == 0 else inner["compiled_bytes"]))

    return Method(name, mesh, axis, state, step, outer_params, step_bytes)
  raise ValueError(f"unknown method {name!r}; choose from exact, bf16, powersgd_rR, diloco_hH, diloco_hH_bf16, "
                   "diloco_hH_int8, diloco_hH_olrX, float16_dynamic, onebit_adam")


def run_method(method: Method, config: train_lm.Config, data, loss_fn, eval_every: int, tail: int,
               progress: bool) -> dict:
  """Trains ``method`` for ``config.steps + tail`` steps; returns its validation curve and bytes per step."""
  train_set, val_set = data
  collate = corpus.make_collate(config.seq_len)
  per_device = config.batch_size // DEVICES
  pipeline = DataPipeline(train_set, collate, method.mesh, per_device_batch=per_device, seed=config.seed,
                          axis_name=method.axis_name)
  eval_mesh = _mesh({"data": DEVICES})
  identity = optax.identity()

  def validate(state) -> float:
    params = jax.tree.map(np.asarray, method.params(state))  # host copy: the next step donates the state
    held = jaxdp.init_state(params, identity, eval_mesh)
    return train_lm.evaluate(loss_fn, held, val_set, eval_mesh, collate, per_device_batch=4 * per_device)["loss"]

  state, curve, bytes_of, first = method.state, [], None, None
  total = config.steps + tail
  start = time.perf_counter()
  for i, (batch, weights) in pipeline.iterate(num_steps=total):
    if first is None:
      first = jax.device_get(weights)
      bytes_of = method.step_bytes(state, batch, weights)
      curve.append({"step": 0, "val_loss": validate(state)})
    state, _ = method.step(state, batch, weights)
    if (i + 1) % eval_every == 0 or i + 1 in (config.steps, total):
      curve.append({"step": i + 1, "val_loss": validate(state)})
      if progress:
        print(f"  {method.name} step {i + 1}/{total}: val loss {curve[-1]['val_loss']:.4f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
  per_step = [bytes_of[0](i) for i in range(total)]
  per_step_compiled = [bytes_of[1](i) for i in range(total)]
  cumulative = np.concatenate([[0.0], np.cumsum(per_step)])
  for point in curve:
    point["bytes_communicated"] = float(cumulative[point["step"]])
  return {"curve": curve, "final_val_loss": next(p["val_loss"] for p in curve if p["step"] == config.steps),
          "per_step": per_step[:config.steps], "per_step_compiled": per_step_compiled[:config.steps], "first_weights": first,
          "seconds": time.perf_counter() - start}


def _period_mean(values: list[float], start: int, period: int) -> float:
  """Mean of ``values[start:]`` over whole periods of ``period`` steps (all of them if fewer)."""
  tail = values[start:]
  whole = len(tail) - len(tail) % period if len(tail) >= period else len(tail)
  return float(np.mean(tail[:whole])) if whole else float(values[-1])


def summarise(name: str, result: dict, start_iter: int) -> dict:
  """One row of ``communication.json`` (without the comparisons to exact)."""
  match = DILOCO.fullmatch(name)
  period = int(match.group(1)) if match else 1
  per_step, compiled = result["per_step"], result["per_step_compiled"]
  skip = _exact_steps(name, start_iter, len(per_step))
  return {
      "method": name,
      "bytes_per_step": _period_mean(per_step, skip, period),
      "compiled_bytes_per_step": _period_mean(compiled, skip, period),
      "bytes_per_step_incl_warmup": float(np.mean(per_step)),
      "final_val_loss": result["final_val_loss"],
      "curve": result["curve"],
      "seconds": result["seconds"],
  }


def compare_rows(rows: list[dict]) -> list[dict]:
  """Adds ``steps_to_target_loss``, ``loss_gap_vs_exact`` and ``bytes_ratio_vs_exact`` (exact's bytes / the row's)."""
  exact = next((r for r in rows if r["method"] == "exact"), None)
  if exact is None:
    raise ValueError("the comparisons need the exact run: keep 'exact' in --methods")
  target = exact["final_val_loss"]
  for row in rows:
    reached = [p["step"] for p in row["curve"] if p["val_loss"] <= target]
    row["steps_to_target_loss"] = reached[0] if reached else None
    row["loss_gap_vs_exact"] = (row["final_val_loss"] - target) / target
    row["bytes_ratio_vs_exact"] = exact["bytes_per_step"] / row["bytes_per_step"] if row["bytes_per_step"] else None
  return rows


REUSE_KEYS = ("steps", "tail_steps", "batch_size", "seq_len", "devices", "meshes", "model", "params", "max_bytes",
              "train_sequences", "val_sequences", "eval_every", "powersgd_start_iter", "optimizer",
              "diloco_outer_optimizer", "dropout", "seed", "bytes")
"""The settings a reused row must share with the run (``--reuse``)."""


def _reusable_rows(reuse: list[dict] | None, setup: dict) -> dict[str, dict]:
  """``{method: row}`` of earlier ``communication.json`` results made with this ``setup`` (the first one having a
  method gives its row); a ``ValueError`` if a setup differs."""
  rows = {}
  keep = ("method", "bytes_per_step", "compiled_bytes_per_step", "bytes_per_step_incl_warmup", "final_val_loss",
          "curve", "seconds")
  for earlier in reuse or []:
    differ = [k for k in REUSE_KEYS if earlier["setup"].get(k) != setup[k]]
    if differ:
      raise ValueError(f"--reuse: a setup differs from this run's in {', '.join(differ)}; rerun those methods "
                       "with the same options, or drop --reuse")
    for row in earlier["rows"]:
      rows.setdefault(row["method"], {**{k: row[k] for k in keep}, "run_by": earlier["setup"].get("command")})
  return rows


def compare(config: train_lm.Config, methods: list[str], eval_every: int, start_iter: int, tail: int = 0,
            progress: bool = True, reuse: list[dict] | None = None, partial=None) -> dict:
  """Trains every method of ``methods`` from one init on one data order; returns ``{"rows", "setup"}``.

  Each runs ``config.steps`` steps (the schedule's length, where ``final_val_loss`` is read) and ``tail``
  more at the schedule's floor, which only ``steps_to_target_loss`` looks at. ``reuse``: earlier results
  of the same setup whose rows are taken as they are for the methods they have.
  """
  if config.batch_size % DEVICES:
    raise ValueError(f"batch_size {config.batch_size} must be a multiple of the {DEVICES} devices")
  for name in methods:
    if (match := DILOCO.fullmatch(name)) and config.steps % int(match.group(1)):
      raise ValueError(f"{name}: steps={config.steps} is not a multiple of H={match.group(1)}, so the run would end "
                       "between outer syncs; choose steps (or H) so that H divides steps")
  if jax.device_count() < DEVICES:
    raise SystemExit(f"{DEVICES} devices are needed but {jax.device_count()} exist; set JAX_NUM_CPU_DEVICES={DEVICES}.")
  config = dataclasses.replace(config, dropout=0.0, out=None, ckpt_dir=None)
  data = train_lm.build_dataset(config)
  definition, params = train_lm.make_model(config)
  params = jax.tree.map(np.asarray, params)  # every method starts from its own copy (steps donate their state)
  loss_fn = lm.make_loss_fn(definition)
  n_params = sum(int(np.size(x)) for x in jax.tree.leaves(params))
  setup = {
      "steps": config.steps, "tail_steps": tail, "batch_size": config.batch_size, "seq_len": config.seq_len,
      "tokens_per_step": config.batch_size * config.seq_len, "devices": DEVICES,
      "meshes": {"exact, bf16, powersgd, float16": {"data": DEVICES}, "diloco": {"replica": DEVICES, "data": 1}},
      "model": {k: getattr(config, k) for k in ("layers", "d_model", "heads", "d_ff")}, "params": n_params,
      "param_bytes": n_params * 4, "max_bytes": config.max_bytes, "train_sequences": len(data[0]),
      "val_sequences": len(data[1]), "eval_every": eval_every, "powersgd_start_iter": start_iter,
      "optimizer": f"adamw lr {config.lr}, weight decay 0.01, warm-up {max(1, config.steps // 10)} steps, cosine "
                   f"decay to lr/10 at step {config.steps}, then constant",
      "diloco_outer_optimizer": f"sgd lr {OUTER_LR} (diloco_hH_olrX: X), Nesterov momentum 0.9", "dropout": 0.0, "seed": config.seed,
      "bytes": "per device and step, sent in collectives (ring), from the HLO before backend optimisation",
  }
  reused = _reusable_rows(reuse, setup)
  for name in methods:
    if name not in reused:
      _check_available(name)
  rows, first, cache = [], None, {}
  for name in methods:
    if name in reused:
      row = dict(reused[name])
      setup.setdefault("rows_run_by", {})[name] = row.pop("run_by")
      rows.append(row)
      if progress:
        print(f"{name}: row taken from --reuse", flush=True)
      continue
    if progress:
      print(f"{name}:", flush=True)
    method = build(name, config, params, loss_fn, start_iter, cache)
    result = run_method(method, config, data, loss_fn, eval_every, tail, progress)
    if first is None:
      first = result["first_weights"]
    elif not np.array_equal(first, result["first_weights"]):  # one data order for every mesh
      raise AssertionError(f"{name} saw another first batch than {methods[0]}")
    rows.append(summarise(name, result, start_iter))
    if partial is not None:  # the rows so far, for --reuse if the run is cut short
      common.write_json(partial, {"rows": rows, "setup": setup})
  # Without exact (its row reused by a later --reuse run) the rows stay without the comparisons.
  return {"rows": compare_rows(rows) if any(r["method"] == "exact" for r in rows) else rows, "setup": setup}


def plot(result: dict, path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
  setup = result["setup"]
  exact = next(r for r in result["rows"] if r["method"] == "exact")
  target = exact["final_val_loss"]
  # The y axis starts where exact is a sixth into its schedule: the early steps (and DiLoCo before its first
  # sync, still at the initial loss) would squeeze the differences that matter into a sliver.
  early = next(p for p in exact["curve"] if p["step"] >= setup["steps"] // 6)["val_loss"]
  lowest = min(p["val_loss"] for row in result["rows"] for p in row["curve"])
  for i, row in enumerate(result["rows"]):
    points = [p for p in row["curve"] if p["step"] > 0]
    style = "-" if row["method"] in ("exact", "bf16", "float16_dynamic") else ("--" if "powersgd" in row["method"] else ":")
    exact_row = row["method"] == "exact"
    # Lines that lie on top of each other (exact, bf16, float16; the DiLoCo pair) stay apart by their markers:
    # a shape each, hollow, on staggered points.
    kw = dict(color="black" if exact_row else f"C{i}", ls=style, label=row["method"], lw=2.5 if exact_row else 1.5,
              zorder=1 if exact_row else 2, marker=None if exact_row else "os^vD<>Px*"[i % 10], mfc="none", ms=6,
              markevery=(i % 3, 3))
    left.plot([p["step"] for p in points], [p["val_loss"] for p in points], **kw)
    sent = [p for p in points if p["bytes_communicated"] > 0]  # log axis: DiLoCo sends nothing before its first sync
    right.plot([p["bytes_communicated"] for p in sent], [p["val_loss"] for p in sent], **kw)
  for ax in (left, right):
    ax.axhline(target, color="gray", lw=0.8, ls="--")
    ax.set_ylim(lowest - 0.05 * (early - lowest), early + 0.3 * (early - lowest))
  if setup.get("tail_steps"):  # the tail at the schedule's floor, after the point every row is compared at
    left.axvline(setup["steps"], color="gray", lw=0.8, ls=":")
  left.set(xlabel=f"step ({setup['tokens_per_step']} tokens each)", ylabel="validation loss (nats/byte)",
           title=f"byte-level LM, {setup['devices']} devices, same tokens")
  right.set(xscale="log", xlabel="bytes sent per device, cumulative", ylabel="validation loss (nats/byte)",
            title="loss against bytes communicated")
  left.legend(fontsize="small")
  overlapping = overlapping_methods(result["rows"])
  if overlapping:
    right.text(0.02, 0.07, "on top of each other (final losses within 0.2%):\n" + "\n".join(overlapping),
              transform=right.transAxes, fontsize="x-small", va="bottom", color="0.3")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def overlapping_methods(rows: list[dict], tolerance: float = 2e-3) -> list[str]:
  """Groups of methods whose final losses are within ``tolerance`` (relative) of each other, as "a, b, c"."""
  ordered = sorted(rows, key=lambda r: r["final_val_loss"])
  groups, group = [], [ordered[0]]
  for row in ordered[1:]:
    if row["final_val_loss"] - group[0]["final_val_loss"] <= tolerance * group[0]["final_val_loss"]:
      group.append(row)
    else:
      groups.append(group)
      group = [row]
  groups.append(group)
  return [", ".join(r["method"] for r in g) for g in groups if len(g) > 1]


def plot_tradeoff(lm_results: list[dict], cnn: dict | None, path) -> None:
  """Bytes against quality for every method: left, the LM runs (loss gap to exact against the bytes ratio, one
  marker shape per run length); right, the CNN (accuracy gap in points, mean over seeds, bars from the lowest to
  the highest seed's gap)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  def family(method: str) -> str:
    return ("diloco" if method.startswith("diloco") else "powersgd" if method.startswith("powersgd")
            else method.split("_")[0])

  colors = {"exact": "black", "bf16": "C0", "powersgd": "C1", "diloco": "C2", "float16": "C4", "onebit": "C3"}
  fig, axes = plt.subplots(1, 2 if cnn else 1, figsize=(13 if cnn else 7, 5), squeeze=False)
  left = axes[0][0]
  for result, marker in zip(lm_results, "osD^v"):
    steps = result["setup"]["steps"]
    for i, row in enumerate(result["rows"]):
      x, y = row["bytes_ratio_vs_exact"], 100 * row["loss_gap_vs_exact"]
      left.scatter(x, y, marker=marker, color=colors.get(family(row["method"]), "C7"), s=40, zorder=3)
      left.annotate(f"{row['method']} ({steps})", (x, y), fontsize=7, xytext=(4, 3 - 9 * (i % 2)),
                    textcoords="offset points")
    left.scatter([], [], marker=marker, color="gray", label=f"{steps} steps")
  left.axhline(0, color="gray", lw=0.8)
  left.axhline(3, color="gray", lw=0.8, ls=":")
  left.set(xscale="log", xlabel="fewer bytes per step than exact (×)", ylabel="final val loss vs exact (%)",
           title="byte-level LM, AdamW inner optimizer, 4 devices, 1 seed")
  left.legend(fontsize="small")
  if cnn:
    right = axes[0][1]
    for i, row in enumerate(cnn["rows"]):
      gaps = 100 * np.asarray(row["accuracy_gap_vs_exact_per_seed"])
      x, y = row["bytes_ratio_vs_exact"], gaps.mean()
      right.errorbar(x, y, yerr=[[y - gaps.min()], [gaps.max() - y]], fmt="o", capsize=3,
                     color=colors.get(family(row["method"]), "C7"))
      right.annotate(row["method"], (x, y), fontsize=7, xytext=(4, 3 - 9 * (i % 2)), textcoords="offset points")
    right.axhline(0, color="gray", lw=0.8)
    right.axhline(-0.5, color="gray", lw=0.8, ls=":")
    right.set(xscale="log", xlabel="fewer bytes per step than exact (×)",
              ylabel="final test accuracy vs exact (points)",
              title=f"digits CNN, SGD + Nesterov 0.9, {len(cnn['setup']['seeds'])} seeds (bars: min to max)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _percent(x: float) -> str:
  """``+6.17%``; a gap below 0.005% with its first significant digit (``-0.0003%``), not as ``-0.00%``."""
  return f"{100 * x:+.2f}%" if x == 0 or abs(x) >= 5e-5 else f"{100 * x:+.1g}%"


def markdown_table(result: dict) -> str:
  """The rows as the Markdown table of ``docs/communication.md``."""
  lines = ["| method | kB sent per device and step | fewer bytes than exact | final val loss | vs exact | "
           "steps to exact's final loss |", "|---|---:|---:|---:|---:|---:|"]
  for row in result["rows"]:
    ratio, reached = row["bytes_ratio_vs_exact"], row["steps_to_target_loss"]
    lines.append(f"| `{row['method']}` | {row['bytes_per_step'] / 1e3:.1f} | "
                 f"{'–' if ratio is None else f'{ratio:.1f}×'} | {row['final_val_loss']:.4f} | "
                 f"{_percent(row['loss_gap_vs_exact'])} | {'not reached' if reached is None else reached} |")
  return "\n".join(lines)


def write_outputs(result: dict, out) -> pathlib.Path:
  """Writes ``communication.json`` and ``communication.png`` into the folder ``out``; returns it."""
  out = pathlib.Path(out)
  common.write_json(out / "communication.json", result)
  if _has_exact(result):
    plot(result, out / "communication.png")
  return out


def _has_exact(result: dict) -> bool:
  return any(r["method"] == "exact" for r in result["rows"])


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help=f"smoke run; defaults become {QUICK}")
  p.add_argument("--steps", type=int, help=f"training steps per method (default {FULL['steps']})")
  p.add_argument("--max-bytes", type=int, help=f"corpus budget in bytes (default {FULL['max_bytes']})")
  p.add_argument("--tail-steps", type=int, help="steps after --steps at the schedule's floor, for steps_to_target_loss "
                 f"(default {FULL['tail_steps']})")
  p.add_argument("--eval-every", type=int, help=f"steps between validations (default {FULL['eval_every']})")
  p.add_argument("--start-iter", type=int, help=f"PowerSGD's exact steps first (default {FULL['start_iter']})")
  p.add_argument("--diloco-h", help=f"DiLoCo's inner steps per outer sync, comma-separated (default {FULL['diloco_h']})")
  p.add_argument("--methods", help="comma-separated subset of the methods (default: all; exact is always needed)")
  p.add_argument("--reuse", help="earlier communication.json files of the same setup, comma-separated: their methods' "
                 "rows are kept, only the others are trained (the runs are deterministic on CPU)")
  p.add_argument("--no-progress", dest="progress", action="store_false")
  p.add_argument("--plot-only", metavar="JSON", help="draw communication.png from a communication.json (e.g. "
                 "docs/data/communication.json) into --out without training; with --publish, into docs/")
  p.add_argument("--publish-as", default="communication", help="--publish copies the outputs to docs/data/NAME.json "
                 "and docs/NAME.png (default communication)")
  p.add_argument("--tradeoff", help="no training: LM communication.json files (comma-separated) and, with --cnn, "
                 "experiments/communication_cnn.py's JSON, drawn as bytes against quality in "
                 "communication_tradeoff.png (--publish: docs/communication_tradeoff.png)")
  p.add_argument("--cnn", help="with --tradeoff: the CNN's communication_cnn.json")
  common.add_output_args(p, "out/communication", quick="out/communication_quick")
  args = p.parse_args(argv)
  common.check_publish(p, args)
  if args.plot_only:
    result = json.loads(pathlib.Path(args.plot_only).read_text())
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    plot(result, pathlib.Path(args.out) / "communication.png")
    common.publish(args, {"communication.png": "communication.png"})
    return result
  if args.tradeoff:
    lm = [json.loads(pathlib.Path(f).read_text()) for f in args.tradeoff.split(",")]
    cnn = json.loads(pathlib.Path(args.cnn).read_text()) if args.cnn else None
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    plot_tradeoff(lm, cnn, pathlib.Path(args.out) / "communication_tradeoff.png")
    common.publish(args, {"communication_tradeoff.png": "communication_tradeoff.png"})
    return {"lm": lm, "cnn": cnn}
  common.fill_defaults(args, FULL, QUICK)
  diloco_h = [int(h) for h in str(args.diloco_h).split(",") if h.strip()]
  methods = args.methods.split(",") if args.methods else method_names(diloco_h)
  config = train_lm.Config(steps=args.steps, max_bytes=args.max_bytes, progress=False)
  start = time.perf_counter()
  reuse = [json.loads(pathlib.Path(f).read_text()) for f in args.reuse.split(",")] if args.reuse else None
  result = compare(config, methods, args.eval_every, args.start_iter, args.tail_steps, progress=args.progress,
                   reuse=reuse, partial=pathlib.Path(args.out) / "partial.json")
  result["machine"] = common.machine()
  result["setup"]["command"] = "python experiments/communication.py " + " ".join(sys.argv[1:] if argv is None else argv)
  result["setup"]["wall_seconds"] = time.perf_counter() - start
  out = write_outputs(result, args.out)
  if _has_exact(result):
    print(markdown_table(result))
  print(f"wall time {result['setup']['wall_seconds']:.0f} s; outputs in {out}")
  common.publish(args, {"communication.json": f"data/{args.publish_as}.json",
                        "communication.png": f"{args.publish_as}.png"})
  return result


if __name__ == "__main__":
  main()
