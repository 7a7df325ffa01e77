"""One test per bad input: the exception type, a message naming the argument, and a usable state.

Every step here donates its state (``donate=True``, the default). After each
bad call the caller's state must be intact: it takes one good step, compared
with a single-device reference (rtol 1e-5, atol 2e-6: float32 re-association
of the gradient sums, as in test_step_properties.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec as P

import jaxdp

D, H, K = 3, 4, 4  # features, hidden units, devices
COUNTS = (2, 3, 0, 1)
OPT = optax.adam(0.01, eps=1e-3)
MESH = jaxdp.data_mesh(jax.devices()[:K])


def init_params(hidden=H, inputs=D, seed=0):
  rng = np.random.default_rng(seed)
  return {
      "hidden": {"w": rng.normal(size=(inputs, hidden)).astype(np.float32), "b": np.zeros((hidden,), np.float32)},
      "out": {"w": rng.normal(size=(hidden,)).astype(np.float32), "b": np.float32(0.0)},
  }


def loss_fn(params, batch):
  """Per-example squared error [b] of a one-hidden-layer tanh network."""
  h = jnp.tanh(batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"][None, :])
  return 0.5 * (h @ params["out"]["w"] + params["out"]["b"] - batch["y"]) ** 2


def device_data():
  rng = np.random.default_rng(1)
  batches = [{"x": rng.normal(size=(n, D)).astype(np.float32), "y": rng.normal(size=(n,)).astype(np.float32)} for n in COUNTS]
  return batches, [rng.uniform(0.5, 2.0, size=(n,)).astype(np.float32) for n in COUNTS]


@functools.lru_cache(maxsize=None)
def good_step():
  return jaxdp.make_train_step(loss_fn, OPT, MESH, donate=True)


def fresh_state():
  return jaxdp.init_state(init_params(), OPT, MESH)


@functools.lru_cache(maxsize=None)
def reference_params():
  """One single-device step on the concatenated real rows: Σ w·l / Σ w, then a plain optax update."""
  batches, weights = device_data()
  batch, w = jax.tree.map(lambda *xs: np.concatenate(xs), *batches), np.concatenate(weights)
  params = jax.tree.map(jnp.asarray, init_params())
  grads = jax.jit(jax.grad(lambda p: jnp.sum(w * loss_fn(p, batch)) / jnp.sum(w)))(params)
  updates, _ = OPT.update(grads, OPT.init(params), params)
  return jax.tree.map(np.asarray, optax.apply_updates(params, updates))


def assert_still_usable(state):
  """``state`` was not donated by the failed call: a good step from it matches the reference."""
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
  batches, weights = device_data()
  new_state, _ = good_step()(state, *jaxdp.shard_uneven(batches, MESH, weights=weights))
  assert int(new_state.step) == 1
  close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=2e-6)
  jax.tree.map(close, jax.tree.map(np.asarray, new_state.params), reference_params())


def global_arrays(rows):
  rng = np.random.default_rng(2)
  return {"x": rng.normal(size=(rows, D)).astype(np.float32), "y": np.zeros((rows,), np.float32)}


def test_batch_not_divisible_by_device_count():
  """A global batch of 6 rows on 4 devices: ValueError naming batch and pointing to shard_uneven."""
  state = fresh_state()
  with pytest.raises(ValueError, match=r"batch") as e:
    good_step()(state, global_arrays(6), np.ones((6,), np.float32))
  assert "shard_uneven" in str(e.value)
  assert_still_usable(state)


@pytest.mark.parametrize("shape", [(8, 2), (4,), (12,)])
def test_weights_shape_does_not_match_losses(shape):
  """Weights of another shape than the [8] losses: ValueError naming weights."""
  state = fresh_state()
  with pytest.raises(ValueError, match=r"weights"):
    good_step()(state, global_arrays(8), np.ones(shape, np.float32))
  assert_still_usable(state)


def test_batch_leaves_with_different_leading_sizes():
  """x with 8 rows but y with 4: ValueError naming batch."""
  state = fresh_state()
  batch = {"x": global_arrays(8)["x"], "y": np.zeros((4,), np.float32)}
  with pytest.raises(ValueError, match=r"batch"):
    good_step()(state, batch, np.ones((8,), np.float32))
  assert_still_usable(state)


@pytest.mark.parametrize("bad", [-1.0, -1e-30, np.nan, np.inf, -np.inf])
def test_shard_uneven_rejects_negative_and_non_finite_weights(bad):
  """One negative or non-finite weight on device 1: ValueError naming weights[1]."""
  state = fresh_state()
  batches, weights = device_data()
  weights[1] = weights[1].copy()
  weights[1][-1] = bad
  with pytest.raises(ValueError, match=r"weights\[1\]"):
    jaxdp.shard_uneven(batches, MESH, weights=weights)
  assert_still_usable(state)


def test_unknown_reduction_in_make_train_step():
  state = fresh_state()
  with pytest.raises(ValueError, match=r"reduction='avg'"):
    jaxdp.make_train_step(loss_fn, OPT, MESH, reduction="avg")
  assert_still_usable(state)


def test_unknown_reduction_in_train_step():
  """train_step inside the user's own shard_map rejects it too, while tracing."""
  state = fresh_state()

  def replica(state, batch, weights):
    return jaxdp.train_step(loss_fn, OPT, state, batch, weights, axis_name="data", reduction="avg")

  step = jax.jit(jax.shard_map(replica, mesh=MESH, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P())))
  batches, weights = device_data()
  with pytest.raises(ValueError, match=r"reduction='avg'"):
    step(state, *jaxdp.shard_uneven(batches, MESH, weights=weights))
  assert_still_usable(state)


