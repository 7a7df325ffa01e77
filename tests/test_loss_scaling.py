"""Dynamic loss scaling (jaxdp.core.loss_scaling): the scale's trajectory against torch GradScaler's rules written
plainly here, skipped steps leaving the state as it was, float16 on 4 devices against 1, bad inputs refused before
donation, and the scale through a checkpoint."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxdp
from helpers import mesh_of
from jaxdp import CheckpointManager

pytestmark = pytest.mark.usefixtures("fast_compiles")

LR, MOMENTUM = 0.05, 0.9
OPT = optax.sgd(LR, momentum=MOMENTUM)
D_IN, D_HID, D_OUT, BATCH = 4, 8, 2, 16


def init_params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w1": np.asarray(jax.random.normal(k1, (D_IN, D_HID)), np.float32) / 2,
          "w2": np.asarray(jax.random.normal(k2, (D_HID, D_OUT)), np.float32) / 3}


def loss_fn(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"])
  return jnp.sum((h @ params["w2"] - batch["y"]) ** 2, axis=-1)


def batch_at(i, poison=None):
  """Step ``i``'s batch; ``poison``: ``inf`` or ``nan`` put in one row of the second device's quarter."""
  rng = np.random.default_rng(100 + i)
  x = rng.normal(size=(BATCH, D_IN)).astype(np.float32)
  y = rng.normal(size=(BATCH, D_OUT)).astype(np.float32)
  if poison is not None:
    x[BATCH // 4 + 1, 2] = poison
  return {"x": x, "y": y}


def reference_gradient(params, batch):
  """The gradient of the mean loss, float64, written out by hand (the chain rule of loss_fn)."""
  x, y = np.float64(batch["x"]), np.float64(batch["y"])
  w1, w2 = np.float64(params["w1"]), np.float64(params["w2"])
  h = np.tanh(x @ w1)
  d_out = 2 * (h @ w2 - y) / len(x)
  d_h = (d_out @ w2.T) * (1 - h**2)
  return {"w1": x.T @ d_h, "w2": h.T @ d_out}


def gradscaler(scale, good, found_inf, applied, *, growth=2.0, backoff=0.5, interval=3):
  """torch.amp.GradScaler.update's rule (_amp_update_scale_), on Python floats."""
  if found_inf:
    return scale * backoff, 0
  if not applied:  # no update this step (zero weight): torch would not call update; nothing changes
    return scale, good
  if good + 1 == interval:
    return scale * growth, 0
  return scale, good + 1


# The script: "ok", "inf"/"nan" (one device's row), "zero" (every weight 0).
SCRIPT = ["ok", "ok", "ok", "inf", "ok", "zero", "ok", "ok", "nan", "nan", "ok", "ok", "ok", "ok"]


def run_script(step, state, script):
  history = []
  for i, kind in enumerate(script):
    poison = {"inf": np.inf, "nan": np.nan}.get(kind)
    weights = np.zeros((BATCH,), np.float32) if kind == "zero" else None
    before = jaxdp.gather_state(state)
    state, metrics = step(state, batch_at(i, poison), weights)
    history.append((kind, before, {k: float(v) for k, v in metrics.items()}))
  return state, history


