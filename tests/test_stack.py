"""Stacks from existing models: jaxdp.adapters.linen/nnx.stack_blocks and unstack_blocks.

A small transformer-like model (an embedding, N identical residual blocks, a head), written as users write
it (a list of blocks in a linen ``setup``, an ``nnx.List`` in nnx), is trained with its blocks stacked under
layer-wise ZeRO-3 (``data_parallel(mesh, zero_stage=3, layers="blocks")``, ``jaxdp.scan_layers``) on 4 devices
with uneven rows (linen also in a 2-stage pipeline), and compared with one device running the original, unstacked model (its own ``__call__``)
on the same global batches: plain ``jax.grad`` of the weighted mean, SGD.

Tolerance: float32, the same arithmetic up to the order of sums (per-device partial sums and a reduce-scatter
against one sum), 3 SGD steps on parameters of size ~1: differences stay near 1e-7; ATOL = 1e-5, while a
wrong layer order, a layer trained twice or a dropped row moves the parameters by more than 1e-3.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdp
from helpers import grid_mesh, mesh_of
from jaxdp.adapters import linen as jlinen
from jaxdp.adapters import nnx as jnnx

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py: plumbing and float32 agreement

ATOL = 1e-5
V, D, N, STEPS, ROWS = 11, 8, 3, 3, 13  # 13 rows over 4 devices: 4, 3, 3, 3 (padded to 4 each)
OPT = optax.sgd(0.1)


def _data(step: int) -> tuple[dict, np.ndarray]:
  rng = np.random.default_rng(step)
  batch = {"tokens": rng.integers(0, V, size=(ROWS,)).astype(np.int32),
           "targets": rng.integers(0, V, size=(ROWS,)).astype(np.int32)}
  return batch, rng.uniform(0.5, 2.0, size=(ROWS,)).astype(np.float32)


def _reference(loss_of_params, params) -> dict:
  """One device, the original model: SGD on the global batch's weighted mean of the per-row losses."""
  @jax.jit
  def step(params, opt_state, batch, weights):
    mean = lambda p: jnp.sum(weights * loss_of_params(p, batch)) / jnp.sum(weights)  # noqa: E731
    updates, opt_state = OPT.update(jax.grad(mean)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = OPT.init(params)
  for k in range(STEPS):
    params, opt_state = step(params, opt_state, *_data(k))
  return params


def _train_stacked(loss_fn, params, mesh, dp=None, rows=None) -> dict:
  dp = jaxdp.data_parallel(mesh, zero_stage=3, layers="blocks") if dp is None else dp
  state, step = jaxdp.init_state(params, OPT, dp), jaxdp.make_train_step(loss_fn, OPT, dp)
  for k in range(STEPS):
    batch, weights = _data(k)
    state, _ = step(state, *jaxdp.split_batch(batch, mesh, weights=weights, rows=rows))
  return jaxdp.gather_state(state).params


def _assert_close(got, want) -> None:
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=ATOL, err_msg=jax.tree_util.keystr(path))


# --- linen -----------------------------------------------------------------------------------------------


class Block(nn.Module):
  @nn.compact
  def __call__(self, h):
    return h + nn.Dense(D)(jnp.tanh(nn.LayerNorm()(h)))


class Transformer(nn.Module):
  n: int = N

  def setup(self):
    self.embed = nn.Embed(V, D)
    self.blocks = [Block() for _ in range(self.n)]  # params blocks_0 .. blocks_{n-1}
    self.head = nn.Dense(V)

  def __call__(self, tokens):
    h = self.embed(tokens)
    for block in self.blocks:
      h = block(h)
    return self.head(h)


def _linen_losses(logits, batch):
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])


@pytest.mark.parametrize("layout", ["layer-wise ZeRO-3", "pipeline"])
def test_linen_stacked_trains_like_the_original_model_on_one_device(layout):
  """Layer-wise ZeRO-3 on 4 devices; or a pipeline of 2 stages x 2 data shards (4 blocks, 2 microbatches)."""
  model = Transformer(n=N if layout == "layer-wise ZeRO-3" else 4)
  params = model.init(jax.random.key(0), jnp.zeros((1,), jnp.int32))["params"]

  def stacked_loss(params, batch):
    h = model.apply({"params": params}, batch["tokens"], method=lambda m, t: m.embed(t))
    h, _ = jaxdp.scan_layers(lambda h, layer, _: (Block().apply({"params": layer}, h), None), h, params["blocks"])
    return _linen_losses(model.apply({"params": params}, h, method=lambda m, h: m.head(h)), batch)

  if layout == "pipeline":
    mesh = grid_mesh((2, 2), ("stage", "data"))
    dp, rows = jaxdp.data_parallel(mesh, layers="blocks", pipeline=jaxdp.pipeline(2, "gpipe")), 8
  else:
    mesh, dp, rows = mesh_of(4), None, None
  got = jlinen.unstack_blocks(_train_stacked(stacked_loss, jlinen.stack_blocks(params), mesh, dp, rows))
  want = _reference(lambda p, b: _linen_losses(model.apply({"params": p}, b["tokens"]), b), dict(params))
  assert set(got) == set(want)
  _assert_close({k: got[k] for k in want}, want)
  moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(dict(params))))
  assert moved > 1e-2


