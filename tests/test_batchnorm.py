"""Cross-replica BatchNorm (jaxdp.adapters.batchnorm) against plain single-device references.

The references see only the real rows of every device, concatenated, with
their weights: numpy float64 two-pass moments for the statistics, a plain
jnp batch norm (two-pass variance) under ``jax.grad`` for the gradients, and
flax's own ``nnx.BatchNorm`` for the module. Hypothesis draws the device
count (1..8), uneven real-row counts per device (0 included) and the weights
(all ones, bool 0/1 masks, random numbers with exact zeros); padding rows
hold NaN (statistics) or zeros (gradients), as ``shard_uneven`` pads.

Tolerances (float32, eps = 1.2e-7):
  * STAT_TOL = 2e-6 of the scale of the terms summed: |mean − ref| <=
    STAT_TOL · E_w[|x|] and |var − ref| <= STAT_TOL · E_w[x²]. Per feature the
    data-parallel sums add at most 8 · 4 · 2 = 64 products, per device and
    then across devices; the float64 reference is exact by comparison. A
    float32 sum of n terms is within ~log2(n) · eps = 7e-7 of the sum of their
    magnitudes, and the fast variance E[x²] − E[x]² inherits the error of
    E[x²]; 2e-6 is about 17 eps. flax's equal-weight pmean is off by ~0.5 on
    the 4/3/2/1 split below. Measured over 300 drawn splits: worst
    error / bound = 0.18 (errors of ~3 eps).
  * Gradients: RTOL = 1e-4, ATOL = 1e-5 against the float32 reference
    (about 100 ulp at 1.0; a backward pass that drops the other devices'
    share of the statistics' cotangents is off by ~4e4 of these bounds). The
    backward pass divides by σ and subtracts terms of similar size, and the
    fast variance loses about log2(E[x²]/var) bits, so the test data keeps
    var >= 0.25 (see gradient_error). Measured over 300 drawn splits: worst
    |error| / (ATOL + RTOL · |ref|) = 0.15.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings, strategies as st
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdp
from helpers import mesh_of
from jaxdp.adapters.batchnorm import BatchNorm, Moments, masked_moments

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py: plumbing and float32 agreement

ROWS, S, C = 4, 2, 3  # padded rows per device, a spatial axis reduced too, features
EPS = 1e-5
STAT_TOL = 2e-6
RTOL, ATOL = 1e-4, 1e-5


def put(mesh, tree, spec):
  return jax.device_put(tree, NamedSharding(mesh, spec))


def make_split(counts, kind, seed, padding=np.nan):
  """Padded global x [k·ROWS, S, C] and weights [k·ROWS], plus the real rows' indices.

  Device d holds rows d·ROWS .. d·ROWS + counts[d] − 1; the others are padding of weight 0.
  """
  rng = np.random.default_rng(seed)
  k = len(counts)
  x = (rng.normal(size=(k * ROWS, S, C)) * 2 + 3).astype(np.float32)
  real = np.concatenate([d * ROWS + np.arange(n) for d, n in enumerate(counts)]).astype(int)
  if kind == "ones":
    w = np.zeros(k * ROWS, np.float32)
    w[real] = 1
  elif kind == "mask":
    w = np.zeros(k * ROWS, bool)
    w[real] = rng.integers(0, 2, size=real.size).astype(bool)
  else:
    w = np.zeros(k * ROWS, np.float32)
    w[real] = rng.uniform(0, 2, size=real.size) * rng.integers(0, 4, size=real.size).astype(bool)
  pad = np.ones(k * ROWS, bool)
  pad[real] = False
  x[pad] = padding
  return x, w, real


def reference_moments(x, w):
  """Float64 two-pass weighted moments over rows and S of x [n, S, C] with weights [n]."""
  x, w = np.asarray(x, np.float64), np.broadcast_to(np.asarray(w, np.float64)[:, None, None], x.shape)
  count = w.sum() / C
  if count == 0:
    return Moments(np.zeros(C), np.zeros(C), 0.0), np.ones(C), np.ones(C)
  mean = (w * x).sum((0, 1)) / count
  var = (w * (x - mean) ** 2).sum((0, 1)) / count
  return Moments(mean, var, count), (w * np.abs(x)).sum((0, 1)) / count, (w * x**2).sum((0, 1)) / count


@functools.lru_cache(maxsize=None)
def sharded_moments(k):
  """masked_moments inside jit(shard_map) over the first k devices; one compile per k and weight dtype."""
  fn = lambda x, w: masked_moments(x, w, axis_name="data")
  return jax.jit(jax.shard_map(fn, mesh=mesh_of(k), in_specs=(P("data"), P("data")), out_specs=P()))


splits = st.tuples(
    st.integers(1, 8).flatmap(lambda k: st.lists(st.integers(0, ROWS), min_size=k, max_size=k)),
    st.sampled_from(["ones", "mask", "random"]),
    st.integers(0, 2**16),
)


def stat_error(counts, kind, seed):
  """Worst error / tolerance bound of the data-parallel moments (<= 1 passes); also checks count."""
  x, w, real = make_split(counts, kind, seed)
  mesh = mesh_of(len(counts))
  got = jax.tree.map(np.asarray, sharded_moments(len(counts))(put(mesh, x, P("data")), put(mesh, w, P("data"))))
  ref, abs_scale, sq_scale = reference_moments(x[real], w[real])
  np.testing.assert_allclose(got.count, S * np.sum(w[real], dtype=np.float64), rtol=1e-6)
  assert got.mean.dtype == got.var.dtype == got.count.dtype == np.float32
  return max(
      np.max(np.abs(got.mean - ref.mean) / (STAT_TOL * abs_scale)),
      np.max(np.abs(got.var - ref.var) / (STAT_TOL * sq_scale)),
  )


@settings(max_examples=10)
@given(splits)
@example(([0, 0, 0], "ones", 0))  # no real row anywhere: zeros, no NaN
@example(([4, 0, 1, 3, 0, 2, 4, 1], "random", 1))  # zero-row devices on the full mesh
@example(([1, 4, 0, 2], "mask", 2))
def test_moments_equal_single_device_reference(split):
  assert stat_error(*split) <= 1


def test_one_all_reduce():
  """The three sums travel in ONE all-reduce (a variadic tuple psum), with or without weights."""
  k = 4
  mesh = mesh_of(k)
  x, w, _ = make_split([1, 2, 3, 4], "random", 0)
  x, w = put(mesh, x, P("data")), put(mesh, w, P("data"))
  no_weights = jax.jit(jax.shard_map(masked_moments, mesh=mesh, in_specs=P("data"), out_specs=P()))
  for hlo in (sharded_moments(k).lower(x, w).compile().as_text(), no_weights.lower(x).compile().as_text()):
    ops = jaxdp.collectives_from_hlo(hlo, k)
    assert ops["all-reduce"].count == 1
    assert ops["all-gather"].count == ops["reduce-scatter"].count == 0


def test_moments_without_weights_and_modes():
  """weights=None counts every element; unbound axis = whole batch; axis_name=None = per device."""
  x, _, _ = make_split([ROWS] * 4, "ones", 3)
  ref, _, _ = reference_moments(x, np.ones(len(x)))
  for got in (masked_moments(x), jax.jit(masked_moments)(x)):  # "data" is not bound here
    np.testing.assert_allclose(got.mean, ref.mean, rtol=1e-6)
    np.testing.assert_allclose(got.var, ref.var, rtol=1e-5)
    assert float(got.count) == len(x) * S
  mesh = mesh_of(4)
  local = jax.jit(
      jax.shard_map(
          lambda x: masked_moments(x, axis_name=None)[:2], mesh=mesh, in_specs=P("data"), out_specs=P("data")
      )
  )(put(mesh, x, P("data")))
  for d in range(4):
    ref, _, _ = reference_moments(x[d * ROWS : (d + 1) * ROWS], np.ones(ROWS))
    np.testing.assert_allclose(local[0][d * C : (d + 1) * C], ref.mean, rtol=1e-6)
    np.testing.assert_allclose(local[1][d * C : (d + 1) * C], ref.var, rtol=1e-5)


def test_weight_broadcasting_rules():
  """[b] aligns with the leading axis; a mask of x's rank broadcasts as numpy; per-feature masks count per feature."""
  x, w, real = make_split([3, 1], "random", 4, padding=0.0)
  base = masked_moments(x, w)
  for full in (w[:, None], w[:, None, None], np.broadcast_to(w[:, None, None], x.shape)):
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6), masked_moments(x, full), base)
  assert base.count.shape == ()
  per_feature = np.broadcast_to(w[:, None, None], x.shape) * np.array([1.0, 0.0, 2.0], np.float32)[None, None, :]
  got = masked_moments(x, per_feature)
  assert got.count.shape == (C,)
  np.testing.assert_allclose(got.count, np.array([1.0, 0.0, 2.0]) * float(base.count), rtol=1e-6)
  np.testing.assert_allclose(got.mean, np.asarray(base.mean) * np.array([1, 0, 1]), rtol=1e-6)
  channels_first = masked_moments(np.moveaxis(x, -1, 1), w, feature_axes=1)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6), channels_first, base)
  low = masked_moments(x.astype(jnp.bfloat16), w)
  assert low.mean.dtype == low.var.dtype == low.count.dtype == jnp.float32
  with pytest.raises(ValueError, match="weights"):
    masked_moments(x, np.ones((len(x), S + 1), np.float32))