def check_against_reference(history, state, init_scale, interval, overflows=False):
  """The scale against GradScaler's rule, skipped steps against the state before them (bitwise), applied ones
  against SGD with momentum on the float64 gradient. ``overflows``: an "ok" step may overflow float16 by itself
  (its flag then decides). Returns the flags of the "ok" steps."""
  scale, good, flags = init_scale, 0, []
  params, velocity = init_params(), {k: np.zeros_like(v, np.float64) for k, v in init_params().items()}
  for i, (kind, before, metrics) in enumerate(history):
    after = jaxdp.gather_state(state) if i + 1 == len(history) else history[i + 1][1]
    assert metrics["loss_scale"] == scale, (i, kind, metrics["loss_scale"], scale)
    if kind == "ok":
      flags.append(metrics["nonfinite"])
    bad = kind in ("inf", "nan") or (overflows and kind == "ok" and metrics["nonfinite"] == 1)
    applied = kind == "ok" and not bad
    assert (metrics["nonfinite"], metrics["skipped"]) == (float(bad), float(not applied)), (i, kind, metrics)
    scale, good = gradscaler(scale, good, bad, applied, interval=interval)
    assert (float(after.loss_scale.scale), int(after.loss_scale.good_steps)) == (scale, good), (i, kind)
    if not applied:  # skipped: params, optimizer state and step as they were, bit for bit
      for a, b in zip(jax.tree.leaves((after.params, after.opt_state, after.step)),
                      jax.tree.leaves((before.params, before.opt_state, before.step))):
        np.testing.assert_array_equal(a, b)
      continue
    grads = reference_gradient(params, batch_at(i))  # optax.sgd with momentum, in float64
    velocity = {k: grads[k] + MOMENTUM * velocity[k] for k in grads}
    params = {k: params[k] - LR * velocity[k] for k in params}
    # float16 forward and backward (ulp 4.9e-4 at 0.5) against float64: measured 3e-4 after 10 steps (float32: 1e-7).
    for k in params:
      np.testing.assert_allclose(after.params[k], params[k], rtol=0, atol=1e-3, err_msg=f"step {i} {k}")
  return flags


def test_scale_follows_gradscaler_and_skipped_steps_change_nothing_else():
  scaling = jaxdp.dynamic_loss_scale(init_scale=2.0**6, growth_interval=3)
  mesh = mesh_of(4)
  state = jaxdp.init_state(init_params(), OPT, mesh, loss_scale=scaling.init())
  step = jaxdp.make_train_step(loss_fn, OPT, mesh, compute_dtype=jnp.float16, loss_scaling=scaling)
  state, history = run_script(step, state, SCRIPT)
  assert set(check_against_reference(history, state, 2.0**6, 3)) == {0.0}
  assert int(jaxdp.gather_state(state).step) == SCRIPT.count("ok")
  used = [metrics["loss_scale"] for _, _, metrics in history]
  assert (min(used), max(used)) == (32.0, 128.0)  # the script grows it and backs it off


def test_float16_overflows_from_two_to_the_sixteen_back_off():
  """torch's 2^16 on this model: its float16 backward pass overflows by itself (no Inf in its batch)."""
  scaling = jaxdp.dynamic_loss_scale(growth_interval=2)
  mesh = mesh_of(4)
  state = jaxdp.init_state(init_params(), OPT, mesh, loss_scale=scaling.init())
  step = jaxdp.make_train_step(loss_fn, OPT, mesh, compute_dtype=jnp.float16, loss_scaling=scaling)
  script = ["ok", "ok", "ok", "inf", "ok", "ok", "ok", "ok"]
  state, history = run_script(step, state, script)
  flags = check_against_reference(history, state, 2.0**16, 2, overflows=True)
  assert 1.0 in flags and 0.0 in flags  # overflows of its own, and steps that fit after the backoff


@pytest.mark.parametrize("init_scale", [2.0**10, 2.0**100])
def test_power_of_two_scaling_in_float32_changes_no_bit(init_scale):
  """In float32 the scale and its division are exact powers of two: the same bits as the unscaled step (also at
  2**100; 2**127, whose reciprocal is subnormal, is refused)."""
  mesh = mesh_of(2)
  scaling = jaxdp.dynamic_loss_scale(init_scale=init_scale)
  plain = jaxdp.make_train_step(loss_fn, OPT, mesh)
  scaled = jaxdp.make_train_step(loss_fn, OPT, mesh, loss_scaling=scaling)
  a = jaxdp.init_state(init_params(), OPT, mesh)
  b = jaxdp.init_state(init_params(), OPT, mesh, loss_scale=scaling.init())
  for i in range(2):
    a, _ = plain(a, batch_at(i))
    b, metrics = scaled(b, batch_at(i))
  for x, y in zip(jax.tree.leaves((a.params, a.opt_state)), jax.tree.leaves((b.params, b.opt_state))):
    np.testing.assert_array_equal(x, y)
  assert float(metrics["loss_scale"]) == init_scale and int(b.loss_scale.good_steps) == 2


