"""Mixed precision, the gradient's reduction dtype, and bucketed reductions.

Buckets change only how the one gradient is cut into all-reduce ops, not any
sum: results are bitwise those of the single reduction (on CPU, where each
element is summed in the same order), and the compiled HLO has one
all-reduce per bucket with the same total bytes. A bfloat16 reduction moves
half the gradient bytes. bfloat16 compute keeps float32 master params.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import jaxdp

# Plumbing and float32 agreement, not speed: most XLA passes skipped while this module runs (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compiles")

K = 4
MESH = jaxdp.data_mesh(jax.devices()[:K])
OPT = optax.adam(1e-2)
SIZES = (5, 16, 16, 3)  # an MLP with 6 leaves: w of 80, 256, 48 floats and b of 16, 16, 3


def init_params():
  rng = np.random.default_rng(0)
  params = {}
  for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
    params[f"layer{i}"] = {"w": rng.normal(size=(a, b)).astype(np.float32) / np.sqrt(a), "b": np.zeros(b, np.float32)}
  return params


def loss_fn(params, batch):
  x = batch["x"]
  for i in range(len(SIZES) - 1):
    x = x @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"][None, :]
    x = jnp.tanh(x) if i < len(SIZES) - 2 else x
  return 0.5 * jnp.sum((x - batch["y"]) ** 2, axis=-1)


def data(seed=0, counts=(3, 0, 5, 2)):
  rng = np.random.default_rng(seed)
  portions = [{"x": rng.normal(size=(n, SIZES[0])).astype(np.float32),
               "y": rng.normal(size=(n, SIZES[-1])).astype(np.float32)} for n in counts]
  return jaxdp.shard_uneven(portions, MESH)


def run(steps=3, **options):
  step = jaxdp.make_train_step(loss_fn, OPT, MESH, **options)
  state, metrics = jaxdp.init_state(init_params(), OPT, MESH), None
  for s in range(steps):
    state, metrics = step(state, *data(s))
  return step, state, metrics


@functools.lru_cache(maxsize=None)
def reference_run():
  """``run()`` with the default options (one all-reduce, float32), computed once and shared by the tests.

  Its state is only read (gathered) by the tests, never stepped again, so sharing it donates nothing.
  """
  return run()


def all_reduces(step):
  """The compiled step's all-reduce ops (count and bytes)."""
  lowered = step.lower(jaxdp.init_state(init_params(), OPT, MESH), *data())
  return jaxdp.collectives_from_hlo(lowered.compile().as_text(), K)["all-reduce"]


@functools.lru_cache(maxsize=None)
def single_all_reduces():
  """The all-reduce ops of the default step (the single reduction)."""
  return all_reduces(reference_run()[0])


NORM = 1  # the scalar all-reduce of the gradient norm's partial sums (each device sums its 1/K of the gradient)


@pytest.mark.parametrize("bucket_bytes,ops", [(None, 1 + NORM), (0, 6 + 1 + NORM), (300, 5 + 1 + NORM),
                                              (10**9, 1 + 1 + NORM)])
def test_buckets_are_bitwise_the_single_reduction(bucket_bytes, ops):
  """One all-reduce per bucket, plus one for the loss, weight and metrics; bitwise the single reduction.

  Plus, in every step, the 4-byte all-reduce of the gradient norm. 0: one bucket per leaf; 300 bytes: the
  leaves in flattening order (b before w) have 64, 320, 64, 1024, 12 and 192 bytes, so reversed they make
  [192 + 12], [1024], [64], [320], [64]; 1 GB: one bucket.
  """
  _, reference, reference_metrics = reference_run()
  step, state, metrics = run(bucket_bytes=bucket_bytes)
  bits = lambda tree: jax.tree.map(lambda x: np.atleast_1d(np.asarray(x)).view(np.uint8), tree)  # noqa: E731  (zeros signs too)
  jax.tree.map(np.testing.assert_array_equal, bits(jaxdp.gather_state(state)), bits(jaxdp.gather_state(reference)))
  jax.tree.map(np.testing.assert_array_equal, bits(metrics), bits(reference_metrics))
  single = single_all_reduces()
  bucketed = all_reduces(step)
  assert bucketed.count == ops
  assert bucketed.bytes == single.bytes  # the same gradient and scalars, cut differently


@pytest.mark.parametrize("zero_stage,bucket_bytes", [(0, 300), (1, 300), (2, 300), (3, 0)])
def test_a_skipped_step_reports_the_same_loss_and_weight_with_buckets(zero_stage, bucket_bytes):
  """A padding row holding NaN (weight 0) makes the gradient NaN and the step skip, while the loss and weight
  stay finite. With stage 0-1 buckets they read NaN: the tie ordering the buckets multiplied 0 by a NaN."""
  rng = np.random.default_rng(0)
  portions = [{"x": rng.normal(size=(n, SIZES[0])).astype(np.float32),
               "y": rng.normal(size=(n, SIZES[-1])).astype(np.float32)} for n in (3, 1, 5, 2)]
  portions[1]["x"][0] = np.nan  # device 1's only row: weight 0
  batch, weights = jaxdp.shard_uneven(portions, MESH, weights=[np.ones(3), np.zeros(1), np.ones(5), np.ones(2)])
  metrics = {}
  for options in ({}, {"zero_stage": zero_stage, "bucket_bytes": bucket_bytes}):
    state = jaxdp.init_state(init_params(), OPT, MESH, zero_stage=options.get("zero_stage", 0))
    _, metrics[bool(options)] = jaxdp.make_train_step(loss_fn, OPT, MESH, **options)(state, batch, weights)
  assert int(metrics[True]["skipped"]) == int(metrics[False]["skipped"]) == 1
  assert np.isfinite(float(metrics[False]["loss"]))
  for name in ("loss", "weight"):
    assert np.asarray(metrics[True][name]).tobytes() == np.asarray(metrics[False][name]).tobytes(), name


