"""A CNN with BatchNorm and Dropout (flax nnx) trained data-parallel on real images.

The program of flax's canonical MNIST example (two convolutions, each with
BatchNorm and Dropout, SGD with momentum), ported to jaxdp in a few lines and
trained on scikit-learn's bundled handwritten digits (1,797 8×8 images,
scikit-learn is an experiments-only dependency). The global batch does not
divide the training set, so the last batch of every epoch is partial and
padded with zero-weight rows, which the exact BatchNorm keeps out of its
statistics.

  python experiments/train_cnn.py                       # N devices, sync BatchNorm
  python experiments/train_cnn.py --bn local            # per-device BatchNorm (DDP without SyncBatchNorm)
  python experiments/train_cnn.py --compare             # 1 device vs N sync vs N local, dropout off
  python experiments/train_cnn.py --compare --dropout 0.5   # the same with dropout: masks follow example ids
  python experiments/train_cnn.py --quick               # 30 steps
  python experiments/train_cnn.py --compare --publish   # also copy loss_curves.png to docs/cnn_loss_curves.png

--quick: about 9 s on an idle 2-core CPU machine.

Dropout is layout-invariant: the step is built with ``example_ids="id"``
(each batch carries the examples' indices in the training set) and the CNN
uses ``jaxdp.adapters.nnx.Dropout``, so every example gets the same mask on one
device or N, whatever the split (see ``jaxdp.core.randomness``).

``--compare`` trains from one init on one data order: one device on the
global batch; N devices with sync BatchNorm; N devices with local BatchNorm;
and, as the yardstick of float32 round-off, one device with the rows of every
batch reversed or shuffled (the same mathematics, other summation orders). It
writes ``compare.json`` and ``loss_curves.png`` under ``--out`` (default
``out/cnn``; ``out/cnn_quick`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

DEFAULT_CPU_DEVICES = 4
STEPS, QUICK_STEPS = 300, 30


def _positive(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
  return value


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--devices", type=int, default=None, help=f"data-parallel devices (CPU: simulated, default {DEFAULT_CPU_DEVICES}; else all)")
  p.add_argument("--bn", default="sync", choices=("sync", "local"), help="BatchNorm statistics over all devices or per device")
  p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK_STEPS} steps unless --steps")
  p.add_argument("--steps", type=_positive, default=None, help=f"training steps ({STEPS}; {QUICK_STEPS} with --quick)")
  p.add_argument("--batch-size", type=int, default=64, help="global batch (the training set of 1,437 does not divide by it)")
  p.add_argument("--lr", type=float, default=0.05)
  p.add_argument("--momentum", type=float, default=0.9)
  p.add_argument("--dropout", type=float, default=None, help="dropout rate (default 0.1; 0 under --compare)")
  p.add_argument("--seed", type=int, default=0)
  from experiments import common  # here, not above: the parser runs before JAX is imported, to set the device count

  common.add_output_args(p, "out/cnn", quick="out/cnn_quick")
  p.add_argument("--compare", action="store_true", help="1 device vs N devices (sync BN) vs N devices (local BN)")
  p.add_argument("--no-progress", dest="progress", action="store_false")
  return p


if __name__ == "__main__":  # must happen before JAX initialises its backend
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if os.environ.get("JAX_PLATFORMS", "").strip().lower() in ("", "cpu"):
    devices = _parser().parse_known_args(sys.argv[1:])[0].devices
    os.environ["JAX_NUM_CPU_DEVICES"] = str(devices or DEFAULT_CPU_DEVICES)
    # The parser imported JAX (experiments.common), which read the environment then: set its flag too.
    import jax

    jax.config.update("jax_num_cpu_devices", devices or DEFAULT_CPU_DEVICES)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import tqdm  # noqa: E402
from flax import nnx  # noqa: E402

import jaxdp  # noqa: E402
from experiments import common  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
  """Every setting of a run; the flags map one to one (``--batch-size`` -> ``batch_size``)."""

  devices: int | None = None
  bn: str = "sync"
  steps: int = STEPS
  batch_size: int = 64
  lr: float = 0.05
  momentum: float = 0.9
  dropout: float | None = None  # None: 0.1 in training, 0 under --compare
  seed: int = 0
  out: str | None = "out/cnn"
  compare: bool = False
  progress: bool = True


class CNN(nnx.Module):
  """flax's MNIST CNN, sized for 8×8 digits, with jaxdp's BatchNorm in place of flax's."""

  def __init__(self, *, bn_axis: str | None, dropout: float, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 16, kernel_size=(3, 3), rngs=rngs)
    self.bn1 = jaxdp.adapters.nnx.BatchNorm(16, axis_name=bn_axis, rngs=rngs)
    self.drop1 = jaxdp.adapters.nnx.Dropout(dropout, rngs=rngs)  # nnx.Dropout, with a mask per example id
    self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), rngs=rngs)
    self.bn2 = jaxdp.adapters.nnx.BatchNorm(32, axis_name=bn_axis, rngs=rngs)
    self.drop2 = jaxdp.adapters.nnx.Dropout(dropout, rngs=rngs)
    self.linear1 = nnx.Linear(2 * 2 * 32, 64, rngs=rngs)
    self.linear2 = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x_BxHxWxC: jax.Array, mask_B: jax.Array | None = None) -> jax.Array:
    pool = lambda x: nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))  # noqa: E731
    x = pool(self.drop1(nnx.relu(self.bn1(self.conv1(x_BxHxWxC), mask=mask_B))))
    x = pool(self.drop2(nnx.relu(self.bn2(self.conv2(x), mask=mask_B))))
    return self.linear2(nnx.relu(self.linear1(x.reshape(x.shape[0], -1))))


