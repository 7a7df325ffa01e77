"""Loops whose carry starts from a constant (every RNN) train and evaluate on any number of devices.

Inside ``shard_map`` (``check_vma=True``) a ``jnp.zeros`` initial carry is typed as the same on every
device while the loop body's output varies with the batch; JAX refuses such a loop, and the carry is
made inside the model (flax's ``nn.RNN``, ``initialize_carry``), out of the user's reach. Each model
here makes its carry that way, trains 5 steps on uneven splits (some rows of length 0) and is compared
with a plain one-device program on the global batch (jax.grad of the mean loss, the same optax update):
float32 round-off, ≤ 1e-6 relative per leaf (SGD with momentum: Adam's 1/√v would magnify round-off on
near-zero gradients into its own noise). Evaluation on both backends gives the one-device loss.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jaxdp
from helpers import assert_close_to_scale as assert_close

# Plumbing and float32 agreement, not speed: most XLA passes skipped while this module runs (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compiles")

B, T, V, H, CLASSES = 12, 5, 11, 6, 3
SPLITS = {2: [7, 5], 3: [6, 4, 2], 4: [5, 4, 2, 1]}
STEPS = 5
OPTIMIZER = optax.sgd(0.1, momentum=0.9)


def data(seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(0, T + 1, (B,)).astype(np.int32)
  lengths[[1, 6]] = 0  # rows with nothing to read
  return {
      "tokens": rng.integers(1, V, (B, T)).astype(np.int32),
      "lengths": lengths,
      "labels": rng.integers(0, CLASSES, (B,)).astype(np.int32),
  }


def pooled(h, lengths):
  mask = (jnp.arange(h.shape[1])[None] < lengths[:, None])[..., None]
  return jnp.sum(h * mask, 1) / jnp.maximum(lengths[:, None], 1)


class LinenClassifier(nn.Module):
  kind: str

  @nn.compact
  def __call__(self, tokens, lengths):
    x = nn.Embed(V, H)(tokens)
    if self.kind == "rnn":
      h = nn.RNN(nn.LSTMCell(H))(x, seq_lengths=lengths)
    elif self.kind == "bidirectional":
      h = nn.Bidirectional(nn.RNN(nn.LSTMCell(H)), nn.RNN(nn.GRUCell(H)))(x, seq_lengths=lengths)
    else:  # nn.scan over time with a zeros carry made in the model
      scan = nn.scan(nn.GRUCell, variable_broadcast="params", split_rngs={"params": False}, in_axes=1, out_axes=1)
      _, h = scan(H)(jnp.zeros((x.shape[0], H)), x)
    return nn.Dense(CLASSES)(pooled(h, lengths))


class NnxClassifier(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(V, H, rngs=rngs)
    self.rnn = nnx.RNN(nnx.LSTMCell(H, H, rngs=rngs))
    self.head = nnx.Linear(H, CLASSES, rngs=rngs)

  def __call__(self, tokens, lengths):
    return self.head(pooled(self.rnn(self.embed(tokens), seq_lengths=lengths), lengths))


def functional(kind):
  def apply(p, tokens, lengths):
    x = p["embed"][tokens]

    def cell(h, x_t):
      h = jnp.tanh(x_t @ p["w"] + h @ p["u"])
      return h, h

    h0 = jnp.zeros((x.shape[0], H))
    if kind == "lax_scan":
      _, hs = lax.scan(cell, h0, jnp.swapaxes(x, 0, 1))
      h = jnp.swapaxes(hs, 0, 1)
    else:  # fori_loop over time, writing each step's state into a zeros buffer (two constant carries)
      def body(t, carry):
        h, hs = carry
        h = cell(h, x[:, t])[0]
        return h, hs.at[:, t].set(h)

      _, h = lax.fori_loop(0, T, body, (h0, jnp.zeros((x.shape[0], T, H))))
    # A while_loop (forward only, no gradient through it) whose zeros carry counts the real tokens.
    count = lax.while_loop(lambda c: c[0] < T, lambda c: (c[0] + 1, c[1] + (c[0] < lengths)), (0, 0 * lengths))[1]
    return pooled(h, count) @ p["head"]

  keys = jax.random.split(jax.random.key(0), 4)
  params = {
      "embed": jax.random.normal(keys[0], (V, H)),
      "w": 0.5 * jax.random.normal(keys[1], (H, H)),
      "u": 0.5 * jax.random.normal(keys[2], (H, H)),
      "head": jax.random.normal(keys[3], (H, CLASSES)),
  }
  return apply, params


def model(kind):
  """``(apply(params, tokens, lengths) -> logits, params)`` for each way of writing the loop."""
  batch = data()
  if kind in ("rnn", "bidirectional", "nn_scan"):
    module = LinenClassifier(kind)
    params = module.init(jax.random.key(1), batch["tokens"], batch["lengths"])["params"]
    return (lambda p, tokens, lengths: module.apply({"params": p}, tokens, lengths)), params
  return functional(kind)


def classification_loss(apply):
  def loss_fn(params, batch):
    logits = apply(params, batch["tokens"], batch["lengths"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])

  return loss_fn


def one_device(loss_fn, params, batch, steps=STEPS):
  """The plain program: the mean loss over the whole batch on one device, optax's update."""
  opt_state = OPTIMIZER.init(params)
  for _ in range(steps):
    grads = jax.grad(lambda p: jnp.mean(loss_fn(p, batch)))(params)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params, float(jnp.mean(loss_fn(params, batch)))