@pytest.mark.parametrize("zero_stage,bucket_bytes", [(0, 0), (1, 100), (3, 100)])
def test_empty_leaves_take_no_bucket(zero_stage, bucket_bytes):
  """A zero-size parameter ran without buckets but failed with them (IndexError, ZeroDivisionError)."""
  params = {**init_params(), "empty": np.zeros((0,), np.float32), "empty_rows": np.zeros((8, 0), np.float32)}
  loss = lambda p, b: loss_fn(p, b) + jnp.sum(p["empty"]) + jnp.sum(p["empty_rows"])  # noqa: E731
  results = []
  for options in ({}, {"zero_stage": zero_stage, "bucket_bytes": bucket_bytes}):
    state = jaxdp.init_state(params, OPT, MESH, zero_stage=options.get("zero_stage", 0))
    state, _ = jaxdp.make_train_step(loss, OPT, MESH, **options)(state, *data())
    results.append(jaxdp.gather_state(state).params)
  if zero_stage < 2:  # the same sums, bit for bit
    jax.tree.map(np.testing.assert_array_equal, results[1], results[0])
  else:  # a flat reduce-scatter may differ from the per-leaf all-reduce in the last bits (see reduce_gradient)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), results[1], results[0])
  assert results[1]["empty_rows"].shape == (8, 0)


def test_the_tie_between_buckets_changes_no_bit_of_a_complex_zero():
  """The -0.0 that orders the buckets' all-reduces was cast to complex as (-0.0 + 0j), which turned an imaginary
  -0.0 into +0.0 (found by a review; README says the tie changes no bit)."""
  from jaxdp.training.reduction import _after

  values = {"c": jax.lax.complex(jnp.array([1.0, 0.0, -0.0]), jnp.array([-0.0, -0.0, 0.0])),
            "f": jnp.array([-0.0, 0.0, 2.0]), "h": jnp.array([-0.0], jnp.bfloat16), "i": jnp.array([3])}
  for previous in (jnp.array([3.0]), jnp.array([1 + 2j], jnp.complex64), jnp.array([jnp.nan], jnp.bfloat16)):
    tied = _after(values, previous)
    for name in values:
      assert tied[name].dtype == values[name].dtype
      np.testing.assert_array_equal(np.asarray(tied[name]).view(np.uint8), np.asarray(values[name]).view(np.uint8))


def test_buckets_follow_reverse_leaf_order():
  leaves = [jnp.zeros(n, jnp.float32) for n in (80, 16, 256, 16, 48, 3)]  # 320, 64, 1024, 64, 192, 12 bytes
  from jaxdp.training.reduction import buckets

  assert buckets(leaves, 300) == [[5, 4, 3], [2], [1], [0]]  # 12 + 192 + 64; 1024; 64 (+ 320 > 300); 320
  assert buckets(leaves, 0) == [[5], [4], [3], [2], [1], [0]]
  assert buckets(leaves[:2] + [jnp.zeros(4, jnp.bfloat16)], 10**6) == [[2], [1, 0]]  # one dtype per bucket


def test_bfloat16_reduction_halves_the_gradient_bytes_and_stays_close():
  """comm_report(compiled=False) shows the bytes asked for; XLA's CPU backend widens bf16 all-reduces itself."""
  _, reference, _ = reference_run()
  step, state, metrics = run(grad_reduce_dtype=jnp.bfloat16)
  args = (jaxdp.init_state(init_params(), OPT, MESH), *data())
  full = jaxdp.comm_report(reference_run()[0], *args, compiled=False)["all-reduce"]
  half = jaxdp.comm_report(step, *args, compiled=False)["all-reduce"]
  grad_bytes = 4 * sum(np.size(x) for x in jax.tree.leaves(init_params()))
  assert full.bytes - half.bytes == grad_bytes // 2  # only the gradient is halved; the float32 scalars are not
  assert state.params["layer0"]["w"].dtype == jnp.float32
  # bfloat16 has an 8-bit mantissa (relative rounding 2**-9 ~ 2e-3 per element); Adam with lr 1e-2 turns a
  # gradient error into at most ~lr per step, so three steps stay within ~3e-2 of the float32 run.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=3e-2), jaxdp.gather_state(state).params,
               jaxdp.gather_state(reference).params)
  assert np.isfinite(float(metrics["loss"]))


def test_bfloat16_compute_keeps_float32_master_params():
  seen = []

  def probe(params, batch):
    seen.append((params["layer0"]["w"].dtype, batch["x"].dtype))
    return loss_fn(params, batch)

  step = jaxdp.make_train_step(probe, OPT, MESH, compute_dtype=jnp.bfloat16)
  state = jaxdp.init_state(init_params(), OPT, MESH)
  _, reference, _ = run(steps=1)
  state, metrics = step(state, *data(0))
  assert seen[-1] == (jnp.bfloat16, jnp.bfloat16)
  assert state.params["layer0"]["w"].dtype == jnp.float32 and metrics["loss"].dtype == jnp.float32
  assert jax.tree.leaves(state.opt_state)[1].dtype == jnp.float32
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-2), jaxdp.gather_state(state).params,
               jaxdp.gather_state(reference).params)


