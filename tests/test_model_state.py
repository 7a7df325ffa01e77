"""Model state, auxiliary metrics and padding-aware losses against a plain single-device reference.

The model: ``h = x @ w1``, exact BatchNorm of ``h`` (``jaxdp.masked_moments``
over the real rows of every device, the functional form a linen or plain-JAX
user calls), ``tanh``, a linear read-out; per-example squared error; an
``abs_err`` metric; running mean and variance as model state (momentum 0.9,
left alone by a micro-batch without real rows).

The reference is written plainly: one device, the concatenated real rows of
each global micro-batch, batch statistics as ``Σ w·h / Σ w`` and
``Σ w·h² / Σ w − mean²`` in numpy-style jnp, the model state threaded
through the micro-batches in order, gradient sums accumulated and divided
once by the total weight, a plain optax update; a step of global weight 0
changes nothing.

Tolerances (float32): RTOL = 1e-5, ATOL = 2e-6, those of
test_step_properties.py (re-associated sums of <= 96 terms, over <= 3
chained steps). BatchNorm divides by the batch's standard deviation (~1
here) and its statistics are sums over the same rows, so it adds no
amplification beyond that; the running statistics are convex combinations
of batch statistics and inherit their error.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import example, given, settings, strategies as st

import jaxdp
from helpers import assert_close as assert_close_elementwise

# Plumbing and float32 agreement, not speed: most XLA passes skipped while this module runs (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compiles")

D, H, MAX_ROWS = 3, 4, 4
RTOL, ATOL = 1e-5, 2e-6
EPS, MOMENTUM = 1e-3, 0.9
OPT = optax.sgd(0.1, momentum=0.9)


def init_params(seed):
  rng = np.random.default_rng(seed)
  return {
      "w1": rng.normal(size=(D, H)).astype(np.float32),
      "scale": (1.0 + 0.1 * rng.normal(size=(H,))).astype(np.float32),
      "bias": (0.1 * rng.normal(size=(H,))).astype(np.float32),
      "w2": rng.normal(size=(H,)).astype(np.float32),
  }


def init_model_state():
  return {"mean": np.zeros((H,), np.float32), "var": np.ones((H,), np.float32)}


def _head(params, h, mean, var, y):
  hn = (h - mean[None, :]) * jax.lax.rsqrt(var[None, :] + EPS) * params["scale"][None, :] + params["bias"][None, :]
  out = jnp.tanh(hn) @ params["w2"]
  return 0.5 * (out - y) ** 2, jnp.abs(out - y)


def loss_fn(params, batch, *, model_state, weights, axis_name, train):
  """jaxdp's loss protocol: exact BatchNorm statistics over every device's real rows."""
  h = batch["x"] @ params["w1"]
  if train:
    moments = jaxdp.masked_moments(h, weights, axis_name=axis_name)
    mean, var = moments.mean, moments.var
    new_state = {
        k: jnp.where(moments.count > 0, MOMENTUM * model_state[k] + (1 - MOMENTUM) * v, model_state[k])
        for k, v in (("mean", mean), ("var", var))
    }
  else:
    mean, var, new_state = model_state["mean"], model_state["var"], model_state
  losses, abs_err = _head(params, h, mean, var, batch["y"])
  return jaxdp.LossOutput(losses, new_state, {"abs_err": abs_err})


def reference_objective(params, model_state, batch, weights):
  """Σ w·l over one global micro-batch, with its statistics written out (no jaxdp)."""
  h = batch["x"] @ params["w1"]
  count = jnp.sum(weights)
  safe = jnp.where(count > 0, count, 1.0)
  mean = jnp.sum(weights[:, None] * h, axis=0) / safe
  var = jnp.maximum(jnp.sum(weights[:, None] * h * h, axis=0) / safe - mean * mean, 0.0)
  losses, abs_err = _head(params, h, mean, var, batch["y"])
  new_state = {
      k: jnp.where(count > 0, MOMENTUM * model_state[k] + (1 - MOMENTUM) * v, model_state[k])
      for k, v in (("mean", mean), ("var", var))
  }
  return jnp.sum(weights * losses), (count, jnp.sum(weights * abs_err), new_state)


reference_gradient = jax.jit(jax.value_and_grad(reference_objective, has_aux=True))
reference_objective_jit = jax.jit(reference_objective)  # one compile per row count; eager would compile every op


class Case(NamedTuple):
  k: int
  counts: tuple
  random_weights: bool
  accum: int
  zero_stage: int
  steps: int
  seed: int


@st.composite
def cases(draw):
  k = draw(st.integers(1, 8))
  counts = draw(st.lists(st.integers(0, MAX_ROWS), min_size=k, max_size=k))
  counts[draw(st.integers(0, k - 1))] = MAX_ROWS
  return Case(
      k=k, counts=tuple(counts), random_weights=draw(st.booleans()), accum=draw(st.sampled_from([1, 2])),
      zero_stage=draw(st.sampled_from([0, 1, 2, 3])) if k > 1 else 0, steps=draw(st.integers(1, 3)),
      seed=draw(st.integers(0, 2**16)),
  )


def device_data(case, step):
  rng = np.random.default_rng([case.seed, step])
  batches, weights = [], []
  for n in case.counts:
    batches.append({"x": rng.normal(size=(n, D)).astype(np.float32), "y": rng.normal(size=(n,)).astype(np.float32)})
    w = rng.uniform(0.0, 2.0, size=n) * (rng.random(n) > 0.25) if case.random_weights else np.ones(n)
    weights.append(w.astype(np.float32))
  return batches, weights


def global_micro_batches(case, step):
  """The real rows of micro-batch ``i`` of every device, concatenated in device order, for each ``i``."""
  batches, weights = device_data(case, step)
  size = MAX_ROWS // case.accum  # every device's slice is padded to MAX_ROWS rows
  micro = []
  for i in range(case.accum):
    rows = [slice(i * size, min((i + 1) * size, n)) for n in case.counts]
    pick = lambda xs: np.concatenate([x[r] for x, r in zip(xs, rows)])  # noqa: E731
    micro.append(({"x": pick([b["x"] for b in batches]), "y": pick([b["y"] for b in batches])}, pick(weights)))
  return micro


def run_reference(case):
  params, model_state = jax.tree.map(jnp.asarray, (init_params(case.seed), init_model_state()))
  opt_state, history = OPT.init(params), []
  for s in range(case.steps):
    grads, loss_sum, weight, err_sum, new_state = None, 0.0, 0.0, 0.0, model_state
    for batch, w in global_micro_batches(case, s):
      (ls, (count, es, new_state)), g = reference_gradient(params, new_state, batch, w)
      grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
      loss_sum, weight, err_sum = loss_sum + ls, weight + count, err_sum + es
    metrics = {"loss": 0.0, "abs_err": 0.0, "weight": float(weight)}
    if weight > 0:
      updates, opt_state = OPT.update(jax.tree.map(lambda g: g / weight, grads), opt_state, params)
      params, model_state = optax.apply_updates(params, updates), new_state
      metrics.update(loss=loss_sum / weight, abs_err=err_sum / weight)
    history.append((params, model_state, metrics))
  return history


@functools.lru_cache(maxsize=None)
def compiled_step(k, accum, zero_stage):
  mesh = jaxdp.data_mesh(jax.devices()[:k])
  return jaxdp.make_train_step(loss_fn, OPT, mesh, accum_steps=accum, zero_stage=zero_stage, check_replicas=True)


MIXED = Case(k=8, counts=(4, 0, 2, 3, 1, 4, 0, 2), random_weights=True, accum=2, zero_stage=2, steps=3, seed=5)
EMPTY_MICRO = Case(k=3, counts=(1, 0, 4), random_weights=False, accum=2, zero_stage=3, steps=2, seed=1)


@settings(max_examples=4)
@example(case=MIXED)
@example(case=EMPTY_MICRO)
@given(case=cases())
def test_model_state_and_metrics_match_one_device(case):
  """Params, optimizer state, model state and the loss/abs_err metrics equal the reference, step by step.

  Over 1-8 devices with uneven (also zero) row counts, random weights with
  zeros, accumulation and every ZeRO stage. The model state is identical on
  every replica after every step.
  """
  mesh = jaxdp.data_mesh(jax.devices()[: case.k])
  step = compiled_step(case.k, case.accum, case.zero_stage)
  state = jaxdp.init_state(init_params(case.seed), OPT, mesh, zero_stage=case.zero_stage, model_state=init_model_state())
  for s, (params, model_state, metrics) in enumerate(run_reference(case)):
    batches, weights = device_data(case, s)
    state, got = step(state, *jaxdp.shard_uneven(batches, mesh, weights=weights))
    jaxdp.assert_replicas_equal(state.model_state)
    assert float(got["replica_divergence"]) == 0.0
    full = jaxdp.gather_state(state)
    assert_close(full.params, params)
    assert_close(full.model_state, model_state)
    np.testing.assert_allclose(got["weight"], metrics["weight"], rtol=1e-6)
    for name in ("loss", "abs_err"):
      np.testing.assert_allclose(got[name], metrics[name], rtol=RTOL, atol=ATOL)


def test_local_statistics_are_averaged_by_weight():
  """Per-device BatchNorm (axis_name=None): the new state is Σ_i w_i·s_i / Σ w of the devices' own updates."""

  def local_loss(params, batch, *, model_state, weights, axis_name, train):
    return loss_fn(params, batch, model_state=model_state, weights=weights, axis_name=None, train=train)

  case = Case(k=4, counts=(3, 0, 4, 1), random_weights=True, accum=1, zero_stage=0, steps=1, seed=2)
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  state = jaxdp.init_state(init_params(2), OPT, mesh, model_state=init_model_state())
  batches, weights = device_data(case, 0)
  step = jaxdp.make_train_step(local_loss, OPT, mesh, check_replicas=True)
  state, metrics = step(state, *jaxdp.shard_uneven(batches, mesh, weights=weights))
  assert float(metrics["replica_divergence"]) == 0.0
  params, start = jax.tree.map(jnp.asarray, (init_params(2), init_model_state()))
  own = [reference_objective_jit(params, start, b, w)[1] for b, w in zip(batches, weights)]
  total = sum(float(np.sum(w)) for w in weights)
  for name in ("mean", "var"):
    expected = sum(np.sum(w) * np.asarray(s[2][name]) for w, s in zip(weights, own)) / total
    np.testing.assert_allclose(np.asarray(state.model_state[name]), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_eval_step_is_the_global_weighted_mean_over_real_rows(zero_stage):
  """make_eval_step on padded, uneven batches: loss and metric over the real rows only, each counted once, from a
  state of any ZeRO stage."""
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  state = jaxdp.init_state(init_params(3), OPT, mesh, zero_stage=zero_stage, model_state=init_model_state())
  state = state._replace(model_state={"mean": np.full((H,), 0.2, np.float32), "var": np.full((H,), 1.5, np.float32)})
  evaluate = jaxdp.make_eval_step(loss_fn, mesh)
  case = Case(k=4, counts=(4, 0, 2, 1), random_weights=True, accum=1, zero_stage=3, steps=1, seed=9)
  parts = [device_data(case, s) for s in range(2)]
  params = jax.tree.map(jnp.asarray, init_params(3))
  sums = np.zeros(3)
  for batches, weights in parts:
    x, y, w = (np.concatenate(v) for v in ([b["x"] for b in batches], [b["y"] for b in batches], weights))
    losses, abs_err = _head(params, x @ params["w1"], state.model_state["mean"], state.model_state["var"], y)
    sums += [np.sum(w * losses), np.sum(w * abs_err), np.sum(w)]
    one = evaluate(state, *jaxdp.shard_uneven(batches, mesh, weights=weights))
    np.testing.assert_allclose(one["loss"], np.sum(w * losses) / np.sum(w), rtol=RTOL, atol=ATOL)
  everything = evaluate.evaluate(state, [jaxdp.shard_uneven(b, mesh, weights=w) for b, w in parts])
  np.testing.assert_allclose(
      [everything["loss"], everything["abs_err"], everything["weight"]], [sums[0] / sums[2], sums[1] / sums[2], sums[2]],
      rtol=RTOL, atol=ATOL,
  )


# Bad inputs: a clear error naming the fix, and the caller's state intact ----------------------------------


def _bad_call(bad_loss, match, error=ValueError):
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  state = jaxdp.init_state(init_params(0), OPT, mesh, model_state=init_model_state())
  batches, weights = device_data(Case(4, (2, 1, 0, 3), False, 1, 0, 1, 0), 0)
  with pytest.raises(error, match=match):
    jaxdp.make_train_step(bad_loss, OPT, mesh)(state, *jaxdp.shard_uneven(batches, mesh, weights=weights))
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
  jaxdp.make_train_step(loss_fn, OPT, mesh)(state, *jaxdp.shard_uneven(batches, mesh, weights=weights))


def test_model_state_of_another_structure_is_refused():
  def bad(params, batch, **kw):
    out = loss_fn(params, batch, **kw)
    return out._replace(model_state={"mean": out.model_state["mean"]})

  _bad_call(bad, r"model_state of another structure")


def test_model_state_of_another_dtype_is_refused():
  def bad(params, batch, **kw):
    out = loss_fn(params, batch, **kw)
    return out._replace(model_state={**out.model_state, "var": out.model_state["var"].astype(jnp.bfloat16)})

  _bad_call(bad, r"model_state\['var'\] .*keep every leaf's shape and dtype")


def test_no_model_state_returned_is_refused():
  def bad(params, batch, **kw):
    return loss_fn(params, batch, **kw).losses

  _bad_call(bad, r"given a model_state but returned none")


def test_loss_without_model_state_argument_is_refused():
  def bad(params, batch):
    return 0.5 * (batch["x"] @ params["w1"]).sum(-1) ** 2

  _bad_call(bad, r"loss_fn takes no model_state argument", TypeError)


@pytest.mark.parametrize("shape", ["scalar", "per-token"])
def test_metrics_of_the_wrong_shape_are_refused(shape):
  def bad(params, batch, **kw):
    out = loss_fn(params, batch, **kw)
    values = out.losses.mean() if shape == "scalar" else jnp.stack([out.losses] * 2, axis=1)
    return out._replace(metrics={"abs_err": values})

  _bad_call(bad, r"metric 'abs_err' has shape .* one\s+value per example")


def test_reserved_metric_names_are_refused():
  def bad(params, batch, **kw):
    out = loss_fn(params, batch, **kw)
    return out._replace(metrics={"grad_norm": out.losses})

  _bad_call(bad, r"metric name 'grad_norm' is not allowed")


def test_loss_with_a_collective_passes_the_checks():
  """make_train_step never runs loss_fn outside the mapped step: a psum inside it is fine (issue: unbound axis)."""
  mesh = jaxdp.data_mesh(jax.devices()[:2])

  def centred(params, batch):
    total = jax.lax.psum(jnp.sum(batch["x"]), "data")  # needs the bound axis
    return 0.5 * (batch["x"] @ params["w1"] - total).sum(-1) ** 2

  state = jaxdp.init_state(init_params(0), OPT, mesh)
  batches, _ = device_data(Case(2, (2, 1), False, 1, 0, 1, 0), 0)
  _, metrics = jaxdp.make_train_step(centred, OPT, mesh)(state, *jaxdp.shard_uneven(batches, mesh))
  assert np.isfinite(float(metrics["loss"]))


# Ordinary code after jaxdp -----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["explicit mesh, in its context", "auto_mesh twin, no context"])
def test_returned_arrays_work_in_ordinary_code(where):
  """State from a step on a user's Explicit mesh: jnp with fresh arrays, nnx metrics, nnx.update, jit.

  The state lives on the user's mesh; JAX's rule for arrays typed on an Explicit mesh is that single-device
  code meets them inside ``jax.set_mesh(mesh)`` (outside it a metrics object's ``reset()`` fails with "Length of
  device assignment 1 is not equal to the size of the mesh 4", as it does for the user's own arrays). A program
  that wants Auto-typed arrays usable anywhere passes ``jaxdp.sharding.layout.auto_mesh(mesh)`` instead."""
  import contextlib

  from jax.sharding import AxisType, Mesh

  users = Mesh(np.array(jax.devices()[:4]), ("data",), axis_types=(AxisType.Explicit,))
  mesh = users if where.startswith("explicit") else jaxdp.sharding.layout.auto_mesh(users)
  state = jaxdp.init_state(init_params(0), OPT, mesh, model_state=init_model_state())
  batches, weights = device_data(Case(4, (2, 1, 0, 3), True, 1, 0, 1, 0), 0)
  state, metrics = jaxdp.make_train_step(loss_fn, OPT, mesh)(state, *jaxdp.shard_uneven(batches, mesh, weights=weights))
  assert state.params["w1"].sharding.mesh == mesh
  with jax.set_mesh(mesh) if mesh is users else contextlib.nullcontext():
    w1 = state.params["w1"] + jnp.ones((D, H))
    assert w1.shape == (D, H) and float(jnp.sum(state.model_state["mean"] * jnp.arange(H))) == pytest.approx(
        float(np.sum(np.asarray(state.model_state["mean"]) * np.arange(H))), rel=1e-6)
    average = nnx.metrics.Average()
    average.update(values=metrics["loss"])
    average.reset()  # failed with "Length of device assignment 1 is not equal to the size of the mesh 4"
    average.update(values=jnp.ones(3))
    assert float(average.compute()) == 1.0
    assert jax.jit(lambda p, x: x @ p["w1"])(state.params, jnp.ones((2, D))).shape == (2, H)


def test_an_integer_state_that_differs_between_replicas_is_refused():
  """A count of real examples seen, kept per replica, took replica 0's value: 7 where one device counts 24 (a
  linen port's sown counter). Refused, naming the leaf; the psum the message asks for gives one device's count."""
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  rng = np.random.default_rng(0)
  portions = [{"x": rng.normal(size=(n, D)).astype(np.float32), "y": rng.normal(size=(n,)).astype(np.float32)}
              for n in (3, 0, 5, 1)]

  def counting(total):
    def loss_fn(params, batch, *, model_state, weights, axis_name):
      seen = jnp.sum(weights > 0).astype(jnp.int32)
      seen = jax.lax.psum(seen, axis_name) if total else seen
      losses = 0.5 * (batch["x"] @ params["w1"] @ params["w2"] - batch["y"]) ** 2
      return jaxdp.LossOutput(losses, model_state={"seen": model_state["seen"] + seen})
    return loss_fn

  params = {k: v for k, v in init_params(0).items() if k in ("w1", "w2")}
  model_state = {"seen": np.zeros((), np.int32)}
  state = jaxdp.init_state(params, OPT, mesh, model_state=model_state)
  with pytest.raises(ValueError, match=r"model_state\['seen'\] \(int32\) differs between the replicas.*lax\.psum"):
    jaxdp.make_train_step(counting(False), OPT, mesh)(state, *jaxdp.shard_uneven(portions, mesh))
  state, _ = jaxdp.make_train_step(counting(True), OPT, mesh)(state, *jaxdp.shard_uneven(portions, mesh))
  assert int(state.model_state["seen"]) == 9


def test_flax_linen_batchnorm_is_refused_in_training_and_runs_in_evaluation():
  """linen's own BatchNorm trained silently on padded batches: the padding rows entered its statistics (first-step
  loss 1.2554 where one device gives 1.2319 on 3/0/5/1 real rows). It is refused while training, as nnx's is."""
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train):
      return nn.Dense(1)(nn.BatchNorm(use_running_average=not train)(nn.Dense(H)(x)))[:, 0]

  model = Net()
  variables = model.init(jax.random.key(0), np.zeros((2, D), np.float32), train=False)

  def loss_fn(params, batch, *, model_state, train):
    out, updates = model.apply({"params": params, "batch_stats": model_state}, batch["x"], train, mutable=["batch_stats"])
    return jaxdp.LossOutput(0.5 * (out - batch["y"]) ** 2, model_state=updates["batch_stats"] if train else model_state)

  mesh = jaxdp.data_mesh(jax.devices()[:4])
  rng = np.random.default_rng(0)
  portions = [{"x": rng.normal(size=(n, D)).astype(np.float32), "y": rng.normal(size=(n,)).astype(np.float32)}
              for n in (3, 0, 5, 1)]
  state = jaxdp.init_state(variables["params"], OPT, mesh, model_state=variables["batch_stats"])
  with pytest.raises(ValueError, match=r"flax\.linen\.BatchNorm .* inside a jaxdp training step.*jaxdp\.adapters\.linen\.BatchNorm.*masked_moments"):
    jaxdp.make_train_step(loss_fn, OPT, mesh)(state, *jaxdp.shard_uneven(portions, mesh))
  metrics = jaxdp.make_eval_step(loss_fn, mesh)(state, *jaxdp.shard_uneven(portions, mesh))
  assert float(metrics["weight"]) == 9.0 and np.isfinite(float(metrics["loss"]))


