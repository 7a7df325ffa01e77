"""DiLoCo over an outer axis, checked against plain single-device references written here.

Each reference is a Python loop: every replica group takes its step on its
own block of rows (the weighted mean of its rows' losses, one device), and
every H steps the groups' deltas are averaged, weighted by each group's
summed weights over the period, and applied by the outer optimizer
(Nesterov SGD written out by hand). With H = 1, inner SGD and outer SGD at
learning rate 1 that is the exact step of the global weighted mean, which
is checked against its own plain reference. The HLO of the two compiled
programs shows where the outer axis is crossed; bad inputs are refused
before anything runs or is donated.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import jaxdp
from jaxdp.analysis.reports import hlo_collectives
from jaxdp.sharding.layout import state_specs
from helpers import float64

# Plumbing and float32 agreement, not speed: most XLA passes skipped while this module runs (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compiles")

FEATURES, HIDDEN = 3, 4
ROWS = 8  # global batch: 2 groups x 2 devices x 2 rows
# The step and the references sum the same float32 numbers in other orders (per device, then all-reduced):
# a few ulps of values of order 1, compounded over at most six steps.
RTOL, ATOL = 2e-5, 2e-6


def loss_fn(params, batch):
  hidden = jnp.tanh(batch["x"] @ params["w"] + params["b"][None])
  return (hidden @ params["v"] - batch["y"]) ** 2


def make_params(seed=0):
  keys = jax.random.split(jax.random.key(seed), 2)
  return {"w": jax.random.normal(keys[0], (FEATURES, HIDDEN)), "b": jnp.zeros((HIDDEN,)),
          "v": jax.random.normal(keys[1], (HIDDEN,))}


def make_batches(n, seed=1):
  rng = np.random.RandomState(seed)
  out = []
  for _ in range(n):
    batch = {"x": rng.randn(ROWS, FEATURES).astype(np.float32), "y": rng.randn(ROWS).astype(np.float32)}
    weights = rng.uniform(0.2, 3.0, ROWS).astype(np.float32)
    weights[rng.randint(ROWS)] = 0.0  # a padding row
    out.append((batch, weights))
  return out


def mesh_of(replicas, data):
  devices = np.asarray(jax.devices()[:replicas * data]).reshape(replicas, data)
  return jax.sharding.Mesh(devices, ("replica", "data"), axis_types=(AxisType.Auto,) * 2)


def mean_grad(params, batch, weights):
  """The plain gradient of ``sum(w * loss) / sum(w)`` on one device, and ``sum(w)``."""
  def mean_loss(p):
    return jnp.sum(weights * loss_fn(p, batch)) / jnp.sum(weights)
  return jax.grad(mean_loss)(params), float(np.sum(weights))


def rows_of(group, n_groups, batch, weights):
  size = ROWS // n_groups
  block = slice(group * size, (group + 1) * size)
  return jax.tree.map(lambda x: x[block], batch), weights[block]


def nesterov(lr, momentum):
  """Outer SGD with Nesterov momentum, by hand: ``m = g + mu m``, ``p -= lr (g + mu m)``."""
  def step(params, grads, m):
    m = jax.tree.map(lambda g, t: g + momentum * t, grads, m)
    return jax.tree.map(lambda p, g, t: p - lr * (g + momentum * t), params, grads, m), m
  return step


def close(actual, expected):
  jax.tree.map(lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=RTOL, atol=ATOL),
               actual, expected)


@pytest.mark.parametrize("accum_steps", [1, 2])
def test_h1_sgd_is_the_exact_global_step(accum_steps):
  mesh = mesh_of(2, 2)
  params, lr = make_params(), 0.3
  state = jaxdp.init_diloco_state(params, optax.sgd(lr), mesh, outer_optimizer=optax.sgd(1.0))
  step = jaxdp.make_diloco_step(loss_fn, optax.sgd(lr), mesh, inner_steps=1, outer_optimizer=optax.sgd(1.0),
                                accum_steps=accum_steps)
  expected = params
  for batch, weights in make_batches(3):
    state, metrics = step(state, batch, weights)
    grads, total = mean_grad(expected, batch, weights)
    expected = jax.tree.map(lambda p, g: p - lr * g, expected, grads)
    close(jaxdp.diloco_params(state), expected)
    assert int(metrics["synced"]) == 1
    np.testing.assert_allclose(np.sum(metrics["weight"]), total, rtol=1e-6)
  # Every group restarts from the outer parameters.
  close(state.inner.params, jax.tree.map(lambda p: np.stack([p, p]), expected))


def test_h3_adam_nesterov_matches_the_plain_loop():
  mesh, groups, h, lr = mesh_of(2, 2), 2, 3, 0.05
  params = make_params(2)
  state = jaxdp.init_diloco_state(params, optax.adam(lr), mesh)
  step = jaxdp.make_diloco_step(loss_fn, optax.adam(lr), mesh, inner_steps=h)
  # The reference: each group's own Adam on its own rows; the outer step written out.
  adam = optax.adam(lr)
  outer, momentum = params, jax.tree.map(jnp.zeros_like, params)
  inner = [params] * groups
  inner_opt = [adam.init(params) for _ in range(groups)]
  period = [0.0] * groups
  outer_step = nesterov(0.7, 0.9)
  for t, (batch, weights) in enumerate(make_batches(2 * h, seed=3)):
    state, metrics = step(state, batch, weights)
    for g in range(groups):
      grads, total = mean_grad(inner[g], *rows_of(g, groups, batch, weights))
      updates, inner_opt[g] = adam.update(grads, inner_opt[g], inner[g])
      inner[g] = optax.apply_updates(inner[g], updates)
      period[g] += total
    if (t + 1) % h == 0:
      share = [w / sum(period) for w in period]
      delta = jax.tree.map(lambda o, *ps: sum(s * (o - p) for s, p in zip(share, ps)), outer, *inner)
      outer, momentum = outer_step(outer, delta, momentum)
      inner, period = [outer] * groups, [0.0] * groups
      assert int(metrics["synced"]) == 1
    else:
      assert int(metrics["synced"]) == 0
    close(state.outer_params, outer)
    close(state.inner.params, jax.tree.map(lambda *ps: np.stack(ps), *inner))
    close(state.inner.opt_state, jax.tree.map(lambda *xs: np.stack(xs), *inner_opt))
    np.testing.assert_allclose(np.asarray(state.period_weight), period, rtol=1e-6)
  assert int(state.inner_step) == 2 * h


def test_groups_agree_after_each_sync_and_differ_between():
  mesh, h = mesh_of(2, 2), 2
  state = jaxdp.init_diloco_state(make_params(), optax.adam(0.05), mesh)
  step = jaxdp.make_diloco_step(loss_fn, optax.adam(0.05), mesh, inner_steps=h)
  for t, (batch, weights) in enumerate(make_batches(2 * h, seed=4)):
    state, _ = step(state, batch, weights)
    # Within a group the devices hold the same values always; the outer state is the same everywhere.
    jaxdp.assert_replicas_equal(state)
    first, second = (jax.tree.map(lambda x, i=i: np.asarray(x[i]), state.inner.params) for i in range(2))
    if (t + 1) % h == 0:
      jax.tree.map(np.testing.assert_array_equal, first, second)
      jax.tree.map(np.testing.assert_array_equal, first, jax.tree.map(np.asarray, state.outer_params))
    else:
      assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)))


def test_bf16_and_int8_deltas_are_close_to_float32():
  mesh, h = mesh_of(2, 2), 2
  results, outer_bytes = [], []
  for delta_dtype in (None, jnp.bfloat16, jnp.int8):
    state = jaxdp.init_diloco_state(make_params(), optax.adam(0.05), mesh)
    step = jaxdp.make_diloco_step(loss_fn, optax.adam(0.05), mesh, inner_steps=h, delta_dtype=delta_dtype)
    for batch, weights in make_batches(h, seed=5):
      state, _ = step(state, batch, weights)
    results.append(state.outer_params)
    # Before optimisation (XLA's CPU backend widens a bfloat16 all-reduce to float32 when it compiles).
    outer_bytes.append(h * step.bytes_per_step(state, batch, weights, compiled=False, outer_only=True))
  size = sum(x.size for x in jax.tree.leaves(results[0]))
  blocks = -(-size // jaxdp.runtime.diloco.INT8_BLOCK)
  # The delta, and the period's weights (4 bytes); for int8 the values padded to whole blocks and a scale each.
  assert outer_bytes == [4 * size + 4, 2 * size + 4, blocks * jaxdp.runtime.diloco.INT8_BLOCK + 4 * blocks + 4]
  # The outer step moves the parameters by about 0.7 x 1.9 x delta, deltas of order lr x h = 0.1: bfloat16 keeps 8
  # bits of each; int8 rounds each group's share to 1/63 of its block's largest magnitude (2 groups).
  for result, atol in zip(results[1:], (2e-3, 5e-3)):
    jax.tree.map(lambda a, b, atol=atol: np.testing.assert_allclose(a, b, atol=atol), result, results[0])
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(results[0])))


def test_int8_sum_of_equal_deltas_does_not_overflow():
  # Four groups on the same rows: equal deltas, each block's largest value the same sign on every group, the
  # worst case for the int8 sum (4 x 31 <= 127). A wrapped sum would be off by about twice the delta.
  mesh, lr = mesh_of(4, 1), 0.5
  batch, weights = make_batches(1, seed=6)[0]
  batch, weights = jax.tree.map(lambda x: np.concatenate([x[:2]] * 4), (batch, weights))
  weights[:] = 1.0
  results = []
  for delta_dtype in (None, jnp.int8):
    state = jaxdp.init_diloco_state(make_params(), optax.sgd(lr), mesh, outer_optimizer=optax.sgd(1.0))
    step = jaxdp.make_diloco_step(loss_fn, optax.sgd(lr), mesh, inner_steps=1, outer_optimizer=optax.sgd(1.0),
                                  delta_dtype=delta_dtype)
    state, _ = step(state, batch, weights)
    results.append(jax.tree.map(np.asarray, state.outer_params))
  moved = max(np.max(np.abs(a - b)) for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(make_params())))
  assert moved > 1e-2
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=moved / 31), results[1], results[0])


def test_hlo_inner_stays_in_the_group_and_sync_all_reduces_the_delta():
  mesh = mesh_of(2, 4)  # groups of 4 devices; the outer axis spans 2
  params = make_params()
  state = jaxdp.init_diloco_state(params, optax.sgd(0.1), mesh)
  step = jaxdp.make_diloco_step(loss_fn, optax.sgd(0.1), mesh, inner_steps=5)
  batch, weights = make_batches(1)[0]
  inner = hlo_collectives(step.lower_inner(state, batch, weights).compile().as_text())
  sync = hlo_collectives(step.lower_sync(state, batch, weights).compile().as_text())
  param_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
  assert inner and all(op.group == 4 for op in inner), [(op.kind, op.group) for op in inner]
  outer_ops = [op for op in sync if op.group == 2]
  assert [op.kind for op in outer_ops] == ["all-reduce"] * len(outer_ops)
  assert sum(op.nbytes for op in outer_ops) == param_bytes + 4  # the delta, and the period's weights
  assert sorted((op.kind, op.group) for op in sync if op.group == 4) == sorted((op.kind, op.group) for op in inner)
  period = step.bytes_per_step(state, batch, weights)
  inner_bytes = sum(op.nbytes for op in inner)
  np.testing.assert_allclose(period, (5 * inner_bytes + param_bytes + 4) / 5)
  np.testing.assert_allclose(step.bytes_per_step(state, batch, weights, outer_only=True), (param_bytes + 4) / 5)


def _leaves_alive_and_equal(state, copy):
  for leaf, kept in zip(jax.tree.leaves(state), jax.tree.leaves(copy)):
    assert not leaf.is_deleted()
    np.testing.assert_array_equal(np.asarray(leaf), kept)


@pytest.mark.parametrize("inner_steps", [0, -2, 1.5, True, None])
def test_bad_inner_steps(inner_steps):
  with pytest.raises(ValueError, match="inner_steps must be an integer >= 1"):
    jaxdp.make_diloco_step(loss_fn, optax.sgd(0.1), mesh_of(2, 2), inner_steps=inner_steps)


def test_bad_meshes_and_options():
  with pytest.raises(ValueError, match="DiLoCo without an outer axis"):
    jaxdp.make_diloco_step(loss_fn, optax.sgd(0.1), jaxdp.data_mesh(jax.devices()[:4]), inner_steps=2)
  with pytest.raises(ValueError, match="DiLoCo without an outer axis"):
    jaxdp.init_diloco_state(make_params(), optax.sgd(0.1), jaxdp.data_mesh(jax.devices()[:4]))
  with pytest.raises(ValueError, match="also one of the data axes"), pytest.warns(DeprecationWarning):
    jaxdp.make_diloco_step(loss_fn, optax.sgd(0.1), mesh_of(2, 2), outer_axis="data", inner_steps=2)
  three = jax.make_mesh((2, 1, 2), ("replica", "model", "data"), axis_types=(AxisType.Auto,) * 3)
  with pytest.raises(ValueError, match="besides the data axes"):
    jaxdp.make_diloco_step(loss_fn, optax.sgd(0.1), three, inner_steps=2)
  with pytest.raises(ValueError, match="every axis of the mesh .* is a data axis"):
    jaxdp.make_diloco_step(loss_fn, optax.sgd(0.1), jaxdp.data_parallel(mesh_of(2, 2), axis_name=("replica", "data")),
                           inner_steps=2)
  with pytest.raises(ValueError, match="reduction='none'"):
    jaxdp.make_diloco_step(loss_fn, optax.sgd(0.1), mesh_of(2, 2), inner_steps=2, reduction="none")
  for bad in (jnp.float16, jnp.int16, "float8"):
    with pytest.raises(ValueError, match="delta_dtype must be None, jnp.bfloat16 or jnp.int8"):
      jaxdp.make_diloco_step(loss_fn, optax.sgd(0.1), mesh_of(2, 2), inner_steps=2, delta_dtype=bad)


def test_the_outer_axis_is_the_meshs_other_axis_and_the_old_keyword_gives_the_same_bits(tmp_path):
  """Any name: the groups' axis is the one the layout's data axes leave. jaxdp 0.1's outer_axis= still runs, the
  same bits after a DeprecationWarning, at every entry point; one naming another axis is refused."""
  devices = np.asarray(jax.devices()[:4]).reshape(2, 2)
  mesh = jax.sharding.Mesh(devices, ("groups", "data"), axis_types=(AxisType.Auto,) * 2)
  layout, params, inner = jaxdp.data_parallel(mesh, axis_name="data"), make_params(), optax.sgd(0.1)
  assert jaxdp.runtime.diloco.outer_axis_of(layout) == "groups"
  batches = make_batches(2)
  new = _run(jaxdp.make_diloco_step(loss_fn, inner, layout, inner_steps=2),
             jaxdp.init_diloco_state(params, inner, layout), batches)
  assert new.inner.params["w"].sharding.spec == jax.sharding.PartitionSpec("groups")
  with pytest.warns(DeprecationWarning, match=r"outer_axis=.*one axis that is not a data axis"):
    old_step = jaxdp.make_diloco_step(loss_fn, inner, layout, outer_axis="groups", inner_steps=2)
  with pytest.warns(DeprecationWarning, match="outer_axis="):
    old = _run(old_step, jaxdp.init_diloco_state(params, inner, layout, outer_axis="groups"), batches)
  jax.tree.map(np.testing.assert_array_equal, old, new)
  with pytest.warns(DeprecationWarning, match="outer_axis="):
    abstract = jaxdp.runtime.diloco.abstract_diloco_state(params, inner, layout, outer_axis="groups")
  assert jax.tree.map(lambda x: x.sharding, abstract) == jax.tree.map(lambda x: x.sharding, new)
  with jaxdp.CheckpointManager(tmp_path, enable_async_checkpointing=False) as ckpt:
    ckpt.save(2, new)
    with pytest.warns(DeprecationWarning, match="outer_axis="):
      restored = ckpt.restore_diloco(params=params, inner_optimizer=inner, layout=layout, outer_axis="groups")
  jax.tree.map(np.testing.assert_array_equal, restored.state, new)
  with pytest.raises(ValueError, match="no 'replica' \\(outer_axis\\)"), pytest.warns(DeprecationWarning):
    jaxdp.init_diloco_state(params, inner, layout, outer_axis="replica")


def test_an_int8_delta_over_more_groups_than_its_levels_is_refused():
  """The int8 sum of R groups has 127 // R levels per group: none past 127 groups (every scale would be x / 0).
  No test mesh has 128 groups: the check make_diloco_step calls with the mesh's group count is tested alone."""
  from jaxdp.runtime import diloco

  diloco.check_int8_groups(jnp.dtype(jnp.int8), 127)
  diloco.check_int8_groups(jnp.dtype(jnp.bfloat16), 1000)
  with pytest.raises(ValueError, match=r"delta_dtype=jnp.int8 over 128 replica groups.*127 // R"):
    diloco.check_int8_groups(jnp.dtype(jnp.int8), 128)