@pytest.mark.parametrize("weight", [1e-9, 1.0, 1e5])
def test_a_float16_gradient_is_taken_at_a_scale_that_follows_the_weights(weight):
  """A float16 parameter's gradient of the weighted *sum* flushed to 0 under small weights (a wrong step, not
  skipped) and overflowed under large ones (skipped); now the sum is divided by a power of two that follows the
  global Σ w (see test_a_float16_backward_pass_over_many_tokens_stays_near_float32) and the gradient scaled back
  in float32. Reference: float32, one device, the mean loss."""
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 3)).astype(np.float32)

  def half_loss(params, batch):
    return 0.5 * jnp.sum((batch["x"] * params["h"].astype(jnp.float32)[None] + params["w"][None] - batch["y"]) ** 2, -1)

  params = {"h": np.array([0.5, -0.25, 0.125], np.float16), "w": np.ones(3, np.float32)}
  wide = {"h": params["h"].astype(np.float32), "w": params["w"]}
  expected = jax.grad(lambda p: jnp.mean(half_loss(p, {"x": x, "y": y})))(wide)["h"]
  opt = optax.sgd(1.0)
  batch, weights = jaxdp.shard_uneven([{"x": x[:3], "y": y[:3]}, {"x": x[3:3], "y": y[3:3]},
                                       {"x": x[3:7], "y": y[3:7]}, {"x": x[7:], "y": y[7:]}], MESH)
  state, metrics = jaxdp.make_train_step(half_loss, opt, MESH)(jaxdp.init_state(params, opt, MESH), batch,
                                                                weights * weight)
  assert int(metrics["skipped"]) == 0
  applied = params["h"].astype(np.float32) - np.asarray(state.params["h"], np.float32)
  np.testing.assert_allclose(applied, expected, rtol=2e-3)  # float16 rounding of each device's mean and the update


@pytest.mark.parametrize("compute_dtype", [jnp.bfloat16, jnp.float16])
def test_a_16_bit_backward_pass_keeps_collectives_in_loss_fn_exact(compute_dtype):
  """A first version scaled each replica's loss by its own Σ w: a loss_fn whose forward pass communicates (exact
  BatchNorm statistics) then mixed the replicas' scales, 104% off when one device's rows weighed 0.05 (found by
  the diff review). The scale is now one constant on every replica. Reference: float32, one device."""
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(16, 3)).astype(np.float32), rng.normal(size=(16,)).astype(np.float32)
  w = np.ones(16, np.float32)
  w[:4] = 0.05  # device 0's rows
  params = {"W": rng.normal(size=(3, 2)).astype(np.float32), "v": rng.normal(size=(2,)).astype(np.float32)}

  def normalised_loss(params, batch, *, weights):
    h = batch["x"] @ params["W"]
    m = jaxdp.masked_moments(h, weights)
    h = (h - m.mean.astype(h.dtype)[None]) * jax.lax.rsqrt(m.var + 1e-3).astype(h.dtype)[None]
    return (h @ params["v"] - batch["y"]) ** 2

  def reference(p):
    h = x @ p["W"]
    mean = (w[:, None] * h).sum(0) / w.sum()
    var = (w[:, None] * h**2).sum(0) / w.sum() - mean**2
    return jnp.sum(w * (((h - mean[None]) * jax.lax.rsqrt(var + 1e-3)[None]) @ p["v"] - y) ** 2) / w.sum()

  opt = optax.sgd(1.0)
  step = jaxdp.make_train_step(normalised_loss, opt, MESH, compute_dtype=compute_dtype)
  state, _ = step(jaxdp.init_state(params, opt, MESH), {"x": x, "y": y}, w)
  applied = params["W"] - np.asarray(state.params["W"])
  expected = jax.grad(reference)(params)["W"]
  assert np.max(np.abs(applied - expected)) / np.max(np.abs(expected)) < 2e-2  # 16-bit rounding: 5e-3 here


def test_a_16_bit_local_gradient_takes_a_batch_with_a_side_input():
  """local_gradient on its own takes a batch whose leaves need not share a leading size (a memory bank next to
  the rows); a version of the 16-bit scale read every leaf's and refused it (found by the second diff review)."""
  params = {"W": jnp.full((3, 2), 0.1)}
  batch = {"a_x": np.ones((4, 3), np.float32), "z_mem": np.ones((5, 2), np.float32)}

  def with_memory(p, b):
    return jnp.tanh((b["a_x"] @ p["W"]) @ b["z_mem"].T).sum(-1)

  wide = jaxdp.local_gradient(with_memory, params, batch, None)
  half = jaxdp.local_gradient(with_memory, params, batch, None, compute_dtype=jnp.bfloat16)
  np.testing.assert_allclose(half.grads["W"], wide.grads["W"], rtol=2e-2)


