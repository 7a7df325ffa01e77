"""flax nnx Modules through jaxdp: split, train data-parallel, evaluate, and back to an ordinary Module.

The model is a small MLP with jaxdp's BatchNorm and a Dropout; the data are
uneven per-device portions padded with zero-weight rows. Tolerances as in
test_model_state.py (rtol 1e-5, atol 2e-6: float32 re-association of sums).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, PartitionSpec as P

import jaxdp

# Plumbing and float32 agreement, not speed: most XLA passes skipped while this module runs (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compiles")

D, H = 3, 5
RTOL, ATOL = 1e-5, 2e-6
OPT = optax.sgd(0.1, momentum=0.9)


class Net(nnx.Module):
  def __init__(self, *, dropout=0.0, bn_axis=jaxdp.adapters.batchnorm.STEP_AXIS, flax_bn=False, rngs):
    self.dense = nnx.Linear(D, H, rngs=rngs)
    self.bn = nnx.BatchNorm(H, rngs=rngs) if flax_bn else jaxdp.adapters.nnx.BatchNorm(H, axis_name=bn_axis, rngs=rngs)
    self.drop = nnx.Dropout(dropout, rngs=rngs)
    self.out = nnx.Linear(H, 1, rngs=rngs)

  def __call__(self, x, mask=None):
    h = self.drop(nnx.relu(self.bn(self.dense(x), mask=mask)))
    return self.out(h)[:, 0]


def objective(model, batch, *, weights):
  pred = model(batch["x"], mask=weights)
  return 0.5 * (pred - batch["y"]) ** 2, {"abs_err": jnp.abs(pred - batch["y"])}


def portions(counts, seed=0):
  rng = np.random.default_rng(seed)
  return [{"x": rng.normal(size=(n, D)).astype(np.float32), "y": rng.normal(size=(n,)).astype(np.float32)} for n in counts]


def single_device_reference(steps_data, seed=0):
  """The same Module trained on one device the ordinary nnx way: nnx.Optimizer and nnx.value_and_grad."""
  model = Net(rngs=nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, OPT, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch):
    def loss(model):
      losses, _ = objective(model, batch, weights=jnp.ones(batch["y"].shape))
      return jnp.mean(losses)

    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value

  losses = [float(step(model, optimizer, jax.tree.map(lambda *x: np.concatenate(x), *data))) for data in steps_data]
  return model, losses


@pytest.mark.fast
def test_training_an_nnx_module_matches_the_ordinary_single_device_program():
  """split -> init_state -> make_train_step -> update: the same params, BatchNorm statistics and losses."""
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  steps_data = [portions((3, 0, 4, 1), seed=s) for s in range(3)]
  model = Net(rngs=nnx.Rngs(0))
  definition, params, model_state = jaxdp.adapters.nnx.split(model)
  loss_fn = jaxdp.adapters.nnx.loss_fn(definition, objective)
  state = jaxdp.init_state(params, OPT, mesh, model_state=model_state)
  step = jaxdp.make_train_step(loss_fn, OPT, mesh, check_replicas=True)
  losses = []
  for data in steps_data:
    state, metrics = step(state, *jaxdp.shard_uneven(data, mesh), rng=jax.random.key(0))
    assert float(metrics["replica_divergence"]) == 0.0
    losses.append(float(metrics["loss"]))
  jaxdp.adapters.nnx.update(model, state)
  reference, reference_losses = single_device_reference(steps_data)
  np.testing.assert_allclose(losses, reference_losses, rtol=RTOL, atol=ATOL)
  for ours, theirs in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(reference, nnx.Param))):
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(model.bn.mean[...], reference.bn.mean[...], rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(model.bn.var[...], reference.bn.var[...], rtol=RTOL, atol=ATOL)
  # Back in ordinary code: the updated Module runs on a host batch, in eval mode, without jax.set_mesh.
  model.eval(), reference.eval()
  x = np.random.default_rng(5).normal(size=(7, D)).astype(np.float32)
  np.testing.assert_allclose(model(x), reference(x), rtol=RTOL, atol=ATOL)
  metric = nnx.metrics.Average()
  metric.update(values=model(x))
  metric.reset()


def train_on(mesh, axis_name, steps_data, accum_steps=1, zero_stage=0, bn_axis=jaxdp.adapters.batchnorm.STEP_AXIS):
  model = Net(bn_axis=bn_axis, rngs=nnx.Rngs(0))
  definition, params, model_state = jaxdp.adapters.nnx.split(model)
  loss_fn = jaxdp.adapters.nnx.loss_fn(definition, objective)
  state = jaxdp.init_state(params, OPT, mesh, model_state=model_state, axis_name=axis_name, zero_stage=zero_stage)
  step = jaxdp.make_train_step(loss_fn, OPT, mesh, axis_name=axis_name, accum_steps=accum_steps, zero_stage=zero_stage)
  losses = []
  for data in steps_data:
    state, metrics = step(state, *jaxdp.shard_uneven(data, mesh, axis_name=axis_name), rng=jax.random.key(0))
    losses.append(float(metrics["loss"]))
  return jaxdp.adapters.nnx.update(model, state), losses


def hybrid_mesh():
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("replica", "data"), axis_types=(AxisType.Auto,) * 2)


@pytest.mark.parametrize("axes,zero_stage", [("batch", 0), (("replica", "data"), 2)], ids=["named-batch", "hybrid"])
def test_batchnorm_synchronises_over_the_steps_data_axis_whatever_its_name(axes, zero_stage):
  """BatchNorm's default axis is the step's. It was "data": silently per-device statistics on a mesh whose data
  axis has another name (loss 1.54 for 1.41 on the first step), and on a hybrid mesh a sum over "data" only."""
  if isinstance(axes, str):
    mesh, counts = jaxdp.data_mesh(jax.devices()[:6], axis_name=axes), (3, 0, 4, 1, 2, 6)
  else:
    mesh, counts = hybrid_mesh(), (4, 0, 3, 2, 1, 2, 0, 4)
  steps_data = [portions(counts, seed=s) for s in range(2)]
  model, losses = train_on(mesh, axes, steps_data, zero_stage=zero_stage)
  reference, reference_losses = single_device_reference(steps_data)
  np.testing.assert_allclose(losses, reference_losses, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(model.bn.mean[...], reference.bn.mean[...], rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(model.bn.var[...], reference.bn.var[...], rtol=RTOL, atol=ATOL)
  for ours, theirs in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(reference, nnx.Param))):
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL)


def test_per_replica_model_state_accumulates_on_a_hybrid_mesh():
  """Local BatchNorm (per-replica statistics) with accum_steps=2 over ("replica", "data") failed to trace (the
  scan's carry changed type); it now runs as on a 1-D mesh of the same 8 devices."""
  steps_data = [portions((4, 0, 4, 2, 2, 2, 0, 4), seed=s) for s in range(2)]
  hybrid, hybrid_losses = train_on(hybrid_mesh(), ("replica", "data"), steps_data, accum_steps=2, bn_axis=None)
  flat, flat_losses = train_on(jaxdp.data_mesh(jax.devices()[:8]), "data", steps_data, accum_steps=2, bn_axis=None)
  np.testing.assert_allclose(hybrid_losses, flat_losses, rtol=RTOL, atol=ATOL)
  kept = lambda m: jax.tree.leaves(nnx.state(m, nnx.Param, nnx.BatchStat))  # noqa: E731
  for ours, theirs in zip(kept(hybrid), kept(flat)):
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL)