def test_bad_inputs_leave_the_state_untouched():
  mesh = mesh_of(2, 2)
  state = jaxdp.init_diloco_state(make_params(), optax.sgd(0.1), mesh)
  copy = jax.tree.map(np.asarray, state)
  step = jaxdp.make_diloco_step(loss_fn, optax.sgd(0.1), mesh, inner_steps=2)
  batch, weights = make_batches(1)[0]
  six = jax.tree.map(lambda x: x[:6], batch)
  with pytest.raises(ValueError, match="does not split evenly over 4 devices"):
    step(state, six, weights[:6])
  _leaves_alive_and_equal(state, copy)
  other = jaxdp.init_diloco_state(make_params(), optax.sgd(0.1), mesh_of(4, 2))  # 4 groups, not 2
  with pytest.raises(ValueError, match="leading dimension of 2"):
    step(other, batch, weights)
  with pytest.raises(ValueError, match="outer_opt_state"):
    step(state._replace(outer_opt_state=optax.adam(0.1).init(state.outer_params)), batch, weights)
  _leaves_alive_and_equal(state, copy)
  with pytest.raises(TypeError, match="DiLoCoState"):
    step(state.inner, batch, weights)
  padded, _ = jaxdp.split_batch(six, jaxdp.data_mesh(jax.devices()[:4]))  # 6 rows padded to 8: needs its weights
  with pytest.raises(ValueError, match="weights is None, but batch was padded by jaxdp.split_batch"):
    step(state, padded)
  _leaves_alive_and_equal(state, copy)
  state, _ = step(state, batch, weights)  # and the step still runs on it