def test_float16_compute_sums_many_tokens_without_overflow():
  """Per-token losses over 20,000 tokens a row: the float16 gradient of the weighted sum overflowed 65,504 and the
  step was skipped as non-finite; at jaxdp's 16-bit scale it is applied, as one float32 device's."""
  rng = np.random.default_rng(1)
  tokens = 20_000
  x = rng.uniform(1.0, 2.0, size=(8, 3)).astype(np.float32)  # a device's 4 rows: a sum of 80,000 to 160,000

  def per_token(params, batch):
    return (batch["x"] @ params["w"])[:, None] * jnp.ones((1, tokens), batch["x"].dtype)

  params = {"w": np.array([1.0, -0.5, 0.25], np.float32)}
  expected = jax.grad(lambda p: jnp.mean(per_token(p, {"x": x})))(params)["w"]
  # One float16 device's mean loss misses it too: its per-token cotangents, 1/160,000, are float16 subnormals.
  half = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float16), tree)  # noqa: E731
  one_device = jax.grad(lambda p: jnp.mean(per_token(half(p), half({"x": x})).astype(jnp.float32)))(params)["w"]
  one_device_error = np.max(np.abs(one_device - expected) / np.abs(expected))  # 5.9e-3
  opt = optax.sgd(1.0)
  batch, weights = jaxdp.shard_uneven([{"x": x[:3]}, {"x": x[3:3]}, {"x": x[3:7]}, {"x": x[7:]}], MESH)
  weights = jnp.broadcast_to(weights[:, None], (weights.shape[0], tokens))
  step = jaxdp.make_train_step(per_token, opt, MESH, compute_dtype=jnp.float16)
  state, metrics = step(jaxdp.init_state(params, opt, MESH), batch, weights)
  assert int(metrics["skipped"]) == 0
  # As close as one float16 device (each device's mean has the same subnormal cotangents, at most 4x larger).
  np.testing.assert_allclose(params["w"] - np.asarray(state.params["w"]), expected, rtol=one_device_error)
  # Without weights (a full batch, no padding) the scale counts the tokens too: 320,000 of them here.
  full = {"x": np.concatenate([x, x])}
  one_device = jax.grad(lambda p: jnp.mean(per_token(half(p), half(full)).astype(jnp.float32)))(params)["w"]
  state, metrics = step(jaxdp.init_state(params, opt, MESH), full)
  assert int(metrics["skipped"]) == 0
  np.testing.assert_allclose(params["w"] - np.asarray(state.params["w"]), expected,
                             rtol=np.max(np.abs(one_device - expected) / np.abs(expected)))


def test_a_model_computing_in_float16_by_its_own_dtype_is_taken_at_the_scale_of_the_mean():
  """flax's ImageNet example on GPU: float32 params, the model computes in float16 (nn.Dense(dtype=float16)), no
  compute_dtype. jaxdp saw no 16-bit dtype and differentiated each device's weighted sum in float16, which
  overflowed where one device's mean does not: every step skipped (found by the port review). The loss's own
  16-bit values are seen now; reference: float32, one device, the mean loss."""
  rng = np.random.default_rng(1)
  tokens = 20_000
  x = rng.uniform(1.0, 2.0, size=(8, 3)).astype(np.float32)

  def in_float16(params, batch):  # what a flax module with dtype=jnp.float16 does inside
    h = batch["x"].astype(jnp.float16) @ params["w"].astype(jnp.float16)
    return (h[:, None] * jnp.ones((1, tokens), jnp.float16)).astype(jnp.float32)

  params = {"w": np.array([1.0, -0.5, 0.25], np.float32)}
  expected = jax.grad(lambda p: jnp.mean(x @ p["w"]))(params)["w"]  # every token's loss is its row's x @ w
  one_device = jax.grad(lambda p: jnp.mean(in_float16(p, {"x": x})))(params)["w"]
  opt = optax.sgd(1.0)
  batch, weights = jaxdp.shard_uneven([{"x": x[:3]}, {"x": x[3:3]}, {"x": x[3:7]}, {"x": x[7:]}], MESH)
  weights = jnp.broadcast_to(weights[:, None], (weights.shape[0], tokens))
  state, metrics = jaxdp.make_train_step(in_float16, opt, MESH)(jaxdp.init_state(params, opt, MESH), batch, weights)
  assert int(metrics["skipped"]) == 0
  np.testing.assert_allclose(params["w"] - np.asarray(state.params["w"]), expected,
                             rtol=max(4 * np.max(np.abs(one_device - expected) / np.abs(expected)), 1e-3))


@pytest.mark.parametrize("reduction", ["mean", "rank_mean"])
def test_a_float16_backward_pass_over_many_tokens_stays_near_float32(reduction):
  """Per-token float16 losses, 4 devices of 1/12/12/12 rows of 16,384 tokens (a diff review's case): at one
  device's mean-loss scale each token's cotangent fell below float16's smallest normal and the update was 2.2e-2
  off float32 (7.7e-2 under rank_mean). The scale is now a power of two near Σw / (N·√n), n a device's loss
  elements: 5.5e-4 (1.5e-3). Reference: the same step with the model in float32."""
  tokens, features, rows = 16_384, 4, (1, 12, 12, 12)
  rng = np.random.default_rng(0)
  portions = [{"x": rng.normal(size=(n, features)).astype(np.float32),
               "y": 0.01 * rng.normal(size=(n, tokens)).astype(np.float32)} for n in rows]
  weights = [np.full((n, tokens), 1e-2 if i == 0 else 1.0, np.float32) for i, n in enumerate(rows)]
  params = {"w": (0.1 * rng.normal(size=(features, tokens))).astype(np.float32)}
  opt = optax.sgd(1.0)

  def in_dtype(dtype):
    def loss(p, b):
      out = b["x"].astype(dtype) @ p["w"].astype(dtype)
      return (0.5 * (out - b["y"].astype(dtype)) ** 2).astype(jnp.float32)
    return loss

  updates = {}
  for dtype in (jnp.float32, jnp.float16):
    step = jaxdp.make_train_step(in_dtype(dtype), opt, MESH, reduction=reduction)
    new, metrics = step(jaxdp.init_state(params, opt, MESH), *jaxdp.shard_uneven(portions, MESH, weights=weights))
    assert int(metrics["skipped"]) == 0
    updates[dtype] = params["w"] - np.asarray(new.params["w"])
  error = np.linalg.norm(updates[jnp.float16] - updates[jnp.float32]) / np.linalg.norm(updates[jnp.float32])
  assert error < 4e-3, error


