"""Padding that cannot poison the gradient, and any global batch on any number of devices.

The model is a tiny length-masked attention classifier: a row of length 0
gives a softmax over no position, NaN. A weight-0 row keeps that NaN out of
the loss sums but not out of the gradient (0 * NaN in the backward pass), so
padding rows must be copies of real rows (the default ``pad="copy"``); with
``pad="zeros"`` the same model gets a non-finite gradient, which shows that
the model exercises the case.

Every training comparison is against a plain single-device step written here
(``jax.grad`` of the weighted mean over the real rows, then the optax
update). Tolerance: the same float32 rows summed in another order (per
device and micro-batch, then across devices) differ by a few ulps; SGD with
momentum is linear in the gradient, so after a few steps the parameters stay
within 1e-6 of the reference, relative to each leaf's largest entry.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import jaxdp
from helpers import mesh_of as _mesh
from jaxdp.io.data import DataPipeline, StreamingPipeline, device_indices, process_positions

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py: plumbing and float32 agreement

VOCAB, T, D, C = 7, 4, 4, 3  # tokens, positions, embedding width, classes
ROWS = 4  # rows per device in the portion tests: a multiple of every accum_steps used
OPT = optax.sgd(0.1, momentum=0.9)
REL = 1e-6


def forward(params, tokens, lengths):
  embedded = params["embed"][tokens]  # [B, T, D]
  scores = embedded @ params["query"]  # [B, T]
  mask = jnp.arange(T)[None, :] < lengths[:, None]
  attention = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)  # NaN on a row of length 0
  pooled = jnp.einsum("bt,btd->bd", attention, embedded)
  return pooled @ params["w"] + params["b"][None, :]


def loss_fn(params, batch):
  logits = forward(params, batch["tokens"], batch["lengths"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])


def init_params():
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  return {
      "embed": np.asarray(jax.random.normal(k1, (VOCAB, D))),
      "query": np.asarray(jax.random.normal(k2, (D,))),
      "w": np.asarray(jax.random.normal(k3, (D, C)) * 0.5),
      "b": np.zeros((C,), np.float32),
  }


def examples(n: int, seed: int) -> tuple[dict, np.ndarray]:
  """``n`` real rows (lengths 1..T) and their non-uniform weights."""
  rng = np.random.default_rng(seed)
  batch = {
      "tokens": rng.integers(0, VOCAB, (n, T)).astype(np.int32),
      "lengths": rng.integers(1, T + 1, (n,)).astype(np.int32),
      "labels": rng.integers(0, C, (n,)).astype(np.int32),
  }
  return batch, (1.0 + np.arange(n) % 3).astype(np.float32)


@jax.jit
def reference_step(params, opt_state, batch, weights):
  """The plain single-device step on the global batch's real rows."""

  def mean_loss(p):
    return jnp.sum(weights * loss_fn(p, batch)) / jnp.sum(weights)

  grads = jax.grad(mean_loss)(params)
  updates, opt_state = OPT.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def reference(batches):
  params = jax.device_put(init_params(), jax.devices()[0])
  opt_state = OPT.init(params)
  for batch, weights in batches:
    params, opt_state = reference_step(params, opt_state, batch, weights)
  return params


def assert_params_close(got, want):
  for path, g, w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    assert np.all(np.isfinite(g)), path
    error = np.max(np.abs(g - w)) / np.max(np.abs(w))
    assert error <= REL, (jax.tree_util.keystr(path[0]), error)


def split(batch, weights, sizes):
  cuts = np.cumsum(sizes)[:-1]
  return [jax.tree.map(lambda x: x[a:b], batch) for a, b in zip([0, *cuts], [*cuts, len(weights)])], np.split(
      weights, cuts)


# Uneven portions per device count, an empty device among them where there are three or more.
SIZES = {2: [3, 1], 3: [2, 0, 3], 4: [1, 3, 0, 2]}


@functools.cache
def _step(n: int, accum_steps: int, max_consecutive_skips: int | None = 10):
  return jaxdp.make_train_step(loss_fn, OPT, _mesh(n), accum_steps=accum_steps,
                               max_consecutive_skips=max_consecutive_skips)


# --- Part A: padding ----------------------------------------------------------------------------


@pytest.mark.parametrize("n, accum_steps", [(2, 1), (3, 2), (4, 2)])
def test_copy_padding_trains_a_length_masked_model_as_one_device(n, accum_steps):
  mesh, step = _mesh(n), _step(n, accum_steps)
  state = jaxdp.init_state(init_params(), OPT, mesh)
  globals_ = [examples(sum(SIZES[n]), seed) for seed in range(3)]
  for batch, weights in globals_:
    portions, portion_weights = split(batch, weights, SIZES[n])
    placed = jaxdp.shard_uneven(portions, mesh, weights=portion_weights, rows=ROWS)
    state, metrics = step(state, *placed)
    assert int(metrics["skipped"]) == 0 and int(metrics["nonfinite"]) == 0
  assert int(state.step) == 3
  assert_params_close(state.params, reference(globals_))