def test_unknown_backend():
  state = fresh_state()
  with pytest.raises(ValueError, match=r"backend='xla'"):
    jaxdp.make_train_step(loss_fn, OPT, MESH, backend="xla")
  assert_still_usable(state)


def test_mesh_without_axis_name():
  """A mesh whose only axis is "batch", with the default axis_name="data": ValueError naming axis_name."""
  state = fresh_state()
  mesh = jaxdp.data_mesh(jax.devices()[:K], axis_name="batch")
  with pytest.raises(ValueError, match=r"axis_name='data'"):
    jaxdp.make_train_step(loss_fn, OPT, mesh)
  with pytest.raises(ValueError, match=r"axis_name='model'"):
    jaxdp.make_train_step(loss_fn, OPT, MESH, axis_name="model")
  with pytest.raises(ValueError, match=r"axis_name='data'"):
    jaxdp.init_state(init_params(), OPT, mesh)
  with pytest.raises(ValueError, match=r"axis_name='data'"):
    jaxdp.shard_uneven(device_data()[0], mesh)
  assert_still_usable(state)


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda: init_params(inputs=D + 1), id="other-shapes"),
        pytest.param(lambda: {"w": np.zeros((D,), np.float32)}, id="other-structure"),
    ],
)
def test_state_built_from_other_params(other):
  """Params that loss_fn cannot use: loss_fn's own error, unwrapped, with a note of where; nothing donated.

  The step does not run loss_fn on the host (it may use collectives), so the error is the one loss_fn
  raises while the step is traced, never replaced by a guess at its cause.
  """
  state, bad = fresh_state(), jaxdp.init_state(other(), OPT, MESH)
  batches, weights = device_data()
  with pytest.raises((TypeError, ValueError, KeyError)) as error:
    good_step()(bad, *jaxdp.shard_uneven(batches, MESH, weights=weights))
  notes = "\n".join(getattr(error.value, "__notes__", []))
  assert "raised inside loss_fn while the training step was traced" in notes and "nothing was donated" in notes
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(bad))
  # Evaluation calls the same loss_fn: the note names the evaluation step, with no word of micro-batches.
  with pytest.raises((TypeError, ValueError, KeyError)) as error:
    jaxdp.make_eval_step(loss_fn, MESH)(bad, global_arrays(8))
  notes = "\n".join(getattr(error.value, "__notes__", []))
  assert "raised inside loss_fn while the evaluation step was traced" in notes and "accum_steps" not in notes
  assert_still_usable(state)


