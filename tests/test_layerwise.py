"""Layer-wise ZeRO-3: a stack of layers gathered one layer at a time inside the loop, as one device trains it.

Each model stacks its repeated layers on a leading axis and gathers its layer with jaxdp.gather inside the
loop body (the functional lax.scan, flax linen's nn.scan + nn.map_variables, flax nnx's nnx.vmap + nnx.scan +
jaxdp.adapters.nnx.gather). Trained at stage 3 with layers= on uneven weights for 5 steps, the parameters equal the plain
one-device program's (jax.grad of the mean loss over the global batch, the same optax update) within float32
round-off: ≤ 1e-6 relative per leaf. The compiled step shows the schedule: the layer's all-gather inside the
loops, and less temporary memory than the whole gather.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import jaxdp
from helpers import assert_close_to_scale as assert_close

# Plumbing and float32 agreement, not speed: most XLA passes skipped while this module runs (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compiles")

L, D, B = 4, 16, 12
SPLITS = {1: [12], 2: [7, 5], 4: [5, 4, 2, 1]}
STEPS = 5
CLIP_ADAMW = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-2))
SGD = optax.sgd(0.1, momentum=0.9)


def data(seed=0):
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(B, D)).astype(np.float32), "y": rng.normal(size=(B,)).astype(np.float32)}


def stacked_params(layers=L):
  keys = jax.random.split(jax.random.key(0), 4)
  return {
      "embed": jax.random.normal(keys[0], (D, D)) * 0.3,
      # 'scale' has a per-layer size (3) no device count divides: it stays whole and is not gathered.
      "layers": {"w": jax.random.normal(keys[1], (layers, D, D)) * 0.3,
                 "b": jax.random.normal(keys[2], (layers, D)) * 0.1, "scale": jnp.ones((layers, 3))},
      "head": jax.random.normal(keys[3], (D, 1)) * 0.3,
  }


def functional_loss(params, batch):
  h = batch["x"] @ params["embed"]

  @jax.checkpoint
  def body(h, layer):
    layer = jaxdp.gather(layer)
    return jnp.tanh(h @ layer["w"] + layer["b"][None]) * jnp.mean(layer["scale"]), None

  h, _ = lax.scan(body, h, params["layers"])
  return 0.5 * ((h @ params["head"])[:, 0] - batch["y"]) ** 2


def with_policy(loss_fn_body_policy):
  """The functional loss with its body checkpointed under a policy (jaxdp.gather_policy(reshard_after_forward))."""

  def loss_fn(params, batch):
    h = batch["x"] @ params["embed"]

    def body(h, layer):
      layer = jaxdp.gather(layer)
      return jnp.tanh(h @ layer["w"] + layer["b"][None]) * jnp.mean(layer["scale"]), None

    h, _ = lax.scan(jax.checkpoint(body, policy=loss_fn_body_policy), h, params["layers"])
    return 0.5 * ((h @ params["head"])[:, 0] - batch["y"]) ** 2

  return loss_fn


def one_device(loss_fn, params, optimizer, steps=STEPS):
  opt_state = optimizer.init(params)
  for _ in range(steps):
    grads = jax.grad(lambda p: jnp.mean(loss_fn(p, data())))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params


def portions(sizes):
  bounds = np.cumsum([0, *sizes])
  return [jax.tree.map(lambda x: x[bounds[i]:bounds[i + 1]], data()) for i in range(len(sizes))]


def train(loss_fn, params, optimizer, mesh, n, *, layers="layers", model_state=None, rng=None, **options):
  rows = -(-max(SPLITS[n]) // 2) * 2  # even: accum_steps=2 splits each device's rows in two
  batch, weights = jaxdp.shard_uneven(portions(SPLITS[n]), mesh, rows=rows)
  step = jaxdp.make_train_step(loss_fn, optimizer, mesh, zero_stage=3, layers=layers, **options)
  state = jaxdp.init_state(params, optimizer, mesh, zero_stage=3, layers=layers, model_state=model_state)
  for _ in range(STEPS):
    state, metrics = step(state, batch, weights, rng=rng)
    assert int(metrics["skipped"]) == 0
  return step, state, (batch, weights)


@pytest.fixture(scope="module")
def reference_clip_adamw():
  return one_device(functional_loss, stacked_params(), CLIP_ADAMW)


@pytest.mark.parametrize("n,reshard,options", [
    (4, True, {}),
    (4, False, {}),
    (2, True, {"accum_steps": 2}),
    (1, True, {}),
])
def test_functional_stack_matches_one_device(n, reshard, options, reference_clip_adamw):
  mesh = jaxdp.data_mesh(jax.devices()[:n])
  loss_fn = with_policy(jaxdp.gather_policy(reshard_after_forward=reshard))
  _, state, _ = train(loss_fn, stacked_params(), CLIP_ADAMW, mesh, n, **options)
  assert_close(state.params, reference_clip_adamw)


def test_muon_on_the_stacks_matches_one_device():
  """Muon's Newton-Schulz iterations read each whole [D, D] layer matrix: the update runs on the global arrays."""
  muon = optax.contrib.muon(1e-2)
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  _, state, _ = train(functional_loss, stacked_params(), muon, mesh, 4)
  assert_close(state.params, one_device(functional_loss, stacked_params(), muon))


