"""Gradient accumulation and per-replica randomness.

Accumulation must equal one step on the whole global batch (a plain
single-device reference written here), communicate once per step however many
micro-batches there are, and hold only one micro-batch's activations.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import jaxdp

# Plumbing and float32 agreement, not speed: most XLA passes skipped while this module runs (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compiles")

ROWS = 12  # the largest per-device portion: divisible by every accum_steps drawn (1..4)
FEATURES = 3
# float32 sums over at most 8 * 12 rows, reordered by device and micro-batch split:
# differences stay within a few ulps of values of order 1, so 1e-5 relative / 1e-6 absolute.
RTOL, ATOL = 1e-5, 1e-6


def loss_fn(params, batch):
  hidden = jnp.tanh(batch["x"] @ params["dense"]["w"] + params["dense"]["b"][None, :])
  return 0.5 * (hidden @ params["out"] - batch["y"]) ** 2


def init_params(seed):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {
      "dense": {"w": jax.random.normal(k1, (FEATURES, 4)) * 0.5, "b": jnp.zeros((4,))},
      "out": jax.random.normal(k2, (4,)) * 0.5,
  }


@functools.partial(jax.jit, static_argnums=0)
def reference_step(optimizer, params, opt_state, x, y, w):
  """One plain single-device step on the real rows of the global batch.

  Jitted: one compile per optimizer and row count (run eagerly, every operation compiled anew for each new
  row count).
  """

  def mean_loss(p):
    losses = loss_fn(p, {"x": x, "y": y})
    return jnp.sum(losses * w) / jnp.sum(w)

  loss, grads = jax.value_and_grad(mean_loss)(params)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def portions(draw, n_devices):
  rng = np.random.default_rng(draw(st.integers(0, 2**16)))
  sizes = [int(s) for s in rng.integers(0, ROWS + 1, n_devices)]
  sizes[rng.integers(n_devices)] = ROWS  # pins the padded size to ROWS
  xs = [rng.normal(size=(s, FEATURES)).astype(np.float32) for s in sizes]
  ys = [rng.normal(size=(s,)).astype(np.float32) for s in sizes]
  ws = [rng.uniform(0, 2, size=(s,)).astype(np.float32) * (rng.random() > 0.2) for s in sizes]
  return xs, ys, ws


# Adam's eps is raised from 1e-8: with the default, a gradient component that is ~0 up to
# round-off becomes a full-lr step of random sign, which no tolerance on the params survives.
# Each factory returns one shared instance: the jitted reference is keyed by it (a static argument).
OPTIMIZERS = {
    "sgd": functools.cache(lambda: optax.sgd(0.1)),
    "adam": functools.cache(lambda: optax.adam(0.05, eps=1e-3)),
}


@settings(max_examples=12)
@given(data=st.data())
def test_accumulation_equals_whole_batch_reference(data):
  n = data.draw(st.sampled_from([1, 2, 3, 4, 8]), label="devices")
  accum = data.draw(st.sampled_from([1, 2, 3, 4]), label="accum_steps")
  optimizer = OPTIMIZERS[data.draw(st.sampled_from(sorted(OPTIMIZERS)), label="optimizer")]()
  steps = data.draw(st.integers(1, 3), label="steps")
  xs, ys, ws = portions(data.draw, n)
  mesh = jaxdp.data_mesh(jax.devices()[:n])
  batch, weights = jaxdp.shard_uneven([{"x": x, "y": y} for x, y in zip(xs, ys)], mesh, weights=ws)

  params = init_params(0)
  state = jaxdp.init_state(params, optimizer, mesh)
  step = jaxdp.make_train_step(loss_fn, optimizer, mesh, accum_steps=accum)
  ref_params, ref_opt = params, optimizer.init(params)
  x, y, w = (np.concatenate(a) for a in (xs, ys, ws))
  for _ in range(steps):
    state, metrics = step(state, batch, weights)
    if w.sum() > 0:
      ref_params, ref_opt, ref_loss = reference_step(optimizer, ref_params, ref_opt, x, y, w)
      np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(metrics["weight"], w.sum(), rtol=RTOL)
    jaxdp.assert_replicas_equal(state)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), state.params, ref_params)


@pytest.mark.parametrize("reduction", jaxdp.REDUCTIONS)
@pytest.mark.parametrize("backend", jaxdp.BACKENDS)
def test_accumulation_matches_one_micro_batch_for_every_reduction(reduction, backend):
  """K micro-batches give what one pass over the same per-device slice gives, whatever the reduction."""
  n = 4
  mesh = jaxdp.data_mesh(jax.devices()[:n])
  rng = np.random.default_rng(1)
  sizes = [ROWS, 5, 0, 9]
  batches = [{"x": rng.normal(size=(s, FEATURES)).astype(np.float32), "y": rng.normal(size=(s,)).astype(np.float32)} for s in sizes]
  batch, weights = jaxdp.shard_uneven(batches, mesh)
  optimizer = optax.adam(0.05, eps=1e-3)
  results = {}
  for accum in (1, 3, 4):
    state = jaxdp.init_state(init_params(2), optimizer, mesh)
    step = jaxdp.make_train_step(loss_fn, optimizer, mesh, reduction=reduction, backend=backend, accum_steps=accum)
    for _ in range(2):
      state, metrics = step(state, batch, weights)
    results[accum] = (jaxdp.per_replica(state.params), jaxdp.per_replica(metrics))
  for accum in (3, 4):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), results[accum], results[1])


def _mlp_loss(params, batch):
  hidden = jax.nn.relu(batch["x"] @ params["w1"])
  return 0.5 * (hidden @ params["w2"] - batch["y"]) ** 2


def _compiled(accum, micro_rows, n=4):
  mesh = jaxdp.data_mesh(jax.devices()[:n])
  params = {"w1": jnp.full((32, 256), 0.01), "w2": jnp.full((256,), 0.01)}
  optimizer = optax.sgd(0.1)
  rows = n * accum * micro_rows
  batch = {"x": np.ones((rows, 32), np.float32), "y": np.ones((rows,), np.float32)}
  step = jaxdp.make_train_step(_mlp_loss, optimizer, mesh, accum_steps=accum)
  return step.lower(jaxdp.init_state(params, optimizer, mesh), batch).compile()


def _loop_bodies(hlo: str) -> dict[str, str]:
  """``{name: text}`` of the computations that are bodies of a ``while`` in ``hlo``."""
  names = set(re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", hlo))
  bodies = {}
  for name in names:
    start = hlo.index("\n" + ("%" if "\n%" + name in hlo else "") + name + " ")
    bodies[name] = hlo[start:hlo.index("\n}", start)]
  return bodies


def test_all_reduce_count_does_not_grow_with_accum_steps():
  """One all-reduce per step whatever K: the count in the HLO is flat, and none sits inside the scan's loop (a
  collective in a loop body counts once in the HLO but runs K times)."""
  hlos = {k: _compiled(k, micro_rows=16).as_text() for k in (1, 2, 4, 8)}
  counts = {k: jaxdp.collectives_from_hlo(hlo, 4)["all-reduce"].count for k, hlo in hlos.items()}
  assert counts[1] >= 1, counts
  assert len(set(counts.values())) == 1, f"all-reduce ops per step depend on accum_steps: {counts}"
  assert _loop_bodies(hlos[8]), "accum_steps=8 compiles to a loop"
  for k, hlo in hlos.items():
    for name, body in _loop_bodies(hlo).items():
      assert not re.search(r"\ball-reduce(-start)?\(", body), f"an all-reduce in loop body {name} at K={k}"


def test_temporary_memory_follows_micro_batch_not_accum_steps():
  temp = {k: _compiled(k, micro_rows=64).memory_analysis().temp_size_in_bytes for k in (1, 2, 4, 8)}
  # The activations of one micro-batch (64 rows x 256 hidden x 4 B = 64 KiB per device) dominate;
  # were all K micro-batches live at once, K=8 would need about 8x what K=1 needs.
  assert temp[8] < 2 * temp[1], temp
  assert temp[8] <= 1.1 * temp[2], temp
  same_total = {k: _compiled(k, micro_rows=64 // k).memory_analysis().temp_size_in_bytes for k in (1, 8)}
  assert same_total[8] < same_total[1], same_total


def _dropout_loss(params, batch, rng):
  keep = jax.random.bernoulli(rng, 0.5, batch["x"].shape)
  return 0.5 * ((batch["x"] * keep) @ params["w"] - batch["y"]) ** 2


def _dropout_run(reduction, seed, steps=3, n=4, accum=1):
  mesh = jaxdp.data_mesh(jax.devices()[:n])
  optimizer = optax.sgd(0.1)
  state = jaxdp.init_state({"w": jnp.ones((FEATURES,))}, optimizer, mesh)
  # Every replica gets the same rows, so only the keys can make them differ.
  x = np.tile(np.arange(8 * FEATURES, dtype=np.float32).reshape(8, FEATURES) / 10, (n, 1))
  batch = {"x": x, "y": np.ones((len(x),), np.float32)}
  step = jaxdp.make_train_step(_dropout_loss, optimizer, mesh, reduction=reduction, check_replicas=True, accum_steps=accum)
  losses, divergence = [], []
  for _ in range(steps):
    state, metrics = step(state, batch, None, jax.random.key(seed))
    losses.append(np.asarray(jaxdp.per_replica(metrics["loss"])))
    divergence.append(float(metrics["replica_divergence"]))
  return state, np.stack(losses), divergence


def test_keys_differ_between_replicas_and_steps():
  _, losses, divergence = _dropout_run("none", seed=0)
  assert all(d > 0 for d in divergence), "identical data and identical keys on every replica"
  assert all(len(np.unique(row)) > 1 for row in losses), losses  # replicas draw different masks
  assert len(np.unique(losses[:, 0])) == len(losses), losses  # one replica draws anew each step


def test_keys_differ_between_micro_batches():
  """With identical micro-batches, K=2 must not reuse one mask: it would equal K=1 on half the rows."""
  _, losses, _ = _dropout_run("none", seed=0, steps=1, n=1, accum=2)
  _, doubled, _ = _dropout_run("none", seed=0, steps=1, n=1, accum=1)
  assert not np.array_equal(losses, doubled)


def test_same_seed_is_bitwise_reproducible_and_replicas_stay_equal():
  state_a, losses_a, divergence = _dropout_run("mean", seed=7)
  state_b, losses_b, _ = _dropout_run("mean", seed=7)
  _, losses_c, _ = _dropout_run("mean", seed=8)
  np.testing.assert_array_equal(losses_a, losses_b)
  jax.tree.map(np.testing.assert_array_equal, jaxdp.per_replica(state_a), jaxdp.per_replica(state_b))
  jaxdp.assert_replicas_equal(state_a)
  assert divergence == [0.0] * len(divergence)
  assert not np.array_equal(losses_a, losses_c)


def test_accum_steps_that_do_not_divide_the_slice_are_refused():
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  optimizer = optax.sgd(0.1)
  state = jaxdp.init_state(init_params(0), optimizer, mesh)
  step = jaxdp.make_train_step(loss_fn, optimizer, mesh, accum_steps=4)
  batch = {"x": np.ones((12, FEATURES), np.float32), "y": np.ones((12,), np.float32)}  # 6 rows per device
  with pytest.raises(ValueError, match="accum_steps"):
    step(state, batch)
  with pytest.raises(ValueError, match="accum_steps"):
    jaxdp.make_train_step(loss_fn, optimizer, mesh, accum_steps=0)
  state, _ = jaxdp.make_train_step(loss_fn, optimizer, mesh, accum_steps=3)(state, batch)  # still usable
  assert int(state.step) == 1


def test_shard_uneven_pads_to_a_size_that_splits_into_micro_batches():
  """The last batch of an epoch, 3/3/2 rows on 3 devices, padded to its largest portion (3) does not split into 2
  micro-batches; the error now points to rows=, which pads every device to a size that does."""
  mesh = jaxdp.data_mesh(jax.devices()[:3])
  opt = optax.sgd(0.1)
  rng = np.random.default_rng(0)
  parts = [{"x": rng.normal(size=(n, 2)).astype(np.float32), "y": rng.normal(size=(n,)).astype(np.float32)}
           for n in (3, 3, 2)]
  loss_fn = lambda p, b: (b["x"] @ p["w"] - b["y"]) ** 2  # noqa: E731
  state = jaxdp.init_state({"w": np.ones((2,), np.float32)}, opt, mesh)
  step = jaxdp.make_train_step(loss_fn, opt, mesh, accum_steps=2)
  with pytest.raises(ValueError, match=r"split into accum_steps=2 micro-batches.*shard_uneven .*rows= a multiple of 2"):
    step(state, *jaxdp.shard_uneven(parts, mesh))
  with pytest.raises(ValueError, match=r"rows must be an integer >= 3"):
    jaxdp.shard_uneven(parts, mesh, rows=2)
  batch, weights = jaxdp.shard_uneven(parts, mesh, rows=4)
  assert batch["x"].shape == (12, 2) and float(weights.sum()) == 8
  state, metrics = step(state, batch, weights)
  whole = jax.tree.map(lambda *a: np.concatenate(a), *parts)
  np.testing.assert_allclose(metrics["loss"], np.mean(loss_fn({"w": np.ones((2,), np.float32)}, whole)), rtol=1e-6)