def test_linen_round_trip_and_refusals():
  params = Transformer().init(jax.random.key(1), jnp.zeros((1,), jnp.int32))["params"]
  stacked = jlinen.stack_blocks(params)
  assert set(stacked) == {"embed", "head", "blocks"}
  assert stacked["blocks"]["Dense_0"]["kernel"].shape == (N, D, D)
  np.testing.assert_array_equal(stacked["blocks"]["Dense_0"]["kernel"][1], params["blocks_1"]["Dense_0"]["kernel"])
  back = jlinen.unstack_blocks(stacked)
  assert jax.tree.structure(back) == jax.tree.structure(dict(params))
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(dict(params))):
    np.testing.assert_array_equal(a, b)
  # Partitioning boxes keep their names; the layer axis is unsplit.
  boxed = {f"blocks_{i}": {"w": nn.Partitioned(jnp.full((2, 3), i, jnp.float32), names=(None, "model"))}
           for i in range(2)}
  stacked_boxed = jlinen.stack_blocks(boxed)["blocks"]["w"]
  assert stacked_boxed.names == (None, None, "model") and stacked_boxed.value.shape == (2, 2, 3)
  assert jlinen.unstack_blocks(jlinen.stack_blocks(boxed))["blocks_1"]["w"].names == (None, "model")
  with pytest.raises(ValueError, match="no layers_0"):
    jlinen.stack_blocks(params, prefix="layers")
  with pytest.raises(ValueError, match="blocks_3 but no blocks_1"):
    jlinen.stack_blocks({"blocks_0": {"w": jnp.zeros(2)}, "blocks_2": {"w": jnp.zeros(2)},
                         "blocks_3": {"w": jnp.zeros(2)}})
  with pytest.raises(ValueError, match=r"params\['blocks_1'\] is not identical.*\['w'\] is float32\[3\]"):
    jlinen.stack_blocks({"blocks_0": {"w": jnp.zeros(2)}, "blocks_1": {"w": jnp.zeros(3)}})
  with pytest.raises(ValueError, match="already has an entry 'blocks'"):
    jlinen.stack_blocks({**params, "blocks": {}})
  with pytest.raises(ValueError, match="no stack 'layers'"):
    jlinen.unstack_blocks(stacked, prefix="layers")


# --- nnx -------------------------------------------------------------------------------------------------


class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    self.linear = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, h):
    return h + self.linear(jnp.tanh(self.norm(h)))


class NnxTransformer(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.blocks = nnx.List([NnxBlock(rngs) for _ in range(N)])
    self.head = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, tokens):
    h = self.embed(tokens)
    for block in self.blocks:
      h = block(h)
    return self.head(h)


def _nnx_stacked_losses(model, batch):
  graphdef, layers = nnx.split(model.blocks)
  h, _ = jaxdp.scan_layers(lambda h, layer, _: (nnx.merge(graphdef, layer)(h), None), model.embed(batch["tokens"]),
                           layers)
  return _linen_losses(model.head(h), batch)


def test_nnx_stacked_layerwise_zero3_trains_like_the_original_model_on_one_device():
  original = NnxTransformer(nnx.Rngs(0))
  graphdef, params = nnx.split(original, nnx.Param)
  want = _reference(lambda p, b: _linen_losses(nnx.merge(graphdef, p)(b["tokens"]), b), params)

  model = NnxTransformer(nnx.Rngs(0))
  model.blocks = jnnx.stack_blocks(model.blocks)  # the same values, one stacked block
  definition, stacked, _ = jnnx.split(model)
  trained = _train_stacked(jnnx.loss_fn(definition, _nnx_stacked_losses), stacked, mesh_of(4))
  state = jaxdp.init_state(stacked, OPT, mesh_of(1))._replace(params=trained)
  jnnx.update(model, state)
  model.blocks = nnx.List(jnnx.unstack_blocks(model.blocks))  # back to the original model
  got = nnx.state(model, nnx.Param)
  _assert_close(got, want)


def test_nnx_round_trip_keeps_values_and_partitioning():
  class Sharded(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(D, D, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model")),
                               rngs=rngs)

  with nnx.use_eager_sharding(False):  # metadata only: no mesh here
    blocks = [Sharded(nnx.Rngs(i)) for i in range(N)]
    stacked = jnnx.stack_blocks(blocks)
    back = jnnx.unstack_blocks(stacked)
  assert stacked.linear.kernel.shape == (N, D, D)
  assert stacked.linear.kernel.get_metadata()["out_sharding"] == (None, None, "model")
  assert len(back) == N
  for a, b in zip(back, blocks):
    assert nnx.graphdef(a) == nnx.graphdef(b)
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
      np.testing.assert_array_equal(x, y)
    assert a.linear.kernel.get_metadata()["out_sharding"] == (None, "model")
  with pytest.raises(ValueError, match="non-empty list"):
    jnnx.stack_blocks([])
  with pytest.raises(ValueError, match=r"blocks\[1\] is not"):
    jnnx.stack_blocks([NnxBlock(nnx.Rngs(0)), nnx.Linear(D, D, rngs=nnx.Rngs(0))])
  with pytest.raises(TypeError, match="not an nnx.Module"):
    jnnx.stack_blocks([NnxBlock(nnx.Rngs(0)), 3])