def test_zero_padding_gives_this_model_a_nonfinite_gradient():
  """The model does exercise the NaN case: zero rows (length 0) at weight 0 poison the step."""
  n, mesh, step = 3, _mesh(3), _step(3, 2)
  state = jaxdp.init_state(init_params(), OPT, mesh)
  batch, weights = examples(sum(SIZES[n]), 0)
  portions, portion_weights = split(batch, weights, SIZES[n])
  zeros = jaxdp.shard_uneven(portions, mesh, weights=portion_weights, rows=ROWS, pad="zeros")
  assert not np.any(np.asarray(zeros[0]["lengths"])[np.asarray(zeros[1]) == 0])
  new, metrics = step(state, *zeros)
  assert int(metrics["nonfinite"]) > 0 and int(metrics["skipped"]) == 1 and int(new.step) == 0
  # The loss sums still ignore the NaN rows: evaluation on the same batch is exact either way.
  evaluate = jaxdp.make_eval_step(loss_fn, mesh)
  copies = jaxdp.shard_uneven(portions, mesh, weights=portion_weights, rows=ROWS)
  want = float(jnp.sum(weights * loss_fn(init_params(), batch)) / jnp.sum(weights))
  for placed in (zeros, copies):
    assert float(evaluate(new, *placed)["loss"]) == pytest.approx(want, rel=1e-6)


def _poisoned_batch(pad: str | None):
  """N = 3, ROWS rows each: zero padding rows (pad='zeros'), or, with pad=None, no padding but one real row of
  length 0 at weight 1 (another cause of NaN, with no padding in the batch)."""
  mesh = _mesh(3)
  if pad is None:
    batch, weights = examples(3 * ROWS, 1)
    batch["lengths"][5] = 0
    return jaxdp.split_batch(batch, mesh, weights=weights)
  batch, weights = examples(sum(SIZES[3]), 1)
  portions, portion_weights = split(batch, weights, SIZES[3])
  return jaxdp.shard_uneven(portions, mesh, weights=portion_weights, rows=ROWS, pad=pad)


@pytest.mark.parametrize("pad", ["zeros", None])
def test_the_skip_guard_names_padding_only_when_the_batch_has_padding_rows(pad):
  step = jaxdp.make_train_step(loss_fn, OPT, _mesh(3), accum_steps=2, max_consecutive_skips=2)
  state = jaxdp.init_state(init_params(), OPT, _mesh(3))
  placed = _poisoned_batch(pad)
  with pytest.raises(FloatingPointError, match="the last 2 steps") as error:
    for _ in range(5):
      state, _ = step(state, *placed)
  message = str(error.value)
  if pad == "zeros":
    assert "padding rows (weight 0)" in message and "pad='copy'" in message and "pad='zeros'" in message
  else:
    assert "padding" not in message
  assert "Lower the learning rate" in message


def test_padding_rows_copy_real_rows_everywhere():
  mesh = _mesh(3)
  batch, weights = examples(5, 2)
  portions, portion_weights = split(batch, weights, [2, 0, 3])
  placed, placed_w = jax.tree.map(np.asarray, jaxdp.shard_uneven(portions, mesh, weights=portion_weights, rows=4))
  np.testing.assert_array_equal(placed_w, [1, 2, 0, 0, 0, 0, 0, 0, 3, 1, 2, 0])
  # Device 0 copies its first row, device 1 (no rows) device 0's, device 2 its own first.
  for leaf, whole in zip(jax.tree.leaves(placed), jax.tree.leaves(batch)):
    np.testing.assert_array_equal(leaf, whole[[0, 1, 0, 0, 0, 0, 0, 0, 2, 3, 4, 2]])
  # A row of weight 0 given by the caller is not copied when the portion has one of positive weight.
  placed, _ = jaxdp.shard_uneven([{"x": np.array([5.0, 6.0])}], _mesh(1), weights=[np.array([0.0, 1.0])], rows=3)
  np.testing.assert_array_equal(np.asarray(placed["x"]), [5, 6, 6])
  # No rows at all: nothing to copy, so zeros (weight 0: the step skips such a batch).
  empty, empty_w = jaxdp.shard_uneven([{"x": np.zeros((0, 2), np.float32)}] * 3, mesh)
  assert not np.any(np.asarray(empty["x"])) and not np.any(np.asarray(empty_w))

  # The pipelines: a device with no example copies example 0 (DataPipeline), or a row of this process
  # (StreamingPipeline); padding after real rows copies the device's own first row.
  def collate(ids):
    return {"id": np.asarray(ids, np.int32)}, np.ones(len(ids), np.float32)

  pipe = DataPipeline(list(range(1, 6)), collate, _mesh(4), per_device_batch=3)
  assert [len(p) for p in pipe.device_indices(0)] == [2, 1, 1, 1]
  ids = np.asarray(pipe.batch_at(0)[0]["id"]).reshape(4, 3)
  for d, k in enumerate([2, 1, 1, 1]):
    assert ids[d, k:].tolist() == [ids[d, 0]] * (3 - k)
  pipe = DataPipeline(list(range(1, 4)), collate, _mesh(4), per_device_batch=1)
  first = [int(p[0]) + 1 for p in pipe.device_indices(0)[:3]]  # dataset[i] is i + 1
  assert np.asarray(pipe.batch_at(0)[0]["id"]).tolist() == [*first, 1]  # the empty device: dataset[0]
  stream = StreamingPipeline(iter(range(1, 4)), collate, _mesh(4), per_device_batch=2)
  ids = np.asarray(next(stream)[0]["id"]).tolist()
  assert ids == [1, 1, 2, 2, 3, 3, 1, 1]  # 3 examples over 4 devices: the empty one copies device 0's