def test_a_batchnorm_axis_not_bound_in_the_step_is_refused():
  """An explicit axis_name the step does not map would give each device its own statistics, silently."""
  mesh = jaxdp.data_mesh(jax.devices()[:2], axis_name="batch")
  with pytest.raises(ValueError, match=r"BatchNorm axis_name='data' is not bound in this jaxdp step, whose data "
                                       r"axis is 'batch'.*axis_name=None for per-device"):
    train_on(mesh, "batch", [portions((2, 1))], bn_axis="data")
  train_on(mesh, "batch", [portions((2, 1))], bn_axis=None)  # per-device statistics, asked for


@pytest.mark.parametrize("axis", ["data", "replica"])
def test_a_batchnorm_axis_covering_part_of_a_hybrid_data_axis_is_refused(axis):
  """On ("replica", "data") an explicit axis_name="data" is bound, so it passed, and gave statistics of one group
  of devices (params off by 4.8e-2 after 3 steps in a review). Refused; the full tuple is the default's result."""
  steps_data = [portions((4, 0, 3, 2, 1, 2, 0, 4))]
  with pytest.raises(ValueError, match=rf"BatchNorm axis_name='{axis}' covers only part of this jaxdp step's data "
                                       r"axes \('replica', 'data'\)"):
    train_on(hybrid_mesh(), ("replica", "data"), steps_data, bn_axis=axis)
  explicit, losses = train_on(hybrid_mesh(), ("replica", "data"), steps_data, bn_axis=("replica", "data"))
  default, default_losses = train_on(hybrid_mesh(), ("replica", "data"), steps_data)
  np.testing.assert_array_equal(losses, default_losses)