def test_train_lm_diloco_evaluates_the_outer_params_and_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
  """--diloco (int8 deltas) with --ckpt-dir, layer-wise ZeRO-3 inside the groups (--zero-stage 3 --scan-layers):
  the run evaluates the outer parameters, which every group holds after the last call's sync. Killed after step 3
  (mid-period: H = 2; the step-6 checkpoint removed) and started again with the same flags, the run's steps 3-5
  and its whole DiLoCo state are bitwise the uninterrupted run's."""
  import shutil

  from experiments import train_lm

  ckpt = tmp_path / "ckpt"
  config = train_lm.Config(
      mesh="replica=2,data=2", diloco_inner_steps=2, diloco_delta_dtype="int8", steps=6, batch_size=8, seq_len=16,
      layers=2, d_model=16, heads=2, d_ff=32, dropout=0.0, max_bytes=20_000, val_every=2, progress=False, out=None,
      ckpt_dir=str(ckpt), ckpt_every=3, zero_stage=3, scan_layers=True,
  )
  full = train_lm.train(config)
  state = full["state"]
  assert [r["step"] for r in full["records"]] == list(range(6)) and int(state.inner_step) == 6
  assert full["summary"]["layerwise"] and any("data" in x.sharding.spec for x in jax.tree.leaves(state.outer_params))
  assert np.isfinite(full["summary"]["val_loss"]) and full["summary"]["diloco_inner_steps"] == 2
  for group in range(2):
    jax.tree.map(lambda x, p, g=group: np.testing.assert_array_equal(np.asarray(x[g]), np.asarray(p)),
                 state.inner.params, full["params"])
  assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [3, 6]
  shutil.rmtree(ckpt / "6")  # as if killed before the last save
  resumed = train_lm.train(config)
  assert resumed["summary"]["start_step"] == 3 and [r["step"] for r in resumed["records"]] == [3, 4, 5]
  assert [r["loss"] for r in resumed["records"]] == [r["loss"] for r in full["records"][3:]]
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed["params"]), jax.device_get(full["params"]))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed["state"]), jax.device_get(full["state"]))