def test_pad_is_validated_everywhere():
  mesh = _mesh(2)
  collate = lambda ids: ({"id": np.asarray(ids, np.int32)}, np.ones(len(ids), np.float32))  # noqa: E731
  calls = [
      lambda pad: jaxdp.shard_uneven([{"x": np.ones(2)}, {"x": np.ones(1)}], mesh, pad=pad),
      lambda pad: jaxdp.split_batch({"x": np.ones(3)}, mesh, pad=pad),
      lambda pad: DataPipeline([1, 2, 3], collate, mesh, per_device_batch=2, pad=pad),
      lambda pad: StreamingPipeline([1, 2, 3], collate, mesh, per_device_batch=2, pad=pad),
  ]
  for call in calls:
    for bad in ("zero", None, 0):
      with pytest.raises(ValueError, match=r"pad must be one of \('copy', 'zeros'\)"):
        call(bad)


# --- Part B: any global batch on any N -----------------------------------------------------------


def test_split_batch_step_equals_one_device_on_the_whole_batch():
  """10 rows over 3 devices (4, 3, 3), and an accumulating step (rows=4 for 2 micro-batches)."""
  mesh, step = _mesh(3), _step(3, 2)
  state = jaxdp.init_state(init_params(), OPT, mesh)
  globals_ = [examples(10, seed) for seed in (10, 11)]
  for batch, weights in globals_:
    placed, placed_w = jaxdp.split_batch(batch, mesh, weights=weights)
    assert placed_w.shape == (12,) and placed_w.sharding == jax.sharding.NamedSharding(mesh, jax.P("data"))
    np.testing.assert_array_equal(np.asarray(placed_w), [*weights[:4], *weights[4:7], 0, *weights[7:], 0])
    state, metrics = step(state, placed, placed_w)
    assert float(metrics["weight"]) == pytest.approx(float(weights.sum()))
  assert_params_close(state.params, reference(globals_))


def test_split_batch_refuses_what_is_not_one_global_batch():
  mesh = _mesh(3)
  with pytest.raises(ValueError, match="leading"):
    jaxdp.split_batch({"x": np.ones(4), "y": np.ones(5)}, mesh)
  with pytest.raises(ValueError, match=r"weights has shape \(3,\) but batch has 4 rows"):
    jaxdp.split_batch({"x": np.ones(4)}, mesh, weights=np.ones(3))
  with pytest.raises(ValueError, match="negative"):
    jaxdp.split_batch({"x": np.ones(4)}, mesh, weights=-np.ones(4))
  with pytest.raises(ValueError, match="rows must be an integer >= 2"):
    jaxdp.split_batch({"x": np.ones(4)}, mesh, rows=1)
  with pytest.raises(TypeError, match="jaxdp.split_batch"):  # shard_uneven given one global batch points here
    jaxdp.shard_uneven({"x": np.ones(4)}, mesh)