def test_the_16_bit_search_reads_what_the_step_runs_and_leaves_eager_calls_alone():
  """The search for 16-bit values in the loss (a diff review): it traced the batch before compute_dtype's cast, so
  a bfloat16 batch under compute_dtype=float32 took the 16-bit path (one more all-reduce, other rounding); and its
  abstract trace broke an eager local_gradient of a loss that branches on a value (fine under eager jax.grad)."""
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(3,)).astype(np.float32)}
  opt = optax.sgd(0.1)

  def tanh_loss(p, b):
    return (jnp.tanh((b["x"] * 0.5) @ p["w"]) - 1.0) ** 2

  x = [rng.normal(size=(n, 3)).astype(jnp.bfloat16) for n in (3, 1, 0, 3)]
  results, counts = {}, {}
  for dtype in (jnp.bfloat16, jnp.float32):
    step = jaxdp.make_train_step(tanh_loss, opt, MESH, compute_dtype=jnp.float32)
    state = jaxdp.init_state(params, opt, MESH)
    batch, weights = jaxdp.shard_uneven([{"x": np.asarray(v).astype(dtype)} for v in x], MESH, rows=3)
    counts[dtype] = jaxdp.comm_report(step, state, batch, weights)["all-reduce"].count
    results[dtype] = np.asarray(step(state, batch, weights)[0].params["w"])
  assert counts[jnp.bfloat16] == counts[jnp.float32]
  np.testing.assert_array_equal(results[jnp.bfloat16], results[jnp.float32])

  def branching(p, b):
    err = b["x"] @ p["w"] - b["y"]
    return jnp.abs(err) if jnp.max(jnp.abs(err)) > 10.0 else 0.5 * err**2

  batch = {"x": np.ones((4, 3), np.float32), "y": np.zeros(4, np.float32)}
  got = jaxdp.local_gradient(branching, {"w": np.ones(3, np.float32)}, batch, None)
  np.testing.assert_array_equal(got.grads["w"], jax.grad(lambda p: jnp.sum(branching(p, batch)))(
      {"w": np.ones(3, np.float32)})["w"])


def test_bad_precision_options():
  with pytest.raises(ValueError, match="compute_dtype=.*not a floating dtype"):
    jaxdp.make_train_step(loss_fn, OPT, MESH, compute_dtype=jnp.int8)
  with pytest.raises(ValueError, match="bucket_bytes"):
    jaxdp.make_train_step(loss_fn, OPT, MESH, bucket_bytes=-1)
  # float32's range but no sign and no mantissa: accepted before, and every step was then skipped.
  with pytest.raises(ValueError, match=r"grad_reduce_dtype=.*0 mantissa bits, fewer than bfloat16's 7"):
    jaxdp.make_train_step(loss_fn, OPT, MESH, grad_reduce_dtype=jnp.float8_e8m0fnu)
  with pytest.raises(ValueError, match=r"grad_reduce_dtype=.*not a floating dtype; use e.g. jnp.bfloat16 or jnp.float32"):
    jaxdp.make_train_step(loss_fn, OPT, MESH, grad_reduce_dtype=jnp.int8)


def test_a_float16_reduction_is_refused():
  """The gradient travels as weighted sums (divided after the all-reduce): float16 overflowed on them (mean
  gradient ~241 over 2,048 rows: grad_norm inf, every step skipped, then a guard error blaming the data)."""
  with pytest.raises(ValueError, match=r"grad_reduce_dtype=.*float16.* narrower range than float32.*jnp\.bfloat16"):
    jaxdp.make_train_step(loss_fn, OPT, MESH, grad_reduce_dtype=jnp.float16)
  replica = lambda s, b, w: jaxdp.train_step(loss_fn, OPT, s, b, w, grad_reduce_dtype=jnp.float16)  # noqa: E731
  step = jax.jit(jax.shard_map(replica, mesh=MESH, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P())))
  with pytest.raises(ValueError, match=r"grad_reduce_dtype=.*float16.* narrower range"):
    step(jaxdp.init_state(init_params(), OPT, MESH), *data())


def collectives(step, zero_stage):
  """The compiled step's collectives by kind (count and bytes), for a state of ``zero_stage``."""
  state = jaxdp.init_state(init_params(), OPT, MESH, zero_stage=zero_stage)
  return jaxdp.collectives_from_hlo(step.lower(state, *data()).compile().as_text(), K)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