def test_eval_step_uses_running_statistics_and_shares_the_metric_definition():
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  model = Net(rngs=nnx.Rngs(1))
  definition, params, model_state = jaxdp.adapters.nnx.split(model)
  loss_fn = jaxdp.adapters.nnx.loss_fn(definition, objective)
  state = jaxdp.init_state(params, OPT, mesh, model_state=model_state, zero_stage=2)
  state, _ = jaxdp.make_train_step(loss_fn, OPT, mesh, zero_stage=2)(state, *jaxdp.shard_uneven(portions((2, 2, 1, 0)), mesh), rng=jax.random.key(1))
  data = portions((4, 1, 0, 2), seed=3)
  got = jaxdp.make_eval_step(loss_fn, mesh)(state, *jaxdp.shard_uneven(data, mesh))
  jaxdp.adapters.nnx.update(model, state).eval()
  host = jax.tree.map(lambda *x: np.concatenate(x), *data)
  pred = model(host["x"])
  np.testing.assert_allclose(got["loss"], np.mean(0.5 * (pred - host["y"]) ** 2), rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(got["abs_err"], np.mean(np.abs(pred - host["y"])), rtol=RTOL, atol=ATOL)
  assert float(got["weight"]) == 7.0


def test_split_and_merge_round_trip():
  model = Net(dropout=0.5, rngs=nnx.Rngs(2))
  definition, params, model_state = jaxdp.adapters.nnx.split(model)
  assert definition.streams == (model.drop.rngs.key.tag,)  # the stream Dropout draws from, reseeded per step
  assert {type(v).__name__ for v in jax.tree.leaves(model_state, is_leaf=lambda x: isinstance(x, nnx.Variable))} == {"BatchStat"}
  again = jaxdp.adapters.nnx.merge(definition, params, model_state)
  again.eval(), model.eval()
  x = np.ones((2, D), np.float32)
  np.testing.assert_array_equal(again(x), model(x))


def test_dropout_keys_differ_by_replica_and_step_and_need_a_key():
  """Per-replica keys: with dropout on, "none" replicas diverge; a step without rng is refused clearly."""
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  model = Net(dropout=0.5, bn_axis=None, rngs=nnx.Rngs(3))
  definition, params, model_state = jaxdp.adapters.nnx.split(model)
  loss_fn = jaxdp.adapters.nnx.loss_fn(definition, objective)
  data = [portions((3, 3), seed=4)[0]] * 2  # the same rows on both devices
  state = jaxdp.init_state(params, OPT, mesh, model_state=model_state)
  step = jaxdp.make_train_step(loss_fn, OPT, mesh, reduction="none")
  new, _ = step(state, *jaxdp.shard_uneven(data, mesh), rng=jax.random.key(0))
  replicas = jaxdp.per_replica(new.params)
  assert not np.array_equal(*jax.tree.leaves(replicas)[0][:2])  # same data, different dropout masks
  with pytest.raises(ValueError, match=r"RNG streams default.*pass rng=jax\.random\.key"):
    jaxdp.make_train_step(loss_fn, OPT, mesh)(new, *jaxdp.shard_uneven(data, mesh))


def same_training(mesh, loss_fns, params, model_state, data, **rng):
  """The gathered states after one step of each loss in ``loss_fns`` from the same start, checked leaf-equal."""
  states = [jaxdp.gather_state(jaxdp.make_train_step(fn, OPT, mesh)(
      jaxdp.init_state(params, OPT, mesh, model_state=model_state), *data, **rng)[0])
      for fn in loss_fns]
  jax.tree.map(np.testing.assert_array_equal, *[(s.params, s.model_state) for s in states])


def test_batchnorm_without_a_mask_takes_the_steps_weights():
  """Without mask= the BatchNorm takes the weights of its rows from the step: padding never enters the statistics
  (the same state as mask=weights by hand), and evaluation runs on the running statistics."""
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  definition, params, model_state = jaxdp.adapters.nnx.split(Net(rngs=nnx.Rngs(0)))
  no_mask = jaxdp.adapters.nnx.loss_fn(definition, lambda model, batch: 0.5 * (model(batch["x"]) - batch["y"]) ** 2)
  by_hand = jaxdp.adapters.nnx.loss_fn(
      definition, lambda model, batch, *, weights: 0.5 * (model(batch["x"], mask=weights) - batch["y"]) ** 2)
  data = jaxdp.shard_uneven(portions((2, 1)), mesh)
  same_training(mesh, (no_mask, by_hand), params, model_state, data, rng=jax.random.key(0))
  state = jaxdp.init_state(params, OPT, mesh, model_state=model_state)
  out = jaxdp.make_eval_step(no_mask, mesh)(state, *data)  # eval: running stats
  assert np.isfinite(float(out["loss"]))


def test_batchnorm_without_a_mask_takes_the_steps_weights_in_a_hand_written_loss():
  """The step's weights belong to the training step, not to jaxdp.adapters.nnx.loss_fn: a loss written with nnx.merge
  by hand gets them too (it trained its BatchNorm on the padding rows before)."""
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  graphdef, params, model_state, rest = nnx.split(Net(rngs=nnx.Rngs(0)), nnx.Param, nnx.BatchStat, ...)

  def by_hand(params, batch, *, model_state, weights, masked):
    model = nnx.merge(graphdef, params, model_state, rest, copy=True)  # fresh Variables, mutable in the trace
    losses = 0.5 * (model(batch["x"], mask=weights if masked else None) - batch["y"]) ** 2
    return jaxdp.LossOutput(losses, model_state=nnx.state(model, nnx.BatchStat))

  data = jaxdp.shard_uneven(portions((2, 1)), mesh)
  same_training(mesh, [functools.partial(by_hand, masked=m) for m in (False, True)], params, model_state, data)


@pytest.mark.parametrize("mask", [False, True])
def test_flax_batchnorm_is_refused_in_a_hand_written_loss(mask):
  """flax's own nnx.BatchNorm reached through flax's nnx.split / merge (jaxdp.adapters.nnx.split never sees it) trained on
  the padding rows, or with mask= on a pmean that weighs devices equally. Refused in training; evaluation runs."""
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  graphdef, params, model_state, rest = nnx.split(Net(flax_bn=True, rngs=nnx.Rngs(0)), nnx.Param, nnx.BatchStat, ...)

  def by_hand(params, batch, *, model_state, weights):
    model = nnx.merge(graphdef, params, model_state, rest)
    losses = 0.5 * (model(batch["x"], mask=(weights > 0)[:, None] if mask else None) - batch["y"]) ** 2
    return jaxdp.LossOutput(losses, model_state=nnx.state(model, nnx.BatchStat))

  state = jaxdp.init_state(params, OPT, mesh, model_state=model_state)
  data = jaxdp.shard_uneven(portions((2, 1)), mesh)
  with pytest.raises(ValueError, match=r"flax's nnx\.BatchNorm is computing batch statistics.*jaxdp\.adapters\.nnx\.BatchNorm"):
    jaxdp.make_train_step(by_hand, OPT, mesh)(state, *data)

  def frozen(params, batch, *, model_state):
    model = nnx.merge(graphdef, params, model_state, rest)
    model.eval()  # running averages: nothing to refuse, in training or evaluation
    return jaxdp.LossOutput(0.5 * (model(batch["x"]) - batch["y"]) ** 2, model_state=nnx.state(model, nnx.BatchStat))

  assert np.isfinite(float(jaxdp.make_eval_step(frozen, mesh)(state, *data)["loss"]))
  jaxdp.make_train_step(frozen, OPT, mesh)(state, *data)
  model = nnx.merge(graphdef, params, model_state, rest)
  assert model(jnp.ones((3, D))).shape == (3,)  # outside a jaxdp step flax's layer runs as ever


def test_masked_moments_without_weights_takes_the_steps_weights():
  """jaxdp.masked_moments(x) in a loss counted the padding rows; it now takes the step's weights, as weights=weights."""
  mesh = jaxdp.data_mesh(jax.devices()[:2])

  def loss(params, batch, *, weights, use_weights):
    h = batch["x"] * params["w"][None, :]
    moments = jaxdp.masked_moments(h, weights if use_weights else None)
    z = (h - moments.mean[None, :]) / jnp.sqrt(moments.var[None, :] + 1e-5)
    return 0.5 * (z.sum(-1) - batch["y"]) ** 2

  data = jaxdp.shard_uneven(portions((2, 1)), mesh)
  states = [jaxdp.gather_state(jaxdp.make_train_step(functools.partial(loss, use_weights=u), OPT, mesh)(
      jaxdp.init_state({"w": np.ones((D,), np.float32)}, OPT, mesh), *data)[0]) for u in (False, True)]
  np.testing.assert_array_equal(states[0].params["w"], states[1].params["w"])


def test_a_state_without_the_models_state_is_refused_by_name():
  """init_state without model_state= for a model with BatchNorm: flax's "Incorrect number of leaves" before."""
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  definition, params, _ = jaxdp.adapters.nnx.split(Net(rngs=nnx.Rngs(0)))
  state = jaxdp.init_state(params, OPT, mesh)
  with pytest.raises(ValueError, match=r"cannot be rebuilt from the step.s params without model state"
                                       r".*model_state=model_state"):
    jaxdp.make_train_step(jaxdp.adapters.nnx.loss_fn(definition, objective), OPT, mesh)(
        state, *jaxdp.shard_uneven(portions((2, 1)), mesh), rng=jax.random.key(0))


def test_flax_batchnorm_is_refused_with_the_fix():
  with pytest.raises(ValueError, match=r"flax nnx\.BatchNorm.*jaxdp\.adapters\.nnx\.BatchNorm"):
    jaxdp.adapters.nnx.split(Net(flax_bn=True, rngs=nnx.Rngs(0)))
  definition, _, _ = jaxdp.adapters.nnx.split(Net(flax_bn=True, rngs=nnx.Rngs(0)), allow_flax_batchnorm=True)
  assert isinstance(definition, jaxdp.adapters.nnx.Definition)


def test_allowed_flax_batchnorm_stays_on_its_running_averages_in_training():
  """allow_flax_batchnorm admits flax's BatchNorm as a frozen layer, but loss_fn's model.train() switched it to
  batch statistics, padding rows included (first loss 2.3374 where one device's frozen model gives 2.2054, in a
  review's port). It now keeps its running averages: they do not move, and the loss is the frozen model's."""
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  model = Net(flax_bn=True, rngs=nnx.Rngs(0))
  definition, params, model_state = jaxdp.adapters.nnx.split(model, allow_flax_batchnorm=True)
  state = jaxdp.init_state(params, OPT, mesh, model_state=model_state)
  step = jaxdp.make_train_step(jaxdp.adapters.nnx.loss_fn(definition, objective), OPT, mesh)
  data = portions((2, 1))
  state, metrics = step(state, *jaxdp.shard_uneven(data, mesh), rng=jax.random.key(0))
  whole = jax.tree.map(lambda *x: np.concatenate(x), *data)
  model.eval()
  np.testing.assert_allclose(metrics["loss"], jnp.mean(0.5 * (model(whole["x"]) - whole["y"]) ** 2), rtol=RTOL)
  jax.tree.map(np.testing.assert_array_equal, jaxdp.gather_state(state).model_state, nnx.state(model, nnx.BatchStat))


class TensorParallelNet(nnx.Module):
  """Megatron-style MLP: the first layer column-split over "model", the second row-split, LayerNorm replicated."""

  def __init__(self, *, rngs):
    kernel, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
    self.up = nnx.Linear(8, 16, kernel_init=nnx.with_partitioning(kernel, (None, "model")),
                         bias_init=nnx.with_partitioning(zeros, ("model",)), rngs=rngs)
    self.down = nnx.Linear(16, 4, kernel_init=nnx.with_partitioning(kernel, ("model", None)), rngs=rngs)
    self.ln = nnx.LayerNorm(4, rngs=rngs)

  def __call__(self, x):
    return self.ln(self.down(nnx.gelu(self.up(x))))


def tp_objective(model, batch):
  return jnp.sum((model(batch["x"]) - batch["y"]) ** 2, axis=-1)


TP_SPECS = {"up": {"kernel": P(None, "model"), "bias": P("model")}, "down": {"kernel": P("model", None), "bias": P()},
            "ln": {"scale": P(), "bias": P()}}


def _trimmed(spec):
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return tuple(entries)


def _specs_by_path(tree):
  return {jax.tree_util.keystr(path): spec for path, spec in jax.tree_util.tree_leaves_with_path(tree)}


def test_partition_specs_read_nnx_metadata_and_init_state_keeps_the_model_splits():
  with nnx.use_eager_sharding(False):  # plain arrays with metadata: no mesh needed to build the model
    model = TensorParallelNet(rngs=nnx.Rngs(0))
  definition, params, _ = jaxdp.adapters.nnx.split(model)
  specs = jaxdp.adapters.nnx.partition_specs(model)
  assert jax.tree.structure(specs) == jax.tree.structure(params)  # params-shaped, as init_state wants it
  assert _specs_by_path(specs) == _specs_by_path(jaxdp.adapters.nnx.partition_specs(params))
  assert _specs_by_path(specs) == {f"['{layer}']['{name}'].value": spec for layer, d in TP_SPECS.items() for name, spec in d.items()}
  with pytest.raises(TypeError, match="nnx.Module or the params"):
    jaxdp.adapters.nnx.partition_specs({"w": np.ones(2)})

  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  opt = optax.adam(1e-2)
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(8, 8)).astype(np.float32), "y": rng.normal(size=(8, 4)).astype(np.float32)}
  loss_fn = jaxdp.adapters.nnx.loss_fn(definition, tp_objective)
  one = jaxdp.data_mesh(jax.devices()[:1])
  reference, _ = jaxdp.make_train_step(loss_fn, opt, one)(jaxdp.init_state(params, opt, one), batch)
  # Stage 3 adds "data" along the largest dimension not split over "model" that 4 divides (None: none does).
  stage3_dims = {"up": {"kernel": 0, "bias": None}, "down": {"kernel": 1, "bias": 0}, "ln": {"scale": 0, "bias": 0}}
  for stage in (0, 3):
    state = jaxdp.init_state(params, opt, mesh, zero_stage=stage, param_specs=specs)
    for layer, names in TP_SPECS.items():
      for name, model_spec in names.items():
        x = state.params[layer][name].get_value()
        entries = list(model_spec) + [None] * (x.ndim - len(model_spec))
        if stage == 3 and stage3_dims[layer][name] is not None:
          entries[stage3_dims[layer][name]] = "data"
        assert _trimmed(x.sharding.spec) == _trimmed(P(*entries)), (stage, layer, name, x.sharding.spec)
    new, _ = jaxdp.make_train_step(loss_fn, opt, mesh, zero_stage=stage)(state, batch)
    assert new.params["up"]["kernel"].get_value().sharding.spec[1] == "model"  # still split after a step
    for got, want in zip(jax.tree.leaves(new.params), jax.tree.leaves(reference.params)):
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


