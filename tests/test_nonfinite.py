"""A NaN or Inf on one replica makes every replica skip the step together.

The decision is collective (made inside the step from an all-reduced count),
so the replicas stay bitwise equal, and a run that keeps producing non-finite
gradients stops with a clear error instead of skipping for ever.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp

N = 4


def loss_fn(params, batch):
  return 0.5 * (batch["x"] @ params["w"] - batch["y"]) ** 2


def _setup(zero_stage=0, max_consecutive_skips=10, reduction="mean"):
  mesh = jaxdp.data_mesh(jax.devices()[:N])
  optimizer = optax.adam(0.1)
  state = jaxdp.init_state({"w": jnp.arange(3.0)}, optimizer, mesh, zero_stage=zero_stage)
  step = jaxdp.make_train_step(
      loss_fn, optimizer, mesh, zero_stage=zero_stage, reduction=reduction,
      check_replicas=True, max_consecutive_skips=max_consecutive_skips,
  )
  return mesh, state, step


def _batch(poison_device=None):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(N * 2, 3)).astype(np.float32)
  y = rng.normal(size=(N * 2,)).astype(np.float32)
  if poison_device is not None:
    x[2 * poison_device, 0] = np.nan  # one row of one device's slice
  return {"x": x, "y": y}


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_nan_on_one_replica_skips_everywhere_and_training_continues(zero_stage):
  _, state, step = _setup(zero_stage)
  state, clean = step(state, _batch())
  before = jaxdp.gather_state(state)
  state, metrics = step(state, _batch(poison_device=2))
  assert int(metrics["nonfinite"]) == 1 and int(metrics["skipped"]) == 1
  assert float(metrics["replica_divergence"]) == 0.0
  jaxdp.assert_replicas_equal(state)
  after = jaxdp.gather_state(state)
  jax.tree.map(np.testing.assert_array_equal, after, before)  # nothing moved, step count included
  state, metrics = step(state, _batch())  # and the run goes on
  assert int(metrics["skipped"]) == 0 and int(state.step) == 2
  assert np.isfinite(jaxdp.gather_state(state).params["w"]).all()


def test_inf_in_the_loss_is_caught_too():
  _, state, step = _setup()
  batch = _batch()
  batch["y"][5] = np.inf
  state, metrics = step(state, batch)
  assert int(metrics["skipped"]) == 1 and int(state.step) == 0


def test_reduction_none_decides_per_replica():
  """Without agreement only the poisoned replica skips; the others step (and diverge, as 'none' does)."""
  _, state, step = _setup(reduction="none")
  state, metrics = step(state, _batch(poison_device=1))
  steps = jaxdp.per_replica(state.step)
  np.testing.assert_array_equal(steps, [1, 0, 1, 1])


def test_too_many_consecutive_skips_raise_before_running():
  _, state, step = _setup(max_consecutive_skips=2)
  poisoned = _batch(poison_device=0)
  state, _ = step(state, poisoned)
  state, _ = step(state, poisoned)
  jax.block_until_ready(state)  # flags are read once their steps are done (at the latest two calls later)
  with pytest.raises(FloatingPointError, match="max_consecutive_skips"):
    step(state, _batch())
  jaxdp.assert_replicas_equal(state)  # not donated: the caller still holds the last good state
  assert int(state.step) == 0


def test_a_good_step_resets_the_count():
  _, state, step = _setup(max_consecutive_skips=2)
  for batch in [_batch(0), _batch(), _batch(1), _batch(), _batch(3)]:
    state, metrics = step(state, jax.block_until_ready(batch))
    jax.block_until_ready(state)  # so that the next call reads this step's flag (it never waits for it)
  assert step.consecutive_skips == 0  # counted up to the previous call's step
  state, _ = step(state, _batch())
  assert step.consecutive_skips == 1


def test_bad_max_consecutive_skips():
  mesh = jaxdp.data_mesh(jax.devices()[:N])
  with pytest.raises(ValueError, match="max_consecutive_skips"):
    jaxdp.make_train_step(loss_fn, optax.sgd(0.1), mesh, max_consecutive_skips=0)
