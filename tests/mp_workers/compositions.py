"""Worker: pairs of features with several processes, each against one device.

Usage: ``python -m jaxdp.launch --nproc 2 --devices-per-proc 2 -- compositions.py OUT``. Every case of
``CASES`` trains a small model for ``STEPS`` steps on uneven rows (21 over the data axes, padded) with the two
processes' four devices, in float64 (x64 on: sums taken in another order then move a result by about 1e-16,
far below a real error's 1e-6 and up), and evaluates it. Process 0 writes ``OUT/<case>.npz`` (``run``'s
arrays). The test runs ``run`` on one device in its own process (and the stateful case on four devices of one
process) and compares.

The cases (the linen model has jaxdp's BatchNorm, with its exact statistics, and layout-invariant dropout):
  * ``hybrid x ZeRO-2``: mesh ``(replica=2, data=2)`` with one process per replica row, the gradient
    reduced over both axes;
  * ``tensor parallel x ZeRO-1``: mesh ``(data=2, model=2)``, data across the processes, the model's two
    matrices split over ``model`` within each (Megatron's column and row split);
  * ``accumulation``: mesh ``(data=4)``, two micro-batches per device, dropout (no BatchNorm: its batch
    statistics per micro-batch depend on the device count);
  * ``PowerSGD``: mesh ``(data=4)``, rank 1 from the second step (its state holds one error per replica, so
    its reference is the same run in one process);
  * ``layer-wise ZeRO-3`` and the three pipeline schedules (``(stage=2, data=2)``, one stage per process, the
    activations crossing between them): a stack of tanh layers;
  * the 16-bit policies of ``PRECISIONS`` on ``(data=4)``, the float64 parameters and sums kept.
"""

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402

import jaxdp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from test_composition_precision import Net, make_loss  # noqa: E402  (the linen model with BatchNorm and dropout)
from test_compositions import TP_SPECS  # noqa: E402  (its Megatron split, BatchNorm replicated)

STEPS, ROWS = 3, 21


def stack_loss(params, batch, rng=None, *, weights):
  # A stack of tanh layers between an embedding and a head: the part layers= and the pipelines take.
  h = jnp.tanh(batch["x"] @ params["embed"])
  h, _ = jaxdp.scan_layers(lambda h, p, _: (jnp.tanh(h @ p["w"] + p["b"][None]), None), h, params["blocks"])
  return jnp.sum((h @ params["head"] - batch["y"]) ** 2, axis=-1)


def stack_params(rng):
  return {"embed": rng.normal(size=(4, 6)) * 0.5, "head": rng.normal(size=(6, 2)) * 0.5,
          "blocks": {"w": rng.normal(size=(LAYERS, 6, 6)) * 0.5, "b": rng.normal(size=(LAYERS, 6)) * 0.1}}


LAYERS = 4

CASES = {
    # name: the layout on four devices (mesh shape, axis names, data_parallel's options), the model ("net": a
    # BatchNorm and dropout, "plain": dropout only, "stack": stacked layers), accum_steps, PowerSGD's rank.
    "hybrid x ZeRO-2": ((2, 2), ("replica", "data"), dict(axis_name=("replica", "data"), zero_stage=2), "net", 1,
                        None),
    # "data" across the processes, "model" within each.
    "tensor parallel x ZeRO-1": ((2, 2), ("data", "model"), dict(param_specs=TP_SPECS, zero_stage=1), "net", 1,
                                 None),
    "accumulation": ((4,), ("data",), {}, "plain", 2, None),
    "PowerSGD": ((4,), ("data",), {}, "plain", 1, 1),
    "layer-wise ZeRO-3": ((4,), ("data",), dict(zero_stage=3, layers="blocks"), "stack", 1, None),
    # One stage per process: the activations cross between the processes.
    "pipeline GPipe": ((2, 2), ("stage", "data"), dict(layers="blocks", pipeline=jaxdp.pipeline(2)), "stack", 1,
                       None),
    "pipeline circular": ((2, 2), ("stage", "data"),
                          dict(layers="blocks", pipeline=jaxdp.pipeline(2, "circular", repeats=2)), "stack", 1, None),
    "pipeline 1F1B": ((2, 2), ("stage", "data"), dict(layers="blocks", pipeline=jaxdp.pipeline(2, "1f1b")), "stack",
                      1, None),
}