class FrozenNet(nnx.Module):
  """Fine-tuning: a BatchNorm frozen on its running averages and an inactive Dropout next to trained layers."""

  def __init__(self, *, rate=0.5, rngs):
    self.dense = nnx.Linear(D, H, rngs=rngs)
    self.frozen_bn = jaxdp.adapters.nnx.BatchNorm(H, use_running_average=True, rngs=rngs)
    self.bn = jaxdp.adapters.nnx.BatchNorm(H, rngs=rngs)
    self.drop = nnx.Dropout(rate, deterministic=True, rngs=rngs)
    self.out = nnx.Linear(H, 1, rngs=rngs)

  def __call__(self, x, mask=None):
    h = self.bn(nnx.relu(self.frozen_bn(self.dense(x), mask=mask)), mask=mask)
    return self.out(self.drop(h))[:, 0]


def frozen_objective(model, batch, *, weights):
  return 0.5 * (model(batch["x"], mask=weights) - batch["y"]) ** 2


@pytest.mark.parametrize("keep_frozen", [True, False])
def test_layers_frozen_at_split_train_as_the_user_says(keep_frozen):
  """jaxdp called model.train() in every training step: a BatchNorm built frozen for fine-tuning trained on
  batch statistics and a Dropout built inactive dropped units (found by a review: loss 4.78 against 1.26).
  A model with frozen layers now needs keep_frozen: True keeps them frozen (a one-device program that never
  calls model.train()), False trains every layer (one that does); each matches its one-device program."""
  with pytest.raises(ValueError, match=r"drop\.deterministic, frozen_bn\.use_running_average are True.*keep_frozen=True"):
    jaxdp.adapters.nnx.split(FrozenNet(rngs=nnx.Rngs(0)))
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  steps_data = [portions((3, 0, 4, 1), seed=s) for s in range(2)]
  rate = 0.5 if keep_frozen else 0.0  # training with keep_frozen=False draws dropout masks: compare at rate 0
  model = FrozenNet(rate=rate, rngs=nnx.Rngs(0))
  definition, params, model_state = jaxdp.adapters.nnx.split(model, keep_frozen=keep_frozen)
  state = jaxdp.init_state(params, OPT, mesh, model_state=model_state)
  step = jaxdp.make_train_step(jaxdp.adapters.nnx.loss_fn(definition, frozen_objective), OPT, mesh)
  for data in steps_data:
    state, _ = step(state, *jaxdp.shard_uneven(data, mesh), rng=jax.random.key(0))
  jaxdp.adapters.nnx.update(model, state)

  reference = FrozenNet(rate=rate, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(reference, OPT, wrt=nnx.Param)
  if not keep_frozen:
    reference.train()
  for data in steps_data:
    batch = jax.tree.map(lambda *x: np.concatenate(x), *data)
    grads = nnx.grad(lambda m: jnp.mean(frozen_objective(m, batch, weights=jnp.ones(batch["y"].shape))))(reference)
    optimizer.update(reference, grads)
  if keep_frozen:
    np.testing.assert_array_equal(model.frozen_bn.mean[...], np.zeros(H))  # never updated
  for ours, theirs in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(reference, nnx.Param))):
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL)
  for ours, theirs in zip(jax.tree.leaves(nnx.state(model, nnx.BatchStat)),
                          jax.tree.leaves(nnx.state(reference, nnx.BatchStat))):
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL)