@pytest.mark.parametrize("bucket_bytes,buckets", [(0, 5), (300, 5), (1100, 3), (10**9, 1)])
def test_zero_buckets_reduce_scatter_and_gather_flat_slices(zero_stage, bucket_bytes, buckets):
  """At stages 1-3, buckets gather the parameters as flat slices, and at stages 2-3 reduce-scatter the gradient so.

  Five leaves split over the 4 devices (w0 [5, 16] along its dimension 1, so its slices are moved to the
  front and back; w1, w2, b0, b1 along dimension 0); b2 [3] divides by nothing and is all-reduced. Their
  whole sizes in reverse flattening order (w2, w1, b1, w0, b0): 192, 1024, 64, 320, 64 bytes, so 300 bytes
  gives five buckets, 1100 gives [192], [1024 + 64], [320 + 64], and 1 GB one. The same steps give the per-leaf
  reduction's state and metrics, up to float32 round-off (XLA may compile the backward pass that feeds
  the concatenation differently), and stage 0's. Stage 1 all-reduces the gradient (in stage 0's buckets).
  (``bucket_bytes=0``, one bucket per leaf, is the per-leaf reference: the default packs small leaves.)
  """
  _, reference, reference_metrics = reference_run()
  per_leaf_step, per_leaf, per_leaf_metrics = run(zero_stage=zero_stage, bucket_bytes=0)  # a collective per leaf
  step, state, metrics = run(zero_stage=zero_stage, bucket_bytes=bucket_bytes)
  for expected, expected_metrics in ((per_leaf, per_leaf_metrics), (reference, reference_metrics)):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 jaxdp.gather_state(state), jaxdp.gather_state(expected))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), metrics, expected_metrics)
  bucketed, per_leaf_ops = collectives(step, zero_stage), collectives(per_leaf_step, zero_stage)
  if zero_stage == 1:
    assert bucketed["reduce-scatter"].count == per_leaf_ops["reduce-scatter"].count == 0
    assert bucketed["all-reduce"].bytes == per_leaf_ops["all-reduce"].bytes
  else:
    assert per_leaf_ops["reduce-scatter"].count == 5
    assert bucketed["reduce-scatter"].count == buckets
    assert bucketed["reduce-scatter"].bytes == per_leaf_ops["reduce-scatter"].bytes  # the same slices, cut differently
  # The parameters' gathers: at stage 3 before the forward pass, at stages 1-2 after the update.
  assert per_leaf_ops["all-gather"].count == 5
  assert bucketed["all-gather"].count == buckets
  assert bucketed["all-gather"].bytes == per_leaf_ops["all-gather"].bytes


@pytest.mark.parametrize("bucket_bytes,buckets", [(0, 5), (1100, 3), (10**9, 1)])
def test_eval_step_gathers_stage_three_params_in_flat_buckets(bucket_bytes, buckets):
  """make_eval_step(bucket_bytes=B) on a stage-3 state: one all-gather per bucket (as the training step's), same sums.

  The gathered parameters are exact copies, but XLA may compile the forward pass that reads them out of a
  bucket differently (seen: 1 ulp of the loss), so the sums equal the per-leaf evaluation's and one device's
  on the same examples up to float32 round-off.
  """
  state = jaxdp.init_state(init_params(), OPT, MESH, zero_stage=3)
  batch, weights = data(seed=5)
  bucketed = jaxdp.make_eval_step(loss_fn, MESH, bucket_bytes=bucket_bytes)
  per_leaf = jaxdp.make_eval_step(loss_fn, MESH, bucket_bytes=0)  # one all-gather per leaf
  packed = jaxdp.make_eval_step(loss_fn, MESH)  # the default: the small leaves (all five here) in one
  one_mesh = jaxdp.data_mesh(jax.devices()[:1])
  one = jaxdp.make_eval_step(loss_fn, one_mesh)(jaxdp.init_state(init_params(), OPT, one_mesh), batch, weights)
  got, expected = bucketed(state, batch, weights), per_leaf(state, batch, weights)
  for reference in (expected, one, packed(state, batch, weights)):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), jax.tree.map(np.asarray, got),
                 jax.tree.map(np.asarray, reference))
  ops = lambda step: jaxdp.collectives_from_hlo(step.lower(state, batch, weights).compile().as_text(), K)  # noqa: E731
  assert ops(per_leaf)["all-gather"].count == 5
  assert ops(packed)["all-gather"].count == 1
  assert ops(bucketed)["all-gather"].count == buckets
  assert ops(bucketed)["all-gather"].bytes == ops(per_leaf)["all-gather"].bytes


def test_eval_step_rejects_a_bad_bucket_size():
  with pytest.raises(ValueError, match="bucket_bytes"):
    jaxdp.make_eval_step(loss_fn, MESH, bucket_bytes=-1)


