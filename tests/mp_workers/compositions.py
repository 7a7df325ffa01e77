"""Worker: pairs of features with several processes, each against one device.

Usage: ``python -m jaxdp.launch --nproc 2 --devices-per-proc 2 -- compositions.py OUT``. Every case of
``CASES`` trains a small linen model for ``STEPS`` steps on uneven rows (21 over 4 devices) with the two
processes' four devices, in float64 (x64 on: sums taken in another order then move a result by about 1e-16,
far below a real error's 1e-6 and up), and evaluates it. Process 0 writes ``OUT/<case>.npz`` (``run``'s
arrays). The test runs ``run`` on one device in its own process (and the stateful case on four devices of one
process) and compares.

The cases (each with jaxdp's exact BatchNorm statistics where it has a BatchNorm):
  * ``hybrid x ZeRO-2``: mesh ``(replica=2, data=2)`` with one process per replica row, the gradient
    reduced over both axes, ZeRO-2, BatchNorm, layout-invariant dropout, evaluation;
  * ``ZeRO-1 x BatchNorm``: mesh ``(data=4)`` over both processes, ZeRO-1, BatchNorm, dropout, evaluation;
  * ``accumulation``: mesh ``(data=4)``, two micro-batches per device, dropout (no BatchNorm: its batch
    statistics per micro-batch depend on the device count);
  * ``PowerSGD``: mesh ``(data=4)``, rank 1 from the second step (its state holds one error per replica, so
    its reference is the same run in one process).
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402

import jaxdp  # noqa: E402

STEPS, ROWS = 3, 21


class Net(nn.Module):
  batchnorm: bool = True

  @nn.compact
  def __call__(self, x, train, mask=None):
    h = nn.Dense(8)(x)
    if self.batchnorm:
      h = jaxdp.adapters.linen.BatchNorm(use_running_average=not train)(h, mask=mask)
    h = jaxdp.adapters.linen.Dropout(0.25, deterministic=not train)(nn.relu(h))
    return nn.Dense(2)(h)


def make_loss(model):
  def loss_fn(params, batch, rng=None, *, model_state, weights, train):
    variables = {"params": params, **({"batch_stats": model_state} if model_state is not None else {})}
    out, updates = model.apply(variables, batch["x"], train, mask=weights,
                               rngs={"dropout": rng} if rng is not None else {}, mutable=["batch_stats"])
    return jaxdp.LossOutput(jnp.sum((out - batch["y"]) ** 2, axis=-1), model_state=updates.get("batch_stats"))

  return loss_fn


CASES = {
    # name: (mesh shape on four devices, axis names, zero stage, accum_steps, BatchNorm, PowerSGD rank)
    "hybrid x ZeRO-2": ((2, 2), ("replica", "data"), 2, 1, True, None),
    "ZeRO-1 x BatchNorm": ((4,), ("data",), 1, 1, True, None),
    "accumulation": ((4,), ("data",), 0, 2, False, None),
    "PowerSGD": ((4,), ("data",), 0, 1, False, 1),
}


def run(case: str, devices: list) -> dict:
  """The case on ``devices`` (4, or 1 for one device): ``{name: array}`` of every step's loss, the final
  parameters, model state and optimizer state (gathered, in flattening order) and the evaluation's metrics."""
  shape, names, zero_stage, accum, batchnorm, rank = CASES[case]
  if len(devices) == 1:
    shape = (1,) * len(shape)
  mesh = Mesh(np.asarray(devices).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))
  layout = jaxdp.data_parallel(mesh, axis_name=names, zero_stage=zero_stage)
  model = Net(batchnorm)
  rng = np.random.default_rng(0)
  data = [{"x": rng.normal(size=(ROWS, 4)), "y": rng.normal(size=(ROWS, 2)), "id": np.arange(ROWS, dtype=np.int32)}
          for _ in range(STEPS + 1)]
  variables = jax.tree.map(lambda a: np.asarray(a, np.float64), model.init(jax.random.key(0), data[0]["x"][:1], False))
  params, model_state = variables["params"], variables.get("batch_stats")
  reduction = None if rank is None else jaxdp.reductions.powersgd(rank, start_iter=1)
  # SGD with momentum: Adam would turn the round-off gradient of the bias before the BatchNorm into a whole step.
  optimizer, loss_fn = optax.sgd(0.1, momentum=0.9), make_loss(model)
  state = jaxdp.init_state(params, optimizer, layout, model_state=model_state, reduction=reduction)
  step = jaxdp.make_train_step(loss_fn, optimizer, layout, reduction=reduction, accum_steps=accum,
                               example_ids="id")
  per_device = -(-ROWS // layout.replicas)
  rows = -(-per_device // accum) * accum  # a device's rows divide into accum_steps micro-batches
  out = {}
  for k in range(STEPS):
    batch, weights = jaxdp.split_batch(data[k], mesh, axis_name=names, rows=rows)
    state, metrics = step(state, batch, weights, jax.random.key(1))
    out[f"loss {k}"] = np.asarray(metrics["loss"])
  batch, weights = jaxdp.split_batch(data[STEPS], mesh, axis_name=names)
  metrics = jaxdp.make_eval_step(loss_fn, layout)(state, batch, weights)
  out.update({f"eval {name}": np.asarray(value) for name, value in metrics.items()})
  whole = jaxdp.gather_state(state)  # collective: every process calls it
  for part in ("params", "model_state", "opt_state"):
    for path, leaf in jax.tree_util.tree_leaves_with_path(getattr(whole, part)):
      out[part + jax.tree_util.keystr(path)] = np.asarray(leaf)
  return out


def main():
  out = sys.argv[1]
  jax.config.update("jax_enable_x64", True)
  jaxdp.distributed.initialize()
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))  # a hybrid replica row = one process
  for case in CASES:
    arrays = run(case, devices)
    print(f"{case}: {len(arrays)} arrays", flush=True)
    if jax.process_index() == 0:
      np.savez(os.path.join(out, f"{case}.npz"), **arrays)


if __name__ == "__main__":
  main()
