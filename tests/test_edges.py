"""The last edges (issue 34): host inputs checked where they enter, padded batches that cannot lose their weights,
the natural mistakes of a flax or optax user named with their fix, and budgets that round down.

Every refusal is checked before anything runs or is donated: the state given to the refused call still trains.
One tiny linear model on 4 devices; the steps are built once per module.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxdp
from jaxdp import CheckpointManager
from jaxdp.analysis import scaling

pytestmark = pytest.mark.usefixtures("fast_compiles")

OPT = optax.sgd(0.1)
N = 4


def loss_fn(params, batch):
  return 0.5 * (batch["x"] @ params["w"] - batch["y"]) ** 2


def rows(n, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 3)).astype(np.float32)
  return {"x": x, "y": x.sum(axis=1)}


@pytest.fixture(scope="module")
def mesh():
  return jaxdp.data_mesh(jax.devices()[:N])


@pytest.fixture(scope="module")
def step(mesh):
  return jaxdp.make_train_step(loss_fn, OPT, mesh)


@pytest.fixture(scope="module")
def eval_step(mesh):
  return jaxdp.make_eval_step(loss_fn, mesh)


def fresh(mesh):
  return jaxdp.init_state({"w": np.zeros(3, np.float32)}, OPT, mesh)


def assert_usable(step, state):
  """Nothing of ``state`` was donated: it still trains (on the batch's 12 rows); returns the state it trains to."""
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
  state, metrics = step(state, rows(12))
  assert float(metrics["weight"]) == 12.0
  return state


# --- Padding cannot be forgotten ---------------------------------------------------------------------


def test_a_padded_batch_without_its_weights_is_refused_and_with_them_trains_on_the_real_rows(mesh, step):
  """The issue's run: 10 rows on 4 devices, step(state, batch) trained on 12 (the 2 padding copies at weight 1)."""
  state = fresh(mesh)
  batch, weights = jaxdp.split_batch(rows(10), mesh)
  with pytest.raises(ValueError, match=r"weights is None, but batch was padded by jaxdp\.split_batch.*"
                                       r"step\(state, batch, weights\)"):
    step(state, batch)
  state = assert_usable(step, state)
  state, metrics = step(state, batch, weights)
  assert float(metrics["weight"]) == 10.0
  own = jax.device_put(rows(12), jax.sharding.NamedSharding(mesh, P("data")))  # the user's own, unpadded: all ones
  _, metrics = step(state, own)
  assert float(metrics["weight"]) == 12.0


def test_every_padding_entry_point_marks_its_batch_and_every_step_refuses_it(mesh, step, eval_step):
  state = fresh(mesh)
  collate = lambda examples: ({"x": np.stack([e[0] for e in examples]), "y": np.stack([e[1] for e in examples])},  # noqa: E731
                              np.ones(len(examples), np.float32))
  examples = [(x, y) for x, y in zip(rows(6)["x"], rows(6)["y"])]
  portions = [{"x": rows(6)["x"][: i % 3], "y": rows(6)["y"][: i % 3]} for i in range(N)]
  made = {
      "shard_uneven": jaxdp.shard_uneven(portions, mesh),
      "DataPipeline": jaxdp.DataPipeline(examples, collate, mesh, per_device_batch=2).batch_at(0),
      "StreamingPipeline": next(iter(jaxdp.StreamingPipeline(iter(examples), collate, mesh, per_device_batch=2)))[:2],
  }
  for name, (batch, weights) in made.items():
    for call in (lambda b: step(state, b), lambda b: eval_step(state, b), lambda b: eval_step.evaluate(state, [(b, None)])):
      with pytest.raises(ValueError, match="weights is None, but batch was padded"):
        call(batch)
    assert float(eval_step(state, batch, weights)["weight"]) == float(np.asarray(weights).sum()), name
  assert_usable(step, state)


# --- has_more: integer counts ----------------------------------------------------------------------------


def test_a_fractional_or_negative_has_more_is_refused_before_donation(mesh, step):
  """np.full(4, 0.5) was truncated to 0 silently: the streams would stop."""
  state = fresh(mesh)
  for bad, match in [(np.full((N,), 0.5, np.float32), r"has_more must hold integer counts.*dtype float32"),
                     (jnp.full((N,), 1.0), r"has_more must hold integer counts.*dtype float32"),
                     (np.array([1, -1, 0, 0], np.int32), r"has_more holds negative counts")]:
    with pytest.raises(ValueError, match=match):
      step(state, rows(12), has_more=bad)
  state = assert_usable(step, state)
  own = jax.shard_map(lambda s, b, h: jaxdp.train_step(loss_fn, OPT, s, b, has_more=h), mesh=mesh,
                      in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()))
  with pytest.raises(ValueError, match="has_more must hold integer counts"):
    own(state, rows(12), np.full((N,), 0.5, np.float32))
  _, metrics = step(state, rows(12), has_more=np.array([1, 1, 0, 1], np.int32))
  assert int(metrics["has_more"]) == 3


# --- Budgets round down --------------------------------------------------------------------------------