def test_opt_state_built_from_other_params():
  """The right params with the optimizer state of other params: ValueError naming state.opt_state."""
  state = fresh_state()
  bad = state._replace(opt_state=OPT.init(init_params(hidden=H + 1)))
  batches, weights = device_data()
  with pytest.raises(ValueError, match=r"state\.opt_state"):
    good_step()(bad, *jaxdp.shard_uneven(batches, MESH, weights=weights))
  assert_still_usable(state)  # shares its params buffers with ``bad``


@pytest.mark.parametrize("wrap", [tuple, lambda s: s._asdict()], ids=["tuple", "dict"])
def test_state_that_is_not_a_train_state(wrap):
  """A plain tuple or dict of the same leaves: TypeError naming state and TrainState."""
  state = fresh_state()
  batches, weights = device_data()
  with pytest.raises(TypeError, match=r"state must be a jaxdp\.TrainState"):
    good_step()(wrap(state), *jaxdp.shard_uneven(batches, MESH, weights=weights))
  assert_still_usable(state)  # shares every buffer with the rejected container


def test_pmap_backend_with_two_axis_mesh():
  """backend="pmap" maps over one axis: a (data, model) mesh is a ValueError naming backend and mesh."""
  state = fresh_state()
  mesh = Mesh(np.array(jax.devices()).reshape(K, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  with pytest.raises(ValueError, match=r"backend='pmap'") as e:
    jaxdp.make_train_step(loss_fn, OPT, mesh, backend="pmap")
  assert "mesh" in str(e.value)
  assert_still_usable(state)


def test_donating_the_state_keeps_callers_params():
  """init_state copies: a donated step consumes the state, never the caller's params on device 0."""
  params = jax.tree.map(jnp.asarray, init_params())  # live on jax.devices()[0], part of MESH
  state = jaxdp.init_state(params, OPT, MESH)
  assert_still_usable(state)
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(params))
  assert_still_usable(jaxdp.init_state(params, OPT, MESH))  # the same params make a second state


def test_a_loss_needing_model_state_given_a_state_without_it_is_told_why():
  """The README's checkpoint recipe built the state without model_state= for a linen BatchNorm loss_fn: flax raised
  its generic "first argument passed to an apply function should be a dictionary of collections". The error now
  carries a note that model_state was None and where to pass it (found by the linen review). A loss that takes
  None for a stateless model keeps working (a first version refused it; found by the next diff review)."""
  def needs_state(params, batch, *, model_state):
    return jaxdp.LossOutput(loss_fn(params, batch) + model_state["offset"], model_state=model_state)

  def takes_none(params, batch, *, model_state):
    return jaxdp.LossOutput(loss_fn(params, batch), model_state=model_state)

  state = fresh_state()
  for make in (lambda f: jaxdp.make_train_step(f, OPT, MESH), lambda f: jaxdp.make_eval_step(f, MESH)):
    with pytest.raises(TypeError) as e:
      make(needs_state)(state, global_arrays(8))
    assert "model_state=None" in str(e.value.__notes__) and "init_state(params" in str(e.value.__notes__)
  jaxdp.make_eval_step(takes_none, MESH)(state, global_arrays(8))
  assert_still_usable(state)
  jaxdp.make_train_step(takes_none, OPT, MESH)(fresh_state(), global_arrays(8))


def test_losses_of_shape_b_1_name_the_squeeze():
  """[b, 1] losses (a Dense(1) output minus y[:, None]) next to [b] weights: the message told a DataPipeline user,
  who does not choose the weights' shape, to reshape the weights; it now says to return [b] losses first."""
  state = fresh_state()
  step = jaxdp.make_train_step(lambda p, b: loss_fn(p, b)[:, None], OPT, MESH)
  with pytest.raises(ValueError, match=r"losses of shape \(2, 1\).*squeeze\(-1\)"):
    step(state, global_arrays(8), np.ones(8, np.float32))
  assert_still_usable(state)


def test_a_flax_train_state_and_a_missing_dropout_key_are_named():
  """A port of flax's ImageNet example passed its flax TrainState (the error said only 'got TrainState', the name
  of jaxdp's own class) and called a step of a dropout model without rng= (flax's 'Dropout_0 needs PRNG' with
  nothing about the step); both now say what to do (from the port review)."""
  import flax.linen as nn
  from flax.training import train_state

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train):
      return nn.Dense(1)(nn.Dropout(0.5, deterministic=not train)(x))[:, 0]

  net = Net()
  params = net.init(jax.random.key(0), np.zeros((1, D), np.float32), False)["params"]
  flax_state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=OPT)

  def dropout_loss(params, batch, rng=None, *, train):
    rngs = {} if rng is None else {"dropout": rng}
    return 0.5 * (net.apply({"params": params}, batch["x"], train, rngs=rngs) - batch["y"]) ** 2

  step = jaxdp.make_train_step(dropout_loss, OPT, MESH)
  batch, weights = jaxdp.shard_uneven(device_data()[0], MESH, weights=device_data()[1])
  with pytest.raises(TypeError, match=r"flax\.training\.train_state\.TrainState.*batch_stats go to model_state="):
    step(flax_state, batch, weights)
  state = jaxdp.init_state(params, OPT, MESH)
  # A forgotten unpack of the step's result is named as such, with no word of flax.
  with pytest.raises(TypeError, match=r"got builtins\.tuple.*\(state, metrics\) pair") as error:
    step(step(state, batch, weights, jax.random.key(0)), batch, weights)
  assert "flax" not in str(error.value)
  state = jaxdp.init_state(params, OPT, MESH)
  with pytest.raises(Exception) as error:
    step(state, batch, weights)
  notes = "\n".join(getattr(error.value, "__notes__", []))
  assert "called without a PRNG key" in notes and "rng=key" in notes
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
  new_state, _ = step(state, batch, weights, jax.random.key(1))  # with the key it trains
  assert int(new_state.step) == 1
  # An error that is not about a key gets no such note, though loss_fn takes an optional key.
  def shape_bug(params, batch, rng=None):
    return batch["x"] @ params["Dense_0"]["kernel"].T
  with pytest.raises(TypeError) as error:
    jaxdp.make_train_step(shape_bug, OPT, MESH)(new_state, batch, weights)
  notes = "\n".join(getattr(error.value, "__notes__", []))
  assert "rows), called with" in notes and "(;" not in notes and "PRNG key" not in notes