SHORT = ["ok", "inf", "ok", "ok", "ok"]
@pytest.mark.parametrize("zero_stage, accum_steps", [(0, 1), (1, 2), (3, 1)])
def test_float16_on_four_devices_equals_one_device(zero_stage, accum_steps):
  """Below float16's overflow (a natural overflow depends on each device's partial sums, as in DDP, so only
  injected non-finite steps are the same on any split): the same scale, step and params as one device."""
  scaling = jaxdp.dynamic_loss_scale(init_scale=2.0**6, growth_interval=2)
  runs = []
  for n in (1, 4):
    mesh = mesh_of(n)
    state = jaxdp.init_state(init_params(), OPT, mesh, zero_stage=zero_stage, loss_scale=scaling.init())
    step = jaxdp.make_train_step(loss_fn, OPT, mesh, compute_dtype=jnp.float16, loss_scaling=scaling,
                                 zero_stage=zero_stage, accum_steps=accum_steps)
    state, history = run_script(step, state, SHORT)
    runs.append((jaxdp.gather_state(state), [m for _, _, m in history]))
  (one, one_metrics), (four, four_metrics) = runs
  assert [m["loss_scale"] for m in one_metrics] == [m["loss_scale"] for m in four_metrics] == [64, 64, 32, 32, 64]
  assert [m["skipped"] for m in four_metrics] == [0, 1, 0, 0, 0]
  np.testing.assert_array_equal(one.loss_scale.scale, four.loss_scale.scale)
  np.testing.assert_array_equal(one.step, four.step)
  for k in one.params:  # float16 sums over other splits: float16 round-off (ulp 4.9e-4 at 0.5)
    np.testing.assert_allclose(four.params[k], one.params[k], rtol=0, atol=5e-4)


def test_per_replica_train_step_matches_make_train_step():
  mesh = mesh_of(4)
  scaling = jaxdp.dynamic_loss_scale(init_scale=2.0**6, growth_interval=2)
  compiled = jaxdp.make_train_step(loss_fn, OPT, mesh, compute_dtype=jnp.float16, loss_scaling=scaling)
  want, _ = run_script(compiled, jaxdp.init_state(init_params(), OPT, mesh, loss_scale=scaling.init()), SHORT[:3])

  @jax.jit
  def step(state, batch, weights=None):
    return jax.shard_map(
        lambda s, b: jaxdp.train_step(loss_fn, OPT, s, b, compute_dtype=jnp.float16, loss_scaling=scaling),
        mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))(state, batch)

  got, _ = run_script(step, jaxdp.init_state(init_params(), OPT, mesh, loss_scale=scaling.init()), SHORT[:3])
  for x, y in zip(jax.tree.leaves(jaxdp.gather_state(got)), jax.tree.leaves(jaxdp.gather_state(want))):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
  assert float(got.loss_scale.scale) == 32.0


