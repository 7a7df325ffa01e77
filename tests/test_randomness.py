"""Layout-invariant dropout: with example ids, every mesh, split and accum_steps gives one device's masks.

A tiny MLP with two dropout layers trains 3 steps of SGD on a global batch of
12 rows (ids not in row order); the data-parallel runs on 1-4 devices with
uneven splits and 1 or 2 micro-batches are compared with a plain one-device
program (nnx: nnx.Optimizer on the whole batch; linen: jax.grad of the mean)
that sets the same ids with jaxdp.use_example_ids. Tolerance: float32
round-off of sums in another order, rtol 1e-6 and atol 5e-7 (1e-6 of the
parameters' scale, ~0.5; measured up to 6.6e-8, an ulp or so). Per-replica
masks (no example_ids) move the parameters by 0.18-0.3 here.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdp
from helpers import assert_close as assert_close_elementwise

D, H, B, STEPS = 3, 8, 12, 3
RTOL, ATOL = 1e-6, 5e-7
OPT = optax.sgd(0.3)
# (devices, rows per device, accum_steps); the real rows are consecutive slices of the global batch.
LAYOUTS = [(1, (12,), 1), (2, (7, 5), 2), (3, (5, 4, 3), 2), (4, (4, 3, 3, 2), 1)]


pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py: the tests check agreement, not speed


def global_batches():
  rng = np.random.default_rng(0)
  ids = rng.permutation(1000)[: STEPS * B].reshape(STEPS, B).astype(np.int32)  # global ids, not row positions
  return [{"x": rng.normal(size=(B, D)).astype(np.float32), "y": rng.normal(size=(B,)).astype(np.float32),
           "id": ids[t]} for t in range(STEPS)]


def split(batch, counts, mesh, accum):
  bounds = np.cumsum((0,) + counts)
  parts = [jax.tree.map(lambda x: x[a:b], batch) for a, b in zip(bounds[:-1], bounds[1:])]
  rows = -(-max(counts) // accum) * accum
  return jaxdp.shard_uneven(parts, mesh, rows=rows)


class NnxNet(nnx.Module):
  def __init__(self, dropout=jaxdp.adapters.nnx.Dropout, *, rngs):
    self.l1, self.l2, self.l3 = nnx.Linear(D, H, rngs=rngs), nnx.Linear(H, H, rngs=rngs), nnx.Linear(H, 1, rngs=rngs)
    self.d1, self.d2 = dropout(0.5, rngs=rngs), dropout(0.3, rngs=rngs)

  def __call__(self, x):
    return self.l3(self.d2(nnx.relu(self.l2(self.d1(nnx.relu(self.l1(x)))))))[:, 0]


def nnx_objective(model, batch):
  return 0.5 * (model(batch["x"]) - batch["y"]) ** 2


class LinenNet(nn.Module):
  dropout: type = jaxdp.adapters.linen.Dropout

  @nn.compact
  def __call__(self, x, train):
    h = self.dropout(0.5, deterministic=not train)(nn.relu(nn.Dense(H)(x)))
    h = self.dropout(0.3, deterministic=not train)(nn.relu(nn.Dense(H)(h)))
    return nn.Dense(1)(h)[:, 0]


def linen_init():
  model = LinenNet()
  return model, model.init(jax.random.key(0), global_batches()[0]["x"], False)["params"]


def linen_loss(model):
  def loss_fn(params, batch, rng=None, *, train):
    pred = model.apply({"params": params}, batch["x"], train, rngs={"dropout": rng} if rng is not None else {})
    return 0.5 * (pred - batch["y"]) ** 2

  return loss_fn


@functools.cache
def nnx_reference():
  """The plain one-device nnx program: the key jaxdp's nnx loss reseeds its one stream with, ids set by hand."""
  batches, rng = global_batches(), jax.random.key(7)
  model = NnxNet(rngs=nnx.Rngs(params=0, dropout=1))
  optimizer = nnx.Optimizer(model, OPT, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch, key):
    nnx.reseed(model, dropout=key)

    def loss(model):
      with jaxdp.use_example_ids(batch["id"]):
        return jnp.mean(nnx_objective(model, batch))

    optimizer.update(model, nnx.grad(loss)(model))

  for t, batch in enumerate(batches):
    step(model, optimizer, batch, jax.random.split(jax.random.fold_in(rng, t), 1)[0])
  return nnx.state(model, nnx.Param)


@functools.cache
def linen_reference():
  """The plain one-device linen program: jax.grad of the mean with the step's documented key, fold_in(rng, t)."""
  batches, rng = global_batches(), jax.random.key(7)
  model, params = linen_init()
  loss_fn = linen_loss(model)

  @jax.jit
  def step(params, opt_state, batch, key):
    def loss(p):
      with jaxdp.use_example_ids(batch["id"]):
        return jnp.mean(loss_fn(p, batch, key, train=True))

    updates, opt_state = OPT.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = OPT.init(params)
  for t, batch in enumerate(batches):
    params, opt_state = step(params, opt_state, batch, jax.random.fold_in(rng, t))
  return params