def test_largest_model_never_exceeds_the_budget_and_is_the_largest_that_fits():
  """M = 16e9, N = 24, stage 1, FP32_ADAM gave 16000000000.000002 bytes; a grid of 1,920 cases, each the largest Ψ
  whose memory_per_device fits (Ψ + 1 does not)."""
  psi = scaling.largest_model(16e9, 24, 1, scaling.FP32_ADAM)
  assert scaling.memory_per_device(psi, 24, 1, scaling.FP32_ADAM) <= 16e9 < scaling.memory_per_device(
      psi + 1, 24, 1, scaling.FP32_ADAM)
  grid = itertools.product([1e9, 7.5e9, 16e9, 24e9, 40e9, 80e9, 96e9, 141e9], [1, 2, 3, 5, 7, 8, 24, 96, 1000, 1024],
                           [0, 1, 2, 3], [scaling.FP32_ADAM, scaling.MIXED_ADAM], ["jaxdp", "paper", "layerwise"],
                           [0.0, 1e9 / 3])
  cases = 0
  for memory, n, stage, precision, schedule, reserved in grid:
    if schedule != "jaxdp" and stage != 3:
      continue
    kwargs = {"schedule": schedule, "layers": 80 if schedule == "layerwise" else None}
    psi = scaling.largest_model(memory, n, stage, precision, reserved_bytes=reserved, **kwargs)
    budget = memory - reserved
    assert scaling.memory_per_device(psi, n, stage, precision, **kwargs) <= budget, (memory, n, stage, schedule)
    assert scaling.memory_per_device(psi + 1, n, stage, precision, **kwargs) > budget, (memory, n, stage, schedule)
    cases += 1
  assert cases == 1920


# --- flax and optax mistakes, named with their fix -------------------------------------------------------


class Net(nnx.Module):
  def __init__(self, width, rngs):
    self.linear = nnx.Linear(3, width, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)  # RNG state: what the cast-to-float advice was about

  def __call__(self, x):
    return self.drop(self.linear(x))


def test_an_nnx_module_or_optimizer_where_params_or_an_optax_transformation_go_names_the_fix(mesh, tmp_path):
  model = Net(2, nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"params is an nnx Module \(Net\).*jaxdp\.adapters\.nnx\.split\(model\)"):
    jaxdp.init_state(model, OPT, mesh)
  with pytest.raises(TypeError, match=r"params is an nnx State holding RngCount, RngKey variables.*jaxdp\.adapters\.nnx\.split"):
    jaxdp.init_state(nnx.state(model), OPT, mesh)
  _, params, _ = jaxdp.adapters.nnx.split(model)
  wrapped = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  for call in (lambda: jaxdp.init_state(params, wrapped, mesh), lambda: jaxdp.make_train_step(loss_fn, wrapped, mesh)):
    with pytest.raises(TypeError, match=r"optimizer is a flax nnx\.Optimizer.*optax GradientTransformation"):
      call()
  with CheckpointManager(tmp_path) as ckpt:  # refused before looking for a checkpoint
    with pytest.raises(TypeError, match=r"params is an nnx Module"):
      ckpt.restore(params=model, optimizer=OPT, mesh=mesh)


def test_a_linen_variables_dict_where_params_go_names_params_and_model_state(mesh):
  import flax.linen as nn

  variables = nn.BatchNorm(use_running_average=False).init(jax.random.key(0), jnp.ones((2, 3)))
  with pytest.raises(ValueError, match=r"params is a flax linen variables dict \(collections 'batch_stats', 'params'\)"
                                       r".*init_state\(variables\['params'\], optimizer, mesh, "
                                       r"model_state=variables\['batch_stats'\]\)"):
    jaxdp.init_state(variables, OPT, mesh)
  jaxdp.init_state({"params": variables["params"]}, OPT, mesh)  # params alone (model.apply's argument) is fine


def test_nnx_update_refuses_a_state_of_another_model_naming_the_leaf(mesh):
  model, other = Net(2, nnx.Rngs(0)), Net(5, nnx.Rngs(1))
  kernel = np.asarray(model.linear.kernel[...])
  _, params, model_state = jaxdp.adapters.nnx.split(other)
  state = jaxdp.init_state(params, OPT, mesh, model_state=model_state)
  with pytest.raises(ValueError, match=r"state\.params\['linear'\]\['bias'\] has shape \(5,\).*the model's has \(2,\)"):
    jaxdp.adapters.nnx.update(model, state)
  np.testing.assert_array_equal(np.asarray(model.linear.kernel[...]), kernel)  # nothing was written
  with pytest.raises(TypeError, match="model must be an nnx.Module"):
    jaxdp.adapters.nnx.update(params, state)
  jaxdp.adapters.nnx.update(other, state)  # its own state: written


def test_example_ids_given_by_hand_must_be_integers_one_per_row():
  """use_example_ids and example_keys took float ids (truncated by fold_in) and ids of any shape."""
  key = jax.random.key(0)
  for bad in (np.array([0.5, 1.5]), np.array([[1, 2]])):
    with pytest.raises(ValueError, match=r"ids must be \[b\] integer ids, one per row"):
      with jaxdp.use_example_ids(bad):
        pass
    with pytest.raises(ValueError, match=r"ids must be \[b\] integer ids"):
      jaxdp.example_keys(key, bad)
  with jaxdp.use_example_ids(np.array([3, 1], np.int32)):
    assert jaxdp.example_keys(key).shape == (2,)


def test_host_example_ids_that_repeat_among_real_rows_are_refused_before_donation():
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  opt = optax.sgd(0.1)
  state = jaxdp.init_state({"w": jnp.zeros((3,))}, opt, mesh)

  def loss(params, batch, rng):
    del rng
    return (batch["x"] @ params["w"]) ** 2

  step = jaxdp.make_train_step(loss, opt, mesh, example_ids="id")
  batch = {"x": np.ones((4, 3), np.float32), "id": np.array([0, 1, 1, 3])}
  with pytest.raises(ValueError, match=r"example_ids='id': the ids \[1\] repeat among the real rows"):
    step(state, batch, None, jax.random.key(0))
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
  weights = np.array([1, 1, 0, 1], np.float32)  # the repeat is a padding row: allowed
  state, metrics = step(state, batch, weights, jax.random.key(0))
  assert float(metrics["weight"]) == 3.0