# 16-bit policies (the cases above run in float64 throughout): compared with one device under the same policy.
PRECISIONS = {
    "bfloat16 compute and reduction": dict(compute_dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16),
    "float16 with loss scaling": dict(compute_dtype=jnp.float16),
}
CASES.update({name: ((4,), ("data",), {}, "net", 1, None) for name in PRECISIONS})


def run(case: str, devices: list) -> dict:
  """The case on ``devices``: 4 (the case's layout), or 1 (one device, a plain data mesh). ``{name: array}`` of
  every step's loss, the final parameters, model state and optimizer state (gathered, in flattening order) and
  the evaluation's metrics."""
  shape, names, options, kind, accum, rank = CASES[case]
  if len(devices) == 1:
    shape, names, options = (1,), ("data",), {}
  mesh = Mesh(np.asarray(devices).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))
  layout = jaxdp.data_parallel(mesh, **options)
  rng = np.random.default_rng(0)
  data = [{"x": rng.normal(size=(ROWS, 4)), "y": rng.normal(size=(ROWS, 2)), "id": np.arange(ROWS, dtype=np.int32)}
          for _ in range(STEPS + 1)]
  if kind == "stack":
    params, model_state, loss_fn = stack_params(rng), None, stack_loss
  else:
    model = Net(kind == "net")
    variables = jax.tree.map(lambda a: np.asarray(a, np.float64), model.init(jax.random.key(0), data[0]["x"][:1], False))
    params, model_state, loss_fn = variables["params"], variables.get("batch_stats"), make_loss(model)
  reduction = None if rank is None else jaxdp.reductions.powersgd(rank, start_iter=1)
  # SGD with momentum: Adam would turn the round-off gradient of the bias before the BatchNorm into a whole step.
  optimizer = optax.sgd(0.1, momentum=0.9)
  keywords = dict(PRECISIONS.get(case, {}))
  if keywords.get("compute_dtype") == jnp.float16:
    keywords["loss_scaling"] = jaxdp.dynamic_loss_scale(init_scale=2.0**8)
  precision = jaxdp.precision(**keywords) if keywords else None
  state = jaxdp.init_state(params, optimizer, layout, model_state=model_state, reduction=reduction,
                           precision=precision)
  step = jaxdp.make_train_step(loss_fn, optimizer, layout, reduction=reduction, accum_steps=accum,
                               example_ids=None if kind == "stack" else "id", precision=precision)
  per_device = -(-ROWS // layout.replicas)
  split = accum * (layout.pipeline.microbatches if layout.pipeline is not None else 1)
  rows = -(-per_device // split) * split  # a device's rows divide into micro-batches
  axis_name = layout.axis_name
  out = {}
  for k in range(STEPS):
    batch, weights = jaxdp.split_batch(data[k], mesh, axis_name=axis_name, rows=rows)
    state, metrics = step(state, batch, weights, jax.random.key(1))
    out[f"loss {k}"] = np.asarray(metrics["loss"])
  batch, weights = jaxdp.split_batch(data[STEPS], mesh, axis_name=axis_name, rows=rows)
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
  jax.config.update("jax_disable_most_optimizations", True)  # plumbing and float64 agreement, not speed
  jaxdp.distributed.initialize()
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))  # a hybrid replica row = one process
  for case in CASES:
    start = time.perf_counter()
    arrays = run(case, devices)
    print(f"{case}: {len(arrays)} arrays, {time.perf_counter() - start:.1f} s", flush=True)
    if jax.process_index() == 0:
      np.savez(os.path.join(out, f"{case}.npz"), **arrays)


if __name__ == "__main__":
  main()