def test_train_lm_diloco_needs_a_replica_axis_and_passes_loss_scaling_to_the_groups():
  from experiments import train_lm

  config = train_lm.Config(
      mesh="replica=2,data=2", diloco_inner_steps=2, steps=2, batch_size=8, seq_len=16, layers=1, d_model=16,
      heads=2, d_ff=32, dropout=0.0, max_bytes=20_000, val_every=2, progress=False, out=None,
      compute_dtype="float16", loss_scaling="dynamic",
  )
  with pytest.raises(ValueError, match="needs --mesh replica=R,data=D"):
    train_lm.train(dataclasses.replace(config, mesh="data=4"))
  # --loss-scaling dynamic reaches the groups: each keeps its own scale (torch's first, 2**16, backed off by
  # float16 overflows), logged per step.
  scaled = train_lm.train(config)
  scales = np.asarray(scaled["state"].inner.loss_scale.scale)
  assert scales.shape == (2,) and np.all(scales <= 2.0**16)
  assert all(0 < r["loss_scale"] <= 2.0**16 and r["skipped"] in (0, 1) for r in scaled["records"])


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_a_nan_batch_skips_the_group_and_counts_as_in_the_exact_step(zero_stage):
  """A NaN row in group 0's block: that group keeps its parameters and adds no weight, group 1 applies its step;
  the call counts, and after max_consecutive_skips such calls the next raises before it runs or donates. The
  same with ZeRO-2 inside the groups (the update on the global arrays, vmapped over the groups)."""
  mesh, lr = jaxdp.data_parallel(mesh_of(2, 2), zero_stage=zero_stage), 0.3
  params = make_params()
  state = jaxdp.init_diloco_state(params, optax.sgd(lr), mesh)
  step = jaxdp.make_diloco_step(loss_fn, optax.sgd(lr), mesh, inner_steps=4, max_consecutive_skips=2)
  (batch, weights), (good, good_weights) = make_batches(2, seed=7)
  batch = jax.tree.map(np.copy, batch)
  batch["x"][0, 0] = np.nan  # group 0's first row
  before = jax.tree.map(np.asarray, state.inner.params)
  state, metrics = step(state, batch, weights)
  np.testing.assert_array_equal(np.asarray(metrics["skipped"]), [1, 0])
  np.testing.assert_array_equal(np.asarray(metrics["nonfinite"]), [1, 0])
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a)[0], b[0]), state.inner.params, before)
  grads, _ = mean_grad(params, *rows_of(1, 2, batch, weights))
  close(jax.tree.map(lambda x: x[1], state.inner.params), jax.tree.map(lambda p, g: p - lr * g, params, grads))
  np.testing.assert_allclose(np.asarray(state.period_weight)[0], 0.0)
  state, _ = step(state, batch, weights)  # two in a row: the limit
  copy = jax.tree.map(np.asarray, state)
  with pytest.raises(FloatingPointError, match="the last 2 steps all had a NaN or Inf .* replica group"):
    step(state, good, good_weights)
  _leaves_alive_and_equal(state, copy)
  assert step.consecutive_skips == 2
  step.reset_nonfinite_guard()
  state, metrics = step(state, good, good_weights)
  np.testing.assert_array_equal(np.asarray(metrics["skipped"]), [0, 0])
  state, _ = step(state, batch, weights)  # a good call in between restarts the count
  state, _ = step(state, good, good_weights)
  state, _ = step(state, batch, weights)
  state, _ = step(state, good, good_weights)
  assert step.consecutive_skips <= 1
  with pytest.raises(ValueError, match="max_consecutive_skips"):
    jaxdp.make_diloco_step(loss_fn, optax.sgd(lr), mesh, inner_steps=4, max_consecutive_skips=0)


def _run(step, state, batches):
  for batch, weights in batches:
    state, _ = step(state, batch, weights)
  return state


