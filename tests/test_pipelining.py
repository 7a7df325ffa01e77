"""Pipeline parallelism over a stage axis (jaxdp.sharding.pipelining), composed with exact data parallelism.

Every pipelined step is compared with an independent single-device reference written plainly here: a Python
loop over the layers, ``jax.grad`` of ``Σ w·l / Σ w`` over the whole batch, the optax update, 5 steps.
"""

import functools

import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, PartitionSpec as P

import jaxdp
from helpers import assert_close_to_scale as assert_close
from helpers import float64
from jaxdp.sharding import pipelining

pytestmark = pytest.mark.usefixtures("fast_compiles")

LAYERS, WIDTH, FEATURES, ROWS, STEPS = 8, 4, 3, 16, 5


def init_params(seed=0):
  k = jax.random.split(jax.random.key(seed), 5)
  return {
      "embed": np.asarray(jax.random.normal(k[0], (FEATURES, WIDTH)) * 0.6),
      "blocks": {"w": np.asarray(jax.random.normal(k[1], (LAYERS, WIDTH, WIDTH)) * 0.6),
                 "b": np.asarray(jax.random.normal(k[2], (LAYERS, WIDTH)) * 0.1)},
      "head": np.asarray(jax.random.normal(k[3], (WIDTH, 2)) * 0.6),
      "scale": np.asarray(jax.random.normal(k[4], (LAYERS,)) * 0.3),  # per-layer inputs (xs), not stacked
  }


def layer(h, p, x):
  return jnp.tanh((h @ p["w"] + p["b"][None, :]) * (1 + x)), None


def loss_fn(params, batch):
  h = jnp.tanh(batch["x"] @ params["embed"])
  h, _ = jaxdp.scan_layers(layer, h, params["blocks"], params["scale"])
  return jnp.sum((h @ params["head"] - batch["y"]) ** 2, axis=-1)


def reference_loss(params, x, y, w):
  h = jnp.tanh(x @ params["embed"])
  for i in range(LAYERS):  # a plain loop over the layers
    h = jnp.tanh((h @ params["blocks"]["w"][i] + params["blocks"]["b"][i][None, :]) * (1 + params["scale"][i]))
  losses = jnp.sum((h @ params["head"] - y) ** 2, axis=-1)
  return jnp.sum(w * losses) / jnp.sum(w)


