"""Property tests: jaxdp's step against a plain single-device reference step.

The reference is one ``jax.jit`` step on the concatenated global batch (only
the real rows, with their weights): the reduced loss written out for each
reduction, ``jax.value_and_grad`` and a plain optax update, skipped on the
host when the global weight is 0. Hypothesis draws the device count (1..8),
uneven per-device row counts (zeros included), weights (all ones, random with
exact zeros, or all zero per device), per-example or per-token losses, the
optimizer (SGD, momentum, Adam) and the number of steps (1..5).

Tolerances (float32, eps = 1.2e-7), for params, optimizer state and metrics:
  * RTOL = 1e-5: the data-parallel step sums each device's rows and then the
    devices (psum); the reference sums all rows at once. Re-associating a sum
    of <= 96 positive float32 terms moves it by ~log2(96) * eps ~ 1e-6
    relative; 1e-5 leaves a factor of ten for five chained steps.
  * ATOL = 2e-6, for components near 0 where a relative bound means nothing:
    gradient components are sums of terms of both signs, so their rounding
    error (~10 eps) is relative to the sum of |terms|, O(1) here, not to the
    component. It reaches the params through lr = 0.1 (momentum: up to
    1/(1 - 0.9) = 10x that) or through Adam, whose eps = 1e-3 bounds its
    amplification of a gradient error by lr / eps = 10 (with eps = 1e-8 a
    near-zero component would turn rounding noise into a full lr step).
    That is ~1e-6 over five steps; atol is twice that, about 17 ulp at 1.0,
    while a wrong normalisation moves params by ~1e-2.
  Measured over these examples: the worst |error| / (ATOL + RTOL * |ref|)
  is about 0.2. The two backends run one per-replica program and are
  compared bitwise.
"""

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given, settings, strategies as st
from jax.sharding import PartitionSpec as P

import jaxdp
from helpers import mesh_of
from helpers import assert_close as assert_close_elementwise

# Plumbing and float32 agreement, not speed: most XLA passes skipped while this module runs (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compiles")

D, T, MAX_ROWS = 3, 3, 4  # features, tokens per example, rows of the fullest device
RTOL, ATOL = 1e-5, 2e-6