def test_a_checkpoint_resumes_bit_for_bit_and_refuses_another_group_count(tmp_path):
  """k steps, save (mid-period: the groups differ, the period's weights are not zero), restore, continue: the
  state equals the uninterrupted run's bit for bit. Another group count, or the TrainState restore, is refused."""
  mesh, h = mesh_of(2, 2), 2
  params, inner, outer = make_params(3), optax.adam(0.05), optax.sgd(0.7, momentum=0.9, nesterov=True)
  batches = make_batches(6, seed=8)
  make_step = lambda: jaxdp.make_diloco_step(loss_fn, inner, mesh, inner_steps=h)  # noqa: E731
  whole = _run(make_step(), jaxdp.init_diloco_state(params, inner, mesh), batches)
  first = _run(make_step(), jaxdp.init_diloco_state(params, inner, mesh), batches[:3])
  assert float(np.sum(np.asarray(first.period_weight))) > 0
  with jaxdp.CheckpointManager(tmp_path / "ckpt", enable_async_checkpointing=False) as ckpt:
    assert ckpt.save(3, first, metadata={"run": "diloco"})
    restored = ckpt.restore_diloco(params=params, inner_optimizer=inner, layout=jaxdp.data_parallel(mesh),
                                   outer_optimizer=outer)
    assert restored.step == 3 and restored.data_step == 3 and restored.metadata == {"run": "diloco"}
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), restored.state, first)
    assert restored.state.inner.params["w"].sharding.spec == jax.sharding.PartitionSpec("replica")
    resumed = _run(make_step(), restored.state, batches[3:])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), resumed, whole)
    # One device per group: the same values (each group's state is replicated within its group).
    narrow = ckpt.restore_diloco(params=params, inner_optimizer=inner, layout=mesh_of(2, 1)).state
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), narrow, first)
    with pytest.raises(ValueError, match="2 DiLoCo replica groups, but the mesh's outer axis 'replica' has 4"):
      ckpt.restore_diloco(params=params, inner_optimizer=inner, layout=mesh_of(4, 1))
    with pytest.raises(ValueError, match="holds a DiLoCo state.*restore_diloco"):
      ckpt.restore(params=params, optimizer=inner, layout=jaxdp.data_mesh(jax.devices()[:4]))
    with pytest.raises(ValueError, match="(?s)does not match the target state.*outer_opt_state"):
      ckpt.restore_diloco(params=params, inner_optimizer=inner, layout=mesh, outer_optimizer=optax.adam(0.1))
  with jaxdp.CheckpointManager(tmp_path / "plain", enable_async_checkpointing=False) as ckpt:
    ckpt.save(1, jaxdp.init_state(params, inner, jaxdp.data_mesh(jax.devices()[:2])))
    with pytest.raises(ValueError, match="holds a jaxdp.TrainState, not a DiLoCo state"):
      ckpt.restore_diloco(params=params, inner_optimizer=inner, layout=mesh)


def _loss_scaled(growth_interval=1):
  return jaxdp.precision(compute_dtype=jnp.float16, loss_scaling=jaxdp.dynamic_loss_scale(
      init_scale=2.0**8, growth_interval=growth_interval))


POLICIES = {  # name: (policy, parameter tolerance)
    # float16 and bfloat16 compute: each device computes what it computes in the exact step, on the same rows;
    # only float32 sums run in other orders.
    "float16 loss scaling": (_loss_scaled, RTOL),
    "bf16 compute": (lambda: jaxdp.precision(compute_dtype=jnp.bfloat16), RTOL),
    # bfloat16 sums over a group's 2 devices, where the exact step's are over 4: bfloat16's round-off.
    "bf16 reduction": (lambda: jaxdp.precision(reduce_dtype=jnp.bfloat16), 1e-2),
}


@pytest.mark.parametrize("policy", POLICIES)
def test_h1_sgd_with_a_precision_policy_is_the_exact_step_with_the_same_policy(policy):
  """With H = 1, inner SGD and outer SGD at 1, a precision policy inside the groups is the exact step under the
  same policy: the same parameters and, with loss scaling, step for step the same (growing) scale in every
  group."""
  mesh, lr = mesh_of(2, 2), 0.3
  params, (make_policy, rtol) = make_params(), POLICIES[policy]
  precision = make_policy()
  state = jaxdp.init_diloco_state(params, optax.sgd(lr), mesh, outer_optimizer=optax.sgd(1.0), precision=precision)
  step = jaxdp.make_diloco_step(loss_fn, optax.sgd(lr), mesh, inner_steps=1, outer_optimizer=optax.sgd(1.0),
                                precision=precision)
  layout = jaxdp.data_parallel(mesh, axis_name=("replica", "data"))
  exact_state = jaxdp.init_state(params, optax.sgd(lr), layout, precision=precision)
  exact = jaxdp.make_train_step(loss_fn, optax.sgd(lr), layout, precision=precision)
  for batch, weights in make_batches(3):
    state, metrics = step(state, batch, weights)
    exact_state, _ = exact(exact_state, batch, weights)
    jax.tree.map(lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol,
                                                         atol=rtol * np.max(np.abs(np.asarray(e)))),
                 state.outer_params, exact_state.params)
    np.testing.assert_array_equal(np.asarray(metrics["skipped"]), [0, 0])
    if precision.loss_scaling is not None:
      np.testing.assert_array_equal(np.asarray(state.inner.loss_scale.scale),
                                    np.full(2, float(exact_state.loss_scale.scale)))
  if precision.loss_scaling is not None:
    assert float(exact_state.loss_scale.scale) == 2.0**11  # grown after each of the 3 applied steps