def test_state_the_same_on_every_replica_is_kept_exactly_under_pmap():
  """pmap has no replication types, so every floating leaf was rebuilt as Σ w·x / Σ w, which rounds: a float
  step counter from 1e4 read 10199.895 after 200 steps with fractional weights (shard_map and one device:
  10200). Elements all replicas agree on are kept exactly (one pmax); a typed PRNG key, which crashed psum
  ("Cannot interpret 'key<fry>' as a data type"), travels as its bits. Per-replica statistics are still
  averaged by weight (test_local_statistics_are_averaged_by_weight)."""
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(8, 3)).astype(np.float32), "y": rng.normal(size=(8,)).astype(np.float32)}
  weights = (rng.uniform(0.01, 1.0, size=8) ** 3).astype(np.float32)

  def loss_fn(params, batch, *, model_state):
    new = {"t": model_state["t"] + 1.0, "key": jax.random.split(model_state["key"])[0]}
    return jaxdp.LossOutput(0.5 * (batch["x"] @ params["w"] - batch["y"]) ** 2, model_state=new)

  steps = 60
  key, t = jax.random.key(3), np.float32(1e4)
  for _ in range(steps):  # the one-device program's state
    key, t = jax.random.split(key)[0], t + np.float32(1.0)
  for backend in ("shard_map", "pmap"):
    state = jaxdp.init_state({"w": np.array([0.3, -0.7, 1.1], np.float32)}, OPT, mesh,
                             model_state={"t": np.float32(1e4), "key": jax.random.key(3)})
    step = jaxdp.make_train_step(loss_fn, OPT, mesh, backend=backend)
    for _ in range(steps):
      state, _ = step(state, batch, weights)
    assert float(state.model_state["t"]) == float(t), backend
    np.testing.assert_array_equal(jax.random.key_data(state.model_state["key"]), jax.random.key_data(key))


