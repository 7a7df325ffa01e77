"""The one-parameter model from the brief, run through jaxdp on 3 devices.

w = 1, loss = ½(w − y)², SGD with lr 0.1, three replicas with targets 0, 2, 4.
Every number printed is computed by jaxdp; nothing is typed in.

  python experiments/seed_example.py

--quick: about 5 s on an idle 2-core CPU machine (the same run: it is
already a few seconds; the flag exists so that every experiment takes it).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # must happen before JAX initialises its backend
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "3")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import jaxdp
from jaxdp.sharding.layout import BACKENDS
from jaxdp.training.reduction import as_varying

LR = 0.1
EVEN = [[0.0], [2.0], [4.0]]  # one example per replica
UNEVEN = [[0.0], [2.0], [4.0, 4.0, 4.0, 4.0]]  # the last replica has four examples


def loss_fn(w, batch):
  """Per-example losses ½(w − y)²."""
  return 0.5 * (w - batch["y"]) ** 2


def _reduction(name: str) -> jaxdp.reductions.Reduction:
  """``jaxdp.reductions.<name>()``: ``"mean"``, ``"rank_mean"``, ``"sum"`` or ``"none"``."""
  return getattr(jaxdp.reductions, name)()


def _local_and_agreed(mesh, batch, weights, reduction):
  """Each replica's local mean gradient and the gradient the replicas agree on (``reduction``: a mode's name)."""

  def per_replica(w, batch, weights):
    local = jaxdp.local_gradient(loss_fn, w, batch, weights, layout="data")
    local_mean = jaxdp.reduce_gradient(local, layout="data", reduction=jaxdp.reductions.none()).grads
    agreed = jaxdp.reduce_gradient(local, layout="data", reduction=_reduction(reduction)).grads
    return local_mean[None], as_varying(agreed, "data")[None]

  f = jax.jit(
      jax.shard_map(per_replica, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P("data"), P("data")))
  )
  local, agreed = f(jax.device_put(jnp.float32(1.0), jax.NamedSharding(mesh, P())), batch, weights)
  return np.asarray(local), np.asarray(agreed)


def run(devices=None, backends=BACKENDS) -> dict:
  """Runs every case of the seed example and returns the computed values.

  Args:
    devices: three devices (default: the first three).
    backends: the backends of ``make_train_step`` to run.

  Returns:
    A dict of numpy arrays (one value per replica) keyed by case name.
  """
  devices = jax.devices()[:3] if devices is None else devices
  if len(devices) != 3:
    raise ValueError(f"the seed example needs 3 devices, got {len(devices)}; set JAX_NUM_CPU_DEVICES=3 on CPU.")
  mesh = jaxdp.data_mesh(devices)
  sgd = optax.sgd(LR)
  even = jaxdp.shard_uneven([{"y": np.array(y, np.float32)} for y in EVEN], mesh)
  uneven = jaxdp.shard_uneven([{"y": np.array(y, np.float32)} for y in UNEVEN], mesh)
  out = {}
  out["local_grad"], out["even_mean_grad"] = _local_and_agreed(mesh, *even, "mean")
  _, out["uneven_mean_grad"] = _local_and_agreed(mesh, *uneven, "mean")
  _, out["uneven_rank_mean_grad"] = _local_and_agreed(mesh, *uneven, "rank_mean")
  for backend in backends:
    for case, data, reduction in [
        ("none", even, "none"),
        ("even_sum", even, "sum"),
        ("even_mean", even, "mean"),
        ("uneven_mean", uneven, "mean"),
        ("uneven_rank_mean", uneven, "rank_mean"),
    ]:
      dp = jaxdp.data_parallel(mesh, backend=backend)
      step = jaxdp.make_train_step(loss_fn, sgd, dp, reduction=_reduction(reduction), check_replicas=True)
      state, metrics = step(jaxdp.init_state(jnp.float32(1.0), sgd, dp), *data)
      out[f"{backend}/{case}/w"] = jaxdp.per_replica(state.params)
      out[f"{backend}/{case}/divergence"] = np.asarray(metrics["replica_divergence"])
      try:
        jaxdp.assert_replicas_equal(state.params)
        out[f"{backend}/{case}/replicas_equal"] = "yes"
      except AssertionError as e:
        out[f"{backend}/{case}/replicas_equal"] = "no: " + str(e).splitlines()[-1].strip()
  return out


def _fmt(values) -> str:
  return ", ".join(f"{v:+.4g}" for v in np.ravel(values))


def report(out: dict, backends=BACKENDS) -> str:
  """A plain-text table of the values ``run`` computed."""
  lines = [
      "jaxdp seed example: w = 1, loss = ½(w − y)², SGD lr 0.1, 3 replicas",
      "",
      f"local gradients (targets 0, 2, 4)            : {_fmt(out['local_grad'])}",
      f"agreed gradient, even, 'mean'                : {_fmt(out['even_mean_grad'][:1])}",
      f"agreed gradient, uneven 1/1/4, 'mean'        : {_fmt(out['uneven_mean_grad'][:1])}   (global-batch gradient)",
      f"agreed gradient, uneven 1/1/4, 'rank_mean'   : {_fmt(out['uneven_rank_mean_grad'][:1])}   (DDP's mean of local means)",
      "",
      f"{'w after one step, per replica':<34}" + "".join(f"| {b:<28}" for b in backends),
  ]
  for case, label in [
      ("none", "'none' (no agreement)"),
      ("even_sum", "'sum', even"),
      ("even_mean", "'mean', even"),
      ("uneven_mean", "'mean', uneven 1/1/4"),
      ("uneven_rank_mean", "'rank_mean', uneven 1/1/4"),
  ]:
    lines.append(f"{label:<34}" + "".join(f"| {_fmt(out[f'{b}/{case}/w']):<28}" for b in backends))
  lines.append("")
  for b in backends:
    lines.append(f"[{b}] 'none': replica_divergence={float(out[f'{b}/none/divergence']):.4g}; "
                 f"assert_replicas_equal -> {out[f'{b}/none/replicas_equal']}")
    lines.append(f"[{b}] 'mean': replica_divergence={float(out[f'{b}/even_mean/divergence']):.4g}; "
                 f"assert_replicas_equal -> {out[f'{b}/even_mean/replicas_equal']}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  import argparse

  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="accepted for uniformity: the run is already seconds long")
  parser.parse_args(argv)
  print(report(run()))


if __name__ == "__main__":
  main()