def classification_loss(model: CNN, batch: dict, *, weights: jax.Array):
  """Per-example cross-entropy and accuracy; ``weights`` (0 for padding) keep padding out of BatchNorm."""
  logits_BxK = model(batch["image"], mask_B=weights)
  losses_B = optax.softmax_cross_entropy_with_integer_labels(logits_BxK.astype(jnp.float32), batch["label"])
  return losses_B, {"accuracy": (jnp.argmax(logits_BxK, -1) == batch["label"]).astype(jnp.float32)}


def load_digits(seed: int = 0) -> tuple[list, list]:
  """``(train, test)`` lists of ``(image [8, 8, 1] float32 in [0, 1], label, index)``; 1,437 / 360, stratified.

  ``index`` is the example's position in its set: its id, from which its dropout masks are drawn."""
  from sklearn.datasets import load_digits as sklearn_digits
  from sklearn.model_selection import train_test_split

  digits = sklearn_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]
  x_tr, x_te, y_tr, y_te = train_test_split(images, digits.target, test_size=0.2, random_state=seed, stratify=digits.target)
  return ([(x, y, i) for i, (x, y) in enumerate(zip(x_tr, y_tr.astype(np.int32)))],
          [(x, y, i) for i, (x, y) in enumerate(zip(x_te, y_te.astype(np.int32)))])


def collate(examples: list) -> tuple[dict, np.ndarray]:
  batch = {"image": np.stack([e[0] for e in examples]), "label": np.array([e[1] for e in examples], np.int32),
           "id": np.array([e[2] for e in examples], np.int32)}
  return batch, np.ones(len(examples), np.float32)


def select_devices(n: int | None) -> list:
  devices = jax.devices()
  if n is not None and not 1 <= n <= len(devices):
    raise ValueError(f"--devices {n} but {len(devices)} {devices[0].platform} devices are visible")
  return devices if n is None else devices[:n]


def reorder_rows(batch, weights, order: str | None):
  """The same batch in another row order: ``"reversed"``, ``"shuffled"`` (a fixed permutation) or ``None``."""
  if order is None:
    return batch, weights
  n = weights.shape[0]
  rows = np.arange(n)[::-1] if order == "reversed" else np.random.default_rng(n).permutation(n)
  return jax.tree.map(lambda x: x[rows], (batch, weights))


