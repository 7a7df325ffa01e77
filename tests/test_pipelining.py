"""Pipeline parallelism over a stage axis (jaxdp.pipelining), composed with exact data parallelism.

Every pipelined step is compared with an independent single-device reference written plainly here: a Python
loop over the layers, ``jax.grad`` of ``Σ w·l / Σ w`` over the whole batch, the optax update, 5 steps.
"""

import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh

import jaxdp
from jaxdp import pipelining

pytestmark = pytest.mark.usefixtures("fast_compiles")

LAYERS, WIDTH, FEATURES, ROWS, STEPS = 8, 4, 3, 16, 5


def init_params(seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  return {
      "embed": np.asarray(jax.random.normal(k[0], (FEATURES, WIDTH)) * 0.6),
      "blocks": {"w": np.asarray(jax.random.normal(k[1], (LAYERS, WIDTH, WIDTH)) * 0.6),
                 "b": np.asarray(jax.random.normal(k[2], (LAYERS, WIDTH)) * 0.1)},
      "head": np.asarray(jax.random.normal(k[3], (WIDTH, 2)) * 0.6),
  }


def layer(h, p, _):
  return jnp.tanh(h @ p["w"] + p["b"][None, :]), None


def loss_fn(params, batch):
  h = jnp.tanh(batch["x"] @ params["embed"])
  h, _ = jaxdp.scan_layers(layer, h, params["blocks"])
  return jnp.sum((h @ params["head"] - batch["y"]) ** 2, axis=-1)


def reference_loss(params, x, y, w):
  h = jnp.tanh(x @ params["embed"])
  for i in range(LAYERS):  # a plain loop over the layers
    h = jnp.tanh(h @ params["blocks"]["w"][i] + params["blocks"]["b"][i][None, :])
  losses = jnp.sum((h @ params["head"] - y) ** 2, axis=-1)
  return jnp.sum(w * losses) / jnp.sum(w)


def batches(steps=STEPS, rows=ROWS, seed=1):
  """Uneven weights; step 0's second half (a whole data shard at data=2) has weight 0; a padding row each step."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(steps):
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    y = rng.normal(size=(rows, 2)).astype(np.float32)
    w = rng.uniform(0.25, 2.0, size=rows).astype(np.float32)
    w[rows - 3] = 0.0
    if i == 0:
      w[rows // 2:] = 0.0
    out.append(({"x": x, "y": y}, w))
  return out


def reference_run(opt, data, params=None):
  params = jax.tree.map(jnp.asarray, init_params() if params is None else params)
  opt_state = opt.init(params)
  grad = jax.jit(jax.grad(reference_loss))
  for batch, w in data:
    g = grad(params, batch["x"], batch["y"], w)
    updates, opt_state = opt.update(g, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params


def adam():
  return optax.adam(1e-2)


def clip_adamw():
  return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))


OPTIMIZERS = {"adam": adam, "clip_adamw": clip_adamw}


def stage_mesh(stages, data=1, replica=None):
  if replica is None:
    shape, names = (stages, data), ("stage", "data")
  else:
    shape, names = (stages, replica, data), ("stage", "replica", "data")
  devices = np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def train(step, mesh, opt, data, axis_name="data", zero_stage=0):
  state = jaxdp.init_state(init_params(), opt, mesh, axis_name=axis_name, zero_stage=zero_stage, layers="blocks")
  for batch, w in data:
    state, metrics = step(state, batch, w)
  return state, metrics


def assert_close(params, reference, rtol=1e-6):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(reference)):
    a, b = np.asarray(a), np.asarray(b)
    err = np.max(np.abs(a - b)) / np.max(np.abs(b))
    assert err <= rtol, (jax.tree_util.keystr(path), err)


# A covering subset of P ∈ {2, 4} × M ∈ {1, P, 2P} × schedule ∈ {gpipe, circular R=2} × data ∈ {absent, 2} ×
# optimizer ∈ {adam, clip+adamw}: every value of every factor and every schedule × P × data pair once (8 compiled
# steps); the pipeline experiment runs the full product.
CASES = [
    # (stages, microbatches, schedule, repeats, data, optimizer)
    (2, 1, "gpipe", 1, 1, "adam"),
    (2, 4, "gpipe", 1, 2, "clip_adamw"),
    (4, 4, "gpipe", 1, 2, "adam"),
    (4, 8, "gpipe", 1, 1, "clip_adamw"),
    (2, 2, "circular", 2, 1, "clip_adamw"),
    (2, 4, "circular", 2, 2, "adam"),
    (4, 4, "circular", 2, 2, "clip_adamw"),
    (4, 8, "circular", 2, 1, "adam"),
]


@pytest.mark.parametrize("stages,microbatches,schedule,repeats,data,optimizer", CASES)
def test_equals_one_device(stages, microbatches, schedule, repeats, data, optimizer):
  opt = OPTIMIZERS[optimizer]()
  mesh = stage_mesh(stages, data)
  step = jaxdp.make_train_step(loss_fn, opt, mesh, layers="blocks",
                               pipeline=jaxdp.pipeline(microbatches, schedule, repeats=repeats))
  runs = batches()
  state, metrics = train(step, mesh, opt, runs)
  assert int(metrics["skipped"]) == 0 and int(state.step) == STEPS
  assert_close(state.params, reference_run(opt, runs))