def test_what_a_loss_sows_is_not_model_state():
  """nnx's sow (nnx.Intermediate) in a model with BatchNorm state made the step refuse the returned state's
  structure, naming a state the user never returned: what the call sows is dropped, as on one device, and so
  is what an eager call sowed before the split."""

  class Sowing(Net):
    def __call__(self, x, mask=None):
      h = self.bn(self.dense(x), mask=mask)
      self.sow(nnx.Intermediate, "h_mean", h.mean())
      return self.out(h)[:, 0]

  mesh = jaxdp.data_mesh(jax.devices()[:4])
  data = portions((3, 0, 4, 1))
  model = Sowing(rngs=nnx.Rngs(0))
  model.eval(), model(data[0]["x"]), model.train()  # an eager call to check shapes sows before the split
  definition, params, model_state = jaxdp.adapters.nnx.split(model)
  assert not jax.tree.leaves(nnx.state(jaxdp.adapters.nnx.merge(definition, params, model_state), nnx.Intermediate))
  assert jax.tree.leaves(nnx.state(model, nnx.Intermediate))  # the user's model keeps what it sowed
  state = jaxdp.init_state(params, OPT, mesh, model_state=model_state)
  step = jaxdp.make_train_step(jaxdp.adapters.nnx.loss_fn(definition, objective), OPT, mesh)
  state, _ = step(state, *jaxdp.shard_uneven(data, mesh), rng=jax.random.key(0))
  reference = Sowing(rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(reference, OPT, wrt=nnx.Param)
  batch = jax.tree.map(lambda *x: np.concatenate(x), *data)
  grads = nnx.grad(lambda m: jnp.mean(objective(m, batch, weights=jnp.ones(batch["y"].shape))[0]))(reference)
  optimizer.update(reference, grads)
  jaxdp.adapters.nnx.update(model, state)
  for ours, theirs in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(reference, nnx.Param))):
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL)


