"""The step's options as values: reductions that compose (a user's own against a plain reference), the layout and
precision values, and the old keyword API translated at the edge with the same numbers bit for bit."""

import ast
import pathlib
import runpy
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp import reductions

ROOT = pathlib.Path(__file__).parents[1]
int8_allreduce = runpy.run_path(str(ROOT / "examples" / "int8_reduction.py"))["int8_allreduce"]


def loss_fn(params, batch):
  return 0.5 * (batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2


def _data(rows=32, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, 3)).astype(np.float32)
  weights = rng.integers(1, 4, size=(rows,)).astype(np.float32)
  weights[:rows // 4] = 0  # the first device holds padding only
  return {"x": x, "y": (x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)}, weights


def test_a_user_written_int8_reduction_matches_a_plain_reference():
  n, block, lr, steps = 4, 256, 0.1, 3
  mesh = jaxdp.data_mesh(jax.devices()[:n])
  batch, weights = _data()
  params = {"b": np.zeros((), np.float32), "w": np.zeros((3,), np.float32)}
  reduction = int8_allreduce(block)
  state = jaxdp.init_state(jax.tree.map(jnp.asarray, params), optax.sgd(lr), mesh, reduction=reduction)
  step = jaxdp.make_train_step(loss_fn, optax.sgd(lr), mesh, reduction=reduction)
  for _ in range(steps):
    state, metrics = step(state, batch, weights)

  # The reference: each replica's weighted gradient sums, quantised per block of 256 with the replicas' shared
  # scale (largest magnitude / (127 // N)), summed as integers, divided by the global weight.
  p = {k: v.astype(np.float64) for k, v in params.items()}
  errors = [{k: np.zeros(np.shape(v)) for k, v in params.items()} for _ in range(n)]
  rows = np.split(np.arange(len(weights)), n)
  for _ in range(steps):
    local = []
    for r in rows:
      x, y, w = batch["x"][r], batch["y"][r], weights[r]
      residual = w * (x @ p["w"] + p["b"] - y)
      local.append({"b": residual.sum(), "w": x.T @ residual})
    total = {}
    for k in p:
      xs = [np.reshape(local[i][k] + errors[i][k], -1) for i in range(n)]
      size = xs[0].size
      padded = [np.pad(v, (0, -size % block)).reshape(-1, block) for v in xs]
      scale = np.max([np.max(np.abs(b), axis=1, keepdims=True) for b in padded], axis=0) / (127 // n)
      qs = [np.round(b / np.where(scale > 0, scale, 1)) for b in padded]
      total[k] = (np.sum(qs, axis=0) * scale).reshape(-1)[:size].reshape(np.shape(p[k]))
      for i in range(n):
        errors[i][k] = (xs[i] - (qs[i] * scale).reshape(-1)[:size]).reshape(np.shape(p[k]))
    p = {k: p[k] - lr * total[k] / weights.sum() for k in p}
  np.testing.assert_allclose(np.asarray(state.params["w"]), p["w"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(state.params["b"]), p["b"], rtol=1e-5, atol=1e-6)
  held = np.asarray(state.compression["w"])  # one error feedback per replica, split over the data axis
  np.testing.assert_allclose(held, np.stack([e["w"] for e in errors]), rtol=1e-4, atol=1e-5)
  assert float(metrics["weight"]) == weights.sum()


def test_the_chain_refuses_pieces_that_do_not_compose():
  with pytest.raises(ValueError, match="two pieces"):
    reductions.chain(reductions.mean(), reductions.rank_mean())
  with pytest.raises(ValueError, match="two pieces"):
    reductions.chain(reductions.powersgd(2), int8_allreduce())
  with pytest.raises(ValueError, match="rank_mean"):
    reductions.chain(reductions.rank_mean(), reductions.powersgd(2))
  with pytest.raises(ValueError, match="bucketed"):
    reductions.chain(reductions.bucketed(1024), int8_allreduce())
  with pytest.raises(TypeError, match="jaxdp.reductions.Reduction"):
    reductions.chain("mean")
  resolved = reductions.resolve(reductions.chain(reductions.bucketed(0), reductions.sum()))
  assert (resolved.mode, resolved.bucket_bytes, resolved.compression, resolved.user) == ("sum", 0, None, None)


def test_the_layout_and_the_step_refuse_pairs_once():
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  with pytest.raises(ValueError, match="backend='pmap'"):
    jaxdp.data_parallel(mesh, zero_stage=1, backend="pmap")
  with pytest.raises(ValueError, match="zero_stage"):
    jaxdp.data_parallel(mesh, zero_stage=4)
  staged = jax.sharding.Mesh(np.asarray(jax.devices()[:2]).reshape(2, 1), ("stage", "data"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with pytest.raises(ValueError, match="a user reduction with a pipeline"):
    jaxdp.make_train_step(loss_fn, optax.sgd(0.1), jaxdp.data_parallel(staged, layers="w", pipeline=jaxdp.pipeline(1)),
                          reduction=reductions.onebit_adam(1e-3, warmup_steps=2).reduction)
  with pytest.raises(ValueError, match="keeps independent replicas"):
    jaxdp.make_train_step(loss_fn, optax.sgd(0.1), jaxdp.data_parallel(mesh, zero_stage=1),
                          reduction=reductions.none())
  with pytest.raises(ValueError, match="reduce_dtype"):
    jaxdp.precision(reduce_dtype=jnp.float16)
  with pytest.raises(TypeError, match="jaxdp.Precision"):
    jaxdp.make_train_step(loss_fn, optax.sgd(0.1), mesh, precision=jnp.bfloat16)


CASES = {
    "zero 2, buckets, adam": (dict(zero_stage=2, bucket_bytes=0), optax.adam(0.05),
                              lambda mesh: dict(layout=jaxdp.data_parallel(mesh, zero_stage=2),
                                                reduction=reductions.bucketed(0))),
    "rank_mean, bf16 compute": (dict(reduction="rank_mean", compute_dtype=jnp.bfloat16), optax.sgd(0.1),
                                lambda mesh: dict(layout=mesh, reduction=reductions.rank_mean(),
                                                  precision=jaxdp.precision(jnp.bfloat16))),
    "powersgd": (dict(compression="powersgd"), optax.sgd(0.1),
                 lambda mesh: dict(layout=mesh, reduction=reductions.powersgd(1, start_iter=1,
                                                                             min_compression_rate=0))),
}


@pytest.mark.parametrize("case", CASES)
def test_the_old_keywords_give_the_same_bits_with_a_warning(case):
  old, opt, new = CASES[case]
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  batch, weights = _data()
  params = {"b": jnp.zeros(()), "w": jnp.zeros((3, 4)) + 0.1}

  def model(params, batch):
    return 0.5 * (batch["x"] @ params["w"] @ jnp.ones(4) + params["b"] - batch["y"]) ** 2

  if old.get("compression") == "powersgd":
    old = dict(old, compression=jaxdp.reductions.compression.powersgd(1, start_iter=1, min_compression_rate=0))
  values = new(mesh)
  init_keywords = {k: v for k, v in old.items() if k in ("zero_stage", "compression")}
  with pytest.warns(DeprecationWarning, match="keyword API of jaxdp 0.1"):
    state = jaxdp.init_state(params, opt, mesh, **init_keywords) if init_keywords else jaxdp.init_state(
        params, opt, mesh)
    step = jaxdp.make_train_step(model, opt, mesh, **old)
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)  # the new API warns about nothing
    new_state = jaxdp.init_state(params, opt, values["layout"], reduction=values.get("reduction"))
    new_step = jaxdp.make_train_step(model, opt, **values)
  for _ in range(3):
    state, metrics = step(state, batch, weights)
    new_state, new_metrics = new_step(new_state, batch, weights)
  jax.tree.map(np.testing.assert_array_equal, jaxdp.gather_state(state), jaxdp.gather_state(new_state))
  assert float(metrics["loss"]) == float(new_metrics["loss"])


def _parameters(node: ast.FunctionDef) -> int:
  a = node.args
  names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs] + [x.arg for x in (a.vararg, a.kwarg) if x]
  return len(names) - (names[:1] in (["self"], ["cls"]))


def test_small_signatures_and_a_small_top_level():
  sizes = {}
  for path in (ROOT / "jaxdp").rglob("*.py"):
    if path.name.startswith("_"):
      continue
    for node in ast.parse(path.read_text()).body:
      items = node.body if isinstance(node, ast.ClassDef) and not node.name.startswith("_") else [node]
      for item in items:
        if isinstance(item, ast.FunctionDef) and not item.name.startswith("_") or (
            isinstance(item, ast.FunctionDef) and item.name == "__init__"):
          sizes[f"{path.stem}.{item.name}"] = _parameters(item)
  assert sizes["compiled.make_train_step"] <= 10
  # jaxdp.adapters.batchnorm.BatchNorm takes nnx.BatchNorm's own 18 arguments, so that it replaces it where it stands.
  too_many = {name: n for name, n in sizes.items() if n > 12 and name != "batchnorm.__init__"}
  assert not too_many, too_many
  assert len(jaxdp.__all__) <= 40


def test_eval_sums_takes_the_old_bucket_bytes_through_the_translation():
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  batch, weights = _data(8)
  state = jaxdp.init_state({"b": jnp.zeros(()), "w": jnp.ones((3,))}, optax.sgd(0.1), mesh)

  def sums(**keywords):
    run = jax.shard_map(lambda s, b, w: jaxdp.eval_sums(loss_fn, s, b, w, **keywords), mesh=mesh,
                        in_specs=(jax.P(), jax.P("data"), jax.P("data")), out_specs=jax.P())
    return jax.jit(run)(state, batch, weights)

  with pytest.warns(DeprecationWarning, match="bucket_bytes="):
    old = sums(axis_name="data", bucket_bytes=0)
  new = sums(layout="data")
  jax.tree.map(np.testing.assert_array_equal, old, new)
