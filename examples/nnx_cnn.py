"""A flax nnx CNN with BatchNorm, trained data-parallel, checked against one device.

Trains the same model from the same init on the same batches twice: on N
devices (jaxdp's BatchNorm takes its statistics over every device's rows)
and on one device. Both runs are the same mathematics, so the losses agree
to float32 round-off while they go down.

  python examples/nnx_cnn.py [--steps 40] [--devices 4]
"""

import argparse
import os

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices")
args = parser.parse_args()
os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(args.devices))  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import jaxdp  # noqa: E402


class CNN(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, 16, kernel_size=(3, 3), rngs=rngs)
    self.bn = jaxdp.adapters.nnx.BatchNorm(16, axis_name="data", rngs=rngs)  # exact statistics over all devices
    self.head = nnx.Linear(16 * 4 * 4, 10, rngs=rngs)

  def __call__(self, x, mask=None):
    x = nnx.relu(self.bn(self.conv(x), mask=mask))
    x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    return self.head(x.reshape(x.shape[0], -1))


def objective(model, batch, *, weights):
  logits = model(batch["image"], mask=weights)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
  return losses, {"accuracy": (logits.argmax(-1) == batch["label"]).astype(jnp.float32)}


digits = load_digits()
images = (digits.images[..., None] / 16.0).astype(np.float32)  # [1797, 8, 8, 1]
labels = digits.target.astype(np.int32)
batch_size = 16 * args.devices
order = np.random.default_rng(0).permutation(len(labels))

definition, params, model_state = jaxdp.adapters.nnx.split(CNN(nnx.Rngs(0)))
loss_fn = jaxdp.adapters.nnx.loss_fn(definition, objective)
opt = optax.sgd(0.05, momentum=0.9)


def train(devices):
  mesh = jaxdp.data_mesh(devices)
  state = jaxdp.init_state(params, opt, mesh, model_state=model_state)
  step = jaxdp.make_train_step(loss_fn, opt, mesh)
  losses = []
  for i in range(args.steps):
    rows = np.take(order, range(i * batch_size, (i + 1) * batch_size), mode="wrap")
    state, metrics = step(state, {"image": images[rows], "label": labels[rows]})
    losses.append(float(metrics["loss"]))
  return losses, float(metrics["accuracy"])


many, accuracy = train(jax.devices())
one, _ = train(jax.devices()[:1])
print(f"{len(jax.devices())} devices: loss {many[0]:.4f} -> {many[-1]:.4f} in {args.steps} steps, "
      f"last batch accuracy {accuracy:.2f}")
print(f"1 device:  loss {one[0]:.4f} -> {one[-1]:.4f}")
print(f"largest loss difference, {len(jax.devices())} devices vs 1: {max(abs(a - b) for a, b in zip(many, one)):.2e}")