def test_plausible_mistakes_at_the_edges_are_named():
  """From an edge review: a key passed where weights go (step(state, batch, key)) trained with weights [0, 7] on a
  2-row batch; int64 ids above 2**31 given to the step itself wrapped silently to int32 (shard_uneven refused
  them); a string leaf got JAX's error naming no leaf; a hand-built Mesh listing a device twice failed deep in
  JAX; zero_stage=np.int64(1) was 'not supported' with no word of why; params on another mesh failed in
  init_state; a dict dataset gave KeyError: 0. Each is now refused naming the fix, the state untouched."""
  state = fresh_state()
  batches, weights = device_data()
  batch, w = jaxdp.shard_uneven(batches, MESH, weights=weights)
  with pytest.raises(TypeError, match=r"weights has dtype key<fry>.*rng=key"):
    good_step()(state, batch, jax.random.key(7))
  with pytest.raises(TypeError, match=r"weights has dtype uint32.*rng=key"):
    good_step()(state, batch, jax.random.PRNGKey(7))
  rows = 8
  with pytest.raises(ValueError, match=r"batch\['id'\] has dtype <U1"):
    good_step()(state, {**global_arrays(rows), "id": np.array(list("abcdefgh"))}, np.ones(rows, np.float32))
  ids = np.full((rows,), 2**32 + 1, np.int64)
  with pytest.raises(ValueError, match=r"batch\['id'\] holds int64 values outside int32's range"):
    good_step()(state, {**global_arrays(rows), "id": ids}, np.ones(rows, np.float32))
  with pytest.raises(ValueError, match=r"batch\['id'\] holds int64 values outside int32's range"):
    jaxdp.make_eval_step(loss_fn, MESH)(state, {**global_arrays(rows), "id": ids}, np.ones(rows, np.float32))
  devices = jax.devices()
  twice = jax.sharding.Mesh(np.array([devices[0], devices[1], devices[0], devices[1]]), ("data",))
  with pytest.raises(ValueError, match=r"more than once.*data_mesh"):
    jaxdp.make_train_step(loss_fn, OPT, twice)
  with pytest.raises(ValueError, match=r"pass a Python int"):
    jaxdp.make_train_step(loss_fn, OPT, MESH, zero_stage=np.int64(1))
  with pytest.raises(ValueError, match=r"dataset is a dict"):
    jaxdp.DataPipeline({"x": np.zeros((4, 2)), "y": np.zeros(4)}, lambda rows: rows, MESH, per_device_batch=1)
  with pytest.raises(ValueError, match=r"examples is a dict"):
    jaxdp.StreamingPipeline({"x": [1, 2]}, lambda rows: rows, MESH, per_device_batch=1, template={"x": 0})
  # Params left on another (larger) mesh, or on this mesh's devices in another order, are placed on this one.
  for other in (jaxdp.data_mesh(devices), jaxdp.data_mesh(devices[:K][::-1])):
    elsewhere = jax.device_put(init_params(), jax.sharding.NamedSharding(other, P()))
    assert_still_usable(jaxdp.init_state(elsewhere, OPT, MESH))
  assert_still_usable(state)
  # Host uint32 weights (counts) of a raw key's shape are weights, not a key (the final diff review): one device's.
  counts = np.array([2, 1], np.uint32)
  two = jaxdp.data_mesh(devices[:2])
  batch2 = global_arrays(2)
  opt = optax.sgd(0.1)
  stepped, _ = jaxdp.make_train_step(loss_fn, opt, two)(jaxdp.init_state(init_params(), opt, two), batch2, counts)
  grads = jax.grad(lambda p: jnp.sum(counts * loss_fn(p, batch2)) / 3.0)(jax.tree.map(jnp.asarray, init_params()))
  expected = jax.tree.map(lambda p, g: p - 0.1 * g, init_params(), grads)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6), stepped.params,
               expected)
  with pytest.raises(TypeError, match=r"weights has dtype uint32.*rng=key"):  # the eval step too
    jaxdp.make_eval_step(loss_fn, two)(stepped, batch2, jax.random.PRNGKey(7))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, "bfloat16"])