def test_h1_sgd_with_hybrid_data_axes_inside_each_group_is_the_exact_step():
  """A group's data axes may be several (`("pod", "data")`): H = 1 with SGD is still the exact step."""
  devices = np.asarray(jax.devices()[:8]).reshape(2, 2, 2)
  mesh = jax.sharding.Mesh(devices, ("replica", "pod", "data"), axis_types=(AxisType.Auto,) * 3)
  group_layout = jaxdp.data_parallel(mesh, axis_name=("pod", "data"))
  params, lr = make_params(4), 0.3
  state = jaxdp.init_diloco_state(params, optax.sgd(lr), group_layout, outer_optimizer=optax.sgd(1.0))
  step = jaxdp.make_diloco_step(loss_fn, optax.sgd(lr), group_layout, inner_steps=1, outer_optimizer=optax.sgd(1.0))
  expected = params
  for batch, weights in make_batches(3, seed=9):
    state, _ = step(state, batch, weights)
    grads, _ = mean_grad(expected, batch, weights)
    expected = jax.tree.map(lambda p, g: p - lr * g, expected, grads)
    close(state.outer_params, expected)


def test_a_group_that_overflows_float16_backs_off_and_skips_alone_and_checkpoints_keep_its_scale(tmp_path):
  """An overflow in group 0's rows (a gradient past float16's range once scaled): group 0 skips and halves its scale, group 1
  applies its step and keeps its scale; a checkpoint mid-period restores every group's scale bitwise, and
  without the policy the restore is refused."""
  mesh, lr = mesh_of(2, 2), 0.3
  params, precision = make_params(), _loss_scaled(growth_interval=2000)
  inner = optax.sgd(lr)
  make_step = lambda: jaxdp.make_diloco_step(loss_fn, inner, mesh, inner_steps=3, precision=precision)  # noqa: E731
  (batch, weights), *rest = make_batches(4, seed=5)
  batch = jax.tree.map(np.copy, batch)
  batch["y"][0] = 1e5  # group 0's first row: its scaled gradient is past float16's largest value
  state = jaxdp.init_diloco_state(params, inner, mesh, precision=precision)
  step = make_step()
  state, metrics = step(state, batch, weights)
  np.testing.assert_array_equal(np.asarray(metrics["skipped"]), [1, 0])
  np.testing.assert_array_equal(np.asarray(state.inner.loss_scale.scale), [2.0**7, 2.0**8])
  jax.tree.map(lambda a, p: np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(p)), state.inner.params, params)
  # Group 1's step is the exact step under the same policy on its rows and devices.
  alone = jaxdp.data_mesh(jax.devices()[2:4])
  expected, _ = jaxdp.make_train_step(loss_fn, inner, alone, precision=precision)(
      jaxdp.init_state(params, inner, alone, precision=precision), *rows_of(1, 2, batch, weights))
  close(jax.tree.map(lambda x: x[1], state.inner.params), expected.params)
  assert step.consecutive_skips <= 1
  with jaxdp.CheckpointManager(tmp_path / "ckpt", enable_async_checkpointing=False) as ckpt:
    assert ckpt.save(1, state)
    saved = jax.tree.map(np.asarray, state)
    whole = _run(make_step(), state, rest)
    restored = ckpt.restore_diloco(params=params, inner_optimizer=inner, layout=mesh, precision=precision).state
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), restored, saved)
    resumed = _run(make_step(), restored, rest)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), resumed, whole)
    with pytest.raises(ValueError, match="(?s)does not match the target state.*loss_scale"):
      ckpt.restore_diloco(params=params, inner_optimizer=inner, layout=mesh)
  with pytest.raises(ValueError, match="loss_scaling is given but state.inner.loss_scale is None"):
    make_step()(jaxdp.init_diloco_state(params, inner, mesh), batch, weights)


def test_h1_sgd_with_layout_invariant_dropout_is_the_exact_step_with_the_same_ids():
  """With `example_ids=`, every group keeps the key and each row's dropout mask follows its id: H = 1 with SGD,
  dropout on, is the exact step with the same ids (whose masks are one device's, `test_randomness.py`)."""
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train):
      h = jaxdp.adapters.linen.Dropout(0.5, deterministic=not train)(nn.tanh(nn.Dense(8)(x)))
      return nn.Dense(1)(h)[:, 0]

  model = Net()

  def dropout_loss(params, batch, rng):
    return (model.apply({"params": params}, batch["x"], True, rngs={"dropout": rng}) - batch["y"]) ** 2

  mesh, lr = mesh_of(2, 2), 0.3
  params = model.init(jax.random.key(0), np.zeros((1, FEATURES), np.float32), False)["params"]
  state = jaxdp.init_diloco_state(params, optax.sgd(lr), mesh, outer_optimizer=optax.sgd(1.0))
  step = jaxdp.make_diloco_step(dropout_loss, optax.sgd(lr), mesh, inner_steps=1, outer_optimizer=optax.sgd(1.0),
                                example_ids="id")
  layout = jaxdp.data_parallel(mesh, axis_name=("replica", "data"))
  exact_state = jaxdp.init_state(params, optax.sgd(lr), layout)
  exact = jaxdp.make_train_step(dropout_loss, optax.sgd(lr), layout, example_ids="id")
  unfolded = jaxdp.make_diloco_step(dropout_loss, optax.sgd(lr), mesh, inner_steps=1, outer_optimizer=optax.sgd(1.0))
  other = jaxdp.init_diloco_state(params, optax.sgd(lr), mesh, outer_optimizer=optax.sgd(1.0))
  rng = jax.random.key(5)
  for batch, weights in make_batches(3, seed=11):
    batch = {**batch, "id": np.arange(ROWS, dtype=np.int32)}
    state, _ = step(state, batch, weights, rng)
    exact_state, _ = exact(exact_state, batch, weights, rng)
    other, _ = unfolded(other, batch, weights, rng)
    close(state.outer_params, exact_state.params)
  # Without example_ids the groups' keys differ (folded with the group's index): other masks, other parameters.
  assert not np.allclose(np.asarray(other.outer_params["Dense_1"]["kernel"]),
                         np.asarray(exact_state.params["Dense_1"]["kernel"]), rtol=1e-3)


