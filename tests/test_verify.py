"""jaxdp.runtime.verify: a user's program checked against one device in float64, teacher-forced.

An exact layout (uneven real rows, a replica of padding only, ZeRO-3 too) is round-off; the same program with
a planted layout bug, DDP's ``rank_mean`` on uneven rows (a replica's mean counts as much as a full one's), is
caught at its first step. The thresholds are the verifier's own: float64 round-off is about 1e-16 relative,
the bug about 1e-1.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp import reductions
from jaxdp.runtime import verify
from helpers import mesh_of

pytestmark = pytest.mark.usefixtures("fast_compiles")


def loss_fn(params, batch):
  hidden = jax.nn.relu(batch["x"] @ params["w"] + params["b"][None, :])
  return jnp.sum((hidden @ params["v"] - batch["y"]) ** 2, axis=-1)


def _program(steps=3, rows=16):
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(5, 8)).astype(np.float32), "b": np.zeros(8, np.float32),
            "v": rng.normal(size=(8, 2)).astype(np.float32)}
  batches = []
  for _ in range(steps):
    weights = rng.uniform(0.5, 2.0, rows).astype(np.float32)
    weights[:rows // 4] = 0.0  # device 0 of 4 holds padding only; the others' real rows differ in weight
    weights[rows // 4:rows // 2] = (weights[rows // 4:rows // 2] > 1.5).astype(np.float32)
    batches.append(({"x": rng.normal(size=(rows, 5)).astype(np.float32),
                     "y": rng.normal(size=(rows, 2)).astype(np.float32)}, weights))
  return params, batches


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_an_exact_port_is_round_off(zero_stage):
  params, batches = _program()
  report = verify.verify(loss_fn, optax.adam(0.05), jaxdp.data_parallel(mesh_of(4), zero_stage=zero_stage), params,
                         batches)
  assert not report.diverged and report.first is None, str(report)
  assert len(report.forced) == len(report.free) == 3
  # float64: far below float32's round-off (~1e-7), so the comparison really ran in float64.
  assert report.worst < 1e-12, str(report)
  assert max(d.worst for d in report.free) < 1e-12
  assert str(report).startswith("round-off: over 3 teacher-forced float64 steps")
  assert not jax.config.read("jax_enable_x64")  # the caller's setting is back
  assert jnp.zeros(2).dtype == jnp.float32


def test_a_planted_layout_bug_is_caught_at_its_first_step():
  params, batches = _program()
  report = verify.verify(loss_fn, optax.adam(0.05), mesh_of(4), params, batches, steps=2,
                         reduction=reductions.rank_mean())
  assert report.diverged and report.first[0] == 1, str(report)
  # Adam's first update is about lr * sign(g) (scale-free), so the parameters barely part at step 1: the loss and
  # the optimizer's moments show it, and the parameters from step 2 on.
  assert report.forced[0].loss > 1e-2 and report.forced[0].opt_state > 1e-2
  assert report.forced[1].params > 1e-6
  assert str(report).startswith(f"divergence at step 1, {report.first[1]}")
  assert len(report.forced) == 2


def test_powersgd_is_verified_against_one_devices_powersgd():
  # Rank 1 from the first step on 4 devices with uneven rows: the replicas' error feedback enters only through its
  # sum, so one device's PowerSGD is the reference, teacher-forced and free-running (error feedback carried).
  params, batches = _program()
  report = verify.verify(loss_fn, optax.sgd(0.05), jaxdp.data_parallel(mesh_of(4), zero_stage=2), params, batches,
                         reduction=reductions.powersgd(1, start_iter=0, min_compression_rate=0))
  assert not report.diverged and report.worst < 1e-12, str(report)
  assert max(d.worst for d in report.free) < 1e-12, str(report)
  # A planted porting bug, each device's losses scaled by its own row count (a local mean), is caught at step 1.
  local_mean = lambda params, batch: loss_fn(params, batch) / batch["x"].shape[0]  # noqa: E731
  planted = verify.verify(local_mean, optax.sgd(0.05), mesh_of(4), params, batches[:2],
                          reduction=reductions.powersgd(1, start_iter=0, min_compression_rate=0))
  assert planted.diverged and planted.first[0] == 1, str(planted)
  with pytest.raises(ValueError, match="PowerSGD and a pipeline"):
    verify.verify(loss_fn, optax.sgd(0.1), jaxdp.data_parallel(
        jax.make_mesh((2, 2), ("stage", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2), layers="w",
        pipeline=jaxdp.pipeline(2)), params, batches, reduction=reductions.powersgd(1))


def test_bad_arguments():
  params, batches = _program(steps=1)
  with pytest.raises(ValueError, match="fewer than steps=2"):
    verify.verify(loss_fn, optax.sgd(0.1), mesh_of(2), params, batches, steps=2)
  with pytest.raises(ValueError, match="user reduction keeps a state per replica"):
    verify.verify(loss_fn, optax.sgd(0.1), mesh_of(2), params, batches,
                  reduction=reductions.onebit_adam(1e-3, warmup_steps=2).reduction)
  with pytest.raises(ValueError, match="rtol"):
    verify.verify(loss_fn, optax.sgd(0.1), mesh_of(2), params, batches, rtol=0)


def test_round_off_the_optimizer_amplifies_is_told_apart_from_a_divergence():
  """A bias before a mean subtraction (BatchNorm's) has a gradient that is round-off only; Adam with a tiny eps
  turns it into steps of about its learning rate, so the parameters part while the gradient agrees."""
  from jaxdp.adapters.batchnorm import masked_moments

  def centred(params, batch, *, weights):
    h = batch["x"] @ params["w"] + params["b"][None, :]
    h = h - masked_moments(h, weights).mean[None, :]
    return jnp.sum((jnp.tanh(h) @ params["v"] - batch["y"]) ** 2, axis=-1)

  params, batches = _program(steps=2)
  report = verify.verify(centred, optax.adam(0.1, eps=1e-30), mesh_of(4), params, batches)
  assert not report.diverged, str(report)
  assert report.amplified is not None and report.amplified[1] == "params['b']", report.forced
  assert report.forced[report.amplified[0] - 1].params > 1e-6
  assert "the optimizer amplifies round-off" in str(report)
