"""1-bit Adam (jaxdp.reductions.onebit_adam) against a plain per-replica numpy implementation of the same algorithm,
with uneven real rows per device and zero-weight padding; its settings refused with the setting named; its state
saved and restored by the CheckpointManager."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp.reductions import onebit

N, LR, WD, B1, B2, EPS, WARMUP, STEPS = 4, 0.05, 0.01, 0.9, 0.999, 1e-8, 2, 6


def loss_fn(params, batch):
  return 0.5 * jnp.sum((batch["x"] @ params["w"] + params["b"][None] - batch["y"]) ** 2, axis=-1)


def _batches():
  """STEPS batches of 16 rows (4 per device); per device 4, 3, 1 and 2 real rows, the rest zero-weight padding
  (which changes from step to step: Σw differs between steps)."""
  rng = np.random.default_rng(0)
  out = []
  for t in range(STEPS):
    x = rng.normal(size=(16, 5)).astype(np.float32)
    y = rng.normal(size=(16, 3)).astype(np.float32)
    weights = rng.integers(1, 4, size=16).astype(np.float32)
    real = [4, 3, 1, 2] if t % 2 == 0 else [2, 4, 3, 1]
    for d, k in enumerate(real):
      weights[4 * d + k:4 * d + 4] = 0
    out.append(({"x": x, "y": y}, weights))
  return out


def _params():
  rng = np.random.default_rng(1)
  return {"b": rng.normal(size=(3,)).astype(np.float32), "w": rng.normal(size=(5, 3)).astype(np.float32)}


def _compress(x):
  """Rows of x as sign · ‖row‖₂/√len (sign(0) = +1)."""
  scale = np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True))
  return np.where(x >= 0, 1.0, -1.0) * scale


def reference(params, batches):
  """1-bit Adam written plainly: N workers with their own errors, N servers with theirs, numpy float64."""
  p = {k: v.astype(np.float64) for k, v in params.items()}
  keys = sorted(p)  # the params' flattening order: b, then w
  size = sum(p[k].size for k in keys)
  n = -(-size // (8 * N)) * (8 * N)
  chunk = n // N
  momentum, worker_err, server_err = np.zeros(n), np.zeros((N, n)), np.zeros((N, chunk))
  mu = {k: np.zeros_like(v) for k, v in p.items()}
  nu = {k: np.zeros_like(v) for k, v in p.items()}
  for t, (batch, weights) in enumerate(batches):
    local = []
    for d in range(N):
      rows = slice(4 * d, 4 * d + 4)
      x, y, w = batch["x"][rows], batch["y"][rows], weights[rows]
      residual = w[:, None] * (x @ p["w"] + p["b"][None] - y)
      grads = {"b": residual.sum(0), "w": x.T @ residual}
      local.append(np.pad(np.concatenate([grads[k].ravel() for k in keys]), (0, n - size)))
    total_weight = weights.sum()
    if t < WARMUP:
      summed = np.sum(local, axis=0)
      momentum = B1 * momentum + (1 - B1) * summed
    else:
      sent = []
      for d in range(N):
        m = B1 * momentum + (1 - B1) * N * local[d] + worker_err[d]
        c = _compress(m.reshape(N, chunk))
        worker_err[d] = m - c.reshape(n)
        sent.append(c)
      synced = []
      for j in range(N):
        avg = np.mean([sent[d][j] for d in range(N)], axis=0) + server_err[j]
        c = _compress(avg[None])[0]
        server_err[j] = avg - c
        synced.append(c)
      summed = momentum = np.concatenate(synced)
    g, offset = {}, 0
    for k in keys:
      g[k] = (summed[offset:offset + p[k].size] / total_weight).reshape(p[k].shape)
      offset += p[k].size
    step = t + 1
    for k in keys:
      if t < WARMUP:
        mu[k] = B1 * mu[k] + (1 - B1) * g[k]
        nu[k] = B2 * nu[k] + (1 - B2) * g[k] ** 2
        v_hat = nu[k] / (1 - B2 ** step)
      else:
        mu[k] = np.where(nu[k] > 0, g[k], 0.0)  # no update where the warm-up saw no gradient
        v_hat = nu[k] / (1 - B2 ** WARMUP)
      update = (mu[k] / (1 - B1 ** step)) / (np.sqrt(v_hat) + EPS)
      p[k] = p[k] - LR * (update + WD * p[k])
  return p, momentum


@pytest.fixture(scope="module")
def trained():
  mesh = jaxdp.data_mesh(jax.devices()[:N])
  method = jaxdp.reductions.onebit_adam(LR, warmup_steps=WARMUP, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
  params = jax.tree.map(jnp.asarray, _params())
  state = jaxdp.init_state(params, method.optimizer, mesh, reduction=method.reduction)
  step = jaxdp.make_train_step(loss_fn, method.optimizer, mesh, reduction=method.reduction)
  states = [state]
  for batch, weights in _batches():
    state, _ = step(state, batch, weights)
    states.append(jax.tree.map(np.asarray, state))
  return states, step, method, mesh


def test_matches_a_plain_per_replica_reference(trained):
  states = trained[0]
  expected, momentum = reference(_params(), _batches())
  got = states[-1]
  for k in expected:
    np.testing.assert_allclose(got.params[k], expected[k], rtol=1e-5, atol=1e-5, err_msg=k)
  # Every replica holds the same synced momentum; the reference's, in gradient-sum units.
  stacked = np.asarray(got.compression.momentum)
  assert stacked.shape == (N, momentum.size)
  for d in range(N):
    np.testing.assert_allclose(stacked[d], momentum, rtol=2e-5, atol=2e-6)
  assert int(np.asarray(got.compression.count)[0]) == STEPS


def test_warmup_is_exact_adamw(trained):
  """During the warm-up the reduction is the exact all-reduce and the optimizer optax.adamw's update."""
  states, _, _, mesh = trained
  opt = optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
  state = jaxdp.init_state(jax.tree.map(jnp.asarray, _params()), opt, mesh)
  step = jaxdp.make_train_step(loss_fn, opt, mesh)
  for (batch, weights), ours in zip(_batches()[:WARMUP], states[1:WARMUP + 1]):
    state, _ = step(state, batch, weights)
    for k in ("b", "w"):
      np.testing.assert_allclose(ours.params[k], np.asarray(state.params[k]), rtol=1e-6, atol=1e-7)