class MLP(nn.Module):
  """A small two-layer model; its params are a nested dict (params/Dense_i/kernel, bias)."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(jnp.tanh(nn.Dense(5)(x)))[..., 0]


MODEL = MLP()


def loss_fn(params, batch):
  """Squared error: per-example losses [b] for x [b, D], per-token losses [b, T] for x [b, T, D]."""
  return 0.5 * (MODEL.apply(params, batch["x"]) - batch["y"]) ** 2


def init_params(seed):
  """Host (numpy) params, so that every state built from them owns its buffers."""
  return jax.tree.map(np.asarray, MODEL.init(jax.random.PRNGKey(seed), jnp.zeros((1, D))))


@functools.lru_cache(maxsize=None)
def make_optimizer(name, reduction):
  """SGD, momentum and Adam. Under "sum" the SGD learning rate is divided by 32.

  The weighted sum of up to 96 tokens has up to ~100x the curvature of the
  mean; with lr = 0.1 five steps on it would be unstable and amplify float32
  rounding from step to step. Adam is invariant to the gradient's scale.
  """
  lr = 0.1 / 32 if reduction == "sum" else 0.1
  if name == "sgd":
    return optax.sgd(lr)
  if name == "momentum":
    return optax.sgd(lr, momentum=0.9)
  return optax.adam(0.01, eps=1e-3)


@functools.lru_cache(maxsize=None)
def compiled_step(k, optimizer, reduction, backend, check_replicas=True):
  """One jitted step per configuration, reused across examples (padded shapes are fixed)."""
  opt = make_optimizer(optimizer, reduction)
  return jaxdp.make_train_step(
      loss_fn, opt, mesh_of(k), reduction=reduction, backend=backend, check_replicas=check_replicas
  )


class Case(NamedTuple):
  k: int
  counts: tuple  # real rows per device
  weighting: tuple  # per device: "ones", "random" or "zero"
  per_token: bool
  optimizer: str
  steps: int
  seed: int


@st.composite
def cases(draw, min_devices=1):
  """A drawn configuration; one device always holds MAX_ROWS rows so the padded shape is fixed."""
  k = draw(st.integers(min_devices, 8))
  counts = draw(st.lists(st.integers(0, MAX_ROWS), min_size=k, max_size=k))
  counts[draw(st.integers(0, k - 1))] = MAX_ROWS
  weighting = draw(st.lists(st.sampled_from(["ones", "random", "zero"]), min_size=k, max_size=k))
  return Case(
      k=k,
      counts=tuple(counts),
      weighting=tuple(weighting),
      per_token=draw(st.booleans()),
      optimizer=draw(st.sampled_from(["sgd", "momentum", "adam"])),
      steps=draw(st.integers(1, 5)),
      seed=draw(st.integers(0, 2**16)),
  )


def device_data(case, step):
  """Per-device batches and weights of one step: lists of host arrays, weights None if all ones."""
  rng = np.random.default_rng([case.seed, step])
  batches, weights = [], []
  for n, how in zip(case.counts, case.weighting):
    shape = (n, T) if case.per_token else (n,)
    batches.append({
        "x": rng.normal(size=(*shape, D)).astype(np.float32),
        "y": rng.normal(size=shape).astype(np.float32),
    })
    w = {"ones": np.ones(shape), "zero": np.zeros(shape)}.get(how)
    if w is None:
      w = rng.uniform(0.0, 2.0, size=shape) * (rng.random(shape) > 0.25)
    weights.append(w.astype(np.float32))
  if not case.per_token and all(h == "ones" for h in case.weighting):
    weights = None  # shard_uneven's default: one weight per real row
  return batches, weights


def global_batch(case, step):
  """The concatenated real rows, their weights and the device each row came from."""
  batches, weights = device_data(case, step)
  if weights is None:
    weights = [np.ones(np.shape(b["y"]), np.float32) for b in batches]
  batch = jax.tree.map(lambda *xs: np.concatenate(xs), *batches)
  device_of_row = np.repeat(np.arange(case.k), case.counts)
  return batch, np.concatenate(weights), device_of_row


def reference_objective(params, batch, weights, device_of_row, reduction, k):
  """The reduced loss, written plainly for each reduction."""
  wl = weights * loss_fn(params, batch)
  wl_rows, w_rows = wl.reshape(wl.shape[0], -1).sum(axis=1), weights.reshape(wl.shape[0], -1).sum(axis=1)
  if reduction == "sum":
    return jnp.sum(wl)
  if reduction == "mean":
    return jnp.sum(wl) / jnp.sum(weights)
  # rank_mean: mean over the k devices of each device's local weighted mean (0 for a weightless device).
  loss_i = jax.ops.segment_sum(wl_rows, device_of_row, num_segments=k)
  weight_i = jax.ops.segment_sum(w_rows, device_of_row, num_segments=k)
  local_mean = jnp.where(weight_i > 0, loss_i / jnp.where(weight_i > 0, weight_i, 1.0), 0.0)
  return jnp.sum(local_mean) / k


@functools.partial(jax.jit, static_argnames=("optimizer", "reduction", "k"))
def reference_step(params, opt_state, batch, weights, device_of_row, *, optimizer, reduction, k):
  """One single-device step: value_and_grad of the objective, then a plain optax update."""
  opt = make_optimizer(optimizer, reduction)
  loss, grads = jax.value_and_grad(reference_objective)(params, batch, weights, device_of_row, reduction, k)
  updates, opt_state = opt.update(grads, opt_state, params)
  grad_norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
  return optax.apply_updates(params, updates), opt_state, loss, grad_norm


def run_reference(case, reduction):
  """States and metrics after each step; a step with global weight 0 changes nothing."""
  params = jax.tree.map(jnp.asarray, init_params(case.seed))
  opt_state, step, history = make_optimizer(case.optimizer, reduction).init(params), 0, []
  for s in range(case.steps):
    batch, weights, device_of_row = global_batch(case, s)
    total = float(np.sum(weights, dtype=np.float64))
    loss = grad_norm = 0.0  # an empty weighted mean is taken as 0: nothing to learn
    if total > 0:
      params, opt_state, loss, grad_norm = reference_step(
          params, opt_state, batch, weights, device_of_row, optimizer=case.optimizer, reduction=reduction, k=case.k
      )
      step += 1
    history.append((jaxdp.TrainState(params, opt_state, step), {"loss": loss, "weight": total, "grad_norm": grad_norm}))
  return history


def to_host(tree):
  return jax.tree.map(np.asarray, tree)


def run_jaxdp(case, reduction, backend):
  """jaxdp's states and metrics after each step, checking replicas and no-op steps on the way."""
  mesh = mesh_of(case.k)
  step = compiled_step(case.k, case.optimizer, reduction, backend)
  state = jaxdp.init_state(init_params(case.seed), make_optimizer(case.optimizer, reduction), mesh)
  history = []
  for s in range(case.steps):
    batches, weights = device_data(case, s)
    before = to_host(state)
    state, metrics = step(state, *jaxdp.shard_uneven(batches, mesh, weights=weights))
    jaxdp.assert_replicas_equal(state)
    assert float(metrics["replica_divergence"]) == 0.0
    if float(metrics["weight"]) == 0.0:
      # Global weight 0: the state comes back bitwise unchanged, step counter included.
      jax.tree.map(np.testing.assert_array_equal, to_host(state), before)
    history.append((to_host(state), to_host(metrics)))
  return history