def _each_group_on_its_own(loss_fn, params, model_state=None, reduction=None, h=2, steps=6, layout=None,
                           inner=None, batches=None, tolerance=None):
  """The DiLoCo step (Adam inside unless `inner`, the paper's Nesterov outside, 2 groups of 2 devices: on
  `layout`, default the (2, 2) mesh) against each group run as jaxdp's own step (ZeRO stage 0) on two other
  devices and the group's rows (its optimizer, model and reduction state carried on across syncs), with the
  outer step written out: checked after every call (to `tolerance`, `(rtol, atol)`). Returns the state."""
  groups = 2
  layout, inner = mesh_of(2, 2) if layout is None else layout, optax.adam(0.05) if inner is None else inner
  state = jaxdp.init_diloco_state(params, inner, layout, model_state=model_state, reduction=reduction)
  step = jaxdp.make_diloco_step(loss_fn, inner, layout, inner_steps=h, reduction=reduction)
  meshes = [jaxdp.data_mesh(jax.devices()[4 + 2 * g:6 + 2 * g]) for g in range(groups)]
  group_steps = [jaxdp.make_train_step(loss_fn, inner, m, reduction=reduction, donate=False) for m in meshes]
  group_states = [jaxdp.init_state(params, inner, m, model_state=model_state, reduction=reduction) for m in meshes]
  outer, momentum, period = params, jax.tree.map(jnp.zeros_like, params), [0.0] * groups
  outer_step = nesterov(0.7, 0.9)
  check = close if tolerance is None else lambda a, e: jax.tree.map(
      lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), *tolerance), a, e)
  for t, (batch, weights) in enumerate(make_batches(steps, seed=5) if batches is None else batches):
    state, metrics = step(state, batch, weights)
    for g in range(groups):
      group_states[g], group_metrics = group_steps[g](group_states[g], *rows_of(g, groups, batch, weights))
      period[g] = np.float32(period[g]) + np.float32(group_metrics["weight"])  # float32, as the state keeps it
    if (t + 1) % h == 0:
      share = [np.float32(w) / np.float32(sum(period)) for w in period]
      delta = jax.tree.map(lambda o, *ps: sum(s.astype(o.dtype) * (o - np.asarray(p)) for s, p in zip(share, ps)),
                           outer, *[s.params for s in group_states])
      outer, momentum = outer_step(outer, delta, momentum)
      group_states, period = [s._replace(params=outer) for s in group_states], [0.0] * groups
    check(state.outer_params, outer)
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *[s._replace(step=None) for s in group_states])
    check((state.inner.params, state.inner.opt_state, state.inner.model_state, state.inner.compression),
          (stacked.params, stacked.opt_state, stacked.model_state, stacked.compression))
  return state


def test_powersgd_inside_each_group_is_the_groups_own_powersgd_step(tmp_path):
  """PowerSGD (rank 1 from the second step, error feedback per replica) compresses each group's inner all-reduce:
  between syncs each group is jaxdp's PowerSGD step on its own two devices and rows (its state carried on across
  syncs), and the outer step is the plain one. A checkpoint restores it bit for bit; without reduction= the
  restore is refused."""
  params, inner = make_params(4), optax.adam(0.05)
  powersgd = jaxdp.reductions.powersgd(1, start_iter=1, min_compression_rate=1.0)  # w [3, 4] is compressed
  state = _each_group_on_its_own(loss_fn, params, reduction=powersgd)
  assert int(state.inner.compression.iteration[0]) == 6
  assert state_specs(state.inner).compression.error["w"] == jax.P("replica", "data")
  with jaxdp.CheckpointManager(tmp_path, enable_async_checkpointing=False) as ckpt:
    ckpt.save(6, state)
    restored = ckpt.restore_diloco(params=params, inner_optimizer=inner, layout=mesh_of(2, 2),
                                   reduction=powersgd).state
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), restored, state)
    with pytest.raises(ValueError, match="does not match the target state"):
      ckpt.restore_diloco(params=params, inner_optimizer=inner, layout=mesh_of(2, 2))
  step = jaxdp.make_diloco_step(loss_fn, inner, mesh_of(2, 2), inner_steps=2, reduction=powersgd)
  plain = jaxdp.init_diloco_state(params, inner, mesh_of(2, 2))  # made without reduction=: refused, naming the fix
  with pytest.raises(ValueError, match=r"init_diloco_state\(\.\.\., reduction=\)"):
    step(plain, *make_batches(1)[0])


def test_batchnorm_statistics_stay_each_groups_own():
  """jaxdp's BatchNorm in the groups: each group's statistics are its own rows' (exact over its two devices)
  and stay its own across syncs, which average only the parameters."""
  norm = jaxdp.adapters.linen.BatchNorm(use_running_average=False)

  def batchnorm_loss(params, batch, *, model_state, weights, train):
    h, updates = norm.clone(use_running_average=not train).apply(
        {"params": params["norm"], "batch_stats": model_state}, batch["x"] @ params["w"], mask=weights,
        mutable=["batch_stats"])
    return jaxdp.LossOutput((jnp.tanh(h) @ params["v"] - batch["y"]) ** 2, model_state=updates["batch_stats"])

  variables = norm.init(jax.random.key(1), jnp.zeros((2, HIDDEN)), mask=jnp.ones((2,)))
  params = {**make_params(6), "norm": variables["params"]}
  state = _each_group_on_its_own(batchnorm_loss, params, model_state=variables["batch_stats"])
  means = np.asarray(state.inner.model_state["mean"])
  assert not np.allclose(means[0], means[1])  # two groups, two sets of rows