def portions(batch, sizes):
  bounds = np.cumsum([0, *sizes])
  return [jax.tree.map(lambda x: x[bounds[i]:bounds[i + 1]], batch) for i in range(len(sizes))]


def train_and_evaluate(loss_fn, params, n, backend="shard_map"):
  mesh = jaxdp.data_mesh(jax.devices()[:n])
  batch, weights = jaxdp.shard_uneven(portions(data(), SPLITS.get(n, [B])), mesh)
  step = jaxdp.make_train_step(loss_fn, OPTIMIZER, mesh, backend=backend)
  state = jaxdp.init_state(params, OPTIMIZER, mesh)
  for _ in range(STEPS):
    state, metrics = step(state, batch, weights)
    assert int(metrics["skipped"]) == 0
  evaluation = jaxdp.make_eval_step(loss_fn, mesh, backend=backend)(state, batch, weights)
  return state, float(evaluation["loss"])


# Each way of writing the loop once, on a device count it shares with another (the compiles are the cost).
@pytest.mark.parametrize("kind,n", [
    ("bidirectional", 2), ("nn_scan", 4), ("lax_scan", 2), ("fori_loop", 4),
])
def test_constant_carry_trains_and_evaluates_as_on_one_device(kind, n):
  apply, params = model(kind)
  loss_fn = classification_loss(apply)
  reference, reference_loss = one_device(loss_fn, params, data())
  state, eval_loss = train_and_evaluate(loss_fn, params, n)
  assert_close(state.params, reference)
  np.testing.assert_allclose(eval_loss, reference_loss, rtol=1e-6)


def nnx_objective(model, batch):
  logits = model(batch["tokens"], batch["lengths"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])


def test_nnx_rnn_matches_the_ordinary_nnx_program():
  """nnx.RNN(nnx.LSTMCell) through jaxdp.adapters.nnx on 3 devices, against nnx.Optimizer + nnx.grad on one."""
  model = NnxClassifier(nnx.Rngs(1))
  definition, params, model_state = jaxdp.adapters.nnx.split(model)
  loss_fn = jaxdp.adapters.nnx.loss_fn(definition, nnx_objective)
  mesh = jaxdp.data_mesh(jax.devices()[:3])
  batch, weights = jaxdp.shard_uneven(portions(data(), SPLITS[3]), mesh)
  step = jaxdp.make_train_step(loss_fn, OPTIMIZER, mesh)
  state = jaxdp.init_state(params, OPTIMIZER, mesh, model_state=model_state)
  for _ in range(STEPS):  # nnx.RNN keeps a 'carry' RNG stream (its zeros carry draws nothing from it)
    state, _ = step(state, batch, weights, rng=jax.random.key(0))
  eval_loss = float(jaxdp.make_eval_step(loss_fn, mesh)(state, batch, weights)["loss"])
  jaxdp.adapters.nnx.update(model, state)

  reference = NnxClassifier(nnx.Rngs(1))
  optimizer = nnx.Optimizer(reference, OPTIMIZER, wrt=nnx.Param)
  for _ in range(STEPS):
    grads = nnx.grad(lambda m: jnp.mean(nnx_objective(m, data())))(reference)
    optimizer.update(reference, grads)
  assert_close(nnx.state(model, nnx.Param), nnx.state(reference, nnx.Param))
  np.testing.assert_allclose(eval_loss, float(jnp.mean(nnx_objective(reference, data()))), rtol=1e-6)


@pytest.mark.parametrize("n", [1, 3, 4])
def test_lstm_classifier_on_every_device_count(n):
  """The issue's program: flax's nn.RNN(LSTMCell) on uneven batches with rows of length 0, no workaround."""
  apply, params = model("rnn")
  loss_fn = classification_loss(apply)
  reference, reference_loss = one_device(loss_fn, params, data())
  state, eval_loss = train_and_evaluate(loss_fn, params, n)
  assert_close(state.params, reference)
  np.testing.assert_allclose(eval_loss, reference_loss, rtol=1e-6)


def test_pmap_backend_trains_and_evaluates_the_same():
  apply, params = model("rnn")
  loss_fn = classification_loss(apply)
  reference, reference_loss = one_device(loss_fn, params, data())
  state, eval_loss = train_and_evaluate(loss_fn, params, 2, backend="pmap")
  assert_close(state.params, reference)
  np.testing.assert_allclose(eval_loss, reference_loss, rtol=1e-6)