def test_layer_axis_is_never_split_and_the_stack_reaches_the_loss_split(reference_clip_adamw):
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  step, state, _ = train(functional_loss, stacked_params(), CLIP_ADAMW, mesh, 4)
  specs = jaxdp.state_specs(state)
  assert specs.params["layers"]["w"] == P(None, "data")  # one layer's [D, D], split on its first dimension
  assert specs.params["layers"]["b"] == P(None, "data")
  assert specs.params["layers"]["scale"] == P()  # 3 per layer: no dimension divides
  assert specs.opt_state[1][0].mu["layers"]["w"] == P(None, "data")  # the optimizer state follows its parameter


def in_loops(compiled, op):
  """The compiled step's ``op`` instructions inside while loops: (forward, backward) counts, from their op names."""
  lines = [line for line in compiled.as_text().splitlines() if f" {op}(" in line and "/while/body/" in line]
  backward = sum("transpose(" in line for line in lines)
  return len(lines) - backward, backward


def test_each_layer_is_gathered_inside_the_loops_and_memory_is_smaller():
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  params = stacked_params()
  batch, weights = jaxdp.shard_uneven(portions(SPLITS[4]), mesh, rows=6)
  compiled = {}
  for name, layers in (("whole", None), ("layerwise", "layers")):
    step = jaxdp.make_train_step(functional_loss, SGD, mesh, zero_stage=3, layers=layers)
    state = jaxdp.init_state(params, SGD, mesh, zero_stage=3, layers=layers)
    compiled[name] = step.lower(state, batch, weights).compile()
  # One all-gather per stacked leaf split over the data axis (w and b) in the forward loop, again in the backward
  # loop (reshard_after_forward), and their gradient reduce-scattered there; none inside the whole gather's loops.
  assert in_loops(compiled["layerwise"], "all-gather") == (2, 2)
  assert in_loops(compiled["layerwise"], "reduce-scatter") == (0, 2)
  assert in_loops(compiled["whole"], "all-gather") == (0, 0)
  temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
  assert temp["layerwise"] < temp["whole"]


def test_reshard_after_forward_false_keeps_the_gathered_layers():
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  params = stacked_params()
  batch, weights = jaxdp.shard_uneven(portions(SPLITS[4]), mesh, rows=6)
  gathers = {}
  for reshard in (True, False):
    step = jaxdp.make_train_step(with_policy(jaxdp.gather_policy(reshard)), SGD, mesh, zero_stage=3,
                                 layers="layers")
    state = jaxdp.init_state(params, SGD, mesh, zero_stage=3, layers="layers")
    gathers[reshard] = in_loops(step.lower(state, batch, weights).compile(), "all-gather")
  assert gathers == {True: (2, 2), False: (2, 0)}  # kept from the forward pass: not gathered again