def assert_matches_reference(history, reference):
  for (state, metrics), (ref_state, ref_metrics) in zip(history, reference, strict=True):
    assert int(state.step) == ref_state.step
    assert_close(state.params, ref_state.params)
    assert_close(state.opt_state, ref_state.opt_state)
    np.testing.assert_allclose(metrics["weight"], ref_metrics["weight"], rtol=1e-6)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=RTOL, atol=ATOL)


def assert_backends_agree(a, b):
  """Both backends run the same per-replica program: the results are bitwise equal."""
  jax.tree.map(np.testing.assert_array_equal, a, b)


# Explicit examples: per-device zero weights next to real ones, and a global weight of 0.
MIXED = Case(
    k=8,
    counts=(4, 0, 2, 3, 1, 4, 0, 2),
    weighting=("random", "zero", "ones", "zero", "random", "ones", "ones", "random"),
    per_token=True,
    optimizer="momentum",
    steps=3,
    seed=7,
)
ALL_ZERO = Case(k=2, counts=(4, 1), weighting=("zero", "zero"), per_token=False, optimizer="adam", steps=2, seed=3)


# Each example compiles one 8-device step per backend, ~1.5 s of CPU each: examples are few,
# and the explicit ones pin the cases that matter (per-device and global zero weight).
@settings(max_examples=3)
@example(case=MIXED)
@example(case=ALL_ZERO)
@given(case=cases())
def test_mean_is_the_global_batch_step_on_both_backends(case):
  """"mean" equals the reference on Σ w·l / Σ w over the concatenated global batch.

  Step by step, on both backends: params, optimizer state, step counter and
  metrics (loss, weight, grad_norm) match the reference, the replicas stay
  bitwise equal (and ``replica_divergence`` is 0), a step with global weight
  0 leaves the state unchanged, and the two backends agree bitwise.
  """
  reference = run_reference(case, "mean")
  by_backend = [run_jaxdp(case, "mean", backend) for backend in jaxdp.BACKENDS]
  for history in by_backend:
    assert_matches_reference(history, reference)
  assert_backends_agree(*by_backend)


