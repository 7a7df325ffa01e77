"""A ResNet with nested BatchNorms ports by swapping the BatchNorm class only: no mask threaded through the blocks.

Inside a jaxdp step, jaxdp's BatchNorm (linen and nnx) called without ``mask=`` takes the padding weights of the
rows it normalises from the step (this replica's, of the current micro-batch), the way its Dropout takes the
example ids. The model below is flax-imagenet-shaped (a stem BatchNorm, two residual blocks with two BatchNorms
each, none of them given a mask) and the loss never mentions the weights. It trains on 4 devices with 5/3/0/2 real
rows padded to 6 per device, and must equal flax's own ``BatchNorm`` trained on one device over the 10 real rows
only; with ``accum_steps=2`` each micro-batch's statistics are those of its own real rows (the reference runs the
same micro-batches one after the other). Tolerance: float32 re-association of the sums over two SGD steps,
``assert_close_to_scale`` at 2e-5 (measured differences are about 1e-6).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxdp
from helpers import assert_close_to_scale, mesh_of

pytestmark = pytest.mark.usefixtures("fast_compiles")

C, HW, CLASSES = 4, 4, 3
COUNTS, ROWS = (5, 3, 0, 2), 6  # real rows per device, padded to ROWS (a multiple of accum_steps=2)
OPT = optax.sgd(0.1, momentum=0.9)
RTOL = 2e-5


def portions(seed):
  rng = np.random.default_rng(seed)
  return [{"x": rng.normal(size=(n, HW, HW, 2)).astype(np.float32), "y": rng.integers(0, CLASSES, size=(n,))}
          for n in COUNTS]


def micro_batches(data, accum_steps):
  """The real rows of each micro-batch the step makes: slice i of every device's padded rows, in device order."""
  per = ROWS // accum_steps
  return [jax.tree.map(lambda *x: np.concatenate(x), *[jax.tree.map(lambda a: a[i * per:(i + 1) * per], d)
                                                         for d in data]) for i in range(accum_steps)]


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


# --- linen: flax imagenet's shape, `norm` the only thing a port changes ---------------------------------------------


class LinenBlock(nn.Module):
  norm: type

  @nn.compact
  def __call__(self, x, train):
    norm = functools.partial(self.norm, use_running_average=not train, momentum=0.9)
    y = nn.relu(norm()(nn.Conv(C, (3, 3), use_bias=False)(x)))
    y = norm()(nn.Conv(C, (3, 3), use_bias=False)(y))
    return nn.relu(x + y)


class LinenResNet(nn.Module):
  norm: type = nn.BatchNorm

  @nn.compact
  def __call__(self, x, train):
    x = nn.relu(self.norm(use_running_average=not train, momentum=0.9)(nn.Conv(C, (3, 3), use_bias=False)(x)))
    for _ in range(2):
      x = LinenBlock(self.norm)(x, train)
    return nn.Dense(CLASSES)(x.mean(axis=(1, 2)))


def linen_variables(model):
  return model.init(jax.random.key(0), np.zeros((1, HW, HW, 2), np.float32), train=False)


def linen_reference(steps_data, accum_steps):
  """flax's nn.BatchNorm on one device: each micro-batch's real rows in turn, the global mean of the losses."""
  variables = linen_variables(LinenResNet(nn.BatchNorm))
  params, stats = variables["params"], variables["batch_stats"]
  opt_state = OPT.init(params)
  model = LinenResNet(nn.BatchNorm)

  def loss_sum(params, stats, batch):
    logits, updates = model.apply({"params": params, "batch_stats": stats}, batch["x"], True, mutable=["batch_stats"])
    return jnp.sum(cross_entropy(logits, batch["y"])), updates["batch_stats"]

  grad_fn = jax.jit(jax.grad(loss_sum, has_aux=True))
  for data in steps_data:
    grads = jax.tree.map(jnp.zeros_like, params)
    for micro in micro_batches(data, accum_steps):
      g, stats = grad_fn(params, stats, micro)
      grads = jax.tree.map(jnp.add, grads, g)
    grads = jax.tree.map(lambda g: g / sum(COUNTS), grads)
    updates, opt_state = OPT.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params, stats


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_linen_resnet_with_only_the_batchnorm_class_swapped(accum_steps):
  mesh = mesh_of(4)
  model = LinenResNet(jaxdp.adapters.linen.BatchNorm)  # the one change to the model

  def loss_fn(params, batch, *, model_state):  # no weights, no mask: the BatchNorms take them from the step
    logits, updates = model.apply({"params": params, "batch_stats": model_state}, batch["x"], True,
                                  mutable=["batch_stats"])
    return jaxdp.LossOutput(cross_entropy(logits, batch["y"]), model_state=updates["batch_stats"])

  variables = linen_variables(model)
  state = jaxdp.init_state(variables["params"], OPT, mesh, model_state=variables["batch_stats"])
  step = jaxdp.make_train_step(loss_fn, OPT, mesh, accum_steps=accum_steps)
  steps_data = [portions(seed) for seed in range(2)]
  for data in steps_data:
    state, metrics = step(state, *jaxdp.shard_uneven(data, mesh, rows=ROWS))
    assert float(metrics["weight"]) == sum(COUNTS)
  params, stats = linen_reference(steps_data, accum_steps)
  ours = jaxdp.gather_state(state)
  assert_close_to_scale(ours.params, params, RTOL)
  assert_close_to_scale(ours.model_state, stats, RTOL)