def test_pipeline_with_a_global_batch_that_the_devices_do_not_divide_matches_one_device():
  """128 examples a step on 3 devices (43, 43, 42); 150 examples: the epoch's last step has 22 (8, 7, 7)."""
  n_examples, mesh = 150, _mesh(3)
  pool, pool_w = examples(n_examples, 3)
  dataset = [({k: v[i] for k, v in pool.items()}, pool_w[i]) for i in range(n_examples)]

  def collate(items):
    return {k: np.stack([b[k] for b, _ in items]) for k in pool}, np.stack([w for _, w in items])

  pipe = DataPipeline(dataset, collate, mesh, global_batch_size=128, seed=1)
  assert (pipe.global_batch, pipe.per_device_batch, pipe.steps_per_epoch) == (128, 43, 2)
  assert [len(p) for p in pipe.device_indices(0)] == [43, 43, 42]
  assert [len(p) for p in pipe.device_indices(1)] == [8, 7, 7]
  step = jaxdp.make_train_step(loss_fn, OPT, mesh)
  state = jaxdp.init_state(init_params(), OPT, mesh)
  globals_ = []
  for s, (batch, weights) in pipe.iterate(num_steps=pipe.steps_per_epoch):
    assert weights.shape == (129,)
    state, metrics = step(state, batch, weights)
    idx = np.concatenate(pipe.device_indices(s))
    globals_.append(({k: v[idx] for k, v in pool.items()}, pool_w[idx]))
    assert float(metrics["weight"]) == pytest.approx(float(pool_w[idx].sum()), rel=1e-6)
  assert_params_close(state.params, reference(globals_))


@settings(max_examples=60)
@given(n_examples=st.integers(1, 60), n_devices=st.integers(1, 8), global_batch=st.integers(1, 20),
       seed=st.integers(0, 100), epoch=st.integers(0, 2))
def test_the_global_batch_plan_uses_every_example_once_and_splits_as_evenly_as_possible(
    n_examples, n_devices, global_batch, seed, epoch):
  steps = -(-n_examples // global_batch)
  plans = [device_indices(n_examples, n_devices, None, seed, epoch * steps + i, global_batch_size=global_batch)
           for i in range(steps)]
  visited = np.concatenate([np.concatenate(p) for p in plans])
  np.testing.assert_array_equal(visited, jaxdp.epoch_permutation(n_examples, seed, epoch))
  for i, plan in enumerate(plans):
    sizes = [len(p) for p in plan]
    assert sum(sizes) == (global_batch if i < steps - 1 else n_examples - (steps - 1) * global_batch)
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert max(sizes) <= -(-global_batch // n_devices)
    # The same global batch on one device, and per_device_batch where n_devices divides it.
    one = device_indices(n_examples, 1, None, seed, epoch * steps + i, global_batch_size=global_batch)
    np.testing.assert_array_equal(np.concatenate(plan), one[0])
    if global_batch % n_devices == 0:
      for a, b in zip(plan, device_indices(n_examples, n_devices, global_batch // n_devices, seed, epoch * steps + i)):
        np.testing.assert_array_equal(a, b)


def test_global_batch_positions_resume_across_device_counts_and_processes():
  collate = lambda ids: ({"id": np.asarray(ids, np.int32)}, np.ones(len(ids), np.float32))  # noqa: E731
  data = list(range(50))
  three = DataPipeline(data, collate, _mesh(3), global_batch_size=10, seed=4)
  four = DataPipeline(data, collate, _mesh(4), global_batch_size=10, seed=4)
  even = DataPipeline(data, collate, _mesh(2), per_device_batch=5, seed=4)
  for s in range(12):
    position = three.position(s)
    assert position["global_batch"] == 10 and position["devices"] == 3
    assert four.step_at(position) == even.step_at(position) == s
    np.testing.assert_array_equal(np.concatenate(three.device_indices(s)), np.concatenate(four.device_indices(s)))
  with pytest.raises(ValueError, match="inside a batch"):
    DataPipeline(data, collate, _mesh(3), global_batch_size=7, seed=4).step_at(three.position(1))
  # Simulated processes (2 x 2 devices) load their own portions; together they are the global batch.
  for s in range(four.steps_per_epoch):
    merged = {}
    for process in range(2):
      merged.update(four.load(s, process_positions(4, 2, process)))
    stitched = jax.tree.map(lambda *xs: np.concatenate(xs), *(merged[q] for q in range(4)))
    whole = jax.tree.map(np.asarray, four.batch_at(s))
    for a, b in zip(jax.tree.leaves(stitched), jax.tree.leaves(whole)):
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "exactly one of per_device_batch"),
        ({"per_device_batch": 2, "global_batch_size": 6}, "exactly one of per_device_batch"),
        ({"global_batch_size": 0}, "global_batch_size must be an integer >= 1"),
        ({"global_batch_size": 2.5}, "global_batch_size must be an integer"),
    ],
)
def test_batch_size_arguments_are_validated(kwargs, match):
  collate = lambda ids: ({"id": np.asarray(ids, np.int32)}, np.ones(len(ids), np.float32))  # noqa: E731
  with pytest.raises(ValueError, match=match):
    DataPipeline([1, 2, 3], collate, _mesh(2), **kwargs)
  with pytest.raises(ValueError, match=match):
    device_indices(3, 2, kwargs.get("per_device_batch"), 0, 0, global_batch_size=kwargs.get("global_batch_size"))