def test_small_leaves_travel_packed_and_sum_bit_for_bit():
  """The one all-reduce packs leaves up to PACK_BYTES into one flat operand per dtype; each sum is unchanged.

  Against ``lax.psum`` of each leaf on its own (the reference), bitwise, for float32, bfloat16 and int32
  leaves, a scalar, and a float32 leaf above the packing size (an operand of its own).
  """
  from jaxdp.training.reduction import PACK_BYTES, _psum

  big = PACK_BYTES // 4 + 1
  rng = np.random.default_rng(3)
  tree = {"a": rng.normal(size=(K, 5, 3)).astype(np.float32), "b": rng.normal(size=(K, 7)).astype(np.float32),
          "s": rng.normal(size=(K,)).astype(np.float32), "big": rng.normal(size=(K, big)).astype(np.float32),
          "h": rng.normal(size=(K, 6)).astype(jnp.bfloat16), "g": rng.normal(size=(K, 4)).astype(jnp.bfloat16),
          "i": rng.integers(-9, 9, size=(K, 4)).astype(np.int32), "j": rng.integers(-9, 9, size=(K, 2)).astype(np.int32)}
  tree = jax.device_put(tree, jax.NamedSharding(MESH, P("data")))

  def mapped(reduce):
    return jax.jit(jax.shard_map(lambda t: reduce(jax.tree.map(lambda x: x[0], t)), mesh=MESH, in_specs=P("data"),
                                 out_specs=P()))

  packed = mapped(lambda t: _psum(t, "data"))
  reference = mapped(lambda t: jax.tree.map(lambda x: jax.lax.psum(x, "data"), t))
  bits = lambda t: jax.tree.map(lambda x: np.atleast_1d(np.asarray(x)).view(np.uint8), t)  # noqa: E731
  jax.tree.map(np.testing.assert_array_equal, bits(packed(tree)), bits(reference(tree)))
  hlo = packed.lower(tree).compile().as_text()
  operands = [line.split(" all-reduce(")[1].split(")")[0].count("%") for line in hlo.splitlines() if " all-reduce(" in line]
  # Four operands (eight leaves): the float32 pack (a, b, s), the bfloat16 pack, the int32 pack, and the big
  # leaf. XLA keeps one all-reduce per reducer type (here the int32 one apart).
  assert sum(operands) == 4


def test_a_16_bit_reduction_with_model_axes_on_cpu_sums_in_float32_as_xla_does():
  """XLA's CPU backend aborts the process (an F-level check, exit 134) compiling a bfloat16 all-reduce inside a
  shard_map that leaves a "model" axis to the compiler, and elsewhere promotes every bfloat16 all-reduce to
  float32 (the operand converted, summed, the sum converted back). There jaxdp writes that promotion itself
  (jaxdp.core.precision.summed_in): the step runs, with float32 collectives only, and its numbers are the same
  as without the model axis, where XLA promotes. The promotion itself is checked bit for bit against XLA's."""
  from jax.sharding import AxisType, Mesh

  x = jnp.asarray(np.random.default_rng(0).normal(size=(K, 512)) * np.logspace(-3, 3, 512), jnp.bfloat16)
  summed = lambda f: jax.jit(jax.shard_map(f, mesh=MESH, in_specs=P("data"), out_specs=P()))(x)  # noqa: E731
  native = summed(lambda v: jax.lax.psum(v, "data"))
  promoted = summed(lambda v: jax.lax.psum(v.astype(jnp.float32), "data").astype(jnp.bfloat16))
  np.testing.assert_array_equal(np.asarray(native).view(np.uint16), np.asarray(promoted).view(np.uint16))

  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  tp = jaxdp.data_parallel(mesh, param_specs=jax.tree.map(lambda _: P(), init_params()))
  plain = jaxdp.data_parallel(Mesh(np.array(jax.devices()[:4]), ("data",), axis_types=(AxisType.Auto,)))
  policy = jaxdp.precision(reduce_dtype=jnp.bfloat16)
  rng = np.random.default_rng(1)
  batch = {"x": rng.normal(size=(16, SIZES[0])).astype(np.float32),
           "y": rng.normal(size=(16, SIZES[-1])).astype(np.float32)}
  weights = rng.uniform(0.0, 3.0, size=16).astype(np.float32)
  finals = []
  for layout in (tp, plain):
    step = jaxdp.make_train_step(loss_fn, OPT, layout, precision=policy)
    state = jaxdp.init_state(init_params(), OPT, layout)
    for _ in range(2):
      state, _ = step(state, batch, weights)
    finals.append(jax.device_get(state.params))
    if layout is tp:
      hlo = step.lower(state, batch, weights).compile().as_text()
      assert not [line for line in hlo.splitlines() if " all-reduce(" in line and "bf16[" in line.split("=")[1]]
  jax.tree.map(np.testing.assert_array_equal, *finals)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_stages_pack_small_leaves_into_one_collective_by_default(zero_stage, monkeypatch):
  """Without bucket_bytes, ZeRO reduce-scattered and gathered every leaf on its own: 28 of each per step for the
  transformer, whose leaves are all small (its step at 8 devices took 0.71-0.86x the time packed). Leaves of up
  to PACK_BYTES now share one collective (gathered leaves: up to PACK_BYTES whole, PACK_BYTES / N a slice), the
  larger keep their own; same sums and state as one collective per leaf, up to float32 round-off."""
  _, per_leaf, per_leaf_metrics = run(zero_stage=zero_stage, bucket_bytes=0)
  step, state, metrics = run(zero_stage=zero_stage)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               jaxdp.gather_state(state), jaxdp.gather_state(per_leaf))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), metrics, per_leaf_metrics)
  ops = collectives(step, zero_stage)
  assert ops["all-gather"].count == 1  # the five split leaves (the largest, w1, 1,024 bytes)
  assert ops["reduce-scatter"].count == (1 if zero_stage >= 2 else 0)
  # Leaves over 100 bytes (w0 320, w1 1,024, w2 192) keep a collective each; the biases b0, b1 (64) share one.
  monkeypatch.setattr(jaxdp.training.reduction, "PACK_BYTES", 100)
  ops = collectives(jaxdp.make_train_step(loss_fn, OPT, MESH, zero_stage=zero_stage), zero_stage)
  assert ops["all-gather"].count == 4
  assert ops["reduce-scatter"].count == (4 if zero_stage >= 2 else 0)