# --- gradients -------------------------------------------------------------------------------------


def init_model(seed=0, **kwargs):
  """Our BatchNorm with random scale and bias, so that their gradients are not trivial."""
  model = BatchNorm(C, momentum=0.9, rngs=nnx.Rngs(seed), **kwargs)
  rng = np.random.default_rng(seed)
  model.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, C), jnp.float32)
  model.bias[...] = jnp.asarray(rng.normal(size=C), jnp.float32)
  return model


GRAPHDEF, PARAMS, STATS = nnx.split(init_model(), nnx.Param, nnx.BatchStat)


def weighted_loss_sum(params, stats, x, w, t):
  """Σ over real rows of w · ½‖BatchNorm(x) − t‖², through the module (training mode)."""
  y = nnx.merge(GRAPHDEF, params, stats, copy=True)(x, mask=w)  # fresh Variables at this trace level
  per_row = 0.5 * jnp.sum(jnp.square(y - t), axis=(1, 2))
  return jnp.sum(jnp.where(w > 0, w * per_row, 0))


@functools.lru_cache(maxsize=None)
def sharded_gradient(k):
  """Per device: grad of the local loss sum w.r.t. x and a varying copy of the params; params' grads psummed."""

  def replica(params, stats, x, w, t):
    varying = jax.tree.map(lambda p: lax.pcast(p, "data", to="varying"), params)
    grad_params, grad_x = jax.grad(weighted_loss_sum, argnums=(0, 2))(varying, stats, x, w, t)
    return lax.psum(grad_params, "data"), grad_x

  specs = dict(in_specs=(P(), P(), P("data"), P("data"), P("data")), out_specs=(P(), P("data")))
  return jax.jit(jax.shard_map(replica, mesh=mesh_of(k), check_vma=True, **specs))


