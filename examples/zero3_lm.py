"""A small byte-level transformer LM trained with layer-wise ZeRO-3.

The blocks' weights are stacked along a layer axis ("blocks") and split over
the devices at rest. Each step gathers one layer at a time inside the scan
over the stack (``jaxdp.gather`` in the body, the stack named by the layout
``jaxdp.data_parallel(mesh, zero_stage=3, layers="blocks")``), and
reduce-scatters that layer's gradient in the backward loop: no device ever
holds the whole stack. The model reads its own source file as its corpus.

  python examples/zero3_lm.py [--steps 30] [--devices 4]
"""

import argparse
import os

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices")
args = parser.parse_args()
os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(args.devices))  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdp  # noqa: E402

L, D, H, T = 4, 64, 4, 32  # layers, width, heads, tokens per sequence


def init(key):
  k = jax.random.split(key, 6)
  normal = lambda key, shape, fan_in: jax.random.normal(key, shape) * fan_in**-0.5  # noqa: E731
  return {"embed": normal(k[0], (256, D), D), "pos": normal(k[1], (T, D), D),
          "blocks": {"qkv": normal(k[2], (L, D, 3 * D), D), "proj": normal(k[3], (L, D, D), D),
                     "up": normal(k[4], (L, D, 4 * D), D), "down": normal(k[5], (L, 4 * D, D), 4 * D)}}


def rms(x):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def block(h_BxTxD, layer):
  layer = jaxdp.gather(layer)  # this layer's whole weights; the rest of the stack stays split
  b = h_BxTxD.shape[0]
  q, k, v = (a.reshape(b, T, H, D // H) for a in jnp.split(rms(h_BxTxD) @ layer["qkv"], 3, axis=-1))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (D // H) ** -0.5
  scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)  # causal
  att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, T, D)
  h_BxTxD = h_BxTxD + att @ layer["proj"]
  return h_BxTxD + jax.nn.gelu(rms(h_BxTxD) @ layer["up"]) @ layer["down"], None


def loss_fn(params, batch):
  tokens = batch["tokens"]  # [B, T + 1] bytes
  h = params["embed"][tokens[:, :-1]] + params["pos"]
  body = jax.checkpoint(block, policy=jaxdp.sharding.layerwise.gather_policy())  # gather again in the backward pass
  h, _ = jax.lax.scan(body, h, params["blocks"])
  logits = rms(h) @ params["embed"].T
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])  # per token [B, T]


mesh, opt = jaxdp.data_mesh(), optax.adamw(3e-3)
dp = jaxdp.data_parallel(mesh, zero_stage=3, layers="blocks")  # the layout: the state's and the step's
state = jaxdp.init_state(init(jax.random.key(0)), opt, dp)
step = jaxdp.make_train_step(loss_fn, opt, dp)

text = np.frombuffer(open(__file__, "rb").read(), np.uint8)
rng = np.random.default_rng(0)
batch_size = 8 * len(jax.devices())
for i in range(args.steps):
  starts = rng.integers(0, len(text) - T - 1, batch_size)
  state, metrics = step(state, {"tokens": np.stack([text[s:s + T + 1] for s in starts]).astype(np.int32)})
  if i == 0 or (i + 1) % 10 == 0 or i + 1 == args.steps:
    print(f"step {i + 1:3d}: loss {float(metrics['loss']):.3f} nats/byte")

up = state.params["blocks"]["up"]
print(f"uniform guessing would be {np.log(256):.3f}; {len(jax.devices())} devices, ZeRO-3 layer-wise: "
      f"each holds {up.addressable_shards[0].data.shape} of the stacked weight {up.shape}")