class _Block(nnx.Module):
  def __init__(self, rate, rngs):
    self.lin = nnx.Linear(4, 4, rngs=rngs)
    self.drop = nnx.Dropout(rate, rngs=rngs)

  def __call__(self, x):
    return x + self.drop(self.lin(x))


class _Stacked(nnx.Module):
  """flax's scan-over-layers idiom: blocks made with nnx.vmap + nnx.split_rngs (a key per layer), run by nnx.scan."""

  def __init__(self, rate, rngs):
    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return _Block(rate, rngs)

    self.blocks = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
      return block(x)

    return forward(x, self.blocks).sum(-1)


def test_layers_stacked_with_a_key_per_layer_train():
  """Layers stacked with nnx.vmap + nnx.split_rngs hold RNG streams with one key per layer; the step's reseed
  refused them ('non-scalar key'), so such a model could not train at any dropout rate (from an nnx port review).
  With dropout on it trains and the replicas agree; at rate 0 it is the one-device step. An error inside a
  stateless nnx loss no longer gets the note about a missing model_state."""
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  tx = optax.sgd(0.1)
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(4, 4)).astype(np.float32), "y": rng.normal(size=(4,)).astype(np.float32)}
  objective = lambda model, b: (model(b["x"]) - b["y"]) ** 2  # noqa: E731
  for rate in (0.5, 0.0):
    model = _Stacked(rate, nnx.Rngs(0))
    definition, params, model_state = jaxdp.adapters.nnx.split(model)
    step = jaxdp.make_train_step(jaxdp.adapters.nnx.loss_fn(definition, objective), tx, mesh, check_replicas=True)
    state, metrics = step(jaxdp.init_state(params, tx, mesh, model_state=model_state), batch, None,
                          jax.random.key(1))
    assert np.isfinite(float(metrics["loss"])) and float(metrics["replica_divergence"]) == 0.0
  # rate 0: one device, the plain nnx program
  grads = nnx.grad(lambda m: jnp.mean(objective(m, batch)))(model)
  expected = jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param), nnx.state(grads, nnx.Param))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
               jaxdp.gather_state(state).params, expected)
  stateless = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
  definition, params, model_state = jaxdp.adapters.nnx.split(stateless)
  broken = jaxdp.adapters.nnx.loss_fn(definition, lambda m, b: m(b["x"].T)[:, 0])  # a shape bug
  with pytest.raises(TypeError) as error:
    jaxdp.make_train_step(broken, tx, mesh)(jaxdp.init_state(params, tx, mesh, model_state=model_state), batch)
  assert "model_state=None" not in "\n".join(getattr(error.value, "__notes__", []))


