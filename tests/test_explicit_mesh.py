"""The user's own mesh, as given: Explicit, Auto or mixed axis types, inside ``jax.set_mesh(mesh)`` and outside.

``jax.make_mesh`` gives Explicit axes (JAX 0.9+). jaxdp keeps the mesh object it is given: the state, the metrics
and the outputs live on it (``x.sharding.mesh == mesh``), the steps run in and out of its context, and a leaf the
user split over a model axis keeps its split (on an Explicit axis it is in ``jax.typeof``). Every layout runs on
both axis types and is compared with an independent one-device program written plainly here: ``jax.grad`` of the
global-batch weighted mean ``Σ w·l / Σ w``, the same optax update, three steps.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxdp
from helpers import assert_close_to_scale
from jaxdp.analysis.reports import comm_report
from jaxdp.sharding.layout import ZERO_STAGES, state_specs

pytestmark = pytest.mark.usefixtures("fast_compiles")

LAYERS, WIDTH, FEATURES, ROWS, STEPS = 4, 4, 3, 16, 3
OPT = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))
RTOL = 2e-6  # float32 sums in another order (per device, then over devices): a few ulps of values of order 1
TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def init_params(seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  return {
      "embed": np.asarray(jax.random.normal(k[0], (FEATURES, WIDTH)) * 0.6),
      "blocks": {"w": np.asarray(jax.random.normal(k[1], (LAYERS, WIDTH, WIDTH)) * 0.6),
                 "b": np.asarray(jax.random.normal(k[2], (LAYERS, WIDTH)) * 0.1)},
      "head": np.asarray(jax.random.normal(k[3], (WIDTH, 2)) * 0.6),
  }


def layer(h, p, _):
  return jnp.tanh(h @ p["w"] + p["b"][None, :]), None


def loss_fn(params, batch):
  h = jnp.tanh(batch["x"] @ params["embed"])
  h, _ = jaxdp.scan_layers(layer, h, params["blocks"])
  return jnp.sum((h @ params["head"] - batch["y"]) ** 2, axis=-1)


def reference_loss(params, x, y, w):
  h = jnp.tanh(x @ params["embed"])
  for i in range(LAYERS):  # a plain loop over the layers
    h = jnp.tanh(h @ params["blocks"]["w"][i] + params["blocks"]["b"][i][None, :])
  return jnp.sum(w * jnp.sum((h @ params["head"] - y) ** 2, axis=-1)) / jnp.sum(w)


def batches(steps=STEPS, seed=1):
  """Uneven weights with zeros (padding rows), a different batch each step."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(steps):
    w = rng.uniform(0.25, 2.0, size=ROWS).astype(np.float32)
    w[[3, 9 + i]] = 0.0
    out.append(({"x": rng.normal(size=(ROWS, FEATURES)).astype(np.float32),
                 "y": rng.normal(size=(ROWS, 2)).astype(np.float32)}, w))
  return out


@functools.cache
def reference(steps=STEPS):
  params, opt_state = jax.tree.map(jnp.asarray, init_params()), OPT.init(jax.tree.map(jnp.asarray, init_params()))
  grad = jax.jit(jax.grad(reference_loss))
  for batch, w in batches(steps):
    updates, opt_state = OPT.update(grad(params, batch["x"], batch["y"], w), opt_state, params)
    params = optax.apply_updates(params, updates)
  return jax.tree.map(np.asarray, params)


def make_mesh(shape, names, types):
  types = (TYPES[types],) * len(names) if isinstance(types, str) else tuple(TYPES[t] for t in types)
  return jax.make_mesh(shape, names, axis_types=types, devices=jax.devices()[:int(np.prod(shape))])


def on_mesh(tree, mesh):
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    assert x.sharding.mesh == mesh, f"{jax.tree_util.keystr(path)} lives on {x.sharding.mesh}, not the user's {mesh}"


def train(dp, params=None, context=(False, False, True), loss=loss_fn):
  """``init_state`` and a step per batch on ``dp``'s mesh, each call outside or inside ``jax.set_mesh``."""
  mesh = dp.mesh
  step = jaxdp.make_train_step(loss, OPT, dp)
  state = jaxdp.init_state(init_params() if params is None else params, OPT, dp)
  on_mesh(state, mesh)
  for inside, (batch, w) in zip(context, batches()):
    with jax.set_mesh(mesh) if inside else contextlib.nullcontext():
      state, metrics = step(state, batch, w)
    on_mesh((state, metrics), mesh)
    assert int(metrics["skipped"]) == 0
  return state


# ZeRO 0-3 ------------------------------------------------------------------------------------------------------------


@functools.cache
def zero_run(types, stage):
  return train(jaxdp.data_parallel(make_mesh((4,), ("data",), types), zero_stage=stage))