@jax.jit
def reference_gradient(scale, bias, x, w, t):
  """Plain single-device batch norm (two-pass variance) over the concatenated real rows."""

  def loss(scale, bias, x):
    wx = jnp.broadcast_to(w[:, None, None], x.shape)
    count = jnp.sum(wx[..., 0])
    mean = jnp.sum(wx * x, axis=(0, 1)) / count
    var = jnp.sum(wx * jnp.square(x - mean[None, None, :]), axis=(0, 1)) / count
    y = (x - mean[None, None, :]) / jnp.sqrt(var[None, None, :] + EPS) * scale[None, None, :] + bias[None, None, :]
    return jnp.sum(w * 0.5 * jnp.sum(jnp.square(y - t), axis=(1, 2)))

  return jax.grad(loss, argnums=(0, 1, 2))(scale, bias, x)


def gradient_error(counts, kind, seed):
  """Worst |error| / (ATOL + RTOL·|ref|) of the data-parallel gradients (<= 1 passes)."""
  x, w, real = make_split(counts, kind, seed, padding=0.0)
  w = w.astype(np.float32)
  rng = np.random.default_rng(seed + 1)
  t = rng.normal(size=x.shape).astype(np.float32)
  # Each real row spreads its S = 2 values by ±d, |d| >= 0.5, around its own centre: the weighted variance is
  # then >= 0.25 whatever the weights. With one real row of nearly equal values, var ~ 1e-4 and the backward
  # pass (which divides by σ) amplifies the fast variance's cancellation by E[x²]/var ~ 1e4: a conditioning
  # problem flax shares, not a data-parallel one.
  centre, spread = rng.normal(size=(real.size, 1, C)), rng.uniform(0.5, 1.5, size=(real.size, 1, C))
  x[real] = (centre + np.concatenate([spread, -spread], axis=1)).astype(np.float32)
  mesh = mesh_of(len(counts))
  grad_params, grad_x = sharded_gradient(len(counts))(
      put(mesh, PARAMS, P()), put(mesh, STATS, P()), *(put(mesh, a, P("data")) for a in (x, w, t))
  )
  grad_x = np.asarray(grad_x)
  pad = np.ones(len(x), bool)
  pad[real] = False
  assert np.all(grad_x[pad] == 0)  # padding rows get no gradient
  if not np.any(w[real] > 0):  # no real weight: nothing to learn, and no NaN
    ref = [np.zeros(C), np.zeros(C), np.zeros((real.size, S, C))]
  else:
    ref = reference_gradient(PARAMS["scale"][...], PARAMS["bias"][...], x[real], w[real], t[real])
  got = [grad_params["scale"][...], grad_params["bias"][...], grad_x[real]]
  return max(float(np.max(np.abs(g - r) / (ATOL + RTOL * np.abs(r)), initial=0)) for g, r in zip(got, ref))