def test_tensor_parallel_groups_equal_the_same_run_without_a_model_axis(tmp_path):
  """Each group's params split over a "model" axis (tensor parallelism inside the group, left to the compiler):
  the same DiLoCo run as on a mesh without the model axis, in float64, every call (two syncs), and a checkpoint
  restored onto the tensor-parallel layout bit for bit."""
  specs = {"w": jax.P(None, "model"), "b": jax.P("model"), "v": jax.P("model")}
  devices = np.asarray(jax.devices()[:8]).reshape(2, 2, 2)
  tp = jaxdp.data_parallel(jax.sharding.Mesh(devices, ("replica", "data", "model"), axis_types=(AxisType.Auto,) * 3),
                           param_specs=specs)
  assert jaxdp.runtime.diloco.outer_axis_of(tp) == "replica"
  inner = optax.adam(0.05)
  with float64():
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), make_params())
    runs = [({k: v.astype(np.float64) for k, v in b.items()}, w.astype(np.float64)) for b, w in make_batches(4)]
    states, traces = [], []
    for layout in (tp, jaxdp.data_parallel(mesh_of(2, 2))):
      state = jaxdp.init_diloco_state(params, inner, layout)
      step = jaxdp.make_diloco_step(loss_fn, inner, layout, inner_steps=2)
      trace = []
      for batch, weights in runs:
        state, metrics = step(state, batch, weights)
        trace.append(jax.device_get((state.outer_params, state.inner)))
      states.append(state)
      traces.append(trace)
      assert int(metrics["synced"]) == 1
    assert state_specs(states[0].inner).params["w"] == jax.P("replica", None, "model")
    assert states[0].outer_params["w"].sharding.spec == jax.P(None, "model")
    for got, want in zip(*traces):  # every call: the outer params and every group's whole state
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14), got, want)
    with jaxdp.CheckpointManager(tmp_path, enable_async_checkpointing=False) as ckpt:
      ckpt.save(4, states[0])
      restored = ckpt.restore_diloco(params=params, inner_optimizer=inner, layout=tp).state
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), restored, states[0])
    assert state_specs(restored.inner).params["w"] == jax.P("replica", None, "model")
  # bfloat16 deltas and a bfloat16 reduction with the model axis left to the compiler: on CPU summed in float32
  # and rounded (jaxdp.core.precision.summed_in: XLA's CPU backend does the same, and aborts on a 16-bit sum
  # there); the same numbers as on the mesh without the model axis.
  options = dict(delta_dtype=jnp.bfloat16, precision=jaxdp.precision(reduce_dtype=jnp.bfloat16))
  finals = []
  for layout in (tp, jaxdp.data_parallel(mesh_of(2, 2))):
    state = jaxdp.init_diloco_state(make_params(), inner, layout)
    step = jaxdp.make_diloco_step(loss_fn, inner, layout, inner_steps=2, **options)
    finals.append(jax.device_get(_run(step, state, make_batches(2)).outer_params))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), *finals)


def stacked_loss(params, batch):
  """The module's model with a stack of layers between `w` and `v` (`jaxdp.scan_layers`: layer-wise ZeRO-3
  gathers it a layer at a time, a pipeline splits it over the stages)."""
  hidden = jnp.tanh(batch["x"] @ params["w"] + params["b"][None])
  hidden, _ = jaxdp.scan_layers(lambda h, p, _: (jnp.tanh(h @ p["u"] + p["c"][None]), None), hidden,
                                params["blocks"])
  return (hidden @ params["v"] - batch["y"]) ** 2


def _group_layouts():
  """ZeRO, layer-wise ZeRO-3 and each pipeline schedule inside DiLoCo's 2 groups (2 data devices each, and 2
  stages for a pipeline)."""
  mesh = mesh_of(2, 2)
  staged = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), ("replica", "stage", "data"),
                             axis_types=(AxisType.Auto,) * 3)
  return {
      "zero1": jaxdp.data_parallel(mesh, zero_stage=1),
      "zero2": jaxdp.data_parallel(mesh, zero_stage=2),
      "zero3": jaxdp.data_parallel(mesh, zero_stage=3),
      "layerwise": jaxdp.data_parallel(mesh, zero_stage=3, layers="blocks"),
      "gpipe_zero2": jaxdp.data_parallel(staged, zero_stage=2, layers="blocks", pipeline=jaxdp.pipeline(2)),
      "circular_zero3": jaxdp.data_parallel(staged, zero_stage=3, layers="blocks",
                                            pipeline=jaxdp.pipeline(2, "circular", repeats=2)),
      "1f1b": jaxdp.data_parallel(staged, layers="blocks", pipeline=jaxdp.pipeline(2, "1f1b")),
  }


@pytest.mark.parametrize("name", list(_group_layouts()))
def test_zero_and_pipelines_inside_the_groups_are_each_groups_own_step(name, tmp_path):
  """ZeRO 1-3, layer-wise ZeRO-3 or a pipeline (GPipe, circular, 1F1B) inside each group: in float64 every call
  (three syncs) equals each group run as jaxdp's plain step (stage 0, no pipeline) on two devices and its rows,
  with the outer Nesterov step written out, with an optimizer that reads the whole gradient (clipping by the
  global norm, then Adam). The state is split as make_train_step splits one group's (and the outer state like
  one group's), and a checkpoint restores onto the layout bit for bit."""
  layout = _group_layouts()[name]
  inner = optax.chain(optax.clip_by_global_norm(0.3), optax.adam(0.05))
  with float64():
    base = jax.tree.map(lambda x: np.asarray(x, np.float64), make_params(6))
    keys = jax.random.split(jax.random.key(7), 2)
    params = {**base, "blocks": {"u": np.asarray(jax.random.normal(keys[0], (4, HIDDEN, HIDDEN)), np.float64) * 0.5,
                                 "c": np.asarray(jax.random.normal(keys[1], (4, HIDDEN)), np.float64) * 0.1}}
    batches = [({k: v.astype(np.float64) for k, v in b.items()}, w.astype(np.float64))
               for b, w in make_batches(6, seed=9)]
    state = _each_group_on_its_own(stacked_loss, params, h=2, layout=layout, inner=inner, batches=batches,
                                   tolerance=(1e-12, 1e-13))
    specs = state_specs(state)
    split = lambda optimizer: jaxdp.sharding.layout.make_layout(  # noqa: E731
        jaxdp.TrainState.create(params, optimizer), layout.mesh, "data", layout.zero_stage, None, layout.layers,
        layout.stage_axis).specs
    group = jax.tree.map(lambda spec: jax.P("replica", *spec), split(inner), is_leaf=lambda x: isinstance(x, jax.P))
    assert (specs.inner.params, specs.inner.opt_state) == (group.params, group.opt_state)
    outer = split(jaxdp.runtime.diloco.default_outer_optimizer())
    assert (specs.outer_params, specs.outer_opt_state) == (outer.params, outer.opt_state)
    if layout.zero_stage == 3:  # each device holds a slice of every group's and of the outer parameters
      assert "data" in specs.inner.params["v"] and "data" in specs.outer_params["v"]
    with jaxdp.CheckpointManager(tmp_path, enable_async_checkpointing=False) as ckpt:
      ckpt.save(6, state)
      restored = ckpt.restore_diloco(params=params, inner_optimizer=inner, layout=layout).state
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), restored, state)
    assert state_specs(restored) == specs