# --- Bad inputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({"growth_interval": 0}, "growth_interval must be an integer >= 1"),
    ({"growth_interval": -3}, "growth_interval must be an integer >= 1"),
    ({"growth_interval": 2.5}, "growth_interval must be an integer >= 1"),
    ({"backoff_factor": 0.0}, "backoff_factor must be positive"),
    ({"backoff_factor": 1.0}, r"backoff_factor must lie in \(0, 1\)"),
    ({"backoff_factor": 2.0}, r"backoff_factor must lie in \(0, 1\)"),
    ({"growth_factor": 1.0}, "growth_factor must be > 1"),
    ({"growth_factor": 0.5}, "growth_factor must be > 1"),
    ({"init_scale": 0.0}, "init_scale must be positive"),
    ({"init_scale": -4.0}, "init_scale must be positive"),
    ({"init_scale": float("inf")}, "init_scale must be positive, finite"),
    ({"init_scale": float("nan")}, "init_scale must be positive, finite"),
    ({"init_scale": 1e39}, "within float32's range"),
    # what the float32 state cannot hold exactly, or whose reciprocal is subnormal: the message names the range
    ({"init_scale": 2.0**127}, r"init_scale must be a power of two from 2\*\*-126 to 2\*\*126, got 2\*\*127"),
    ({"init_scale": 1e-40}, r"init_scale must be a power of two from 2\*\*-126 to 2\*\*126.*subnormal"),
    ({"init_scale": 2.0**-127}, r"init_scale must be a power of two from 2\*\*-126"),
    ({"init_scale": 1000.0}, r"init_scale must be a power of two.*got 1000.0.*exact only for a power of two"),
    ({"growth_factor": 3.0}, r"growth_factor must be a power of two from 2\*\*1 to 2\*\*126, got 3.0"),
    ({"growth_factor": 2.0**127}, r"growth_factor must be a power of two"),
    ({"backoff_factor": 0.3}, r"backoff_factor must be a power of two from 2\*\*-126 to 2\*\*-1, got 0.3"),
    ({"backoff_factor": 1e-40}, r"backoff_factor must be a power of two from 2\*\*-126"),
    ({"growth_interval": 2**31}, r"growth_interval must be an integer >= 1 and <= 2147483647 \(2\*\*31 - 1.*int32"),
    ({"growth_interval": 2**40}, r"growth_interval must be an integer >= 1 and <= 2147483647"),
])
def test_bad_settings_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jaxdp.dynamic_loss_scale(**kwargs)


def test_the_extreme_settings_are_accepted_and_the_scale_stays_where_its_reciprocal_is_normal():
  """2**-126 and 2**126 are the scales whose reciprocals are normal float32 numbers: accepted, and the update rule
  neither grows past 2**126 (torch would, to 2**127) nor backs off below 2**-126; a DynamicLossScale built by hand
  is checked as the factory checks it."""
  top = jaxdp.dynamic_loss_scale(init_scale=2.0**126, growth_interval=2**31 - 1)
  bottom = jaxdp.dynamic_loss_scale(init_scale=2.0**-126, backoff_factor=2.0**-126, growth_factor=2.0**126)
  assert (top.init_scale, bottom.init_scale) == (2.0**126, 2.0**-126)
  grow = jaxdp.update_loss_scale(top._replace(growth_interval=1), top.init(), nonfinite=False, applied=True)
  assert (float(grow.scale), int(grow.good_steps)) == (2.0**126, 0)
  back = jaxdp.update_loss_scale(bottom, bottom.init(), nonfinite=True, applied=False)
  assert (float(back.scale), int(back.good_steps)) == (2.0**-126, 0)
  half = jaxdp.update_loss_scale(top, top.init(), nonfinite=True, applied=False)
  assert float(half.scale) == 2.0**125
  with pytest.raises(ValueError, match=r"init_scale must be a power of two.*got 2\*\*127"):
    jaxdp.make_train_step(loss_fn, OPT, mesh_of(1), loss_scaling=jaxdp.DynamicLossScale(init_scale=2.0**127))