def test_the_refusals_advice_for_state_computed_from_params_and_for_a_maximum_works():
  """A pruning mask |w| > 0.5 is the same on every replica but typed per-replica (the step differentiates each
  replica's copy of the params): refused, and the message's lax.pmax(lax.stop_gradient(x)) makes it replicated.
  The docs' advice for a running maximum was lax.pmax alone, which has no derivative (NotImplementedError
  inside the differentiated loss); with stop_gradient it gives the one-device maximum over the real rows."""
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  rng = np.random.default_rng(1)
  portions = [{"x": rng.normal(size=(n, 3)).astype(np.float32), "y": rng.normal(size=(n,)).astype(np.float32)}
              for n in (3, 0, 5, 1)]
  params = {"w": np.array([0.3, -0.7, 1.1], np.float32)}

  def loss_fn(advised):
    def loss(p, batch, *, model_state, weights, axis_name):
      h = batch["x"] @ p["w"]
      mask = jax.lax.stop_gradient(jnp.abs(p["w"]) > 0.5)
      top = jax.lax.stop_gradient(jnp.where(weights > 0, h, -jnp.inf).max())
      if advised:
        mask, top = jax.lax.pmax(mask, axis_name), jax.lax.pmax(top, axis_name)
      new = {"mask": mask, "max": jnp.maximum(model_state["max"], top)}
      return jaxdp.LossOutput(0.5 * (h - batch["y"]) ** 2, model_state=new)
    return loss

  state = jaxdp.init_state(params, OPT, mesh, model_state={"mask": np.zeros(3, bool), "max": np.float32(-np.inf)})
  with pytest.raises(ValueError, match=r"model_state\['mask'\].*computed from the params.*lax\.stop_gradient"):
    jaxdp.make_train_step(loss_fn(False), OPT, mesh)(state, *jaxdp.shard_uneven(portions, mesh))
  state, _ = jaxdp.make_train_step(loss_fn(True), OPT, mesh)(state, *jaxdp.shard_uneven(portions, mesh))
  x = np.concatenate([p["x"] for p in portions])
  np.testing.assert_array_equal(state.model_state["mask"], np.abs(params["w"]) > 0.5)
  np.testing.assert_allclose(float(state.model_state["max"]), float(np.max(x @ params["w"])), rtol=RTOL)