class _Tuned(nnx.Module):
  def __init__(self, rngs):
    self.base = nnx.Linear(3, 4, rngs=rngs)
    self.head = nnx.Linear(4, 1, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.tanh(self.base(x)))[:, 0]


def test_the_readmes_wrt_recipe_trains_only_the_subset():
  """nnx.Optimizer(model, tx, wrt=subset) has no counterpart in split; the docs (porting-nnx.md) freeze the rest with
  optax.multi_transform over the same filter. Reference: one device, nnx.Optimizer(wrt=subset)."""
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(8, 3)).astype(np.float32), "y": rng.normal(size=(8,)).astype(np.float32)}
  objective = lambda model, b: (model(b["x"]) - b["y"]) ** 2  # noqa: E731
  WRT = nnx.All(nnx.Param, nnx.PathContains("head"))  # the docs' lines, as written there
  labels = lambda params: nnx.from_flat_state(  # noqa: E731
      [(path, v.replace("train" if WRT(path, v) else "frozen")) for path, v in nnx.to_flat_state(params)])
  tx = optax.multi_transform({"train": optax.adam(0.1), "frozen": optax.set_to_zero()}, labels)
  model = _Tuned(nnx.Rngs(0))
  definition, params, model_state = jaxdp.adapters.nnx.split(model)
  step = jaxdp.make_train_step(jaxdp.adapters.nnx.loss_fn(definition, objective), tx, mesh)
  state = jaxdp.init_state(params, tx, mesh, model_state=model_state)
  for _ in range(2):
    state, _ = step(state, batch)
  reference = _Tuned(nnx.Rngs(0))
  optimizer = nnx.Optimizer(reference, optax.adam(0.1), wrt=WRT)
  for _ in range(2):
    optimizer.update(reference, nnx.grad(lambda m: jnp.mean(objective(m, batch)), argnums=nnx.DiffState(0, WRT))(
        reference))
  got = jaxdp.gather_state(state).params
  np.testing.assert_array_equal(np.asarray(got["base"]["kernel"]), np.asarray(model.base.kernel[...]))
  for name in ("kernel", "bias"):
    np.testing.assert_allclose(np.asarray(got["head"][name]), np.asarray(getattr(reference.head, name)[...]),
                               rtol=1e-5, atol=1e-6)


def _two_device_dropout_setup():
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  model = Net(dropout=0.5, rngs=nnx.Rngs(5))
  definition, params, model_state = jaxdp.adapters.nnx.split(model)
  loss_fn = jaxdp.adapters.nnx.loss_fn(definition, objective)
  state = jaxdp.init_state(params, OPT, mesh, model_state=model_state)
  return mesh, model, loss_fn, state, jaxdp.shard_uneven(portions((3, 2), seed=6), mesh)


def test_upstream_mode_calls_after_split_are_honoured_or_refused_never_ignored():
  """flax's MNIST loop calls model.train() / model.eval() on the Module each epoch. After jaxdp.adapters.nnx.split the
  steps run the rebuilt Module, so those calls could not act on them: the loop as written runs (the eval step is
  always deterministic), and a training step while the object is in eval mode is refused, not run in train mode."""
  mesh, model, loss_fn, state, (batch, weights) = _two_device_dropout_setup()
  step, evaluate = jaxdp.make_train_step(loss_fn, OPT, mesh), jaxdp.make_eval_step(loss_fn, mesh)
  for epoch in range(2):  # the upstream loop
    model.train()
    state, _ = step(state, batch, weights, rng=jax.random.key(epoch))
    model.eval()
    first, second = evaluate(state, batch, weights), evaluate(state, batch, weights)
    assert float(first["loss"]) == float(second["loss"])  # dropout off in evaluation
  # The object is still in eval mode: training now would be ignoring it. Refused before anything is donated.
  with pytest.raises(ValueError, match=r"changed mode since \(bn\.use_running_average=True, drop\.deterministic=True.*model\.train\(\)"):
    step(state, batch, weights, rng=jax.random.key(7))
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
  # The loss traced by hand (train_step in your own shard_map) is refused the same way.
  with pytest.raises(ValueError, match=r"changed mode since"):
    loss_fn(state.params, batch, jax.random.key(0), model_state=state.model_state, weights=weights, train=True)
  model.train()
  state, _ = step(state, batch, weights, rng=jax.random.key(7))
  assert int(state.step) == 3


