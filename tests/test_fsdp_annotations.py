"""Models that carry their own FSDP annotations over the data axis train as they are.

nanodo- and MaxText-style models annotate kernels with ``nn.with_partitioning(init, (None, "data"))`` (linen)
or nnx ``sharding`` metadata. jaxdp takes an annotation's data axis as the model's FSDP placement, which its
``zero_stage=`` decides: ``init_state`` drops the data axes from the annotations (model axes kept), and inside
the step flax applies the boxes without the step's manual axes (``nn.DenseGeneral`` constrains its flattened
kernel there). Each model, unchanged, is compared with one device running the same model on the whole batch:
``jax.grad`` of ``Σ w·l / Σ w``, the same optax update, three steps.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxdp
from helpers import assert_close_to_scale
from jaxdp.sharding.layout import state_specs

pytestmark = pytest.mark.usefixtures("fast_compiles")

FEATURES, ROWS, STEPS = 4, 16, 3
OPT = optax.adam(1e-2)
RTOL = 1e-5  # float32 sums in another order: a few ulps, which Adam's 1/sqrt(v) amplifies in the small biases
INIT = nn.initializers.lecun_normal()


def batches(seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(STEPS):
    w = rng.uniform(0.25, 2.0, size=ROWS).astype(np.float32)
    w[[2, 7 + i]] = 0.0
    out.append(({"x": rng.normal(size=(ROWS, FEATURES)).astype(np.float32),
                 "y": rng.normal(size=(ROWS,)).astype(np.float32)}, w))
  return out


class Linen(nn.Module):
  """A kernel split over "data" on dim 1, a DenseGeneral's on dim 1 of (4, 2, 4), the head's on dim 0."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8, kernel_init=nn.with_partitioning(INIT, (None, "data")))(x)
    h = nn.DenseGeneral((2, 4), kernel_init=nn.with_partitioning(INIT, (None, "data", None)))(jnp.tanh(h))
    return nn.Dense(1, kernel_init=nn.with_partitioning(INIT, ("data", None)))(jnp.tanh(h.reshape(-1, 8)))[:, 0]


class Nnx(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(FEATURES, 8, kernel_init=nnx.with_partitioning(INIT, (None, "data")), rngs=rngs)
    self.b = nnx.Linear(8, 1, kernel_init=nnx.with_partitioning(INIT, ("data", None)), rngs=rngs)

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x)))[:, 0]


def one_device(loss, params):
  """The plain program: the whole batch on one device, no mesh."""
  params = jax.tree.map(np.asarray, params)
  opt_state = OPT.init(params)
  mean = jax.jit(jax.grad(lambda p, b, w: jnp.sum(w * loss(p, b)) / jnp.sum(w)))
  for batch, w in batches():
    updates, opt_state = OPT.update(mean(params, batch, w), opt_state, params)
    params = optax.apply_updates(params, updates)
  return params


def train(loss_fn, params, mesh, stage, model_state=None):
  step = jaxdp.make_train_step(loss_fn, OPT, jaxdp.data_parallel(mesh, zero_stage=stage))
  state = jaxdp.init_state(params, OPT, jaxdp.data_parallel(mesh, zero_stage=stage), model_state=model_state)
  for batch, w in batches():
    state, metrics = step(state, batch, w)
    assert int(metrics["skipped"]) == 0
  return state


@pytest.fixture(scope="module")
def linen_model():
  model = Linen()
  return model, model.init(jax.random.key(0), jnp.ones((2, FEATURES)))["params"]


@pytest.mark.parametrize("stage", [0, 3])
def test_a_linen_model_annotated_over_the_data_axis_trains_unchanged(linen_model, stage):
  model, boxed = linen_model
  assert isinstance(boxed["Dense_0"]["kernel"], nn.Partitioned)

  def loss_fn(params, batch):
    return (model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2

  state = train(loss_fn, boxed, jaxdp.data_mesh(jax.devices()[:4]), stage)
  expected = one_device(lambda p, b: (model.apply({"params": p}, b["x"]) - b["y"]) ** 2, nn.unbox(boxed))
  specs = state_specs(state).params
  # zero_stage decides the data split (the dimension rule), whatever the annotation said.
  assert specs["Dense_0"]["kernel"] == (P(None, "data") if stage == 3 else P())
  assert_close_to_scale(jaxdp.gather_state(state).params, expected, RTOL)


@pytest.mark.parametrize("stage", [0, 3])
def test_an_nnx_model_with_sharding_metadata_over_the_data_axis_trains_unchanged(stage):
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])  # Explicit, as JAX makes it
  with jax.set_mesh(mesh):  # flax shards annotated variables as it creates them
    model = Nnx(nnx.Rngs(0))
  definition, params, model_state = jaxdp.adapters.nnx.split(model)
  assert jax.typeof(params["a"]["kernel"][...]).sharding.spec == P(None, "data")
  loss_fn = jaxdp.adapters.nnx.loss_fn(definition, lambda m, batch: (m(batch["x"]) - batch["y"]) ** 2)
  state = train(loss_fn, params, mesh, stage, model_state)

  def plain(p, b):  # the model's arithmetic, written out: one device, no mesh, no flax
    h = jnp.tanh(b["x"] @ p["a"]["kernel"] + p["a"]["bias"][None, :])
    return (h @ p["b"]["kernel"] + p["b"]["bias"][None, :])[:, 0] - b["y"]

  expected = one_device(lambda p, b: plain(p, b) ** 2, jax.tree.map(np.asarray, params))
  assert state_specs(state).params["a"]["kernel"] == (P(None, "data") if stage == 3 else P())
  assert_close_to_scale(jaxdp.gather_state(state).params, expected, RTOL)


def test_a_real_conflict_names_the_argument_passed(linen_model):
  model, boxed = linen_model
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  unboxed = nn.unbox(boxed)
  specs = jax.tree.map(lambda _: P(), unboxed)
  specs["Dense_0"]["kernel"] = P(None, "data")
  with pytest.raises(ValueError, match=r"^param_specs\['Dense_0'\]\['kernel'\] = P\(None, 'data'\) shards over the data"):
    jaxdp.init_state(unboxed, OPT, jaxdp.data_parallel(mesh, param_specs=specs))
  # An annotation over an axis the mesh lacks is the model's, and the message says so (not param_specs).
  wrong = jax.tree.map(lambda x: x.replace(names=("model", None)) if isinstance(x, nn.Partitioned) and x.value.ndim == 2
                       else x, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  with pytest.raises(ValueError, match=r"annotation \(nn.with_partitioning\) of params\['Dense_0'\]\['kernel'\] = "
                                       r"P\('model',\) names axis 'model', which the mesh"):
    jaxdp.init_state(wrong, OPT, mesh)


def test_flax_is_changed_only_while_a_step_traces():
  before = nn.Partitioned.unbox
  with jaxdp.adapters.flax_support.annotations_in_step():
    assert nn.Partitioned.unbox is not before
  assert nn.Partitioned.unbox is before