@pytest.mark.parametrize("stage", ZERO_STAGES)
@pytest.mark.parametrize("types", TYPES)
def test_every_zero_stage_on_the_users_mesh_equals_one_device(types, stage):
  """The done-when of the issue: ``jax.make_mesh``, steps inside ``jax.set_mesh(mesh)`` (and outside), every stage."""
  state = zero_run(types, stage)
  assert state_specs(state).params["head"] == (P("data") if stage == 3 else P())
  assert_close_to_scale(jaxdp.gather_state(state).params, reference(), RTOL)


def test_a_step_inside_the_context_of_an_explicit_mesh_keeps_its_types():
  """Inside ``jax.set_mesh``: the same program as outside (not traced again), typed on the user's mesh."""
  mesh = make_mesh((4,), ("data",), "explicit")
  dp = jaxdp.data_parallel(mesh, zero_stage=3)
  step = jaxdp.make_train_step(loss_fn, OPT, dp)
  state = jaxdp.init_state(init_params(), OPT, dp)
  (batch, w), = batches(1)
  state, _ = step(state, batch, w)
  with jax.set_mesh(mesh):
    state, metrics = step(state, batch, w)
    assert jax.typeof(state.params["head"]).sharding.spec == P("data", None)
    assert jax.typeof(metrics["loss"]).sharding.mesh.axis_types == (AxisType.Explicit,)
    loss = float(jnp.asarray(metrics["loss"]) + 0.0)  # ordinary JAX code in the context takes it
  assert np.isfinite(loss) and step._traces == 1


@pytest.mark.parametrize("stage", [0, 2])
def test_one_reduction_either_way(stage):
  """The exact weighted mean stays one reduction of the gradient's sums: the compiled step's collectives (kind,
  count, bytes) are the same on an Explicit mesh as on an Auto one."""
  reports = {}
  for types in TYPES:
    dp = jaxdp.data_parallel(make_mesh((4,), ("data",), types), zero_stage=stage)
    state = jaxdp.init_state(init_params(), OPT, dp)
    reports[types] = comm_report(jaxdp.make_train_step(loss_fn, OPT, dp), state, *batches(1)[0])
  assert reports["explicit"] == reports["auto"]
  assert reports["auto"]["reduce-scatter" if stage else "all-reduce"].count >= 1


# Layer-wise, tensor-parallel, hybrid, pipeline -------------------------------------------------------------------------


@pytest.mark.parametrize("types", TYPES)
def test_layerwise_zero3(types):
  dp = jaxdp.data_parallel(make_mesh((4,), ("data",), types), zero_stage=3, layers="blocks")
  state = train(dp)
  assert state_specs(state).params["blocks"]["w"] == P(None, "data")
  assert_close_to_scale(jaxdp.gather_state(state).params, reference(), RTOL)


TP_SPECS = {"embed": P(None, "model"), "blocks": {"w": P(None, None, "model"), "b": P()}, "head": P("model")}


def tp_loss(params, batch):
  """``loss_fn`` written for a model axis that may be Explicit: each product says its output is whole over it
  (``out_sharding``; an Explicit axis refuses to guess, and a scan carry must keep its type)."""
  whole = lambda a, b: jnp.matmul(a, b, out_sharding=P())  # noqa: E731
  h = jnp.tanh(whole(batch["x"], params["embed"]))
  h, _ = jax.lax.scan(lambda h, p: (jnp.tanh(whole(h, p["w"]) + p["b"][None, :]), None), h, params["blocks"])
  return jnp.sum((whole(h, params["head"]) - batch["y"]) ** 2, axis=-1)


# Every stage kind on each pure type; each mixed mesh once, where the update reads split parameters (2) and
# where the parameters are split (3).
TP_CASES = [(t, s) for t in TYPES for s in (0, 2, 3)] + [(("explicit", "auto"), 2), (("auto", "explicit"), 3)]


@pytest.mark.parametrize("types,stage", TP_CASES)
def test_tensor_parallel_leaves_keep_their_spec(types, stage):
  """A (data, model) mesh: a leaf the user placed over "model" (the rest by ``param_specs``) keeps that split,
  and on an Explicit model axis its type says so."""
  mesh = make_mesh((2, 2), ("data", "model"), types)
  params = init_params()
  params["embed"] = jax.device_put(params["embed"], NamedSharding(mesh, TP_SPECS["embed"]))
  dp = jaxdp.data_parallel(mesh, zero_stage=stage, param_specs=None if stage == 0 else TP_SPECS)
  state = train(dp, params, loss=tp_loss)
  specs = state_specs(state).params
  assert specs["embed"] == P(None, "model")  # (3, 4): no dimension left that the 2 replicas divide
  if stage == 3:
    assert specs["blocks"]["w"] == P("data", None, "model") and specs["head"] == P("model", "data")
  if stage == 2:
    assert state_specs(state).opt_state[1][0].mu["head"] == P("model", "data")
  if mesh.axis_types[1] == AxisType.Explicit:  # in the array's type
    assert jax.typeof(state.params["embed"]).sharding.spec == P(None, "model")
  assert_close_to_scale(jaxdp.gather_state(state).params, reference(), RTOL)