def test_under_pmap_replicas_without_rows_do_not_keep_their_own_nan_state():
  """The pmap agreement test was a pmax of (x, -x): XLA's max skips NaN, so a masked mean on replicas holding only
  padding (0/0) counted as agreed, and each replica kept its own value (device 0 finite, the others NaN, with
  replica_divergence 0). Agreement is now bit for bit, which also stops 0.0 and -0.0 (equal values) from staying
  different bits on different replicas (found by the diff review)."""
  mesh = jaxdp.data_mesh(jax.devices()[:4])

  def loss_fn(params, batch, *, model_state, weights):
    mean = jnp.sum(weights[:, None] * batch["x"], 0) / jnp.sum(weights)  # 0/0 on a replica of padding only
    return jaxdp.LossOutput((batch["x"] @ params["w"] - batch["y"]) ** 2, {"ema": 0.9 * model_state["ema"] + 0.1 * mean})

  x = np.array([[1.0, 5.0], [3.0, 7.0]] + [[0, 0]] * 6, np.float32)
  batch, weights = {"x": x, "y": np.ones(8, np.float32)}, np.array([1, 1, 0, 0, 0, 0, 0, 0], np.float32)
  for backend in ("shard_map", "pmap"):
    state = jaxdp.init_state({"w": np.ones(2, np.float32)}, OPT, mesh, model_state={"ema": np.zeros(2, np.float32)})
    state, _ = jaxdp.make_train_step(loss_fn, OPT, mesh, backend=backend)(state, batch, weights)
    for shard in state.model_state["ema"].addressable_shards:
      np.testing.assert_allclose(np.asarray(shard.data), [0.2, 0.6], rtol=1e-6, err_msg=backend)

  zeros = jax.pmap(lambda s, w: jaxdp.reduce_model_state({"s": s}, w, axis_name="data"), axis_name="data",
                   devices=jax.devices()[:4])(np.array([[0.0], [-0.0], [0.0], [-0.0]], np.float32), np.ones(4, np.float32))
  assert not np.any(np.signbit(np.asarray(zeros["s"])))  # one value, +0.0, on every replica