def test_accumulation_carries_a_constant_carry_model():
  apply, params = model("lax_scan")
  loss_fn = classification_loss(apply)
  reference, _ = one_device(loss_fn, params, data(), steps=2)
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  batch, weights = jaxdp.shard_uneven(portions(data(), [8, 4]), mesh)
  step = jaxdp.make_train_step(loss_fn, OPTIMIZER, mesh, accum_steps=2)
  state = jaxdp.init_state(params, OPTIMIZER, mesh)
  for _ in range(2):
    state, _ = step(state, batch, weights)
  assert_close(state.params, reference)


def test_train_step_in_a_users_shard_map():
  """jaxdp.train_step composed in the user's own shard_map (check_vma=True) accepts the carry too."""
  apply, params = model("lax_scan")
  loss_fn = classification_loss(apply)
  reference, _ = one_device(loss_fn, params, data(), steps=1)
  mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  batch = jax.device_put(data(), jax.NamedSharding(mesh, jax.P("data")))
  state = jaxdp.TrainState(params, OPTIMIZER.init(params), jnp.zeros((), jnp.int32), None)

  def replica(state, batch):
    return jaxdp.train_step(loss_fn, OPTIMIZER, state, batch, axis_name="data")

  mapped = jax.jit(jax.shard_map(replica, mesh=mesh, in_specs=(jax.P(), jax.P("data")), out_specs=jax.P()))
  new_state, _ = mapped(state, batch)
  assert_close(new_state.params, reference)


def delayed_chain_loss(params, batch):
  # b's next value is a's previous one: b becomes per-device only in the second iteration, which one retrace
  # of the loop cannot see; jaxdp.as_varying on its initial value is the fix the message names.
  x = params["embed"][batch["tokens"]].sum(-1)

  def body(carry, x_t):
    a, b = carry
    return (a + x_t, a), None

  (a, b), _ = lax.scan(body, (jnp.zeros(x.shape[0]), jnp.zeros(x.shape[0])), x.T)
  return (a + b) ** 2


@pytest.mark.parametrize("n", [1, 2])
def test_a_loop_typing_error_at_scale_shows_on_one_device_too(n):
  """One device type-checks the step as N > 1 does: what fails at scale fails on one device first."""
  _, params = model("lax_scan")
  mesh = jaxdp.data_mesh(jax.devices()[:n])
  batch, weights = jaxdp.shard_uneven(portions(data(), SPLITS.get(n, [B])), mesh)
  step = jaxdp.make_train_step(delayed_chain_loss, OPTIMIZER, mesh)
  state = jaxdp.init_state(params, OPTIMIZER, mesh)
  with pytest.raises(TypeError, match="carry input and carry output must have equal types") as error:
    step(state, batch, weights)
  assert any("jaxdp.as_varying(initial_value, 'data')" in note for note in error.value.__notes__)


def fixed_delayed_chain_loss(params, batch):
  x = params["embed"][batch["tokens"]].sum(-1)

  def body(carry, x_t):
    a, b = carry
    return (a + x_t, a), None

  zeros = jnp.zeros(x.shape[0])
  (a, b), _ = lax.scan(body, (zeros, jaxdp.as_varying(zeros, "data")), x.T)
  return 0.01 * (a + b) ** 2


def test_as_varying_fixes_the_chained_carry_and_runs_outside_a_step():
  _, params = model("lax_scan")
  reference, _ = one_device(fixed_delayed_chain_loss, params, data(), steps=2)  # the same loss, no shard_map
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  batch, weights = jaxdp.shard_uneven(portions(data(), SPLITS[2]), mesh)
  step = jaxdp.make_train_step(fixed_delayed_chain_loss, OPTIMIZER, mesh)
  state = jaxdp.init_state(params, OPTIMIZER, mesh)
  for _ in range(2):
    state, _ = step(state, batch, weights)
  assert_close(state.params, reference)


def test_promotion_is_scoped_to_jaxdp_steps():
  """Outside a jaxdp step, JAX's own typing of loops is unchanged."""
  mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  x = jax.device_put(jnp.ones((2, 3)), jax.NamedSharding(mesh, jax.P("data")))

  def body(h, x_t):
    return h + x_t, None

  def run(x):
    return lax.scan(body, jnp.zeros(()), x[0])[0][None]

  apply, params = model("lax_scan")
  loss_fn = classification_loss(apply)
  batch, weights = jaxdp.shard_uneven(portions(data(), [7, 5]), mesh)
  jaxdp.make_eval_step(loss_fn, mesh)(jaxdp.init_state(params, OPTIMIZER, mesh), batch, weights)  # a jaxdp trace
  with pytest.raises(TypeError, match="carry input and carry output must have equal types"):
    jax.shard_map(run, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data"))(x)