def train(config: Config, *, devices=None, bn: str | None = None, data=None, row_order: str | None = None, desc: str = "train") -> dict:
  """Trains one model; returns per-step records, evaluation metrics and the trained Module.

  ``row_order`` reorders the rows of every batch (:func:`reorder_rows`): the
  same mathematics in another summation order.
  """
  devices = select_devices(config.devices) if devices is None else list(devices)
  if config.batch_size % len(devices):
    raise ValueError(f"--batch-size {config.batch_size} must be a multiple of the {len(devices)} devices")
  mesh = jaxdp.data_mesh(devices)
  train_set, test_set = load_digits(config.seed) if data is None else data
  dropout = 0.1 if config.dropout is None else config.dropout
  model = CNN(bn_axis="data" if (bn or config.bn) == "sync" else None, dropout=dropout, rngs=nnx.Rngs(config.seed))
  definition, params, model_state = jaxdp.adapters.nnx.split(model)
  optimizer = optax.sgd(config.lr, momentum=config.momentum)
  loss_fn = jaxdp.adapters.nnx.loss_fn(definition, classification_loss)
  state = jaxdp.init_state(params, optimizer, mesh, model_state=model_state)
  step = jaxdp.make_train_step(loss_fn, optimizer, mesh, example_ids="id")  # masks follow batch["id"]
  pipeline = jaxdp.DataPipeline(train_set, collate, mesh, per_device_batch=config.batch_size // len(devices), seed=config.seed)
  rng = jax.random.key(config.seed)  # fold_in(rng, step) on every device; unused when dropout is 0
  records, start = [], time.perf_counter()
  with tqdm.tqdm(total=config.steps, desc=desc, disable=not config.progress, dynamic_ncols=True) as bar:
    for i, (batch, weights) in pipeline.iterate(num_steps=config.steps):
      batch, weights = reorder_rows(batch, weights, row_order)
      state, metrics = step(state, batch, weights, rng)
      metrics = jax.device_get(metrics)
      records.append({"step": i, "loss": float(metrics["loss"]), "accuracy": float(metrics["accuracy"]),
                      "examples": float(metrics["weight"])})
      bar.set_postfix(loss=f"{records[-1]['loss']:.4f}", acc=f"{records[-1]['accuracy']:.3f}", refresh=False)
      bar.update(1)
  evaluation = evaluate(loss_fn, state, test_set, mesh, len(devices))
  jaxdp.adapters.nnx.update(model, state)  # back to an ordinary Module on one device
  return {"records": records, "eval": evaluation, "model": model, "seconds": time.perf_counter() - start,
          "devices": len(devices), "bn": bn or config.bn}


def evaluate(loss_fn, state, test_set: list, mesh, n_devices: int) -> dict:
  """Exact weighted test loss and accuracy, data-parallel, every test image counted once."""
  pipeline = jaxdp.DataPipeline(test_set, collate, mesh, per_device_batch=-(-len(test_set) // (4 * n_devices)), seed=0)
  eval_step = jaxdp.make_eval_step(loss_fn, mesh)
  return eval_step.evaluate(state, (data for _, data in pipeline.iterate(num_steps=pipeline.steps_per_epoch)))


def host_accuracy(model: CNN, test_set: list) -> float:
  """Test accuracy computed by ordinary single-device code on the Module jaxdp trained."""
  model.eval()
  batch, _ = collate(test_set)
  logits = nnx.jit(lambda m, x: m(x))(model, batch["image"])
  return float(np.mean(np.argmax(np.asarray(logits), -1) == batch["label"]))


RUNS = (
    ("single", 1, "sync", None), ("sync", None, "sync", None), ("local", None, "local", None),
    ("single_reversed", 1, "sync", "reversed"), ("single_shuffled", 1, "sync", "shuffled"),
)
"""The runs of :func:`compare`: (name, devices (None: all), BatchNorm mode, row order)."""
YARDSTICKS = ("single_reversed", "single_shuffled")
STABLE_ATOL = 1e-6
"""The single-device run counts as stable up to the first step where a reordered copy of it differs by more."""


def compare(config: Config, data: tuple[list, list] | None = None) -> dict:
  """Same init, same data order: 1 device vs N devices (sync BN) vs N devices (local BN).

  Dropout is 0 unless ``config.dropout`` is set; its masks follow the
  example ids, so they are the same in every run but ``local``'s model.

  ``single_reversed`` and ``single_shuffled`` are the single-device run on
  batches whose rows are reversed or shuffled: their distance to ``single``
  is how far float32 round-off alone moves this training run. The run is
  *stable* up to the first step where either differs from ``single`` by more
  than :data:`STABLE_ATOL`; the N-device runs are judged on that window.
  """
  config = dataclasses.replace(config, dropout=config.dropout or 0.0)
  devices = select_devices(config.devices)
  data = load_digits(config.seed) if data is None else data
  runs = {}
  for name, n, bn, order in RUNS:
    runs[name] = train(config, devices=devices[:n] if n else devices, bn=bn, data=data, row_order=order, desc=name)
  loss = {k: np.array([r["loss"] for r in run["records"]]) for k, run in runs.items()}
  unstable = [_first_over(loss[k], loss["single"], STABLE_ATOL) for k in YARDSTICKS]
  stable = min([s for s in unstable if s is not None], default=config.steps)
  result = {"devices": len(devices), "steps": config.steps, "batch_size": config.batch_size, "dropout": config.dropout,
            "stable_steps": stable, "stable_atol": STABLE_ATOL}
  for name, run in runs.items():
    gap = np.abs(loss[name] - loss["single"])
    result[name] = {
        "eval_accuracy": run["eval"]["accuracy"], "eval_loss": run["eval"]["loss"],
        "host_eval_accuracy": host_accuracy(run["model"], data[1]),
        "max_abs_loss_diff_vs_single": float(np.max(gap)),
        "max_abs_loss_diff_vs_single_while_stable": float(np.max(gap[:stable])) if stable else 0.0,
        "max_abs_loss_diff_vs_single_first_10": float(np.max(gap[:10])),
        "final_train_loss": float(loss[name][-1]), "seconds": run["seconds"],
    }
  result["max_abs_loss_diff_sync_vs_single_shuffled"] = float(np.max(np.abs(loss["sync"] - loss["single_shuffled"])))
  result["losses"] = {k: v.tolist() for k, v in loss.items()}
  if config.out is not None:
    out = pathlib.Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_curves(loss, result, out / "loss_curves.png")
  return {**result, "runs": runs}


def _first_over(a: np.ndarray, b: np.ndarray, threshold: float) -> int | None:
  """The first step where ``|a - b| > threshold``, or ``None``."""
  over = np.nonzero(np.abs(a - b) > threshold)[0]
  return int(over[0]) if over.size else None


def plot_curves(loss: dict, result: dict, path) -> None:
  """Training loss of each run, and |loss − single device| on a log scale."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  n = result["devices"]
  labels = {"single": "1 device", "sync": f"{n} devices, sync BN", "local": f"{n} devices, local BN",
            "single_reversed": "1 device, rows reversed", "single_shuffled": "1 device, rows shuffled"}
  colors = {"single": "C0", "sync": "C1", "local": "C2", "single_reversed": "C7", "single_shuffled": "C4"}
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  for k, style in (("single", "-"), ("sync", "--"), ("local", ":")):
    left.plot(loss[k], style, color=colors[k], label=labels[k])
  for k, style in (("local", "-"), ("single_reversed", "-"), ("single_shuffled", "-"), ("sync", "--")):
    right.semilogy(np.maximum(np.abs(loss[k] - loss["single"]), 1e-10), style, color=colors[k], label=labels[k])
  right.axvline(result["stable_steps"], color="gray", lw=0.8, ls="--", label="end of the stable window")
  left.set(xlabel="step", ylabel="train loss", title=f"digits CNN, BatchNorm, dropout {result['dropout']:g}")
  right.set(xlabel="step", ylabel="|loss − 1-device loss|", title="gap to the single-device run (0 drawn at 1e-10)")
  left.legend(), right.legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
  parser = _parser()
  args = parser.parse_args(argv)
  common.check_publish(parser, args)
  if args.publish and not args.compare:
    parser.error("--publish copies --compare's loss_curves.png: add --compare.")
  args.steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
  config = Config(**{k: v for k, v in vars(args).items() if k not in ("quick", "publish")})
  start = time.perf_counter()
  if config.compare:
    result = compare(config)
    print(f"the single-device run is stable (reordered rows within {STABLE_ATOL:g}) for {result['stable_steps']} "
          f"of {config.steps} steps")
    for name, *_ in RUNS:
      r = result[name]
      print(f"[{name:>15}] eval accuracy {r['eval_accuracy']:.4f} (host {r['host_eval_accuracy']:.4f}), "
            f"eval loss {r['eval_loss']:.4f}, max |Δ train loss| vs single {r['max_abs_loss_diff_vs_single']:.2e} "
            f"({r['max_abs_loss_diff_vs_single_while_stable']:.2e} while stable, "
            f"{r['max_abs_loss_diff_vs_single_first_10']:.2e} in the first 10 steps)")
    common.publish(args, {"loss_curves.png": "cnn_loss_curves.png"})
  else:
    result = train(config)
    print(f"{result['devices']} device(s), {result['bn']} BatchNorm: final train loss {result['records'][-1]['loss']:.4f}, "
          f"eval accuracy {result['eval']['accuracy']:.4f} (host {host_accuracy(result['model'], load_digits(config.seed)[1]):.4f}), "
          f"eval loss {result['eval']['loss']:.4f}")
  print(f"wall time {time.perf_counter() - start:.1f} s" + (f"; outputs in {config.out}" if config.compare else ""))
  return result


if __name__ == "__main__":
  main()
