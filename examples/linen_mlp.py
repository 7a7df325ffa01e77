"""A flax linen model with BatchNorm on uneven per-device batches, checked against one device.

Each device holds a different number of examples (the last batch of an
epoch, a data loader that cannot split evenly). jaxdp pads them with
weight-0 rows, its BatchNorm ignores those rows, and the default reduction
is the gradient of the global batch's mean loss: the same update as one
device on the concatenated batch. DDP's mean of per-device means
(``reduction=jaxdp.reductions.rank_mean()``) is printed next to it for contrast.

  python examples/linen_mlp.py [--steps 20] [--devices 4]
"""

import argparse
import os

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices")
args = parser.parse_args()
os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(args.devices))  # before JAX starts

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdp  # noqa: E402


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x, train, mask=None):
    h = jaxdp.adapters.linen.BatchNorm(use_running_average=not train)(nn.Dense(32, use_bias=False)(x), mask=mask)
    return nn.Dense(1)(nn.relu(h))[:, 0]


model = MLP()
rng = np.random.default_rng(0)
true_w = rng.normal(size=(8,)).astype(np.float32)
variables = model.init(jax.random.key(0), np.zeros((2, 8), np.float32), False)


def loss_fn(params, batch, *, model_state, weights, train):
  pred, updates = model.apply({"params": params, "batch_stats": model_state}, batch["x"], train,
                              mask=weights, mutable=["batch_stats"])
  return jaxdp.LossOutput(0.5 * (pred - batch["y"]) ** 2, model_state=updates["batch_stats"])


def portions(sizes):
  """One random regression batch per device, of the given sizes."""
  xs = [rng.normal(size=(n, 8)).astype(np.float32) for n in sizes]
  return [{"x": x, "y": np.tanh(x @ true_w)} for x in xs]


def train(devices, reduction, batches):
  mesh, opt = jaxdp.data_mesh(devices), optax.sgd(0.1)
  state = jaxdp.init_state(variables["params"], opt, mesh, model_state=variables["batch_stats"])
  step = jaxdp.make_train_step(loss_fn, opt, mesh, reduction=reduction)
  for per_device in batches:
    if len(devices) == 1:  # one device: the whole global batch
      per_device = [jax.tree.map(lambda *parts: np.concatenate(parts), *per_device)]
    state, metrics = step(state, *jaxdp.shard_uneven(per_device, mesh))
  return float(metrics["loss"]), jax.device_get(state.params)


n = len(jax.devices())
sizes = [2 + 3 * i for i in range(n)]  # 2, 5, 8, ... examples: uneven
batches = [portions(sizes) for _ in range(args.steps)]
one_loss, one_params = train(jax.devices()[:1], jaxdp.reductions.mean(), batches)
for name in ("mean", "rank_mean"):  # the default (exact) and DDP's mean of per-device means
  loss, params = train(jax.devices(), getattr(jaxdp.reductions, name)(), batches)
  gap = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one_params)))
  print(f"{n} devices, examples {sizes}, reduction=jaxdp.reductions.{name}(): final loss {loss:.4f}; "
        f"largest parameter difference to 1 device: {gap:.1e}")
print(f"1 device, the same {sum(sizes)} examples per step: final loss {one_loss:.4f} after {args.steps} steps")
