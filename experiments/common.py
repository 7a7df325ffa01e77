"""What the benchmarks share: the MLP, one timing loop, one statistic, argument and JSON helpers.

Every script that times steps does it here, the same way: the methods run
interleaved step by step (so a change in the load of a shared machine hits
all of them alike), a step is timed to ``block_until_ready``, and a series
of step times is summarised by its median and its 10th and 90th
percentiles. Absolute times on a shared machine drift from day to day;
compare methods through ratios computed within one run.

Importing this module imports JAX but does not start its backend: a script
still sets ``JAX_NUM_CPU_DEVICES`` before its first ``jax.devices()``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

MLP_LAYERS = (784, 1024, 1024, 10)
"""The benchmark MLP: 784-1024-1024-10, ReLU, 1.86M params."""

# --------------------------------------------------------------------------
# The MLP.
# --------------------------------------------------------------------------


def mlp_params(layers=MLP_LAYERS, seed: int = 0) -> dict:
  """He-initialised weights and zero biases: ``{"layer{i}": {"w": [in, out], "b": [out]}}``."""
  keys = jax.random.split(jax.random.key(seed), len(layers) - 1)
  return {
      f"layer{i}": {
          "w": jax.random.normal(key, (fan_in, fan_out), jnp.float32) * np.sqrt(2.0 / fan_in),
          "b": jnp.zeros((fan_out,), jnp.float32),
      }
      for i, (key, fan_in, fan_out) in enumerate(zip(keys, layers[:-1], layers[1:]))
  }


def mlp_loss(params: dict, batch: dict) -> jax.Array:
  """Per-example softmax cross-entropy ``[b]`` of the ReLU MLP ``params`` on ``batch = {"x", "y"}``."""
  h = batch["x"]
  n = len(params)
  for i in range(n):
    layer = params[f"layer{i}"]
    h = h @ layer["w"] + layer["b"][None, :]
    if i < n - 1:
      h = jax.nn.relu(h)
  return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"])


def mlp_batch(layers, rows: int, seed: int = 0) -> dict:
  """Random inputs ``x [rows, in]`` and labels ``y [rows]`` (fixed seed), as numpy arrays."""
  rng = np.random.default_rng(seed)
  return {
      "x": rng.standard_normal((rows, layers[0]), dtype=np.float32),
      "y": rng.integers(0, layers[-1], rows).astype(np.int32),
  }


def param_count(layers) -> int:
  """Parameters of the MLP ``layers`` (weights and biases)."""
  return sum(a * b + b for a, b in zip(layers[:-1], layers[1:]))


def tree_bytes(tree) -> int:
  """Bytes of every leaf of ``tree`` (e.g. the gradient bytes of params)."""
  return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def host_copy(tree):
  """Fresh numpy copies of ``tree``, so that each donated state owns its buffers.

  (``jax.device_put(x, replicated, may_alias=False)`` of a device array still
  reuses ``x``'s buffer for the first device's shard on a multi-device mesh,
  so donating one method's state would delete the arrays another one reads.)
  """
  return jax.tree.map(np.array, tree)


# --------------------------------------------------------------------------
# Timing and its statistic.
# --------------------------------------------------------------------------


def stats(samples) -> dict:
  """``{"median", "p10", "p90", "n"}`` of a series of step times (or ratios)."""
  t = np.asarray(samples, np.float64)
  if t.size == 0:
    return {"median": float("nan"), "p10": float("nan"), "p90": float("nan"), "n": 0}
  return {
      "median": float(np.median(t)),
      "p10": float(np.percentile(t, 10)),
      "p90": float(np.percentile(t, 90)),
      "n": int(t.size),
  }


def time_interleaved(runners: dict[str, Callable[[], Any]], steps: int, warmup: int) -> dict[str, list[float]]:
  """Runs one step of every runner per round; returns each one's timed step times in ms.

  Each round runs the methods in a new order (a seeded shuffle), so no
  method always runs right after the same other one: what a step leaves
  behind (caches, another process's threads still busy) is shared out
  evenly rather than always charged to the same method.

  Args:
    runners: ``name -> run()``, where ``run()`` performs one step and waits
      for its result (``jax.block_until_ready``). A runner whose step happens
      elsewhere (in other processes) may time itself and return its own
      seconds; any other return value is ignored and the call is timed here.
    steps: timed rounds.
    warmup: untimed rounds first (the first one compiles).
  """
  times = {name: [] for name in runners}
  names, shuffle = list(runners), np.random.default_rng(0)
  for i in range(warmup + steps):
    for j in shuffle.permutation(len(names)):
      name, run = names[j], runners[names[j]]
      start = time.perf_counter()
      own = run()
      elapsed = own if isinstance(own, float) else time.perf_counter() - start
      if i >= warmup:
        times[name].append(1e3 * elapsed)
  return times


def time_steps(run: Callable[[], Any], steps: int, warmup: int) -> list[float]:
  """:func:`time_interleaved` of a single runner: its timed step times in ms."""
  return time_interleaved({"run": run}, steps, warmup)["run"]


def ratio_stats(numerator: list[float], denominator: list[float]) -> dict:
  """Ratio of the medians, and the spread of the per-round ratios (same round, same machine load)."""
  per_round = np.asarray(numerator) / np.asarray(denominator)
  spread = stats(per_round)
  return {"ratio": float(np.median(numerator) / np.median(denominator)), "p10": spread["p10"], "p90": spread["p90"]}


def fmt_ms(s: dict) -> str:
  """``median (p10–p90)`` with one decimal."""
  return f"{s['median']:.1f} ({s['p10']:.1f}–{s['p90']:.1f})"


# --------------------------------------------------------------------------
# Arguments, machine and output.
# --------------------------------------------------------------------------


def reduction_of(mode: str = "mean", bucket_bytes: int | None = None, compression: Any = None) -> Any:
  """An experiment's ``--reduction``/``--bucket-bytes``/PowerSGD flags as the step's reduction value:
  ``jaxdp.reductions.<mode>()``, chained with ``bucketed(bucket_bytes)`` and a ``powersgd(...)`` piece when given."""
  import jaxdp

  pieces = [getattr(jaxdp.reductions, mode)()]
  if bucket_bytes is not None:
    pieces.append(jaxdp.reductions.bucketed(bucket_bytes))
  if compression is not None:
    pieces.append(compression)
  return pieces[0] if len(pieces) == 1 else jaxdp.reductions.chain(*pieces)


def precision_of(compute_dtype: Any = None, reduce_dtype: Any = None, loss_scaling: Any = None) -> Any:
  """An experiment's dtype flags as the step's precision policy (``"float32"`` or ``None``: the params' own)."""
  import jaxdp

  own = lambda d: None if d is None or d == "float32" else d  # noqa: E731
  return jaxdp.precision(compute_dtype=own(compute_dtype), reduce_dtype=own(reduce_dtype), loss_scaling=loss_scaling)


def fill_defaults(args: argparse.Namespace, full: dict, quick: dict) -> argparse.Namespace:
  """Sets every option left ``None`` from ``quick`` (under ``--quick``) or ``full``."""
  for name, default in (quick if args.quick else full).items():
    if getattr(args, name, None) is None:
      setattr(args, name, default)
  return args


def device_counts(spec: str | list | tuple, available: int | None = None) -> list[int]:
  """``"1,2,4,8"`` as sorted unique ints; raises ``SystemExit`` naming the fix if too few devices exist."""
  counts = sorted({int(d) for d in (spec.split(",") if isinstance(spec, str) else spec) if str(d).strip()})
  available = jax.device_count() if available is None else available
  for n in counts:
    if not 1 <= n <= available:
      raise SystemExit(f"--devices asks for {n} devices but {available} exist; set JAX_NUM_CPU_DEVICES >= {n}.")
  return counts


def cpu_cores() -> int:
  """Cores this process may run on (its affinity mask, which XLA's thread pool also follows)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    return os.cpu_count() or 1


def machine() -> dict:
  """What the numbers were measured on: backend, devices, cores, versions."""
  devices = jax.devices()
  return {
      "backend": jax.default_backend(),
      "device_kind": devices[0].device_kind,
      "device_count": len(devices),
      "cpu_cores": cpu_cores(),
      "processor": platform.processor() or platform.machine(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "optax": optax.__version__,
  }


DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
"""Where ``--publish`` copies an experiment's committed outputs: reports and figures here, data in ``data/``."""


def add_output_args(parser: argparse.ArgumentParser, out: str, quick: str | None = None) -> None:
  """Adds ``--out DIR`` and ``--publish``, the same two options in every experiment.

  With ``quick``, ``--out`` defaults to ``None`` and :func:`check_publish`
  fills it in (``quick`` under ``--quick``, so a smoke run keeps the full
  run's outputs).
  """
  default = f"{out}; {quick} with --quick" if quick else out
  parser.add_argument("--out", default=None if quick else out, help=f"folder for every output (default {default})")
  parser.add_argument("--publish", action="store_true",
                      help=f"also copy the committed outputs into {DOCS.name}/ and {DOCS.name}/data/, "
                           "overwriting the tracked files there (not with --quick)")
  parser.set_defaults(_out_defaults=(out, quick or out))


def check_publish(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Fills in ``--out``'s default; refuses ``--publish --quick`` before anything runs.

  (A smoke run's numbers must not replace the committed ones.)
  """
  quick = bool(getattr(args, "quick", False))
  if args.publish and quick:
    parser.error("--publish writes the committed files under docs/: run without --quick.")
  defaults = vars(args).pop("_out_defaults")
  if args.out is None:
    args.out = defaults[quick]


def publish(args: argparse.Namespace, files: dict[str, str]) -> list[pathlib.Path]:
  """Under ``--publish``, copies ``{file under args.out: path under docs/}``; returns the paths written.

  The experiment always writes into ``--out`` first, so what is published is
  byte for byte what the run left there.
  """
  if not args.publish:
    return []
  written = []
  for name, target in files.items():
    dest = DOCS / target
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(pathlib.Path(args.out) / name, dest)
    written.append(dest)
  print("published " + ", ".join(str(p.relative_to(DOCS.parent)) for p in written), flush=True)
  return written


def write_json(path, obj) -> pathlib.Path:
  """Writes ``obj`` as indented JSON (numpy scalars as floats), creating the folder."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(obj, indent=1, default=float) + "\n")
  return path


def tensorboard_writer(logdir: str | pathlib.Path):
  """A tensorboardX ``SummaryWriter`` on ``logdir``; tensorboardX is optional, imported only here."""
  try:
    from tensorboardX import SummaryWriter
  except ImportError:
    raise SystemExit("--tensorboard writes TensorBoard event files with tensorboardX, which is not installed: "
                     "pip install 'jaxdp[tensorboard]' (or pip install tensorboardX), or run without --tensorboard.") from None
  return SummaryWriter(logdir=str(logdir))


class MetricsSink:
  """The step metrics of a run: ``metrics.jsonl`` (one JSON object a step) in ``folder``, and with ``tensorboard``
  the same numbers as TensorBoard scalars in ``folder/tensorboard`` (tensorboardX; ``tensorboard --logdir``).

  ``write(line)`` takes one ``metrics.jsonl`` line, the JSON of a record with a ``"step"``; every other number of
  it becomes a scalar of that name at that step. A context manager: leaving it closes both.
  """

  def __init__(self, folder: str | pathlib.Path, *, append: bool = False, tensorboard: bool = False):
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    self._writer = tensorboard_writer(folder / "tensorboard") if tensorboard else None
    self._file = open(folder / "metrics.jsonl", "a" if append else "w")

  def write(self, line: str) -> None:
    self._file.write(line)
    if self._writer is not None:
      record = json.loads(line)
      for name, value in record.items():
        if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
          self._writer.add_scalar(name, value, global_step=record["step"])

  def close(self) -> None:
    self._file.close()
    if self._writer is not None:
      self._writer.close()

  def __enter__(self) -> "MetricsSink":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