@settings(max_examples=10)
@given(splits)
@example(([3, 0, 4, 1], "random", 0))  # a zero-row device
@example(([0, 2, 0, 0, 0, 0, 0, 1], "ones", 1))
@example(([0, 0], "ones", 2))  # no real row anywhere
def test_gradients_equal_single_device_reference(split):
  assert gradient_error(*split) <= 1


# --- the nnx module --------------------------------------------------------------------------------


def batches(n, rows=6, seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.normal(size=(rows, S, C)) * 2 + 3, jnp.float32) for _ in range(n)]


def assert_state_equal(a, b):
  for name in ("scale", "bias", "mean", "var"):
    np.testing.assert_array_equal(getattr(a, name)[...], getattr(b, name)[...], err_msg=name)


@pytest.mark.parametrize("jit", [False, True])
def test_module_equals_flax_on_one_device(jit):
  """No padding, one device, default axis_name (unbound here): bitwise flax's nnx.BatchNorm."""
  ours = BatchNorm(C, momentum=0.9, rngs=nnx.Rngs(0))
  theirs = nnx.BatchNorm(C, momentum=0.9, rngs=nnx.Rngs(0))
  call = nnx.jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
  assert_state_equal(ours, theirs)
  for x in batches(3):
    np.testing.assert_array_equal(call(ours, x), call(theirs, x))
  assert_state_equal(ours, theirs)
  ours.eval(), theirs.eval()
  np.testing.assert_array_equal(call(ours, x), call(theirs, x))


