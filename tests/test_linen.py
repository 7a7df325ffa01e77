"""jaxdp.adapters.linen.BatchNorm: flax linen's BatchNorm, exact over padded uneven batches on any number of devices.

The reference is the program a linen user had before: flax's own
``nn.BatchNorm`` on one device, over the concatenated real rows, trained with
``jax.grad`` and optax. Tolerances (float32): RTOL = 1e-5, ATOL = 2e-6, those
of test_model_state.py (re-associated sums of a few dozen terms over a few
chained steps; BatchNorm divides by a standard deviation of about 1).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py: plumbing and float32 agreement

D, H = 5, 6
RTOL, ATOL = 1e-5, 2e-6
OPT = optax.adam(1e-2)
ROWS = (3, 0, 5, 1)  # real rows per device: uneven, one device without any


class Net(nn.Module):
  """Dense, BatchNorm, dropout, Dense: the shape of a linen classifier head. ``norm``: the BatchNorm class."""

  norm: type = nn.BatchNorm
  dropout: float = 0.0

  @nn.compact
  def __call__(self, x, train, mask=None):
    # No bias before BatchNorm (it cancels): its gradient would be round-off, which Adam scales up to lr.
    h = nn.Dense(H, use_bias=False)(x)
    bn = self.norm(use_running_average=not train, momentum=0.9)
    h = bn(h, mask=mask) if self.norm is jaxdp.adapters.linen.BatchNorm else bn(h)
    h = nn.Dropout(self.dropout, deterministic=not train)(nn.relu(h))
    return nn.Dense(1)(h)[:, 0]


def portions(seed=0):
  rng = np.random.default_rng(seed)
  return [{"x": rng.normal(size=(n, D)).astype(np.float32), "y": rng.normal(size=(n,)).astype(np.float32)}
          for n in ROWS]


def jaxdp_loss(model):
  def loss_fn(params, batch, rng=None, *, model_state, weights, train):
    variables = {"params": params, "batch_stats": model_state}
    if not train:
      out = model.apply(variables, batch["x"], False)
      return jaxdp.LossOutput(0.5 * (out - batch["y"]) ** 2, model_state=model_state)
    out, updates = model.apply(variables, batch["x"], True, mask=weights, mutable=["batch_stats"],
                               rngs=None if rng is None else {"dropout": rng})
    return jaxdp.LossOutput(0.5 * (out - batch["y"]) ** 2, model_state=updates["batch_stats"])

  return loss_fn


def test_same_variables_and_outputs_as_flax_on_one_device():
  """Swapping nn.BatchNorm for jaxdp.adapters.linen.BatchNorm keeps the variable tree, the outputs and the running update."""
  x = np.random.default_rng(1).normal(size=(7, 3, D)).astype(np.float32) * 2 + 1
  ours, theirs = Net(norm=jaxdp.adapters.linen.BatchNorm), Net()
  variables = theirs.init(jax.random.key(0), x[:, 0], train=False)
  assert jax.tree.structure(ours.init(jax.random.key(0), x[:, 0], train=False)) == jax.tree.structure(variables)
  for train in (True, False):
    out_ours, new_ours = ours.apply(variables, x[:, 0], train, mutable=["batch_stats"])
    out_theirs, new_theirs = theirs.apply(variables, x[:, 0], train, mutable=["batch_stats"])
    np.testing.assert_allclose(out_ours, out_theirs, rtol=RTOL, atol=ATOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), new_ours, new_theirs)
  # Features on a middle axis of a rank-3 input, as nn.BatchNorm(axis=1) takes them.
  for train in (True, False):
    outs = []
    for norm in (jaxdp.adapters.linen.BatchNorm(use_running_average=not train, axis=1), nn.BatchNorm(not train, axis=1)):
      v = norm.init(jax.random.key(0), x)
      outs.append(norm.apply(v, x, mutable=["batch_stats"]))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), *outs)


@pytest.mark.fast
def test_trained_on_four_devices_equals_flax_on_one_device():
  """3/0/5/1 real rows, padded: the linen program trained through make_train_step equals flax's BatchNorm on one
  device over the 9 real rows, step by step (loss, params, batch_stats), and so does evaluation."""
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  ours, theirs = Net(norm=jaxdp.adapters.linen.BatchNorm), Net()
  variables = theirs.init(jax.random.key(0), np.zeros((2, D), np.float32), train=False)
  loss_fn = jaxdp_loss(ours)
  step, evaluate = jaxdp.make_train_step(loss_fn, OPT, mesh), jaxdp.make_eval_step(loss_fn, mesh)
  state = jaxdp.init_state(variables["params"], OPT, mesh, model_state=variables["batch_stats"])

  params, stats, opt_state = variables["params"], variables["batch_stats"], OPT.init(variables["params"])

  def reference_loss(params, stats, batch):
    out, updates = theirs.apply({"params": params, "batch_stats": stats}, batch["x"], True, mutable=["batch_stats"])
    return jnp.mean(0.5 * (out - batch["y"]) ** 2), updates["batch_stats"]

  for seed in range(4):
    parts = portions(seed)
    whole = jax.tree.map(lambda *a: np.concatenate(a), *parts)
    (loss, stats), grads = jax.value_and_grad(reference_loss, has_aux=True)(params, stats, whole)
    updates, opt_state = OPT.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    state, metrics = step(state, *jaxdp.shard_uneven(parts, mesh))
    np.testing.assert_allclose(metrics["loss"], loss, rtol=RTOL, atol=ATOL)
    assert float(metrics["weight"]) == sum(ROWS)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), state.params, params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), state.model_state, stats)
  jaxdp.assert_replicas_equal(state)

  parts = portions(9)
  whole = jax.tree.map(lambda *a: np.concatenate(a), *parts)
  expected = jnp.mean(0.5 * (theirs.apply({"params": params, "batch_stats": stats}, whole["x"], False) - whole["y"]) ** 2)
  np.testing.assert_allclose(evaluate(state, *jaxdp.shard_uneven(parts, mesh))["loss"], expected, rtol=RTOL, atol=ATOL)


def test_dropout_trains_with_the_steps_rng_and_replicas_stay_equal():
  """With dropout the replicas draw different masks (the step's per-replica key) and still apply one update."""
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  model = Net(norm=jaxdp.adapters.linen.BatchNorm, dropout=0.5)
  variables = model.init(jax.random.key(0), np.zeros((2, D), np.float32), train=False)
  state = jaxdp.init_state(variables["params"], OPT, mesh, model_state=variables["batch_stats"])
  step = jaxdp.make_train_step(jaxdp_loss(model), OPT, mesh)
  for seed in range(2):
    state, metrics = step(state, *jaxdp.shard_uneven(portions(seed), mesh), rng=jax.random.key(seed))
    assert np.isfinite(float(metrics["loss"])) and int(metrics["skipped"]) == 0
  jaxdp.assert_replicas_equal(state)


def test_training_without_a_mask_takes_the_steps_weights():
  """Without mask= a jaxdp BatchNorm in a training step takes the weights of its rows from the step: the same
  state as passing mask=weights by hand (padding rows never enter the statistics)."""
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  model = Net(norm=jaxdp.adapters.linen.BatchNorm)
  variables = model.init(jax.random.key(0), np.zeros((2, D), np.float32), train=False)

  def no_mask(params, batch, *, model_state, train):
    out, updates = model.apply({"params": params, "batch_stats": model_state}, batch["x"], train,
                               mutable=["batch_stats"])
    return jaxdp.LossOutput(0.5 * (out - batch["y"]) ** 2, model_state=updates["batch_stats"])

  def by_hand(params, batch, *, model_state, weights, train):
    out, updates = model.apply({"params": params, "batch_stats": model_state}, batch["x"], train, mask=weights,
                               mutable=["batch_stats"])
    return jaxdp.LossOutput(0.5 * (out - batch["y"]) ** 2, model_state=updates["batch_stats"])

  data = jaxdp.shard_uneven(portions(), mesh)
  states = [jaxdp.make_train_step(fn, OPT, mesh)(
      jaxdp.init_state(variables["params"], OPT, mesh, model_state=variables["batch_stats"]), *data)[0]
      for fn in (no_mask, by_hand)]
  ours, theirs = (jaxdp.gather_state(s) for s in states)
  jax.tree.map(np.testing.assert_array_equal, (ours.params, ours.model_state), (theirs.params, theirs.model_state))


@pytest.mark.parametrize("field", [{"axis_index_groups": [[0, 1]]}, {"use_fast_variance": False},
                                   {"force_float32_reductions": False}])
def test_unsupported_fields_are_refused(field):
  with pytest.raises(ValueError, match=next(iter(field))):
    jaxdp.adapters.linen.BatchNorm(use_running_average=False, **field).init(jax.random.key(0), np.ones((2, 3), np.float32))


def test_a_loss_that_requires_a_key_is_told_what_evaluation_passes():
  """A linen port with Dropout writes loss_fn(params, batch, rng, ...): evaluation (no key) failed with Python's
  bare "missing 1 required positional argument"; now the error says why and how to fix it, and nothing is donated."""
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  model = Net(norm=jaxdp.adapters.linen.BatchNorm, dropout=0.5)
  variables = model.init(jax.random.key(0), np.zeros((2, D), np.float32), train=False)
  plain = jaxdp_loss(model)

  def keyed(params, batch, rng, *, model_state, weights, train):
    return plain(params, batch, rng, model_state=model_state, weights=weights, train=train)

  state = jaxdp.init_state(variables["params"], OPT, mesh, model_state=variables["batch_stats"])
  batch = jaxdp.shard_uneven(portions()[:2], mesh)
  with pytest.raises(TypeError, match=r"third argument \('rng'\) without a default.*evaluation \(make_eval_step\)"):
    jaxdp.make_eval_step(keyed, mesh)(state, *batch)
  with pytest.raises(TypeError, match=r"rng=None"):
    jaxdp.make_train_step(keyed, OPT, mesh)(state, *batch)
  state, metrics = jaxdp.make_train_step(keyed, OPT, mesh)(state, *batch, rng=jax.random.key(0))
  assert int(metrics["skipped"]) == 0


def _notes(call):
  with pytest.raises(Exception) as error:
    call()
  return str(error.value) + "\n".join(getattr(error.value, "__notes__", []))


def test_a_missing_dropout_key_gets_jaxdps_note_on_every_route():
  """flax's "Dropout_0 needs PRNG" from a step called without rng= gets a note naming step(..., rng=key), through
  make_train_step and train_step in your own shard_map, also for a loss_fn that takes no key at all; evaluation
  (dropout off) runs without one."""
  from jax.sharding import PartitionSpec as P

  mesh = jaxdp.data_mesh(jax.devices()[:2])
  model = Net(norm=jaxdp.adapters.linen.BatchNorm, dropout=0.5)
  variables = model.init(jax.random.key(0), np.zeros((2, D), np.float32), train=False)
  state = jaxdp.init_state(variables["params"], OPT, mesh, model_state=variables["batch_stats"])
  batch, weights = jaxdp.shard_uneven(portions()[:2], mesh)
  keyed = jaxdp_loss(model)

  def keyless(params, batch, *, model_state, weights, train):  # forgot the key altogether
    return keyed(params, batch, None, model_state=model_state, weights=weights, train=train)

  assert "rng=key" in _notes(lambda: jaxdp.make_train_step(keyed, OPT, mesh)(state, batch, weights))
  said = _notes(lambda: jaxdp.make_train_step(keyless, OPT, mesh)(state, batch, weights))
  assert "takes none: declare one as its third argument" in said and "rng=key" in said
  specs = jaxdp.state_specs(state)
  mapped = jax.jit(jax.shard_map(lambda s, b, w: jaxdp.train_step(keyed, OPT, s, b, w), mesh=mesh,
                                 in_specs=(specs, P("data"), P("data")), out_specs=(specs, P())))
  assert "rng=key" in _notes(lambda: mapped(state, batch, weights))
  assert float(jaxdp.make_eval_step(keyed, mesh)(state, batch, weights)["weight"]) == 3.0
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


def test_a_scalar_mean_is_named_where_per_example_losses_belong():
  """A linen loss_fn returning the mean (or upstream's (mean, logits)): the message says a scalar mean was
  returned where per-example losses belong, and where extra outputs go."""
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  model = Net()
  variables = model.init(jax.random.key(0), np.zeros((2, D), np.float32), train=False)
  state = jaxdp.init_state(variables["params"], OPT, mesh)
  batch, weights = jaxdp.shard_uneven(portions()[:2], mesh)
  apply = lambda p, b: model.apply({"params": p, "batch_stats": variables["batch_stats"]}, b["x"], False)  # noqa: E731

  def mean(params, batch):
    return jnp.mean((apply(params, batch) - batch["y"]) ** 2)

  def mean_and_logits(params, batch):
    out = apply(params, batch)
    return jnp.mean((out - batch["y"]) ** 2), out

  with pytest.raises(ValueError, match=r"returned a scalar \(shape \(\)\), a mean, where per-example losses \[b\] "
                     r"\(or per-token losses \[b, t\]\) belong, b=3.*weighted mean itself"):
    jaxdp.make_train_step(mean, OPT, mesh)(state, batch, weights)
  with pytest.raises(TypeError, match=r"tuple of 2 items whose first, the loss, is a scalar.*LossOutput\(losses, "
                     r"metrics=\{name: values\}\) as per-example values"):
    jaxdp.make_train_step(mean_and_logits, OPT, mesh)(state, batch, weights)
  with pytest.raises(ValueError, match=r"a scalar \(shape \(\)\), a mean"):
    jaxdp.make_eval_step(mean, mesh)(state, batch, weights)


def test_the_docs_per_example_metrics_block_runs_as_written():
  """docs/porting-linen.md's port of per-example training metrics (accuracy from logits through LossOutput.metrics)
  runs as written, on every device of this session, and reports the exact mean of the per-example values."""
  import pathlib

  text = (pathlib.Path(__file__).parents[1] / "docs" / "porting-linen.md").read_text()
  start = text.index("import flax.linen as nn, jax, jax.numpy as jnp, numpy as np, optax, jaxdp")
  scope: dict = {}
  exec(text[start:text.index("```", start)], scope)  # noqa: S102
  logits = scope["model"].apply({"params": scope["params"]}, scope["batch"]["x"])
  expected = np.mean(np.asarray(logits.argmax(-1)) == scope["batch"]["y"])
  np.testing.assert_allclose(float(scope["metrics"]["accuracy"]), expected, rtol=RTOL, atol=ATOL)