@pytest.mark.parametrize("types", TYPES)
def test_hybrid_sharding(types):
  dp = jaxdp.data_parallel(make_mesh((2, 2), ("replica", "data"), types), axis_name=("replica", "data"),
                           zero_stage=3)
  state = train(dp)
  assert state_specs(state).params["head"] == P("data")
  assert_close_to_scale(jaxdp.gather_state(state).params, reference(), RTOL)


@pytest.mark.parametrize("types", TYPES)
def test_pipeline(types):
  mesh = make_mesh((2, 2), ("stage", "data"), types)
  dp = jaxdp.data_parallel(mesh, layers="blocks", pipeline=jaxdp.pipeline(2, "gpipe"))
  state = train(dp)
  assert state_specs(state).params["blocks"]["w"][0] == "stage"
  assert_close_to_scale(jaxdp.gather_state(state).params, reference(), RTOL)


# Evaluation and checkpoints ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("types", TYPES)
def test_eval_step(types):
  state = zero_run(types, 3)
  mesh = state.params["embed"].sharding.mesh
  evaluate = jaxdp.make_eval_step(loss_fn, jaxdp.data_parallel(mesh, zero_stage=3))
  data = batches(2, seed=4)
  with jax.set_mesh(mesh):
    means = evaluate(state, *data[0])
  on_mesh(means, mesh)
  totals = evaluate.evaluate(state, data)
  params = jaxdp.gather_state(state).params
  loss = sum(float(reference_loss(params, b["x"], b["y"], w)) * float(np.sum(w)) for b, w in data)
  weight = sum(float(np.sum(w)) for _, w in data)
  assert float(means["loss"]) == pytest.approx(float(reference_loss(params, data[0][0]["x"], data[0][0]["y"],
                                                                    data[0][1])), rel=1e-6)
  assert totals["weight"] == pytest.approx(weight, rel=1e-6) and totals["loss"] == pytest.approx(loss / weight, rel=1e-6)


@pytest.mark.parametrize("saved,restored", [("explicit", "auto"), ("auto", "explicit")])
def test_checkpoint_restored_onto_the_other_axis_type(tmp_path, saved, restored):
  state = zero_run(saved, 2)
  target = jaxdp.data_parallel(make_mesh((2,), ("data",), restored), zero_stage=3)
  with jaxdp.CheckpointManager(tmp_path, enable_async_checkpointing=False) as ckpt:
    ckpt.save(STEPS, state)
    back = ckpt.restore(params=init_params(), optimizer=OPT, layout=target).state
  on_mesh(back, target.mesh)
  assert state_specs(back).params["head"] == P("data")
  for a, b in zip(jax.tree.leaves(jaxdp.gather_state(back)), jax.tree.leaves(jaxdp.gather_state(state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # It trains on: one more step there equals one more step where it was saved.
  extra = batches(STEPS + 1)[-1]
  ours, _ = jaxdp.make_train_step(loss_fn, OPT, target)(back, *extra)
  theirs, _ = jaxdp.make_train_step(loss_fn, OPT, jaxdp.data_parallel(state.params["embed"].sharding.mesh,
                                                                     zero_stage=2), donate=False)(state, *extra)
  assert_close_to_scale(jaxdp.gather_state(ours).params, jaxdp.gather_state(theirs).params, RTOL)


def test_diloco_on_both_axis_types():
  """DiLoCo maps over every axis, so the types change nothing inside: the same numbers, on the user's mesh."""
  outer = {}
  for types in TYPES:
    mesh = make_mesh((2, 2), ("replica", "data"), types)
    dp = jaxdp.data_parallel(mesh, axis_name="data")
    state = jaxdp.init_diloco_state(init_params(), OPT, dp)
    step = jaxdp.make_diloco_step(loss_fn, OPT, dp, inner_steps=2)
    for inside, (batch, w) in zip((False, True, False, True), batches(2) * 2):
      with jax.set_mesh(mesh) if inside else contextlib.nullcontext():
        state, metrics = step(state, batch, w)
    on_mesh((state, metrics), mesh)
    outer[types] = jaxdp.runtime.diloco.diloco_params(state)
  assert_close_to_scale(outer["explicit"], outer["auto"], RTOL)