def test_module_padding_rows_change_nothing():
  """Zero-weight rows (NaN here) change neither the real rows' outputs nor the running statistics."""
  plain, padded = BatchNorm(C, momentum=0.9, rngs=nnx.Rngs(0)), BatchNorm(C, momentum=0.9, rngs=nnx.Rngs(0))
  mask = jnp.asarray([1, 0, 1, 1, 0, 1, 1, 0, 1], jnp.float32)
  real = np.flatnonzero(np.asarray(mask))
  for x in batches(3):
    with_padding = jnp.zeros((len(mask), S, C)).at[real].set(x).at[np.flatnonzero(np.asarray(mask) == 0)].set(jnp.nan)
    np.testing.assert_allclose(padded(with_padding, mask=mask)[real], plain(x), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(padded.mean[...], plain.mean[...], rtol=1e-6)
  np.testing.assert_allclose(padded.var[...], plain.var[...], rtol=1e-6)


def test_module_eval_uses_running_statistics():
  model = init_model()
  for x in batches(2):
    model(x)
  model.eval()
  assert model.use_running_average is True
  stats = (model.mean[...], model.var[...])
  x = batches(1, seed=1)[0]
  expected = (x - stats[0][None, None, :]) / jnp.sqrt(stats[1][None, None, :] + EPS) * model.scale[...][
      None, None, :
  ] + model.bias[...][None, None, :]
  np.testing.assert_allclose(model(x), expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(model.mean[...], stats[0])  # eval leaves the statistics alone
  model.train()
  assert model.use_running_average is False
  assert nnx.view(model, use_running_average=True).use_running_average is True
  np.testing.assert_allclose(model(x, use_running_average=True), expected, rtol=1e-5, atol=1e-5)


def test_module_without_real_rows_keeps_running_statistics():
  model = init_model()
  model(batches(1)[0])
  before = (np.asarray(model.mean[...]), np.asarray(model.var[...]))
  y = model(batches(1, seed=2)[0], mask=jnp.zeros(6, bool))
  np.testing.assert_array_equal(model.mean[...], before[0])
  np.testing.assert_array_equal(model.var[...], before[1])
  assert np.all(np.isfinite(y))


def sharded_module(model, k, x, w, synced):
  """The module's training call inside jit(shard_map); returns outputs and (when synced) its new state."""
  graphdef, state = nnx.split(model)

  def replica(state, x, w):
    m = nnx.merge(graphdef, state)
    y = m(x, mask=w)
    return (y, nnx.state(m)) if synced else y

  mesh = mesh_of(k)
  out_specs = (P("data"), P()) if synced else P("data")
  fn = jax.jit(jax.shard_map(replica, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=out_specs))
  return fn(put(mesh, state, P()), put(mesh, x, P("data")), put(mesh, w, P("data")))


def test_module_synced_and_local_statistics():
  """axis_name="data": the whole real global batch; axis_name=None: each device's own rows."""
  counts = [3, 0, 4, 1]
  x, w, real = make_split(counts, "random", 5, padding=0.0)
  y, state = sharded_module(init_model(), len(counts), x, w, synced=True)
  whole = init_model()
  np.testing.assert_allclose(np.asarray(y)[real], whole(x[real], mask=w[real]), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(state["mean"][...], whole.mean[...], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(state["var"][...], whole.var[...], rtol=1e-5, atol=1e-6)
  y = np.asarray(sharded_module(init_model(axis_name=None), len(counts), x, w, synced=False))
  for d, n in enumerate(counts):
    rows = slice(d * ROWS, d * ROWS + n)
    np.testing.assert_allclose(y[rows], init_model()(x[rows], mask=w[rows]), rtol=1e-5, atol=1e-5)


def test_module_in_global_view_jit():
  """Default axis_name under jit over a globally sharded batch (no shard_map): XLA sums over all devices."""
  mesh = mesh_of(4)
  x = jnp.concatenate(batches(4, rows=2))
  ours, theirs = BatchNorm(C, rngs=nnx.Rngs(0)), nnx.BatchNorm(C, rngs=nnx.Rngs(0))
  with jax.set_mesh(mesh):
    y = nnx.jit(lambda m, x: m(x))(ours, put(mesh, x, P("data")))
  np.testing.assert_allclose(y, theirs(x), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ours.var[...], theirs.var[...], rtol=1e-6)


def test_flax_pmean_is_not_exact_on_uneven_split():
  """flax's masked BatchNorm pmeans per-device means with equal weight; ours matches the global batch."""
  counts = [4, 3, 2, 1]
  x, w, real = make_split(counts, "ones", 6, padding=0.0)
  ref, _, _ = reference_moments(x[real], w[real])
  mask = jnp.asarray(w[:, None, None] > 0)
  theirs = nnx.BatchNorm(C, axis_name="data", momentum=0.0, rngs=nnx.Rngs(0))  # momentum 0: running = batch
  _, flax_state = sharded_module(theirs, len(counts), x, mask, synced=True)
  _, our_state = sharded_module(BatchNorm(C, momentum=0.0, rngs=nnx.Rngs(0)), len(counts), x, w, synced=True)
  for name in ("mean", "var"):
    flax_error = np.max(np.abs(flax_state[name][...] - getattr(ref, name)))
    our_error = np.max(np.abs(our_state[name][...] - getattr(ref, name)))
    assert flax_error - our_error > 0, name
    assert our_error <= 1e-5