def test_the_compressed_step_sends_one_bit_per_value():
  """The compressed program's collectives: an all-to-all of the signs (1 bit per value) and a psum of the servers'
  chunks, no float32 all-reduce of the gradient."""
  mesh = jaxdp.data_mesh(jax.devices()[:N])
  settings = jaxdp.reductions.onebit_adam(LR, warmup_steps=1).settings._replace(warmup_steps=0)
  reduction = onebit.reduction(settings)
  opt = optax.sgd(0.1)
  params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}  # loss_fn's shapes: x [16, 64], y [16, 32]
  batch = {"x": np.ones((16, 64), np.float32), "y": np.ones((16, 32), np.float32)}
  state = jaxdp.init_state(params, opt, mesh, reduction=reduction)
  step = jaxdp.make_train_step(loss_fn, opt, mesh, reduction=reduction)
  report = jaxdp.comm_report(step, state, batch, compiled=False)
  n = onebit.padded_size(params, N)  # 2,048 + 32 values, padded to a multiple of 32
  assert report["all-to-all"].count == 2  # the signs and the scales
  assert report["all-to-all"].traffic_bytes == pytest.approx((N - 1) / N * (n / 8 + 4 * N))
  exact = 2 * (N - 1) / N * 4 * n
  sent = sum(c.traffic_bytes for c in report.values())
  assert sent < exact / 10


@pytest.mark.parametrize("kwargs, match", [
    ({"warmup_steps": 0}, "warmup_steps"),
    ({"warmup_steps": 1.5}, "warmup_steps"),
    ({"warmup_steps": 2, "b1": 1.0}, "b1"),
    ({"warmup_steps": 2, "b2": -0.1}, "b2"),
    ({"warmup_steps": 2, "eps": 0.0}, "eps"),
    ({"warmup_steps": 2, "weight_decay": -1.0}, "weight_decay"),
    ({"warmup_steps": 2, "weight_decay": float("nan")}, "weight_decay"),
])
def test_settings_are_refused_with_their_name(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    jaxdp.reductions.onebit_adam(1e-3, **kwargs)
  with pytest.raises(ValueError, match="learning_rate"):
    jaxdp.reductions.onebit_adam(-1.0, warmup_steps=2)


def test_a_state_for_other_devices_is_refused_before_anything_runs(trained):
  states, step, method, _ = trained
  other = jaxdp.init_state(jax.tree.map(jnp.asarray, _params()), method.optimizer,
                           jaxdp.data_mesh(jax.devices()[:2]), reduction=method.reduction)
  before = jax.tree.map(np.asarray, other)
  batch, weights = _batches()[0]
  with pytest.raises(ValueError):
    step(other, batch, weights)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, other), before)


def test_the_state_is_checkpointed(trained, tmp_path):
  """Saved after the freeze and restored onto a fresh target, the state trains on to the same parameters."""
  states, step, method, mesh = trained
  mid = jax.tree.map(jnp.asarray, states[WARMUP + 1])
  with jaxdp.CheckpointManager(tmp_path / "ckpt") as manager:
    manager.save(WARMUP + 1, mid)
    manager.wait()
    restored = manager.restore(params=jax.tree.map(jnp.asarray, _params()), optimizer=method.optimizer,
                               layout=mesh, reduction=method.reduction).state
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored), states[WARMUP + 1])
  assert isinstance(restored.compression, onebit.OneBitAdamState)
  state = restored
  for batch, weights in _batches()[WARMUP + 1:]:
    state, _ = step(state, batch, weights)
  for k in ("b", "w"):
    np.testing.assert_allclose(np.asarray(state.params[k]), states[-1].params[k], rtol=1e-6, atol=1e-7)