def batches(steps=STEPS, rows=ROWS, seed=1):
  """Uneven weights; step 0's second half (a whole data shard at data=2) has weight 0; a padding row each step."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(steps):
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    y = rng.normal(size=(rows, 2)).astype(np.float32)
    w = rng.uniform(0.25, 2.0, size=rows).astype(np.float32)
    w[rows - 3] = 0.0
    if i == 0:
      w[rows // 2:] = 0.0
    out.append(({"x": x, "y": y}, w))
  return out


def reference_run(opt, data, params=None):
  params = jax.tree.map(jnp.asarray, init_params() if params is None else params)
  opt_state = opt.init(params)
  grad = jax.jit(jax.grad(reference_loss))
  for batch, w in data:
    g = grad(params, batch["x"], batch["y"], w)
    updates, opt_state = opt.update(g, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params


def adam():
  return optax.adam(1e-2)


def clip_adamw():
  return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))


OPTIMIZERS = {"adam": adam, "clip_adamw": clip_adamw}


def stage_mesh(stages, data=1, replica=None):
  if replica is None:
    shape, names = (stages, data), ("stage", "data")
  else:
    shape, names = (stages, replica, data), ("stage", "replica", "data")
  devices = np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


@functools.cache
def built(stages, data, microbatches, schedule="gpipe", repeats=1, optimizer="adam", zero_stage=0, accum_steps=1,
          replica=None, gather="step"):
  """``(step, optimizer, mesh, axis_name)``, built once per module: tests that can share a compiled step do."""
  opt, mesh = OPTIMIZERS[optimizer](), stage_mesh(stages, data, replica)
  axis_name = "data" if replica is None else ("replica", "data")
  step = jaxdp.make_train_step(loss_fn, opt, mesh, axis_name=axis_name, zero_stage=zero_stage, accum_steps=accum_steps,
                               layers="blocks", check_replicas=zero_stage > 0,
                               pipeline=jaxdp.pipeline(microbatches, schedule, repeats=repeats, gather=gather))
  return step, opt, mesh, axis_name


def train(step, mesh, opt, data, axis_name="data", zero_stage=0):
  state = jaxdp.init_state(init_params(), opt, mesh, axis_name=axis_name, zero_stage=zero_stage, layers="blocks")
  for batch, w in data:
    state, metrics = step(state, batch, w)
  return state, metrics


def test_circular_assignment():
  # L = 8 over P = 2 stages, R = 2: blocks of 2 layers; stage 0 holds blocks 0 and 2, stage 1 blocks 1 and 3.
  order = pipelining.circular_order(np.arange(LAYERS), 2, 2)
  np.testing.assert_array_equal(order, [0, 1, 4, 5, 2, 3, 6, 7])
  np.testing.assert_array_equal(pipelining.natural_order(order, 2, 2), np.arange(LAYERS))
  # The table's layer block (w // M)·P + s at stage s is the r-th block that stage holds.
  table = pipelining.schedule_table(2, 2, 2)
  for t, s in zip(*np.nonzero(table != pipelining.IDLE)):
    repeat, _ = pipelining.unit_of(table[t, s], 2)
    block = repeat * 2 + s
    np.testing.assert_array_equal(order.reshape(2, 2, 2)[s, repeat], [2 * block, 2 * block + 1])


# A covering subset of P ∈ {2, 4} × M ∈ {1, P, 2P} × schedule ∈ {gpipe, circular R=2} × data ∈ {absent, 2} ×
# optimizer ∈ {adam, clip+adamw}: every value of every factor and every schedule × P × data pair once (8 compiled
# steps); the pipeline experiment runs the full product.
CASES = [
    # (stages, microbatches, schedule, repeats, data, optimizer)
    (2, 1, "gpipe", 1, 1, "adam"),
    (2, 4, "gpipe", 1, 2, "clip_adamw"),
    (4, 4, "gpipe", 1, 2, "adam"),
    (4, 8, "gpipe", 1, 1, "clip_adamw"),
    (2, 2, "circular", 2, 1, "clip_adamw"),
    (2, 4, "circular", 2, 2, "adam"),
    (4, 4, "circular", 2, 2, "clip_adamw"),
    (4, 8, "circular", 2, 1, "adam"),
]


@pytest.mark.parametrize("stages,microbatches,schedule,repeats,data,optimizer", CASES)
def test_equals_one_device(stages, microbatches, schedule, repeats, data, optimizer):
  step, opt, mesh, _ = built(stages, data, microbatches, schedule, repeats, optimizer)
  runs = batches()
  state, metrics = train(step, mesh, opt, runs)
  assert int(metrics["skipped"]) == 0 and int(state.step) == STEPS
  assert_close(state.params, reference_run(opt, runs))


@pytest.mark.parametrize("schedule,repeats", [("circular", 2), ("gpipe", 1)])
@pytest.mark.parametrize("zero_stage,accum_steps,replica", [(1, 2, None), (2, 1, 2)])
def test_zero_accumulation_and_replicas(zero_stage, accum_steps, replica, schedule, repeats):
  # ZeRO 1 with accum_steps=2 on ("stage", "data"); ZeRO 2 on ("stage", "replica", "data") (hybrid: split over data).
  step, opt, mesh, axis_name = built(2, 2, 2, schedule, repeats, "clip_adamw", zero_stage, accum_steps, replica)
  runs = batches()
  state, metrics = train(step, mesh, opt, runs, axis_name=axis_name, zero_stage=zero_stage)
  assert float(metrics["replica_divergence"]) == 0.0
  assert_close(state.params, reference_run(opt, runs))
  specs = jaxdp.state_specs(state)
  assert specs.params["blocks"]["w"][0] == "stage" and specs.params["head"] == jax.sharding.PartitionSpec()
  mu = specs.opt_state[1][0].mu if zero_stage else None
  assert mu["blocks"]["w"][0] == "stage" and "data" in jax.tree.leaves(tuple(mu["blocks"]["w"]))


def reference_means(params, data):
  loss = sum(float(reference_loss(params, b["x"], b["y"], w) * np.sum(w)) for b, w in data)
  weight = sum(float(np.sum(w)) for _, w in data)
  return loss / weight, weight


@pytest.mark.parametrize("schedule,repeats", [("gpipe", 1), ("circular", 2), ("1f1b", 1), ("1f1b", 2)])
def test_eval_on_the_pipeline_mesh(schedule, repeats):
  mesh = stage_mesh(2, 2)
  evaluate = jaxdp.make_eval_step(loss_fn, mesh, layers="blocks", pipeline=jaxdp.pipeline(2, schedule, repeats=repeats))
  params = init_params(3)
  state = jaxdp.init_state(params, adam(), mesh, layers="blocks")
  data = batches(2, seed=4)
  means = evaluate.evaluate(state, data)
  loss, weight = reference_means(params, data)
  assert means["weight"] == pytest.approx(weight, rel=1e-6)
  assert means["loss"] == pytest.approx(loss, rel=1e-6)


def test_gradient_reduced_over_the_data_axis_once_per_step():
  # P = 4 stages, N = 2 replicas: an all-reduce over 2 devices is over the data axis, over 4 over the stages.
  mesh, opt = stage_mesh(4, 2), adam()
  b, w = batches(1)[0]
  params = init_params()
  blocks = sum(np.size(x) for x in jax.tree.leaves(params["blocks"]))
  local_grad_bytes = 4 * (np.size(params["embed"]) + np.size(params["head"]) + LAYERS + blocks // 4)  # a stage's L / 4 layers
  for microbatches in (1, 4):
    step = jaxdp.make_train_step(loss_fn, opt, mesh, layers="blocks", pipeline=jaxdp.pipeline(microbatches, "gpipe"))
    state = jaxdp.init_state(init_params(), opt, mesh, layers="blocks", stage_axis="stage")
    ops = jaxdp.analysis.reports.hlo_collectives(step.lower(state, b, w).compile().as_text())
    over_data = [op for op in ops if op.kind == "all-reduce" and op.group == 2]
    assert len(over_data) == 1, [op.line[:120] for op in over_data]
    assert over_data[0].nbytes >= local_grad_bytes  # every leaf's gradient in that one all-reduce
    assert "while" not in over_data[0].line  # not inside the loop over microbatches
    assert not [op for op in ops if op.kind != "all-reduce"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_nonfinite_on_one_device_skips_on_every_stage_and_replica(schedule):
  step, opt, mesh, _ = built(2, 2, 4, schedule, 1, "clip_adamw")  # GPipe: a step of test_equals_one_device
  (batch, w), (good, good_w) = batches(2)
  state, _ = step(jaxdp.init_state(init_params(), opt, mesh, layers="blocks"), good, good_w)
  before = jaxdp.gather_state(state)
  batch["x"][ROWS - 1, 0] = np.nan  # one row on the second replica, weight > 0
  w[ROWS - 1] = 1.0
  state, metrics = step(state, batch, w)
  assert int(metrics["skipped"]) == 1 and int(metrics["nonfinite"]) == 1
  after = jaxdp.gather_state(state)
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)
  # Every device's shards are unchanged: each stage's block and each replica's copy.
  for leaf, host in zip(jax.tree.leaves(state.params), jax.tree.leaves(before.params)):
    for shard in leaf.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), host[shard.index])


@pytest.mark.parametrize("schedule,microbatches,repeats", [("gpipe", 2, 1), ("circular", 2, 2), ("1f1b", 4, 1)])
def test_checkpoint_across_meshes_with_and_without_a_stage_axis(tmp_path, schedule, microbatches, repeats):
  # (steps of the tests above: the ZeRO-1, accum_steps=2 cases)
  piped, opt, pipe_mesh, _ = built(2, 2, microbatches, schedule, repeats, "clip_adamw", 1, 2, None)
  runs = batches(6)
  plain_mesh = Mesh(np.asarray(jax.devices()[:2]), ("data",), axis_types=(AxisType.Auto,))
  plain = jaxdp.make_train_step(loss_fn, opt, plain_mesh, zero_stage=1)
  state = jaxdp.init_state(init_params(), opt, pipe_mesh, layers="blocks", stage_axis="stage", zero_stage=1)
  for batch, w in runs[:2]:
    state, _ = piped(state, batch, w)
  with jaxdp.CheckpointManager(tmp_path / "a", enable_async_checkpointing=False) as ckpt:
    ckpt.save(2, state)
    restored = ckpt.restore(params=init_params(), optimizer=opt, mesh=plain_mesh, zero_stage=1).state
  for batch, w in runs[2:4]:  # on the plain data mesh: scan_layers is a lax.scan there
    restored, _ = plain(restored, batch, w)
  with jaxdp.CheckpointManager(tmp_path / "b", enable_async_checkpointing=False) as ckpt:
    ckpt.save(4, restored)
    back = ckpt.restore(params=init_params(), optimizer=opt, mesh=pipe_mesh, zero_stage=1, layers="blocks",
                        stage_axis="stage").state
  assert jaxdp.state_specs(back).params["blocks"]["w"][0] == "stage"
  for batch, w in runs[4:]:
    back, _ = piped(back, batch, w)
  assert int(back.step) == 6
  assert_close(back.params, reference_run(opt, runs))


# --- Errors: raised before anything runs or is donated ------------------------------------------------------------


def assert_untouched(state, host):
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(host)):
    assert not a.is_deleted()
    np.testing.assert_array_equal(np.asarray(a), b)


def test_errors_of_the_step_arguments():
  mesh, opt = stage_mesh(2, 2), adam()
  with pytest.raises(ValueError, match=r"stage axis with no stacked layers.*layers="):
    jaxdp.make_train_step(loss_fn, opt, mesh, pipeline=jaxdp.pipeline(2))
  with pytest.raises(ValueError, match=r"'stage' axis .* pipeline=None"):
    jaxdp.make_train_step(loss_fn, opt, mesh, layers="blocks")
  with pytest.raises(ValueError, match=r"needs microbatches >= stages.*microbatches=1"):
    jaxdp.make_train_step(loss_fn, opt, mesh, layers="blocks", pipeline=jaxdp.pipeline(1, "circular", repeats=2))
  with pytest.raises(ValueError, match=r"gather='all' is not a ZeRO-3 gather of a pipeline"):
    jaxdp.make_train_step(loss_fn, opt, mesh, layers="blocks", pipeline=jaxdp.pipeline(2, gather="all"), zero_stage=3)
  with pytest.raises(ValueError, match=r"repeats=2 under schedule='gpipe'"):
    jaxdp.pipeline(4, "gpipe", repeats=2)
  with pytest.raises(ValueError, match=r"microbatches=3 must be a multiple of 2"):
    jaxdp.make_train_step(loss_fn, opt, mesh, layers="blocks", pipeline=jaxdp.pipeline(3, "1f1b", repeats=2))
  with pytest.raises(ValueError, match=r"not an axis of the mesh"):
    jaxdp.make_train_step(loss_fn, opt, stage_mesh(1, 2), layers="blocks", pipeline=jaxdp.pipeline(2, axis_name="pp"))
  with pytest.raises(ValueError, match=r"backend='pmap' maps over one axis only.*'stage'"):
    jaxdp.make_train_step(loss_fn, opt, mesh, layers="blocks", pipeline=jaxdp.pipeline(2), backend="pmap")
  with pytest.raises(ValueError, match=r"is also a data axis"):
    jaxdp.make_train_step(loss_fn, opt, mesh, axis_name=("stage", "data"), layers="blocks", pipeline=jaxdp.pipeline(2))
  with pytest.raises(ValueError, match=r"reduction='none' with a pipeline"):
    jaxdp.make_train_step(loss_fn, opt, mesh, layers="blocks", pipeline=jaxdp.pipeline(2), reduction="none")
  with pytest.raises(ValueError, match=r"'stage' axis .* pipeline=None"):
    jaxdp.make_eval_step(loss_fn, mesh, layers="blocks")
  with pytest.raises(TypeError, match=r"pipeline must be a jaxdp.Pipeline"):
    jaxdp.make_train_step(loss_fn, opt, mesh, layers="blocks", pipeline=2)


@pytest.mark.parametrize("case", ["layers", "circular_layers", "rows", "loop", "ys", "carry"])
def test_errors_before_donation(case):
  mesh, opt = stage_mesh(2, 2), adam()
  params, pipe, fn, rows = init_params(), jaxdp.pipeline(2, "gpipe"), loss_fn, ROWS
  if case == "layers":  # L = 3 over P = 2
    params["blocks"] = jax.tree.map(lambda x: x[:3], params["blocks"])
    match = r"L = 3 layers does not split into P = 2 stages: L % 2 = 1"
  elif case == "circular_layers":  # L = 6 over P·R = 4
    params["blocks"] = jax.tree.map(lambda x: x[:6], params["blocks"])
    pipe, match = jaxdp.pipeline(2, "circular", repeats=2), r"L = 6 layers does not split into P·R = 2·2 = 4 blocks"
  elif case == "rows":  # 12 rows: 6 per replica, not a multiple of M = 4
    pipe, rows, match = jaxdp.pipeline(4, "gpipe"), 12, r"12 rows: 6 per device .* microbatches=4"
  elif case in ("ys", "carry"):  # per-layer outputs; a carry leaf without the batch rows (a running statistic)
    def fn(params, batch):
      h = jnp.tanh(batch["x"] @ params["embed"])
      if case == "ys":
        h, _ = jaxdp.scan_layers(lambda c, p, x: (layer(c, p, x)[0], jnp.sum(c)), h, params["blocks"], params["scale"])
      else:
        (h, _), _ = jaxdp.scan_layers(lambda c, p, x: ((layer(c[0], p, x)[0], c[1] + jnp.mean(c[0])), None),
                                      (h, jnp.zeros(())), params["blocks"], params["scale"])
      return jnp.sum((h @ params["head"] - batch["y"]) ** 2, axis=-1)
    match = r"f must return \(carry, None\)" if case == "ys" else r"must hold the batch rows there; got leading sizes"
  else:  # a loss that loops over its stage's block itself
    def fn(params, batch):
      h = jnp.tanh(batch["x"] @ params["embed"])
      h, _ = jax.lax.scan(lambda c, p: layer(c, p, 0.0), h, params["blocks"])
      return jnp.sum((h @ params["head"] - batch["y"]) ** 2, axis=-1)
    match = r"did not run the stacks named by layers= through jaxdp.scan_layers"
  step = jaxdp.make_train_step(fn, opt, mesh, layers="blocks", pipeline=pipe)
  if case == "layers":
    with pytest.raises(ValueError, match=r"L = 3 layers, which do not split over the 2 devices of the stage axis"):
      jaxdp.init_state(params, opt, mesh, layers="blocks", stage_axis="stage")
  state = jaxdp.init_state(params, opt, mesh, layers="blocks", stage_axis=None if "layers" in case else "stage")
  host = jaxdp.gather_state(state)
  batch, w = batches(1, rows=rows)[0]
  with pytest.raises(ValueError, match=match):
    step(state, batch, w)
  assert_untouched(state, host)


def test_flax_nnx_stack_made_by_vmap():
  # An nnx model whose stack nnx.vmap made: the loss runs it with scan_layers over the stack's state; the pipelined
  # step (circular, on ("stage", "data")) equals the same loss's step on one device.
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Linear(FEATURES, WIDTH, rngs=rngs)
      self.layers = nnx.split_rngs(splits=4)(nnx.vmap(lambda r: nnx.Linear(WIDTH, WIDTH, rngs=r)))(rngs)
      self.head = nnx.Linear(WIDTH, 2, rngs=rngs)

  def my_loss(model, batch):
    graphdef, stack = nnx.split(model.layers)
    h = jnp.tanh(model.embed(batch["x"]))
    h, _ = jaxdp.scan_layers(lambda c, s, _: (jnp.tanh(nnx.merge(graphdef, s)(c)), None), h, stack)
    return jnp.sum((model.head(h) - batch["y"]) ** 2, axis=-1)

  definition, params, _ = jaxdp.adapters.nnx.split(Model(nnx.Rngs(0)))
  fn, opt, runs = jaxdp.adapters.nnx.loss_fn(definition, my_loss), adam(), batches(3)
  results = []
  one_device = Mesh(np.asarray(jax.devices()[:1]), ("data",), axis_types=(AxisType.Auto,))
  for mesh, kwargs in ((one_device, {}),
                       (stage_mesh(2, 2), {"layers": "layers", "pipeline": jaxdp.pipeline(2, "circular", repeats=2)})):
    step = jaxdp.make_train_step(fn, opt, mesh, **kwargs)
    state = jaxdp.init_state(params, opt, mesh)
    for batch, w in runs:
      state, _ = step(state, batch, w)
    results.append(jaxdp.gather_state(state).params)
  assert_close(results[1], results[0])


# --- 1F1B, ZeRO-3 inside the stages, layout-invariant dropout ----------------------------------------------------


@pytest.mark.parametrize("stages,microbatches,repeats", [(1, 3, 1), (2, 1, 1), (2, 5, 1), (3, 4, 1), (4, 4, 1),
                                                       (4, 9, 1), (2, 2, 2), (2, 6, 3), (4, 8, 2)])
def test_one_f_one_b_table_runs_every_unit_once_in_order_with_bounded_slots(stages, microbatches, repeats):
  # The table replayed on labels: each read of a slot finds the (microbatch, block) the table says, every forward
  # and backward pass of every unit runs once after what it needs (the previous virtual stage's forward pass,
  # the next one's backward pass), and the idle cells are the bubble. Virtual stage r·P + s is stage s's block r.
  table = pipelining.one_f_one_b_table(stages, microbatches, repeats)
  ticks = 2 * (repeats * microbatches + stages - 1)
  assert table.kind.shape == (ticks, stages)
  assert np.mean(table.kind == 0) == pytest.approx(pipelining.bubble_formula(stages, microbatches, repeats), abs=1e-12)
  if repeats == 1:
    assert table.slots <= stages and table.cotangent_slots <= stages
  else:  # interleaved: bounded independently of M (from M = 2P on, the same for any M)
    slots = lambda k: pipelining.one_f_one_b_table(stages, k * stages, repeats).slots  # noqa: E731
    assert table.slots <= slots(2) == slots(4)
  last = (stages - 1, repeats - 1)
  inputs = np.full((stages, table.slots, 2), -1)
  cts = np.full((stages, table.cotangent_slots, 2), -1)
  when = {}
  for t in range(ticks):
    for s in range(stages):
      kind, m, r = table.kind[t, s], table.microbatch[t, s], table.repeat[t, s]
      k, ck = table.slot[t, s], table.cotangent_slot[t, s]
      if kind == pipelining.FORWARD:
        before = ("F", m, r, s - 1) if s > 0 else ("F", m, r - 1, stages - 1) if r > 0 else None
        assert before is None or when[before] < t
        if (s, r) == (0, 0):
          inputs[s, k] = (m, r)
        assert tuple(inputs[s, k]) == (m, r)
        if (s, r) == last:
          cts[s, ck] = (m, r)
      elif kind == pipelining.BACKWARD:
        after = ("F", m, r, s) if (s, r) == last else ("B", m, r, s + 1) if s < stages - 1 else ("B", m, r + 1, 0)
        assert when[("F", m, r, s)] < t and when[after] < t
        assert tuple(inputs[s, k]) == (m, r) and tuple(cts[s, ck]) == (m, r)
      if kind:
        key = ("F" if kind == pipelining.FORWARD else "B", m, r, s)
        assert key not in when
        when[key] = t
    for s in range(stages):  # what arrives at the end of the tick, from the previous / next stage on the ring
      if table.received[t, s] >= 0:
        sender = (s - 1) % stages
        assert table.kind[t, sender] == pipelining.FORWARD
        inputs[s, table.received[t, s]] = (table.microbatch[t, sender], table.repeat[t, sender] + (s == 0))
      if table.cotangent_received[t, s] >= 0:
        sender = (s + 1) % stages
        assert table.kind[t, sender] == pipelining.BACKWARD
        cts[s, table.cotangent_received[t, s]] = (table.microbatch[t, sender],
                                                  table.repeat[t, sender] - (s == stages - 1))
  assert len(when) == 2 * stages * microbatches * repeats


ONE_F_ONE_B_CASES = [
    # (stages, data, microbatches, optimizer, zero_stage, accum_steps, replica)
    (2, 2, 2, "adam", 0, 1, None),
    (4, 1, 8, "clip_adamw", 0, 1, None),
    (2, 2, 4, "clip_adamw", 1, 2, None),
    (2, 2, 2, "adam", 2, 1, 2),
]


@pytest.mark.parametrize("stages,data,microbatches,optimizer,zero_stage,accum_steps,replica", ONE_F_ONE_B_CASES)
def test_one_f_one_b_equals_one_device(stages, data, microbatches, optimizer, zero_stage, accum_steps, replica):
  # 1F1B on ("stage", "data"), with ZeRO 1 and accum_steps=2, and ZeRO 2 on a hybrid ("stage", "replica", "data").
  step, opt, mesh, axis_name = built(stages, data, microbatches, "1f1b", 1, optimizer, zero_stage, accum_steps,
                                     replica)
  runs = batches()
  state, metrics = train(step, mesh, opt, runs, axis_name=axis_name, zero_stage=zero_stage)
  assert int(metrics["skipped"]) == 0 and int(state.step) == STEPS
  assert_close(state.params, reference_run(opt, runs))
  if zero_stage:
    assert float(metrics["replica_divergence"]) == 0.0


@pytest.mark.parametrize("stages,data,microbatches,repeats,zero_stage", [(2, 2, 2, 2, 0), (4, 1, 4, 2, 1)])
def test_interleaved_one_f_one_b_equals_one_device(stages, data, microbatches, repeats, zero_stage):
  # 1F1B with repeats=2: stage s runs blocks s and s + P (virtual stages), a microbatch goes round the ring twice.
  step, opt, mesh, axis_name = built(stages, data, microbatches, "1f1b", repeats, "clip_adamw", zero_stage)
  runs = batches()
  state, metrics = train(step, mesh, opt, runs, axis_name=axis_name, zero_stage=zero_stage)
  assert int(metrics["skipped"]) == 0 and int(state.step) == STEPS
  assert_close(state.params, reference_run(opt, runs))
  if zero_stage:
    assert float(metrics["replica_divergence"]) == 0.0


@pytest.mark.parametrize("schedule,repeats,gather", [("gpipe", 1, "step"), ("gpipe", 1, "layer"),
                                                     ("circular", 2, "step"), ("circular", 2, "layer"),
                                                     ("1f1b", 1, "step"), ("1f1b", 1, "layer")])
def test_zero3_inside_the_stages_equals_one_device(schedule, repeats, gather):
  # ZeRO-3: a stage's layers split over "data" at rest, gathered once per step or one layer at a time inside the
  # loop over microbatches; the gradient reduce-scattered back (the gather's transpose).
  step, opt, mesh, _ = built(2, 2, 2, schedule, repeats, "clip_adamw", 3, 1, None, gather)
  runs = batches()
  state, metrics = train(step, mesh, opt, runs, zero_stage=3)
  assert int(metrics["skipped"]) == 0 and float(metrics["replica_divergence"]) == 0.0
  specs = jaxdp.state_specs(state).params
  assert tuple(specs["blocks"]["w"])[:2] == ("stage", "data") and "data" in tuple(specs["embed"])
  assert_close(state.params, reference_run(opt, runs))


RATE = 0.3


def dropout_layer(h, p, key):
  h = jnp.tanh(h @ p["w"] + p["b"][None, :])
  keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1 - RATE, h.shape[1:]))(jaxdp.example_keys(key))
  return jnp.where(keep, h / (1 - RATE), 0.0), None


def dropout_loss(params, batch, rng):
  h = jnp.tanh(batch["x"] @ params["embed"])
  h, _ = jaxdp.scan_layers(dropout_layer, h, params["blocks"], jax.random.split(rng, LAYERS))
  return jnp.sum((h @ params["head"] - batch["y"]) ** 2, axis=-1)


def reference_dropout_loss(params, x, y, w, ids, key):
  # One device, a plain loop: row r's mask in layer i from fold_in(layer i's key, id_r).
  h = jnp.tanh(x @ params["embed"])
  keys = jax.random.split(key, LAYERS)
  for i in range(LAYERS):
    h = jnp.tanh(h @ params["blocks"]["w"][i] + params["blocks"]["b"][i][None, :])
    rows = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(keys[i], ids)
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1 - RATE, h.shape[1:]))(rows)
    h = jnp.where(keep, h / (1 - RATE), 0.0)
  return jnp.sum(w * jnp.sum((h @ params["head"] - y) ** 2, axis=-1)) / jnp.sum(w)


@pytest.mark.parametrize("schedule,microbatches,repeats", [("gpipe", 4, 1), ("circular", 2, 2), ("1f1b", 2, 1)])
def test_dropout_with_example_ids_equals_one_device(schedule, microbatches, repeats):
  opt, rng = adam(), jax.random.key(7)
  runs = [({**b, "id": np.arange(ROWS, dtype=np.int32) + 100 * i}, w) for i, (b, w) in enumerate(batches())]
  params = jax.tree.map(jnp.asarray, init_params())
  opt_state, grad = opt.init(params), jax.jit(jax.grad(reference_dropout_loss))
  for i, (b, w) in enumerate(runs):  # the step's key at step i: fold_in(rng, i), the same on every device
    updates, opt_state = opt.update(grad(params, b["x"], b["y"], w, b["id"], jax.random.fold_in(rng, i)), opt_state,
                                    params)
    params = optax.apply_updates(params, updates)
  dp = jaxdp.data_parallel(stage_mesh(2, 2), layers="blocks",
                           pipeline=jaxdp.pipeline(microbatches, schedule, repeats=repeats))
  step = jaxdp.make_train_step(dropout_loss, opt, dp, example_ids="id")
  state = jaxdp.init_state(init_params(), opt, dp)
  for b, w in runs:
    state, _ = step(state, b, w, rng)
  assert_close(state.params, params)


def test_one_f_one_b_refuses_a_model_state():
  def with_state(params, batch, model_state):
    h = jnp.tanh(batch["x"] @ params["embed"])
    h, _ = jaxdp.scan_layers(layer, h, params["blocks"], params["scale"])
    losses = jnp.sum((h @ params["head"] - batch["y"]) ** 2, axis=-1)
    return jaxdp.LossOutput(losses, model_state={"mean": model_state["mean"] * 0.9 + 0.1 * jnp.mean(h)})

  mesh, opt = stage_mesh(2, 2), adam()
  dp = jaxdp.data_parallel(mesh, layers="blocks", pipeline=jaxdp.pipeline(2, "1f1b"))
  step = jaxdp.make_train_step(with_state, opt, dp)
  state = jaxdp.init_state(init_params(), opt, dp, model_state={"mean": jnp.zeros(())})
  host = jaxdp.gather_state(state)
  batch, w = batches(1)[0]
  with pytest.raises(ValueError, match=r"schedule='1f1b' with a model state"):
    step(state, batch, w)
  assert_untouched(state, host)


TP_SPECS = {"embed": P(None, "model"), "blocks": {"w": P(None, None, "model"), "b": P(None, "model")},
            "head": P("model", None), "scale": P()}


@pytest.mark.parametrize("schedule,microbatches,repeats", [("circular", 2, 2), ("1f1b", 2, 1)])
def test_tensor_parallel_stages_equal_one_device(schedule, microbatches, repeats):
  # ("stage", "data", "model") = (2, 2, 2): each stage's layers split over "model" (left to the compiler inside
  # the map). 1F1B once failed here tracing its parts (an activation's abstract value with a model axis).
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), ("stage", "data", "model"),
              axis_types=(AxisType.Auto,) * 3)
  opt = adam()
  dp = jaxdp.data_parallel(mesh, layers="blocks", param_specs=TP_SPECS,
                           pipeline=jaxdp.pipeline(microbatches, schedule, repeats=repeats))
  step, state, runs = jaxdp.make_train_step(loss_fn, opt, dp), jaxdp.init_state(init_params(), opt, dp), batches()
  for batch, w in runs:
    state, metrics = step(state, batch, w)
  assert int(metrics["skipped"]) == 0
  assert tuple(state.params["blocks"]["w"].sharding.spec) == ("stage", None, "model")
  assert_close(state.params, reference_run(opt, runs))


def batchnorm_loss(params, batch, *, model_state, weights, train):
  # jaxdp's BatchNorm on the embedding, before the stack: GPipe and circular run the loss once on each device's
  # rows (only the stack is pipelined), so its statistics are the whole batch's.
  norm = jaxdp.adapters.linen.BatchNorm(use_running_average=not train)
  h, updates = norm.apply({"params": params["norm"], "batch_stats": model_state}, batch["x"] @ params["embed"],
                          mask=weights, mutable=["batch_stats"])
  h, _ = jaxdp.scan_layers(layer, jnp.tanh(h), params["blocks"], params["scale"])
  return jaxdp.LossOutput(jnp.sum((h @ params["head"] - batch["y"]) ** 2, axis=-1), model_state=updates["batch_stats"])


@pytest.mark.parametrize("schedule,microbatches,repeats", [("gpipe", 4, 1), ("circular", 2, 2)])
def test_batchnorm_before_the_stack_equals_one_device(schedule, microbatches, repeats):
  # The verifier (float64, teacher-forced): loss, gradient and the BatchNorm statistics of every step within
  # round-off of one device's. (1F1B runs the whole loss per microbatch: test_one_f_one_b_refuses_a_model_state.)
  from jaxdp.runtime import verify

  variables = jaxdp.adapters.linen.BatchNorm(use_running_average=False).init(
      jax.random.key(0), jnp.zeros((2, WIDTH)), mask=jnp.ones((2,)))
  params = {**init_params(), "norm": variables["params"]}
  dp = jaxdp.data_parallel(stage_mesh(2, 2), layers="blocks",
                           pipeline=jaxdp.pipeline(microbatches, schedule, repeats=repeats))
  report = verify.verify(batchnorm_loss, optax.sgd(0.1, momentum=0.9), dp, params, batches(3),
                         model_state=variables["batch_stats"])
  assert not report.diverged and report.worst < 1e-12, str(report)


SCHEDULES = {"gpipe": (4, "gpipe", 1), "circular": (2, "circular", 2), "1f1b": (2, "1f1b", 1)}  # (M, schedule, R)


def _one_device_and_pipelined(schedule):
  microbatches, name, repeats = SCHEDULES[schedule]
  return (jaxdp.data_parallel(Mesh(np.asarray(jax.devices()[:1]), ("data",), axis_types=(AxisType.Auto,))),
          jaxdp.data_parallel(stage_mesh(2, 2), layers="blocks",
                              pipeline=jaxdp.pipeline(microbatches, name, repeats=repeats)))


@pytest.mark.parametrize("schedule,policy", [("gpipe", "compute"), ("circular", "compute"), ("1f1b", "compute"),
                                             ("gpipe", "reduce"), ("circular", "reduce"), ("1f1b", "reduce")])
def test_bf16_compute_or_reduction_equals_one_device_to_bf16_round_off(schedule, policy):
  # compute_dtype or reduce_dtype bfloat16 (float32 master weights and sums), SGD, 3 steps: the pipelined step on
  # ("stage", "data") against the same policy on one device, and against the float32 reference; bfloat16 keeps 8
  # bits (spacing 2**-8 = 3.9e-3 relative), and the microbatches' (or the devices') partial sums round differently
  # from one device's whole-batch ones.
  opt, runs = optax.sgd(0.1), batches(3)
  policy = jaxdp.precision(**{f"{policy}_dtype": jnp.bfloat16})
  results = []
  for layout in _one_device_and_pipelined(schedule):
    step = jaxdp.make_train_step(loss_fn, opt, layout, precision=policy)
    state = jaxdp.init_state(init_params(), opt, layout)
    for batch, w in runs:
      state, metrics = step(state, batch, w)
    assert int(metrics["skipped"]) == 0
    results.append(jaxdp.gather_state(state).params)
  assert_close(results[1], results[0], rtol=2e-2)
  assert_close(results[1], reference_run(opt, runs), rtol=3e-2)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_float16_loss_scaling_follows_one_device(schedule):
  # compute_dtype=float16 with dynamic loss scaling: the same skipped steps and scales as one device's run of the
  # policy (2**16 overflows here, then 2**15, then 2**14 applies), parameters within float16's round-off (2**-11).
  opt, runs = optax.sgd(0.1), batches(3)
  policy = jaxdp.precision(compute_dtype=jnp.float16, loss_scaling=jaxdp.dynamic_loss_scale())
  results = []
  for layout in _one_device_and_pipelined(schedule):
    step = jaxdp.make_train_step(loss_fn, opt, layout, precision=policy)
    state, seen = jaxdp.init_state(init_params(), opt, layout, precision=policy), []
    for batch, w in runs:
      state, metrics = step(state, batch, w)
      seen.append((int(metrics["skipped"]), float(metrics["loss_scale"])))
    results.append((seen, jaxdp.gather_state(state).params))
  assert results[1][0] == results[0][0] and any(not skipped for skipped, _ in results[0][0])
  assert_close(results[1][1], results[0][1], rtol=5e-3)


def reference_powersgd_run(params, q0, data, lr):
  """PowerSGD (error feedback, warm start) on one device in plain jnp, float64: each stacked matrix compressed
  layer by layer, every other matrix whole, vectors exact; SGD on the exactly divided sum. The replicas' errors
  enter PowerSGD only through their sum, so one device's error is the sum of theirs."""
  params = jax.tree.map(jnp.asarray, params)
  q = dict(q0)
  errors = {k: jnp.zeros(params["blocks"]["w"].shape if k == "blocks/w" else params[k].shape) for k in q}
  get = lambda tree, k: tree["blocks"]["w"] if k == "blocks/w" else tree[k]  # noqa: E731
  for batch, w in data:
    sums = jax.grad(lambda p: reference_loss(p, batch["x"], batch["y"], w) * jnp.sum(w))(params)
    approx = {}
    for k in q:
      m = get(sums, k) + errors[k]
      if k == "blocks/w":  # one [4, 4] matrix per layer, each with its own factors
        p = jnp.stack([jnp.linalg.qr(m[i] @ q[k][i])[0] for i in range(LAYERS)])
        q[k] = jnp.stack([m[i].T @ p[i] for i in range(LAYERS)])
        approx[k] = jnp.stack([p[i] @ q[k][i].T for i in range(LAYERS)])
      else:
        p = jnp.linalg.qr(m @ q[k])[0]
        q[k] = m.T @ p
        approx[k] = p @ q[k].T
      errors[k] = m - approx[k]
    sums = {**sums, "blocks": {**sums["blocks"], "w": approx["blocks/w"]},
            **{k: v for k, v in approx.items() if k != "blocks/w"}}
    params = jax.tree.map(lambda x, g: x - lr * g / jnp.sum(w), params, sums)
  return params, q, errors