@pytest.mark.parametrize("reduction", ["rank_mean", "sum"])
@settings(max_examples=3)
@example(case=MIXED, backend="pmap")
@example(case=ALL_ZERO, backend="shard_map")
@given(case=cases(), backend=st.sampled_from(jaxdp.BACKENDS))
def test_rank_mean_and_sum_match_their_references(reduction, case, backend):
  """"rank_mean" is the mean over devices of local weighted means; "sum" is the step on Σ w·l.

  Under "rank_mean" a device with zero weight contributes zero gradient but
  counts in the denominator. Same checks as for "mean", on a drawn backend.
  """
  assert_matches_reference(run_jaxdp(case, reduction, backend), run_reference(case, reduction))


def test_zero_global_weight_is_a_no_op():
  """With every weight 0 (Adam, whose count would move) the state and step counter do not change."""
  for reduction in ["mean", "rank_mean", "sum"]:
    history = run_jaxdp(ALL_ZERO, reduction, "shard_map")
    initial = jaxdp.TrainState.create(init_params(ALL_ZERO.seed), make_optimizer("adam", reduction))
    for state, metrics in history:
      jax.tree.map(np.testing.assert_array_equal, state, to_host(initial))
      assert metrics["weight"] == 0.0 and np.isfinite(metrics["loss"]) and metrics["grad_norm"] == 0.0


def run_reference_alone(case, device):
  """Device ``device`` stepping alone on its own rows with the "mean" reference."""
  rows = lambda x, device_of_row: x[device_of_row == device]  # noqa: E731
  params = jax.tree.map(jnp.asarray, init_params(case.seed))
  opt_state, step, losses = make_optimizer(case.optimizer, "none").init(params), 0, []
  for s in range(case.steps):
    batch, weights, device_of_row = global_batch(case, s)
    batch, weights = jax.tree.map(lambda x: rows(x, device_of_row), (batch, weights))
    loss = 0.0
    if np.sum(weights, dtype=np.float64) > 0:
      params, opt_state, loss, _ = reference_step(
          params, opt_state, batch, weights, np.zeros(len(weights), int), optimizer=case.optimizer, reduction="mean", k=1
      )
      step += 1
    losses.append(loss)
  return to_host(jaxdp.TrainState(params, opt_state, step)), losses


@settings(max_examples=2)
@example(case=MIXED, backend="pmap")
@given(case=cases(min_devices=2), backend=st.sampled_from(jaxdp.BACKENDS))
def test_none_is_each_device_stepping_alone(case, backend):
  """Under "none" device i holds the reference of device i stepping alone on its local mean.

  ``metrics`` are local too, and ``replica_divergence`` is positive exactly
  when the per-device references differ (and 0 when they are identical).
  """
  mesh = mesh_of(case.k)
  step = compiled_step(case.k, case.optimizer, "none", backend)
  state = jaxdp.init_state(init_params(case.seed), make_optimizer(case.optimizer, "none"), mesh)
  for s in range(case.steps):
    batches, weights = device_data(case, s)
    state, metrics = step(state, *jaxdp.shard_uneven(batches, mesh, weights=weights))
  alone = [run_reference_alone(case, i) for i in range(case.k)]
  replicas = jaxdp.per_replica(state)
  for i, (ref_state, ref_losses) in enumerate(alone):
    assert replicas.step[i] == ref_state.step
    assert_close(jax.tree.map(lambda x: x[i], replicas.params), ref_state.params)
    assert_close(jax.tree.map(lambda x: x[i], replicas.opt_state), ref_state.opt_state)
    np.testing.assert_allclose(jaxdp.per_replica(metrics["loss"])[i], ref_losses[-1], rtol=RTOL, atol=ATOL)
  spread = max(
      float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
      for ref_state, _ in alone[1:]
      for a, b in zip(jax.tree.leaves(ref_state.params), jax.tree.leaves(alone[0][0].params))
  )
  if spread > 1e-3:
    assert float(metrics["replica_divergence"]) > 0.0
  elif spread == 0.0:
    assert float(metrics["replica_divergence"]) == 0.0