@pytest.mark.parametrize("route", ["gather", "scan_layers"])
def test_hybrid_and_tensor_parallel_meshes(route, reference_clip_adamw):
  loss_fn = functional_loss if route == "gather" else prefetching_loss()
  devices = np.array(jax.devices())
  hybrid = Mesh(devices.reshape(2, 4), ("replica", "data"), axis_types=(AxisType.Explicit,) * 2)
  batch, weights = jaxdp.shard_uneven(portions([2, 2, 2, 2, 1, 1, 1, 1]), hybrid, axis_name=("replica", "data"))
  step = jaxdp.make_train_step(loss_fn, CLIP_ADAMW, hybrid, axis_name=("replica", "data"), zero_stage=3,
                               layers="layers")
  state = jaxdp.init_state(stacked_params(), CLIP_ADAMW, hybrid, axis_name=("replica", "data"), zero_stage=3,
                           layers="layers")
  for _ in range(STEPS):
    state, _ = step(state, batch, weights)
  assert_close(state.params, reference_clip_adamw)

  # "model" Auto: this loss is written for the compiler's partitioning (an Explicit model axis types the carry).
  tp = Mesh(devices.reshape(4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
  params = stacked_params()
  params["layers"]["w"] = jax.device_put(params["layers"]["w"], NamedSharding(tp, P(None, None, "model")))
  batch, weights = jaxdp.shard_uneven(portions(SPLITS[4]), tp, rows=6)
  step = jaxdp.make_train_step(loss_fn, CLIP_ADAMW, tp, zero_stage=3, layers="layers")
  state = jaxdp.init_state(params, CLIP_ADAMW, tp, zero_stage=3, layers="layers")
  for _ in range(STEPS):
    state, _ = step(state, batch, weights)
  assert jaxdp.state_specs(state).params["layers"]["w"] == P(None, "data", "model")
  assert_close(state.params, reference_clip_adamw)


def test_a_non_finite_step_is_skipped_on_every_replica():
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  batch, weights = jaxdp.shard_uneven(portions(SPLITS[4]), mesh, rows=6)
  bad = {"x": np.where(np.arange(24)[:, None] == 0, np.inf, np.asarray(batch["x"])).astype(np.float32),
         "y": np.asarray(batch["y"])}
  step = jaxdp.make_train_step(functional_loss, SGD, mesh, zero_stage=3, layers="layers")
  state = jaxdp.init_state(stacked_params(), SGD, mesh, zero_stage=3, layers="layers")
  before = jaxdp.gather_state(state).params
  state, metrics = step(state, bad, weights)
  assert int(metrics["skipped"]) == 1
  assert_close(jaxdp.gather_state(state).params, before, rtol=0)


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return jnp.tanh(nn.Dense(D)(h)), None


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D)(x)
    block = nn.map_variables(LinenBlock, "params", trans_in_fn=jaxdp.gather, init=True)
    block = nn.remat(block, policy=jaxdp.gather_policy(), prevent_cse=False)
    h, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)(name="layers")(h, None)
    return nn.Dense(1)(h)[:, 0]


def test_linen_scan_matches_one_device():
  net = LinenNet()
  params = net.init(jax.random.key(0), data()["x"])["params"]

  def loss_fn(p, batch):
    return 0.5 * (net.apply({"params": p}, batch["x"]) - batch["y"]) ** 2

  reference = one_device(loss_fn, params, SGD)
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  step, state, (batch, weights) = train(loss_fn, params, SGD, mesh, 4)
  assert_close(state.params, reference)
  evaluation = jaxdp.make_eval_step(loss_fn, mesh)(state, batch, weights)
  np.testing.assert_allclose(float(evaluation["loss"]), float(jnp.mean(loss_fn(reference, data()))), rtol=1e-6)


class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, h):
    return jnp.tanh(self.linear(h))


class NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Linear(D, D, rngs=rngs)

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NnxBlock(rngs)

    self.layers = make(rngs)
    self.head = nnx.Linear(D, 1, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat(policy=jaxdp.gather_policy())
    def forward(h, layer):
      return jaxdp.adapters.nnx.gather(layer)(h)

    return self.head(forward(self.embed(x), self.layers))[:, 0]


def nnx_objective(model, batch):
  return 0.5 * (model(batch["x"]) - batch["y"]) ** 2


def test_nnx_stack_matches_the_ordinary_nnx_program():
  model = NnxNet(nnx.Rngs(0))
  definition, params, model_state = jaxdp.adapters.nnx.split(model)
  loss_fn = jaxdp.adapters.nnx.loss_fn(definition, nnx_objective)
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  _, state, _ = train(loss_fn, params, SGD, mesh, 4, model_state=model_state)
  jaxdp.adapters.nnx.update(model, state)

  reference = NnxNet(nnx.Rngs(0))
  optimizer = nnx.Optimizer(reference, SGD, wrt=nnx.Param)
  for _ in range(STEPS):
    optimizer.update(reference, nnx.grad(lambda m: jnp.mean(nnx_objective(m, data())))(reference))
  assert_close(nnx.state(model, nnx.Param), nnx.state(reference, nnx.Param))


def test_bad_layers_are_refused_before_anything_runs():
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  params = stacked_params()
  with pytest.raises(ValueError, match="no leaf under"):
    jaxdp.init_state(params, SGD, mesh, zero_stage=3, layers="blocks")
  uneven = dict(params, layers=dict(params["layers"], b=jnp.zeros((L + 1, D))))
  with pytest.raises(ValueError, match="do not share a leading layer axis"):
    jaxdp.init_state(uneven, SGD, mesh, zero_stage=3, layers="layers")
  with pytest.raises(TypeError, match="layers must name"):
    jaxdp.make_train_step(functional_loss, SGD, mesh, zero_stage=3, layers=3.5)
  with pytest.raises(TypeError, match=r"call it: jax.checkpoint\(body, policy=jaxdp.gather_policy\(\)\)"):
    jax.grad(lambda w: jnp.sum(jax.checkpoint(jnp.sin, policy=jaxdp.gather_policy)(w)))(1.0)
  with pytest.raises(ValueError, match="rank_mean"):
    jaxdp.make_train_step(functional_loss, SGD, mesh, zero_stage=3, layers="layers", reduction="rank_mean")
  with pytest.raises(ValueError, match="presummed leaves"):
    jax.shard_map(lambda g: jaxdp.reduce_gradient(jaxdp.LocalGradient(g, jnp.sum(g), jnp.sum(g), {}, None),
                                                 axis_name="data", presummed=True).grads,
                  mesh=mesh, in_specs=P("data"), out_specs=P())(jnp.ones(4))
  tp = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  split_layers = dict(params, layers=dict(params["layers"], w=jax.device_put(
      params["layers"]["w"], NamedSharding(tp, P("model")))))
  with pytest.raises(ValueError, match="along its layer axis"):
    jaxdp.init_state(split_layers, SGD, tp, zero_stage=3, layers="layers")


def test_gather_outside_a_layer_of_the_stack_is_refused_inside_the_step():
  def loss_fn(params, batch):
    jaxdp.gather({"not_a_layer": params["embed"]})  # the embedding is no stacked leaf
    return functional_loss(params, batch)

  mesh = jaxdp.data_mesh(jax.devices()[:4])
  batch, weights = jaxdp.shard_uneven(portions(SPLITS[4]), mesh, rows=6)
  step = jaxdp.make_train_step(loss_fn, SGD, mesh, zero_stage=3, layers="layers")
  state = jaxdp.init_state(stacked_params(), SGD, mesh, zero_stage=3, layers="layers")
  with pytest.raises(ValueError, match="no parameter of a stacked layer"):
    step(state, batch, weights)


def test_checkpoints_restore_across_the_layer_wise_and_whole_gather_layouts(tmp_path):
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  _, state, (batch, weights) = train(functional_loss, stacked_params(), SGD, mesh, 4)
  full = jaxdp.gather_state(state)
  with jaxdp.CheckpointManager(tmp_path / "ckpt", enable_async_checkpointing=False) as ckpt:
    ckpt.save(5, state)
    restored = {layers: ckpt.restore(params=stacked_params(), optimizer=SGD, mesh=jaxdp.data_mesh(jax.devices()[:2]),
                                     zero_stage=3, layers=layers).state for layers in ("layers", None)}
  for layers, got in restored.items():
    for a, b in zip(jax.tree.leaves(jaxdp.gather_state(got)), jax.tree.leaves(full)):
      np.testing.assert_array_equal(a, b)
  assert jaxdp.state_specs(restored["layers"]).params["layers"]["w"] == P(None, "data")
  # Either restored state trains on under the layer-wise step (the whole-gather one moved into its layout first).
  mesh2 = jaxdp.data_mesh(jax.devices()[:2])
  batch2, weights2 = jaxdp.shard_uneven(portions(SPLITS[2]), mesh2)
  step = jaxdp.make_train_step(functional_loss, SGD, mesh2, zero_stage=3, layers="layers")
  after = [jaxdp.gather_state(step(got, batch2, weights2)[0]).params for got in restored.values()]
  for a, b in zip(jax.tree.leaves(after[0]), jax.tree.leaves(after[1])):
    np.testing.assert_array_equal(a, b)


def test_evaluation_gathers_a_layer_at_a_time_and_gives_the_same_loss():
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  batch, weights = jaxdp.shard_uneven(portions(SPLITS[4]), mesh, rows=6)
  state = jaxdp.init_state(stacked_params(), SGD, mesh, zero_stage=3, layers="layers")
  layerwise = jaxdp.make_eval_step(functional_loss, mesh, layers="layers")
  whole = jaxdp.make_eval_step(functional_loss, mesh)
  np.testing.assert_allclose(float(layerwise(state, batch, weights)["loss"]),
                             float(jnp.mean(functional_loss(stacked_params(), data()))), rtol=1e-6)
  np.testing.assert_allclose(float(layerwise(state, batch, weights)["loss"]), float(whole(state, batch, weights)["loss"]),
                             rtol=1e-6)
  assert in_loops(layerwise.lower(state, batch, weights).compile(), "all-gather") == (2, 0)
  # 32 layers laid out without layers=: split along the layer axis (the largest), gathered whole by the same step.
  deep = stacked_params(32)
  other = jaxdp.init_state(deep, SGD, mesh, zero_stage=3)
  assert jaxdp.state_specs(other).params["layers"]["w"] == P("data")
  np.testing.assert_allclose(float(layerwise(other, batch, weights)["loss"]),
                             float(jnp.mean(functional_loss(deep, data()))), rtol=1e-6)


def prefetching_loss(reshard_after_forward=True, closure=False):
  """The functional model through jaxdp.scan_layers (prefetch); ``closure``: the body also reads a parameter."""

  def loss_fn(params, batch):
    h = batch["x"] @ params["embed"]
    gain = params["embed"][0, 0] if closure else 1.0

    def f(h, layer, _):
      return jnp.tanh(h @ layer["w"] + layer["b"][None]) * jnp.mean(layer["scale"]) * gain, jnp.sum(h)

    h, sums = jaxdp.scan_layers(f, h, params["layers"], reshard_after_forward=reshard_after_forward)
    return 0.5 * ((h @ params["head"])[:, 0] - batch["y"]) ** 2 + 0.0 * jnp.sum(sums)

  return loss_fn


@pytest.mark.parametrize("reshard", [True, False])
def test_scan_layers_prefetches_and_matches_one_device(reshard):
  loss_fn = prefetching_loss(reshard)
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  step, state, (batch, weights) = train(loss_fn, stacked_params(), CLIP_ADAMW, mesh, 4)
  assert_close(state.params, one_device(loss_fn, stacked_params(), CLIP_ADAMW))
  compiled = step.lower(state, batch, weights).compile()
  assert in_loops(compiled, "all-gather") == ((2, 2) if reshard else (2, 0))
  assert in_loops(compiled, "reduce-scatter") == (0, 2)
  # Prefetch: the forward loop carries the next layer's gathered w [D, D] (its all-gather's result is used by
  # the next iteration); the loop over a plain scan carries only slices.
  forward = [line.split(" while(")[0] for line in compiled.as_text().splitlines()
             if " while(" in line and "transpose(" not in line]
  assert len(forward) == 1 and f"f32[{D},{D}]" in forward[0]


def test_scan_layers_returns_the_gradient_of_what_its_body_closes_over():
  loss_fn = prefetching_loss(closure=True)
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  _, state, _ = train(loss_fn, stacked_params(), SGD, mesh, 4)
  assert_close(state.params, one_device(loss_fn, stacked_params(), SGD))


@pytest.mark.parametrize("route", ["gather", "scan_layers"])
def test_compute_dtype_casts_the_slices_and_the_gradient_is_summed_in_float32(route):
  """bfloat16 compute: each layer's bf16 slices are gathered in float32 (the master weights' dtype) and cast
  back, so the gradient's reduce-scatter sums in float32 as every reduction of the step does. Within bfloat16
  round-off of float32 one device (its epsilon is 7.8e-3; the whole gather measured 3.3e-3 here)."""
  loss_fn = functional_loss if route == "gather" else prefetching_loss()
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  _, state, _ = train(loss_fn, stacked_params(), SGD, mesh, 4, compute_dtype=jnp.bfloat16)
  assert_close(state.params, one_device(functional_loss, stacked_params(), SGD), rtol=1e-2)


@pytest.mark.parametrize("route", ["gather", "scan_layers"])
def test_reduce_dtype_reduce_scatters_each_layers_gradient_in_it(route):
  """bfloat16 reduce_dtype: each layer's gradient, reduce-scattered inside the backward loop, communicates in
  bfloat16 as the step's other gradient collectives do (the program jaxdp writes has no float32 reduce-scatter
  left); within bfloat16 round-off of float32 one device."""
  loss_fn = functional_loss if route == "gather" else prefetching_loss()
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  step, state, (batch, weights) = train(loss_fn, stacked_params(), SGD, mesh, 4,
                                        precision=jaxdp.precision(reduce_dtype=jnp.bfloat16))
  assert_close(state.params, one_device(functional_loss, stacked_params(), SGD), rtol=1e-2)
  hlo = step.lower(state, batch, weights).as_text(dialect="hlo")
  scatters = [line.split("=", 1)[1].split()[0] for line in hlo.splitlines() if " reduce-scatter(" in line]
  assert len(scatters) >= 3 and all(s.startswith("bf16[") for s in scatters), scatters


def test_float16_loss_scaling_follows_one_device():
  """float16 compute with dynamic loss scaling, layer-wise: the layers' gradients are reduce-scattered scaled
  and unscaled after, as every gradient of the step; one device's run of the policy within float16's round-off,
  with the same scales."""
  policy = jaxdp.precision(compute_dtype=jnp.float16, loss_scaling=jaxdp.dynamic_loss_scale(init_scale=2.0**8,
                                                                                          growth_interval=2))
  results = []
  for n in (1, 4):
    mesh = jaxdp.data_mesh(jax.devices()[:n])
    layout = jaxdp.data_parallel(mesh, zero_stage=3 if n > 1 else 0, layers="layers" if n > 1 else None)
    batch, weights = jaxdp.shard_uneven(portions(SPLITS[n]), mesh)
    step = jaxdp.make_train_step(functional_loss, SGD, layout, precision=policy)
    state, scales = jaxdp.init_state(stacked_params(), SGD, layout, precision=policy), []
    for _ in range(STEPS):
      state, metrics = step(state, batch, weights)
      scales.append((int(metrics["skipped"]), float(metrics["loss_scale"])))
    results.append((scales, jaxdp.gather_state(state).params))
  assert results[1][0] == results[0][0] and results[0][0][-1][1] > 2.0**8  # grown, never skipped
  assert_close(results[1][1], results[0][1], rtol=5e-3)


def test_batchnorm_before_the_stack_and_dropout_inside_it_equal_one_device():
  """jaxdp's BatchNorm on the embedding (exact statistics) and layout-invariant dropout inside each gathered
  layer (row r's mask from its id), layer-wise at stage 3 on 4 devices: the verifier (float64, teacher-forced)
  finds every step's loss, gradient and BatchNorm statistics within round-off of one device's."""
  from jaxdp.runtime import verify

  norm = jaxdp.adapters.linen.BatchNorm(use_running_average=False)

  def loss_fn(params, batch, rng, *, model_state, weights, train):
    h, updates = norm.clone(use_running_average=not train).apply(
        {"params": params["norm"], "batch_stats": model_state}, batch["x"] @ params["embed"], mask=weights,
        mutable=["batch_stats"])

    def body(h, layer_and_key):
      layer, key = layer_and_key
      layer = jaxdp.gather(layer)
      h = jnp.tanh(h @ layer["w"] + layer["b"][None]) * jnp.mean(layer["scale"])
      keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.75, h.shape[1:]))(jaxdp.example_keys(key))
      return jnp.where(keep, h / 0.75, 0.0), None

    h, _ = lax.scan(body, h, (params["layers"], jax.random.split(rng, L)))
    return jaxdp.LossOutput(0.5 * ((h @ params["head"])[:, 0] - batch["y"]) ** 2, model_state=updates["batch_stats"])

  variables = norm.init(jax.random.key(1), jnp.zeros((2, D)), mask=jnp.ones((2,)))
  params = {**stacked_params(), "norm": variables["params"]}
  dp = jaxdp.data_parallel(jaxdp.data_mesh(jax.devices()[:4]), zero_stage=3, layers="layers")
  weights = np.ones((B,), np.float32)
  weights[[2, 6, 7, 8]] = 0.0  # real rows per device: 2, 1, 3, 2
  batches = [({**data(seed), "id": np.arange(B, dtype=np.int32) + 100 * seed}, weights) for seed in range(3)]
  report = verify.verify(loss_fn, SGD, dp, params, batches, model_state=variables["batch_stats"],
                         rng=jax.random.key(2), example_ids="id")
  assert not report.diverged and report.worst < 1e-12, str(report)