@pytest.mark.parametrize("schedule,microbatches,repeats,zero_stage", [("gpipe", 4, 1, 2), ("circular", 2, 2, 3),
                                                                      ("1f1b", 2, 1, 0)])
def test_powersgd_compresses_each_stacked_layer_and_equals_one_device(schedule, microbatches, repeats, zero_stage,
                                                                     tmp_path):
  # rank 1 from the first step, on ("stage", "data") = (2, 2), uneven weights (step 0: one data shard all
  # padding), float64: the parameters, each layer's Q and the replicas' summed error feedback against a plain
  # one-device PowerSGD (circular: the factors follow their layers through the circular assignment). The last
  # step runs on a state restored from a checkpoint.
  reduction = jaxdp.reductions.powersgd(1, start_iter=0, min_compression_rate=0)
  lr = 0.1
  with float64():
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), init_params())
    dp = jaxdp.data_parallel(stage_mesh(2, 2), layers="blocks", zero_stage=zero_stage,
                             pipeline=jaxdp.pipeline(microbatches, schedule, repeats=repeats))
    opt = optax.sgd(lr)
    state = jaxdp.init_state(params, opt, dp, reduction=reduction)
    assert state.compression.q["blocks"]["w"].shape == (LAYERS, WIDTH, 1)  # one factor per layer
    assert tuple(state.compression.q["blocks"]["w"].sharding.spec) == ("stage",)
    assert tuple(state.compression.error["blocks"]["w"].sharding.spec) == ("data", "stage")
    q0 = {"blocks/w": np.asarray(state.compression.q["blocks"]["w"]),
          **{k: np.asarray(state.compression.q[k]) for k in ("embed", "head")}}
    step = jaxdp.make_train_step(loss_fn, opt, dp, reduction=reduction)
    runs = [({k: v.astype(np.float64) for k, v in b.items()}, w.astype(np.float64)) for b, w in batches(3)]
    for batch, w in runs[:-1]:
      state, metrics = step(state, batch, w)
    with jaxdp.CheckpointManager(tmp_path / "ckpt") as ckpt:
      ckpt.save(1, state, force=True)
      ckpt.wait()
      state = ckpt.restore(params=params, optimizer=opt, layout=dp, reduction=reduction).state
    state, metrics = step(state, *runs[-1])
    assert int(metrics["skipped"]) == 0
    want_params, want_q, want_errors = reference_powersgd_run(params, q0, runs, lr)
    got = jaxdp.gather_state(state)
    assert_close(got.params, want_params, rtol=1e-12)
    assert_close(np.asarray(got.compression.q["blocks"]["w"]), want_q["blocks/w"], rtol=1e-12)
    assert_close(np.asarray(got.compression.error["blocks"]["w"]).sum(0), want_errors["blocks/w"], rtol=1e-12)
    assert_close(np.asarray(got.compression.error["embed"]).sum(0), want_errors["embed"], rtol=1e-12)


def test_powersgd_refused_where_no_device_holds_a_stacked_layers_local_gradient():
  # ZeRO-3 with gather="layer" reduce-scatters each layer's gradient inside the backward pass; a user's
  # stateful reduction has its state made for whole leaves, which a stage never holds.
  mesh = stage_mesh(2, 2)
  powersgd = jaxdp.reductions.powersgd(1)
  with pytest.raises(ValueError, match="gather='layer'"):
    jaxdp.make_train_step(loss_fn, optax.sgd(0.1), jaxdp.data_parallel(
        mesh, layers="blocks", zero_stage=3, pipeline=jaxdp.pipeline(2, gather="layer")), reduction=powersgd)
  from jaxdp.reductions.onebit import onebit_adam

  with pytest.raises(ValueError, match="a user reduction with a pipeline"):
    jaxdp.make_train_step(loss_fn, optax.sgd(0.1), jaxdp.data_parallel(
        mesh, layers="blocks", pipeline=jaxdp.pipeline(2)), reduction=onebit_adam(1e-3, warmup_steps=2).reduction)