def test_zero_packing_groups_dtypes_gathers_after_a_stateless_update_and_leaves_model_meshes_alone():
  """From the packing review: (1) a bf16 kernel and an f32 scale per layer got one all-gather per leaf (buckets
  broke at every dtype change in leaf order): the small leaves are grouped by dtype first, one gather each;
  (2) SGD at stage 2 kept XLA's per-leaf gathers (the update is split by the gradient there, whatever the
  optimizer); (3) on a ("data", "model") mesh the packed row was split over "model" by the compiler and
  gathered back with part of the backward pass (2.8x the all-gather bytes at 1,000 rows a device): packing
  is left out where the compiler partitions another axis. The numbers equal one collective per leaf."""
  layers = 3
  params = {f"layer{i}": {"scale": np.ones(16, np.float32), "w": jnp.asarray(np.eye(16) * 0.5, jnp.bfloat16)}
            for i in range(layers)}

  def loss(p, batch):
    h = batch["x"]
    for i in range(layers):
      h = jnp.tanh((h * p[f"layer{i}"]["scale"][None, :]) @ p[f"layer{i}"]["w"].astype(jnp.float32))
    return 0.5 * jnp.sum((h - batch["y"]) ** 2, -1)

  batch = {"x": np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32), "y": np.zeros((8, 16), np.float32)}
  for opt, stage, gathers in ((optax.adam(1e-3), 3, 2), (optax.adam(1e-3), 1, 2), (optax.sgd(0.1), 2, 2),
                              (optax.sgd(0.1), 1, 0)):
    state = jaxdp.init_state(params, opt, MESH, zero_stage=stage)
    default = jaxdp.make_train_step(loss, opt, MESH, zero_stage=stage)
    per_leaf = jaxdp.make_train_step(loss, opt, MESH, zero_stage=stage, bucket_bytes=0)
    report = jaxdp.comm_report(default, state, batch)
    assert report["all-gather"].count == gathers, (opt, stage)
    assert report["all-gather"].bytes == jaxdp.comm_report(per_leaf, state, batch)["all-gather"].bytes
    got, expected = default(state, batch)[0], per_leaf(jaxdp.init_state(params, opt, MESH, zero_stage=stage), batch)[0]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                         rtol=1e-5, atol=1e-6), jaxdp.gather_state(got).params,
                 jaxdp.gather_state(expected).params)

  # "model" Auto: the compiler partitions it (this loss is written for that; an Explicit model axis types it).
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
  rng = np.random.default_rng(1)
  tp = {"w1": rng.normal(size=(8, 16)).astype(np.float32) * 0.3, "w2": rng.normal(size=(16, 8)).astype(np.float32) * 0.3,
        "b2": rng.normal(size=(8,)).astype(np.float32) * 0.1, "g": np.ones((8,), np.float32),
        "u": rng.normal(size=(4, 8)).astype(np.float32) * 0.3,
        "big": rng.normal(size=(128, 1024)).astype(np.float32) * 0.01}
  specs = {"w1": P(None, "model"), "w2": P("model", None), "b2": P(), "g": P(), "u": P(), "big": P(None, "model")}

  def tp_loss(p, batch):
    x = batch["x"]
    out = ((jnp.tanh(x @ p["w1"]) @ p["w2"] + p["b2"][None, :]) * p["g"][None, :] + x @ p["u"].T.sum(-1, keepdims=True)
           + (jnp.tile(x, (1, 16)) @ p["big"][:, :8]) * 0.1)
    return 0.5 * jnp.sum((out - batch["y"][:, None]) ** 2, -1)

  tp_batch = {"x": rng.normal(size=(4000, 8)).astype(np.float32), "y": rng.normal(size=(4000,)).astype(np.float32)}
  opt = optax.adam(1e-3)
  state = jaxdp.init_state(tp, opt, mesh, zero_stage=2, param_specs=specs)
  reports = [jaxdp.comm_report(jaxdp.make_train_step(tp_loss, opt, mesh, zero_stage=2, bucket_bytes=b), state, tp_batch)
             for b in (None, 0)]
  for kind in ("all-gather", "all-reduce", "reduce-scatter"):
    assert reports[0][kind].bytes == reports[1][kind].bytes, kind


def test_eval_step_runs_the_forward_pass_in_the_training_compute_dtype():
  """make_eval_step had no compute_dtype, so a model trained with compute_dtype=bfloat16 was evaluated in float32
  (a one-device bf16 program evaluates in bf16; from the linen review). With it, the sums equal a plain
  one-device evaluation on params and batch cast to bfloat16 (bf16 per-device forward passes, float32 sums:
  rtol 1e-2), and differ from the float32 evaluation by bf16's rounding."""
  state = jaxdp.init_state(init_params(), OPT, MESH)
  batch, weights = data(seed=7)
  got = jaxdp.make_eval_step(loss_fn, MESH, compute_dtype=jnp.bfloat16)(state, batch, weights)
  full = jaxdp.make_eval_step(loss_fn, MESH)(state, batch, weights)
  cast = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      (init_params(), batch))
  losses = loss_fn(*cast).astype(jnp.float32)
  expected = float(jnp.sum(weights * losses) / jnp.sum(weights))
  np.testing.assert_allclose(float(got["loss"]), expected, rtol=1e-2)
  assert float(got["loss"]) != float(full["loss"])
  with pytest.raises(ValueError, match=r"compute_dtype=.*not a floating dtype"):
    jaxdp.make_eval_step(loss_fn, MESH, compute_dtype=jnp.int32)