def test_the_documented_way_to_train_in_another_mode_splits_again():
  """To train with dropout off from now on (what model.eval() before a one-device step does), split the Module in
  that mode with keep_frozen=True and build a step on it: the same state trains, and the key no longer matters."""
  mesh, model, loss_fn, state, (batch, weights) = _two_device_dropout_setup()
  state, _ = jaxdp.make_train_step(loss_fn, OPT, mesh)(state, batch, weights, rng=jax.random.key(0))
  model.drop.eval()  # a mode change on the object the first split saw
  definition, _, _ = jaxdp.adapters.nnx.split(model, keep_frozen=True)
  frozen_step = jaxdp.make_train_step(jaxdp.adapters.nnx.loss_fn(definition, objective), OPT, mesh, donate=False)
  a, _ = frozen_step(state, batch, weights, rng=jax.random.key(1))
  b, _ = frozen_step(state, batch, weights, rng=jax.random.key(2))
  jax.tree.map(np.testing.assert_array_equal, a.params, b.params)  # no dropout: the key changes nothing
  assert int(a.step) == 2


def test_a_scalar_mean_with_logits_is_named_as_such():
  """upstream's nnx loss returns (mean_loss, logits): the message names the scalar mean and where logits go."""
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  definition, params, model_state = jaxdp.adapters.nnx.split(Net(rngs=nnx.Rngs(0)))
  state = jaxdp.init_state(params, OPT, mesh, model_state=model_state)
  data = jaxdp.shard_uneven(portions((2, 2)), mesh)

  def upstream(model, batch, *, weights):
    pred = model(batch["x"], mask=weights)
    return jnp.mean((pred - batch["y"]) ** 2), pred

  def mean_only(model, batch, *, weights):
    return jnp.mean((model(batch["x"], mask=weights) - batch["y"]) ** 2)

  step = jaxdp.make_train_step(jaxdp.adapters.nnx.loss_fn(definition, upstream), OPT, mesh)
  with pytest.raises(TypeError, match=r"first item is a scalar \(shape \(\)\), a mean, where per-example losses "
                     r"\[b\].*weighted mean itself.*second item is an array of shape \(2,\), not a dict: extra "
                     r"outputs \(like logits\) go into metrics as a dict of per-example values"):
    step(state, *data, rng=jax.random.key(0))
  step = jaxdp.make_train_step(jaxdp.adapters.nnx.loss_fn(definition, mean_only), OPT, mesh)
  with pytest.raises(ValueError, match=r"loss_fn returned a scalar \(shape \(\)\), a mean, where per-example"):
    step(state, *data, rng=jax.random.key(0))
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


class _UpstreamDropout(nnx.Module):
  """flax's MNIST CNN's way: Dropout built without rngs, the key passed at the call."""

  def __init__(self, *, rngs):
    self.dense = nnx.Linear(D, 1, rngs=rngs)
    self.drop = nnx.Dropout(0.5)

  def __call__(self, x, rngs=None):
    return self.drop(self.dense(x), rngs=rngs)[:, 0]


@pytest.mark.parametrize("kind", ["streams", "upstream"])
def test_a_missing_step_key_is_named_on_every_route(kind):
  """A dropout model stepped without rng=: jaxdp's message or note names step(..., rng=key) through
  make_train_step and through train_step in your own shard_map; the eval step runs without a key."""
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  if kind == "streams":
    model = Net(dropout=0.5, rngs=nnx.Rngs(0))
    fn = objective
  else:
    model = _UpstreamDropout(rngs=nnx.Rngs(0))
    fn = lambda model, batch, *, rngs: (model(batch["x"], rngs=rngs) - batch["y"]) ** 2  # noqa: E731
  definition, params, model_state = jaxdp.adapters.nnx.split(model)
  loss_fn = jaxdp.adapters.nnx.loss_fn(definition, fn)
  state = jaxdp.init_state(params, OPT, mesh, model_state=model_state)
  batch, weights = jaxdp.shard_uneven(portions((2, 2)), mesh)

  def said(call):
    with pytest.raises(Exception) as error:
      call()
    return str(error.value) + "\n".join(getattr(error.value, "__notes__", []))

  assert "rng=key" in said(lambda: jaxdp.make_train_step(loss_fn, OPT, mesh)(state, batch, weights))
  specs = jaxdp.state_specs(state)
  mapped = jax.jit(jax.shard_map(lambda s, b, w: jaxdp.train_step(loss_fn, OPT, s, b, w), mesh=mesh,
                                 in_specs=(specs, P("data"), P("data")), out_specs=(specs, P())))
  assert "rng=key" in said(lambda: mapped(state, batch, weights))
  assert float(jaxdp.make_eval_step(loss_fn, mesh)(state, batch, weights)["weight"]) == 4.0