def test_subnormal_host_weights_given_to_the_step_are_refused(dtype):
  """Weights in (0, float32's smallest normal) given to the step directly were flushed to 0 on the devices: a
  silent skipped step (weight 0, skipped 1, nonfinite 0). Refused on the host, as shard_uneven does, by the train
  and the eval step; the state is untouched."""
  state = fresh_state()
  batch = global_arrays(8)
  weights = np.ones(8, np.float32)
  weights[[1, 6]] = 1e-40
  weights = weights.astype(jnp.bfloat16 if dtype == "bfloat16" else dtype)
  message = r"weights has 2 values in \(0, 1\.18e-38\), below float32's smallest normal.*Scale the weights up"
  with pytest.raises(ValueError, match=message):
    good_step()(state, batch, weights)
  with pytest.raises(ValueError, match=message):
    jaxdp.make_eval_step(loss_fn, MESH)(state, batch, weights)
  assert_still_usable(state)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_subnormal_device_weights_are_reported_by_a_later_call(dtype):
  """Device weights are not read on the host (that would wait for the device): each call counts them in a
  program of its own, and a later call raises, naming them, before it runs anything. Never a silent skip."""
  step = jaxdp.make_train_step(loss_fn, OPT, MESH, donate=True)
  state = fresh_state()
  batch = global_arrays(8)
  state, metrics = step(state, batch, jnp.full((8,), 1e-40, dtype))
  assert (float(metrics["weight"]), int(metrics["skipped"]), int(metrics["nonfinite"])) == (0.0, 1, 0)
  jax.block_until_ready(metrics)
  with pytest.raises(ValueError, match=r"the weights \(a JAX array\) given to an earlier step has 8 values in "
                     r"\(0, 1\.18e-38\).*counted their rows as padding"):
    step(state, batch, jnp.ones((8,), dtype))
  state, metrics = step(state, batch, jnp.ones((8,), dtype))  # reported once: the step goes on
  assert int(metrics["skipped"]) == 0 and int(state.step) == 1