def test_linen_unmasked_outside_a_step_is_flax():
  """Outside a jaxdp step nothing is taken from anywhere: jaxdp's unmasked BatchNorm computes flax's batch."""
  x = np.random.default_rng(0).normal(size=(7, HW, HW, 2)).astype(np.float32)
  ours_model, flax_model = LinenResNet(jaxdp.adapters.linen.BatchNorm), LinenResNet(nn.BatchNorm)
  variables = linen_variables(flax_model)
  ours = ours_model.apply(variables, x, True, mutable=["batch_stats"])
  theirs = flax_model.apply(variables, x, True, mutable=["batch_stats"])
  assert_close_to_scale(ours, theirs, 1e-6)


def test_step_weights_that_do_not_fit_the_input_are_refused():
  """A BatchNorm whose input's rows are not the step's (here the batch folded into the features' neighbours) is
  told to pass mask= itself; nothing is donated."""
  mesh = mesh_of(2)
  norm = jaxdp.adapters.linen.BatchNorm(use_running_average=False)
  variables = norm.init(jax.random.key(0), np.zeros((1, 2), np.float32))

  def loss_fn(params, batch, *, model_state):
    folded = batch["x"].reshape(-1, 2)  # [b * 2, 2]: not the step's [b] rows
    out, updates = norm.apply({"params": params, "batch_stats": model_state}, folded, mutable=["batch_stats"])
    return jaxdp.LossOutput(jnp.sum(out.reshape(-1, 4), -1), model_state=updates["batch_stats"])

  state = jaxdp.init_state(variables["params"], OPT, mesh, model_state=variables["batch_stats"])
  data = [{"x": np.ones((n, 4), np.float32)} for n in (2, 1)]
  with pytest.raises(ValueError, match=r"BatchNorm was called without mask= inside a jaxdp step.*Pass mask="):
    jaxdp.make_train_step(loss_fn, OPT, mesh)(state, *jaxdp.shard_uneven(data, mesh))
  np.testing.assert_array_equal(jaxdp.gather_state(state).params["scale"], variables["params"]["scale"])


# --- nnx: the same ResNet, the BatchNorm class a constructor argument ------------------------------------------------


class NnxBlock(nnx.Module):
  def __init__(self, norm, *, rngs):
    self.conv1, self.bn1 = nnx.Conv(C, C, (3, 3), use_bias=False, rngs=rngs), norm(C, momentum=0.9, rngs=rngs)
    self.conv2, self.bn2 = nnx.Conv(C, C, (3, 3), use_bias=False, rngs=rngs), norm(C, momentum=0.9, rngs=rngs)

  def __call__(self, x):
    y = nnx.relu(self.bn1(self.conv1(x)))
    return nnx.relu(x + self.bn2(self.conv2(y)))


class NnxResNet(nnx.Module):
  def __init__(self, norm=nnx.BatchNorm, *, rngs):
    self.stem, self.bn = nnx.Conv(2, C, (3, 3), use_bias=False, rngs=rngs), norm(C, momentum=0.9, rngs=rngs)
    self.blocks = nnx.List([NnxBlock(norm, rngs=rngs) for _ in range(2)])
    self.head = nnx.Linear(C, CLASSES, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn(self.stem(x)))
    for block in self.blocks:
      x = block(x)
    return self.head(x.mean(axis=(1, 2)))


def nnx_reference(steps_data, accum_steps):
  """flax's nnx.BatchNorm on one device, the ordinary nnx way: each micro-batch's real rows in turn."""
  model = NnxResNet(nnx.BatchNorm, rngs=nnx.Rngs(0))
  opt_state = OPT.init(nnx.state(model, nnx.Param))

  @nnx.jit
  def grad_of_sum(model, batch):  # updates the model's BatchNorm statistics in place
    return nnx.grad(lambda m: jnp.sum(cross_entropy(m(batch["x"]), batch["y"])))(model)

  for data in steps_data:
    grads = None
    for micro in micro_batches(data, accum_steps):
      g = grad_of_sum(model, micro)
      grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    grads = jax.tree.map(lambda g: g / sum(COUNTS), grads)
    params = nnx.state(model, nnx.Param)
    updates, opt_state = OPT.update(grads, opt_state, params)
    nnx.update(model, optax.apply_updates(params, updates))
  return model


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_nnx_resnet_with_only_the_batchnorm_class_swapped(accum_steps):
  mesh = mesh_of(4)
  model = NnxResNet(jaxdp.adapters.nnx.BatchNorm, rngs=nnx.Rngs(0))  # the one change to the model
  definition, params, model_state = jaxdp.adapters.nnx.split(model)
  loss_fn = jaxdp.adapters.nnx.loss_fn(definition, lambda model, batch: cross_entropy(model(batch["x"]), batch["y"]))
  state = jaxdp.init_state(params, OPT, mesh, model_state=model_state)
  step = jaxdp.make_train_step(loss_fn, OPT, mesh, accum_steps=accum_steps)
  steps_data = [portions(seed) for seed in range(2)]
  for data in steps_data:
    state, _ = step(state, *jaxdp.shard_uneven(data, mesh, rows=ROWS), rng=jax.random.key(0))
  jaxdp.adapters.nnx.update(model, state)
  reference = nnx_reference(steps_data, accum_steps)
  assert_close_to_scale(nnx.state(model, nnx.Param), nnx.state(reference, nnx.Param), RTOL)
  assert_close_to_scale(nnx.state(model, nnx.BatchStat), nnx.state(reference, nnx.BatchStat), RTOL)


def test_nnx_unmasked_outside_a_step_is_flax():
  x = np.random.default_rng(0).normal(size=(7, HW, HW, 2)).astype(np.float32)
  ours, theirs = NnxResNet(jaxdp.adapters.nnx.BatchNorm, rngs=nnx.Rngs(0)), NnxResNet(rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(ours(x), theirs(x))  # same float32 operations: bitwise (see batchnorm.py)
  np.testing.assert_array_equal(ours.blocks[1].bn2.var[...], theirs.blocks[1].bn2.var[...])