class EmaState(NamedTuple):
  ema: dict


def ema_of_params(decay):
  """The docs' recipe (docs/porting-linen.md), as written there: an EMA of the parameters kept in the optimizer state."""

  def init(params):
    return EmaState(jax.tree.map(lambda p: p.astype(jnp.float32), params))

  def update(updates, state, params):
    new = optax.apply_updates(params, updates)
    return updates, EmaState(jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, state.ema, new))

  return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_the_readmes_ema_of_params_in_the_optimizer_state_is_one_devices(zero_stage):
  """The docs keep an EMA of the parameters in opt_state (a port review found the model_state route one step
  behind, K updates a step under accum_steps): after 3 uneven steps (one of global weight 0, skipped) it is the
  one-device EMA ``0.9 * ema + 0.1 * new_params`` of the plain program's parameters, at stage 0 and 3."""
  opt = optax.chain(OPT, ema_of_params(0.9))
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  params, model_state = init_params(0), init_model_state()
  counts = [(2, 0, 3, 1), (0, 0, 0, 0), (1, 4, 0, 2)]
  step = jaxdp.make_train_step(loss_fn, opt, mesh, zero_stage=zero_stage)
  state = jaxdp.init_state(params, opt, mesh, model_state=model_state, zero_stage=zero_stage)
  rng = np.random.default_rng(5)
  ref_params, ref_state, ref_opt = jax.tree.map(jnp.asarray, params), model_state, OPT.init(params)
  ema = jax.tree.map(jnp.asarray, params)
  for rows in counts:
    portions = [{"x": rng.normal(size=(n, D)).astype(np.float32), "y": rng.normal(size=(n,)).astype(np.float32)}
                for n in rows]
    state, _ = step(state, *jaxdp.shard_uneven(portions, mesh))
    if sum(rows):  # one device: the global batch's weighted mean, the plain update, then the EMA
      batch = jax.tree.map(lambda *xs: np.concatenate(xs), *portions)
      weights = np.ones(sum(rows), np.float32)
      (_, (count, _, ref_state)), sums = reference_gradient(ref_params, ref_state, batch, weights)
      updates, ref_opt = OPT.update(jax.tree.map(lambda g: g / count, sums), ref_opt, ref_params)
      ref_params = optax.apply_updates(ref_params, updates)
      ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, ema, ref_params)
  got = jaxdp.gather_state(state)
  for k in params:
    np.testing.assert_allclose(np.asarray(got.opt_state[-1].ema[k]), np.asarray(ema[k]), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(got.params[k]), np.asarray(ref_params[k]), rtol=RTOL, atol=ATOL)


def assert_close(actual, expected):
  assert_close_elementwise(actual, expected, rtol=RTOL, atol=ATOL)