def train(loss_fn, params, batches, rng, layout, example_ids="id"):
  n, counts, accum = layout
  mesh = jaxdp.data_mesh(jax.devices()[:n])
  state = jaxdp.init_state(params, OPT, mesh)
  step = jaxdp.make_train_step(loss_fn, OPT, mesh, accum_steps=accum, example_ids=example_ids)
  for batch in batches:
    state, metrics = step(state, *split(batch, counts, mesh, accum), rng=rng)
    assert int(metrics["skipped"]) == 0
  return jaxdp.gather_state(state).params


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"{l[0]}dev-{'-'.join(map(str, l[1]))}-accum{l[2]}")
def test_nnx_dropout_masks_are_one_devices_on_every_layout(layout):
  batches, rng = global_batches(), jax.random.key(7)
  definition, params, _ = jaxdp.adapters.nnx.split(NnxNet(rngs=nnx.Rngs(params=0, dropout=1)))
  ours = train(jaxdp.adapters.nnx.loss_fn(definition, nnx_objective), params, batches, rng, layout)
  assert_close(ours, nnx_reference())


# linen on two layouts (the scan test below adds 3 devices with 2 micro-batches): the step is nnx's.
@pytest.mark.parametrize("layout", LAYOUTS[::3], ids=lambda l: f"{l[0]}dev-{'-'.join(map(str, l[1]))}-accum{l[2]}")
def test_linen_dropout_masks_are_one_devices_on_every_layout(layout):
  batches, rng = global_batches(), jax.random.key(7)
  model, params = linen_init()
  ours = train(linen_loss(model), params, batches, rng, layout)
  assert_close(ours, linen_reference())


def test_a_run_resumed_from_a_checkpoint_on_another_device_count_keeps_one_devices_masks(tmp_path):
  """Dropout with example_ids across a checkpoint: the first steps on 4 devices, saved, restored on 2 devices
  with 2 micro-batches, the rest there: the masks still follow the ids and the step count (the key is
  `fold_in(rng, state.step)`), so the run is the one-device run."""
  batches, rng = global_batches(), jax.random.key(7)
  model, params = linen_init()
  loss_fn, first = linen_loss(model), len(batches) // 2
  (n, counts, accum), (n2, counts2, accum2) = LAYOUTS[3], LAYOUTS[1]
  mesh = jaxdp.data_mesh(jax.devices()[:n])
  state = jaxdp.init_state(params, OPT, mesh)
  step = jaxdp.make_train_step(loss_fn, OPT, mesh, accum_steps=accum, example_ids="id")
  for batch in batches[:first]:
    state, _ = step(state, *split(batch, counts, mesh, accum), rng=rng)
  with jaxdp.CheckpointManager(tmp_path / "ckpt", enable_async_checkpointing=False) as ckpt:
    ckpt.save(first, state)
    mesh = jaxdp.data_mesh(jax.devices()[:n2])
    state = ckpt.restore(params=params, optimizer=OPT, layout=mesh).state
  assert int(state.step) == first
  step = jaxdp.make_train_step(loss_fn, OPT, mesh, accum_steps=accum2, example_ids="id")
  for batch in batches[first:]:
    state, _ = step(state, *split(batch, counts2, mesh, accum2), rng=rng)
  assert_close(jaxdp.gather_state(state).params, linen_reference())


def test_the_masks_are_fold_in_of_the_layer_key_and_the_id():
  """Written out by hand: row r keeps unit j where bernoulli(fold_in(key, id_r), 1 - rate, [d])[j]."""
  x = jnp.asarray(np.random.default_rng(1).normal(size=(5, 6)).astype(np.float32))
  ids, key, rate = jnp.array([9, 2, 40, 7, 3]), jax.random.key(4), 0.4
  expected = np.stack([np.where(jax.random.bernoulli(jax.random.fold_in(key, i), 1 - rate, (6,)), x[r] / (1 - rate), 0)
                       for r, i in enumerate(ids)])
  with jaxdp.use_example_ids(ids):
    via_nnx = jaxdp.adapters.nnx.Dropout(rate)(x, rngs=key)
    via_linen = jaxdp.adapters.linen.Dropout(rate, deterministic=False).apply({}, x, rng=key)
    keys = jaxdp.example_keys(key)
  np.testing.assert_array_equal(via_nnx, expected)
  np.testing.assert_array_equal(via_linen, expected)
  np.testing.assert_array_equal(jax.random.key_data(keys), jax.random.key_data(jax.vmap(jax.random.fold_in, (None, 0))(key, ids)))
  # Without ids they are flax's layers, bit for bit.
  np.testing.assert_array_equal(jaxdp.adapters.nnx.Dropout(rate)(x, rngs=key), nnx.Dropout(rate)(x, rngs=key))
  np.testing.assert_array_equal(jaxdp.adapters.linen.Dropout(rate, deterministic=False).apply({}, x, rng=key),
                                nn.Dropout(rate, deterministic=False).apply({}, x, rng=key))