def test_state_and_step_that_disagree_are_refused_before_donation():
  mesh = mesh_of(2)
  scaling = jaxdp.dynamic_loss_scale()
  scaled = jaxdp.make_train_step(loss_fn, OPT, mesh, loss_scaling=scaling)
  plain = jaxdp.make_train_step(loss_fn, OPT, mesh)
  without = jaxdp.init_state(init_params(), OPT, mesh)
  with_scale = jaxdp.init_state(init_params(), OPT, mesh, loss_scale=scaling.init())
  with pytest.raises(ValueError, match=r"loss_scaling is given but state.loss_scale is None.*init_state"):
    scaled(without, batch_at(0))
  with pytest.raises(ValueError, match=r"state.loss_scale is set but the step has no loss_scaling"):
    plain(with_scale, batch_at(0))
  wrong = with_scale._replace(loss_scale=jaxdp.LossScale(jnp.ones((), jnp.float16), jnp.zeros((), jnp.int32)))
  with pytest.raises(ValueError, match=r"state.loss_scale.scale must be a float32 scalar"):
    scaled(wrong, batch_at(0))
  for leaf in jax.tree.leaves((without, with_scale)):  # nothing was donated: both states still run
    assert not leaf.is_deleted()
  plain(without, batch_at(0))
  with pytest.raises(TypeError, match="loss_scaling must be a jaxdp.DynamicLossScale"):
    jaxdp.make_train_step(loss_fn, OPT, mesh, loss_scaling=2.0**16)
  with pytest.raises(ValueError, match="loss_scaling with reduction='none'"):
    jaxdp.make_train_step(loss_fn, OPT, mesh, loss_scaling=scaling, reduction="none")
  with pytest.raises(TypeError, match="loss_scale must be a jaxdp.LossScale"):
    jaxdp.init_state(init_params(), OPT, mesh, loss_scale=2.0**16)


def test_per_replica_mismatch_is_refused_while_tracing():
  mesh = mesh_of(2)
  state = jaxdp.init_state(init_params(), OPT, mesh)
  step = jax.shard_map(lambda s, b: jaxdp.train_step(loss_fn, OPT, s, b, loss_scaling=jaxdp.dynamic_loss_scale()),
                       mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
  with pytest.raises(ValueError, match="loss_scaling is given but state.loss_scale is None"):
    step(state, batch_at(0))


# --- Checkpoints -----------------------------------------------------------------------------------


def test_loss_scale_survives_a_checkpoint_and_its_absence_too(tmp_path):
  mesh = mesh_of(2)
  scaling = jaxdp.dynamic_loss_scale(init_scale=2.0**6, growth_interval=2)
  step = jaxdp.make_train_step(loss_fn, OPT, mesh, compute_dtype=jnp.float16, loss_scaling=scaling, zero_stage=1)
  state = jaxdp.init_state(init_params(), OPT, mesh, zero_stage=1, loss_scale=scaling.init())
  state, _ = run_script(step, state, ["ok", "inf", "ok"])
  full = jaxdp.gather_state(state)
  assert (float(full.loss_scale.scale), int(full.loss_scale.good_steps)) == (32.0, 1)
  with CheckpointManager(tmp_path / "scaled", enable_async_checkpointing=False) as ckpt:
    ckpt.save(3, state)
    restored = ckpt.restore(params=init_params(), optimizer=OPT, mesh=mesh_of(4), zero_stage=3)
  got = jaxdp.gather_state(restored.state)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(full)):
    np.testing.assert_array_equal(a, b)
  assert isinstance(got.loss_scale, jaxdp.LossScale) and got.loss_scale.scale.dtype == np.float32
  with CheckpointManager(tmp_path / "plain", enable_async_checkpointing=False) as ckpt:
    ckpt.save(0, jaxdp.init_state(init_params(), OPT, mesh))
    assert ckpt.restore(params=init_params(), optimizer=OPT, mesh=mesh).state.loss_scale is None


def test_update_rule_keeps_a_scale_whose_growth_would_overflow_float32():
  """GradScaler keeps the scale when scale * growth_factor is not finite; the counter still restarts."""
  scaling = jaxdp.dynamic_loss_scale(growth_interval=1)
  big = jaxdp.LossScale(jnp.float32(3e38), jnp.int32(0))
  kept = jaxdp.update_loss_scale(scaling, big, nonfinite=False, applied=True)
  assert (float(kept.scale), int(kept.good_steps)) == (float(np.float32(3e38)), 0)
  grown = jaxdp.update_loss_scale(scaling, jaxdp.LossScale(jnp.float32(8.0), jnp.int32(0)), False, True)
  assert (float(grown.scale), int(grown.good_steps)) == (16.0, 0)