@pytest.mark.parametrize("n", [3, 4, 8])
def test_global_norm_of_an_agreed_gradient_is_summed_in_parts(n):
  """``global_norm`` inside ``shard_map``: each device sums its 1/N of each replicated leaf, one psum adds them.

  Leaf sizes that N does not divide (the last windows overlap and are masked), a scalar and an empty leaf,
  with a divisor: the norm equals numpy's on the whole tree, on every device. A NaN or Inf placed in any
  device's part makes every device's norm non-finite, so the skip stays collective.
  """
  rng = np.random.default_rng(n)
  tree = {"a": rng.normal(size=(7, 3)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32),
          "c": np.float32(1.5), "d": np.zeros((0, 4), np.float32), "e": rng.normal(size=(16,)).astype(np.float32)}
  mesh = jaxdp.data_mesh(jax.devices()[:n])
  norm = jax.jit(jax.shard_map(
      lambda t: jaxdp.global_norm(t, "data", jnp.float32(4.0))[None], mesh=mesh, in_specs=P(), out_specs=P("data")))
  expected = np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64) / 4.0)) for x in jax.tree.leaves(tree)))
  np.testing.assert_allclose(np.asarray(norm(tree)), np.full(n, expected), rtol=1e-6)
  assert "all-reduce" in norm.lower(tree).compile().as_text()  # the parts were added, not recomputed whole
  for bad in (np.nan, np.inf):
    for index in (0, 10, 20):  # spread over the devices' parts of the 21 elements of "a"
      poisoned = dict(tree, a=tree["a"].copy())
      poisoned["a"].flat[index] = bad
      assert not np.isfinite(np.asarray(norm(poisoned))).any(), (bad, index)


def test_global_norm_never_mixes_replicas_it_cannot_tell_apart():
  """Under ``pmap`` or ``shard_map(check_vma=False)`` nothing types a per-replica leaf as varying.

  ``global_norm(tree, "data")`` then sums each leaf whole on each device (each replica's own norm, as
  before the split existed), not a sum of the replicas' slices, which would be a norm of no vector at all.
  With ``agreed=True`` (what ``finish_step`` passes for a reduced gradient) on equal leaves it splits
  them and adds the parts with one all-reduce, equal to the whole norm.
  """
  n = 4
  rng = np.random.default_rng(0)
  local = {"a": rng.normal(size=(n, 7, 3)).astype(np.float32), "b": rng.normal(size=(n, 5)).astype(np.float32)}
  own = np.sqrt(np.sum(np.square(local["a"].astype(np.float64)), axis=(1, 2))
                + np.sum(np.square(local["b"].astype(np.float64)), axis=1))
  mesh = jaxdp.data_mesh(jax.devices()[:n])
  by_pmap = jax.pmap(lambda t: jaxdp.global_norm(t, "data"), axis_name="data", devices=jax.devices()[:n])
  unchecked = jax.jit(jax.shard_map(lambda t: jaxdp.global_norm(jax.tree.map(lambda x: x[0], t), "data")[None],
                                    mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))
  for norm in (by_pmap, unchecked):
    np.testing.assert_allclose(np.asarray(norm(local)), own, rtol=1e-6)
  same = jax.tree.map(lambda x: np.broadcast_to(x[:1], x.shape).copy(), local)
  agreed = jax.pmap(lambda t: jaxdp.global_norm(t, "data", agreed=True), axis_name="data", devices=jax.devices()[:n])
  np.testing.assert_allclose(np.asarray(agreed(same)), np.full(n, own[0]), rtol=1e-6)
  assert "all-reduce" in agreed.lower(same).compile().as_text()  # split and added, not summed whole


def assert_close(actual, expected):
  assert_close_elementwise(actual, expected, rtol=RTOL, atol=ATOL)