def test_without_example_ids_the_step_is_unchanged():
  """jaxdp.adapters.nnx.Dropout without the option is nnx.Dropout under the per-replica keys: the same bits."""
  batches, rng, layout = global_batches()[:2], jax.random.key(7), (2, (7, 5), 2)
  results = []
  for dropout in (jaxdp.adapters.nnx.Dropout, nnx.Dropout):
    definition, params, _ = jaxdp.adapters.nnx.split(NnxNet(dropout, rngs=nnx.Rngs(params=0, dropout=1)))
    results.append(train(jaxdp.adapters.nnx.loss_fn(definition, nnx_objective), params, batches, rng, layout, None))
  for a, b in zip(*map(jax.tree.leaves, results)):
    np.testing.assert_array_equal(a, b)


def test_flax_dropout_is_refused_with_example_ids():
  """The same key on every replica would give flax's own Dropout the same mask everywhere: refused, nnx and linen."""
  batches, rng, layout = global_batches()[:1], jax.random.key(7), (2, (7, 5), 1)
  definition, params, _ = jaxdp.adapters.nnx.split(NnxNet(nnx.Dropout, rngs=nnx.Rngs(params=0, dropout=1)))
  with pytest.raises(ValueError, match=r"flax nnx\.Dropout layers \(d1, d2\).*jaxdp\.adapters\.nnx\.Dropout"):
    train(jaxdp.adapters.nnx.loss_fn(definition, nnx_objective), params, batches, rng, layout)
  model = LinenNet(nn.Dropout)
  params = model.init(jax.random.key(0), batches[0]["x"], False)["params"]
  with pytest.raises(ValueError, match=r"flax\.linen\.Dropout .*correlated.*jaxdp\.adapters\.linen\.Dropout"):
    train(linen_loss(model), params, batches, rng, layout)


def test_example_ids_that_are_not_in_the_batch_are_refused():
  batches, rng, layout = global_batches()[:1], jax.random.key(7), (2, (7, 5), 1)
  definition, params, _ = jaxdp.adapters.nnx.split(NnxNet(rngs=nnx.Rngs(params=0, dropout=1)))
  with pytest.raises(ValueError, match=r"example_ids='index' but the batch has no such key"):
    train(jaxdp.adapters.nnx.loss_fn(definition, nnx_objective), params, batches, rng, layout, "index")
  with pytest.raises(TypeError, match="example_ids must be None"):
    jaxdp.make_train_step(jaxdp.adapters.nnx.loss_fn(definition, nnx_objective), OPT, example_ids=3)


class _ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return jaxdp.adapters.linen.Dropout(0.5, deterministic=False)(nn.relu(nn.Dense(H)(h))), None


class _LinenScanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    scanned = nn.scan(_ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True}, length=3)
    h, _ = scanned()(nn.Dense(H)(x), None)
    return nn.Dense(1)(h)[:, 0]


class _NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.lin, self.drop = nnx.Linear(H, H, rngs=rngs), jaxdp.adapters.nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, h):
    return self.drop(nnx.relu(self.lin(h)))


class _NnxScanned(nnx.Module):
  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stack(rngs):
      return _NnxBlock(rngs)

    self.inp, self.blocks, self.out = nnx.Linear(D, H, rngs=rngs), stack(rngs), nnx.Linear(H, 1, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(h, block):
      return block(h)

    return self.out(body(self.inp(x), self.blocks))[:, 0]


def test_layers_under_scan_keep_their_own_keys_and_the_masks_follow_the_ids():
  """nn.scan / nnx.scan over stacked layers: flax's per-iteration keys, then the ids; 3 devices, 2 micro-batches."""
  batches, rng = global_batches()[:2], jax.random.key(7)
  model = _LinenScanned()
  params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, batches[0]["x"])["params"]
  linen_fn = lambda p, b, key: (model.apply({"params": p}, b["x"], rngs={"dropout": key}) - b["y"]) ** 2  # noqa: E731
  definition, nnx_params, _ = jaxdp.adapters.nnx.split(_NnxScanned(nnx.Rngs(params=0, dropout=1)))
  nnx_fn = jaxdp.adapters.nnx.loss_fn(definition, nnx_objective)
  for loss_fn, p in ((linen_fn, params), (nnx_fn, nnx_params)):
    one = train(loss_fn, p, batches, rng, (1, (12,), 1))
    assert_close(train(loss_fn, p, batches, rng, (3, (5, 4, 3), 2)), one)


def assert_close(actual, expected):
  assert_close_elementwise(actual, expected, rtol=RTOL, atol=ATOL)
