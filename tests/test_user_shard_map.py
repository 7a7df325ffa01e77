"""jaxdp.train_step composed by hand: inside the user's own shard_map or pmap, on a 2-axis mesh.

Tolerances against the single-device reference are those of
test_step_properties.py (rtol 1e-5, atol 2e-6, float32 re-association of the
gradient sums); the same program built two ways must agree bitwise.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec as P

import jaxdp

# Plumbing and float32 agreement, not speed: most XLA passes skipped while this module runs (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("fast_compiles")

D, H, K = 3, 4, 4  # features, hidden units, devices on the data axis
COUNTS = (3, 0, 4, 1)  # uneven rows per device, one device empty
OPT = optax.adam(0.01, eps=1e-3)
MESH = jaxdp.data_mesh(jax.devices()[:K])
RTOL, ATOL = 1e-5, 2e-6


def init_params(seed=0):
  rng = np.random.default_rng(seed)
  return {
      "hidden": {"w": rng.normal(size=(D, H)).astype(np.float32), "b": rng.normal(size=(H,)).astype(np.float32)},
      "out": {"w": rng.normal(size=(H,)).astype(np.float32), "b": np.float32(0.5)},
  }


def loss_fn(params, batch):
  """Per-example squared error of a one-hidden-layer tanh network."""
  h = jnp.tanh(batch["x"] @ params["hidden"]["w"] + params["hidden"]["b"][None, :])
  return 0.5 * (h @ params["out"]["w"] + params["out"]["b"] - batch["y"]) ** 2


def device_data(step):
  """One (batch, weights) portion per device of the data axis, with random weights."""
  rng = np.random.default_rng(100 + step)
  batches = [{"x": rng.normal(size=(n, D)).astype(np.float32), "y": rng.normal(size=(n,)).astype(np.float32)} for n in COUNTS]
  weights = [rng.uniform(0.5, 2.0, size=(n,)).astype(np.float32) for n in COUNTS]
  return batches, weights


@jax.jit
def reference_step(params, opt_state, batch, weights):
  """Single device, concatenated real rows: value_and_grad of Σ w·l / Σ w and a plain optax update."""
  loss, grads = jax.value_and_grad(lambda p: jnp.sum(weights * loss_fn(p, batch)) / jnp.sum(weights))(params)
  updates, opt_state = OPT.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def reference(steps):
  params = jax.tree.map(jnp.asarray, init_params())
  opt_state = OPT.init(params)
  for s in range(steps):
    batches, weights = device_data(s)
    batch = jax.tree.map(lambda *xs: np.concatenate(xs), *batches)
    params, opt_state, _ = reference_step(params, opt_state, batch, np.concatenate(weights))
  return params, opt_state


def assert_matches_reference(state, steps):
  params, opt_state = reference(steps)
  assert int(state.step) == steps
  close = functools.partial(np.testing.assert_allclose, rtol=RTOL, atol=ATOL)
  jax.tree.map(close, (state.params, state.opt_state), (params, opt_state))


def replica(state, batch, weights):
  """The user's per-replica function: jaxdp's pure step over the "data" axis."""
  return jaxdp.train_step(loss_fn, OPT, state, batch, weights, axis_name="data")


def shard(data, mesh):
  batches, weights = data
  return jaxdp.shard_uneven(batches, mesh, weights=weights)


def run(step, mesh, steps=2):
  """Runs ``step`` from a fresh state; returns the final state and every step's metrics, on the host."""
  state, all_metrics = jaxdp.init_state(init_params(), OPT, mesh), []
  for s in range(steps):
    state, metrics = step(state, *shard(device_data(s), mesh))
    jaxdp.assert_replicas_equal(state)
    assert jaxdp.per_replica(state.step).shape == (mesh.size,)  # every device of the mesh holds one
    all_metrics.append(metrics)
  return jax.tree.map(np.asarray, (state, all_metrics))


@functools.lru_cache(maxsize=None)
def library_step(backend="shard_map"):
  return jaxdp.make_train_step(loss_fn, OPT, MESH, backend=backend)


def assert_bitwise_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_train_step_inside_own_shard_map_equals_make_train_step():
  """A hand-written jit(shard_map(train_step)) computes bitwise what make_train_step computes."""
  own = jax.jit(jax.shard_map(replica, mesh=MESH, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P())))
  ours, theirs = run(own, MESH), run(library_step(), MESH)
  assert_bitwise_equal(ours, theirs)
  assert_matches_reference(ours[0], steps=2)


def test_train_step_inside_own_pmap_equals_make_train_step():
  """A hand-written pmap(train_step), state unmapped and batch split [K, b], matches make_train_step.

  The same per-replica program runs on both: bitwise equal to the pmap
  backend, and to the shard_map backend too.
  """
  own = jax.pmap(replica, axis_name="data", in_axes=(None, 0, 0), out_axes=(None, None), devices=jax.devices()[:K])

  def step(state, batch, weights):
    split = lambda x: np.asarray(x).reshape(K, -1, *x.shape[1:])  # noqa: E731
    return own(state, *jax.tree.map(split, (batch, weights)))

  ours = run(step, MESH)
  assert_bitwise_equal(ours, run(library_step("pmap"), MESH))
  assert_bitwise_equal(ours, run(library_step(), MESH))
  assert_matches_reference(ours[0], steps=2)


def two_axis_mesh():
  devices = np.array(jax.devices()).reshape(K, 2)
  return Mesh(devices, ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def test_two_axis_mesh_reduces_over_data_only():
  """On a (data=4, model=2) mesh the batch is split over "data" and replicated over "model".

  Only "data" is reduced over: both make_train_step and a hand-written
  shard_map equal the single-device reference on the 4 portions, and the
  reported global weight is the real Σ w (a reduction over "model" as well
  would double it, and cancel out of the mean). All 8 devices hold the same
  replica (checked in ``run``).
  """
  mesh = two_axis_mesh()
  library = run(jaxdp.make_train_step(loss_fn, OPT, mesh), mesh)
  own = jax.jit(jax.shard_map(replica, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P())))
  hand_written = run(own, mesh)
  # The gradient norm is summed in another order: the library leaves "model" to the compiler (an Auto
  # axis, which may split a leaf), so each replica sums the whole gradient; here every axis is manual and
  # each replica sums its quarter (jaxdp.global_norm). All else is bitwise equal.
  norms = [[m.pop("grad_norm") for m in metrics] for _, metrics in (library, hand_written)]
  np.testing.assert_allclose(*norms, rtol=2e-7)
  assert_bitwise_equal(library, hand_written)
  state, all_metrics = library
  assert_matches_reference(state, steps=2)
  for s, metrics in enumerate(all_metrics):
    np.testing.assert_allclose(metrics["weight"], np.sum(np.concatenate(device_data(s)[1]), dtype=np.float64), rtol=1e-6)


def test_lower_compile_shows_all_reduce_and_memory():
  """``step.lower(...).compile()`` works: its HLO has an all-reduce and memory analysis is available.

  Lowering neither runs nor donates: the same state then takes a real step
  that matches the reference.
  """
  step = library_step()
  state = jaxdp.init_state(init_params(), OPT, MESH)
  batch, weights = shard(device_data(0), MESH)
  compiled = step.lower(state, batch, weights).compile()
  assert "all-reduce" in compiled.as_text()
  memory = compiled.memory_analysis()
  assert memory is not None
  assert memory.argument_size_in_bytes > 0 and memory.output_size_in_bytes > 0
  state, _ = step(state, batch, weights)
  assert_matches_reference(jax.tree.map(np.asarray, state), steps=1)


def _per_replica(fn):
  """``fn`` per replica of MESH, every output stacked over the devices (replicas may differ under "none")."""
  stacked = lambda *args: jax.tree.map(lambda x: x[None], fn(*args))  # noqa: E731
  return jax.jit(jax.shard_map(stacked, mesh=MESH, in_specs=(P(), P("data"), P("data")), out_specs=P("data"),
                               check_vma=False))


@pytest.mark.parametrize("reduction", jaxdp.REDUCTIONS)
def test_deferred_division_gives_the_divided_gradient(reduction):
  """``reduce_gradient(divide=False)`` leaves the reduced sums and their divisor; dividing gives the same gradient.

  ``applied_gradient`` of the deferred result equals ``divide=True``'s
  gradient bitwise (one shared division), with the same loss and weight.
  ``finish_step`` divides a deferred gradient inside the update (what
  ``train_step`` does): the same state and metrics as from the divided
  gradient, to float32 round-off (the norm's sum may be fused differently).
  """
  state = jaxdp.init_state(init_params(), OPT, MESH)
  batch, weights = shard(device_data(0), MESH)

  def reductions(state, batch, weights):
    local = jaxdp.local_gradient(loss_fn, state.params, batch, weights, axis_name="data")
    divided = jaxdp.reduce_gradient(local, axis_name="data", reduction=reduction)
    deferred = jaxdp.reduce_gradient(local, axis_name="data", reduction=reduction, divide=False)
    assert (deferred.grad_divisor is None) == (reduction == "sum") and divided.grad_divisor is None
    return divided, deferred._replace(grad_divisor=None), jaxdp.applied_gradient(deferred)

  divided, deferred, applied = _per_replica(reductions)(state, batch, weights)
  assert_bitwise_equal(applied, divided.grads)
  assert_bitwise_equal(deferred._replace(grads=None), divided._replace(grads=None))

  def finished(state, batch, weights):
    return [
        jaxdp.finish_step(OPT, state, jaxdp.gradient_step(loss_fn, state, batch, weights, reduction=reduction,
                                                          divide=divide), axis_name="data",
                          agreed=reduction != "none")  # as train_step composes them
        for divide in (True, False)
    ]

  from_divided, from_deferred = _per_replica(finished)(state, batch, weights)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-7), from_deferred, from_divided)
  own = jax.jit(jax.shard_map(lambda *a: jaxdp.train_step(loss_fn, OPT, *a, reduction=reduction), mesh=MESH,
                              in_specs=(P(), P("data"), P("data")), out_specs=P("data") if reduction == "none" else P(),
                              check_vma=False))
  if reduction != "none":  # train_step is the deferred composition
    assert_bitwise_equal(jax.tree.map(lambda x: x[0], from_deferred), own(state, batch, weights))


def test_finish_step_takes_each_replicas_own_norm_of_a_per_replica_gradient():
  """finish_step(axis_name=...) without ``agreed=True`` is safe for a ``reduction="none"`` gradient.

  Under ``check_vma=False`` (as under pmap) nothing tells per-replica leaves from agreed ones; the norm
  then sums each replica's own values, so its ``grad_norm`` is the norm of its own gradient (reference
  written plainly here). Splitting them into 1/N parts, as ``agreed=True`` does for an agreed gradient,
  would mix the replicas' slices.
  """
  state = jaxdp.init_state(init_params(), OPT, MESH)
  batch, weights = shard(device_data(0), MESH)

  def norms(state, batch, weights):
    reduced = jaxdp.gradient_step(loss_fn, state, batch, weights, reduction="none")
    _, metrics = jaxdp.finish_step(OPT, state, reduced, axis_name="data")
    own = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(jaxdp.applied_gradient(reduced))))
    return metrics["grad_norm"], own

  got, own = _per_replica(norms)(state, batch, weights)
  np.testing.assert_allclose(got, own, rtol=1e-6)
  assert len(np.unique(np.asarray(own))) > 1  # the replicas' gradients differ


def test_compiled_step_writes_no_divided_copy_of_the_gradient():
  """The weighted mean costs no pass of its own: no gradient-sized array is written between reduction and update.

  In the compiled step, after the all-reduce and outside the skip
  ``cond`` (whose branch holds the optimizer update), nothing has the shape
  of the large weight. The hand-written composition that divides first
  (``gradient_step(divide=True)``) does write one there: the check sees it.
  The weight is larger than ``PACK_BYTES``: smaller leaves travel packed in
  one flat operand and are sliced out of it after the all-reduce (a copy of
  the sum, not a divided one).
  """
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  wide = (64, 1100)  # a shape no other value of this program has
  assert wide[0] * wide[1] * 4 > jaxdp.training.reduction.PACK_BYTES
  params = {"w": np.full(wide, 0.01, np.float32), "v": np.ones((wide[1],), np.float32)}

  def wide_loss(params, batch):
    return jnp.square(jnp.tanh(batch["x"] @ params["w"]) @ params["v"] - batch["y"])

  batch, weights = jaxdp.shard_uneven(
      [{"x": np.ones((n, wide[0]), np.float32), "y": np.ones((n,), np.float32)} for n in (3, 5)], mesh)
  state = jaxdp.init_state(params, OPT, mesh)

  def written_after_reduction(hlo: str) -> list[str]:
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    after = entry[entry.index(" all-reduce("):].splitlines()[1:]
    shape = f"f32[{wide[0]},{wide[1]}]"
    return [line for line in after if f"= {shape}" in line and " get-tuple-element(" not in line]

  library = jaxdp.make_train_step(wide_loss, OPT, mesh).lower(state, batch, weights).compile().as_text()
  assert " conditional(" in library
  assert written_after_reduction(library) == []

  def divided_first(state, batch, weights):
    reduced = jaxdp.gradient_step(wide_loss, state, batch, weights, divide=True)
    return jaxdp.finish_step(OPT, state, reduced, axis_name="data")

  own = jax.jit(jax.shard_map(divided_first, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P())))
  assert written_after_reduction(own.lower(state, batch, weights).compile().as_text()) != []


# --- Compositions the types cannot make right: refused, or made right -------------------------------


def _global(batches, weights):
  return jaxdp.shard_uneven(batches, MESH, weights=weights)


def _mapped(replica, check_vma=True, out_specs=P()):
  return jax.jit(jax.shard_map(replica, mesh=MESH, in_specs=(P(), P("data"), P("data")), out_specs=out_specs,
                               check_vma=check_vma))


def test_a_gradient_already_summed_by_jax_grad_is_refused():
  """local_gradient without axis_name inside shard_map(check_vma=True): jax.grad of the replicated params sums over
  the axis itself, and reduce_gradient summed again: a gradient 4x too large (8x on 8 devices), no error."""

  def replica(params, batch, weights):
    local = jaxdp.local_gradient(loss_fn, params, batch, weights)  # no axis_name
    return jaxdp.reduce_gradient(local, axis_name="data").grads

  with pytest.raises(ValueError, match=r"already summed over 'data'.*Pass axis_name= to local_gradient"):
    _mapped(replica)(init_params(), *_global(*device_data(0)))


def test_a_gradient_reduced_twice_is_refused():
  """A ReducedGradient's values passed to reduce_gradient again were summed over N identical copies and divided by
  the weight a second time: 9x too small on 3/0/3/3 rows, no error (found by the composition review)."""

  def replica(params, batch, weights):
    once = jaxdp.reduce_gradient(jaxdp.local_gradient(loss_fn, params, batch, weights, axis_name="data"),
                                 axis_name="data")
    return jaxdp.reduce_gradient(jaxdp.LocalGradient(once.grads, once.loss, once.weight), axis_name="data").grads

  with pytest.raises(ValueError, match=r"typed as the same on every replica of 'data'.*Pass the LocalGradient"):
    _mapped(replica)(init_params(), *_global(*device_data(0)))


def test_an_axis_name_that_misses_the_batch_axis_is_named():
  """train_step(axis_name="model") in a shard_map whose batch is split over "data": JAX's "cond branches must have
  equal output types" (and, under check_vma=False, a silent per-group step)."""
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
  state = jaxdp.TrainState.create(init_params(), OPT)
  specs = jax.tree.map(lambda _: P(), state)
  batch, weights = jax.device_get(_global(*device_data(0)))  # 16 rows, split over "data" below

  def replica(state, batch, weights):
    return jaxdp.train_step(loss_fn, OPT, state, batch, weights, axis_name="model")

  step = jax.jit(jax.shard_map(replica, mesh=mesh, in_specs=(specs, P("data"), P("data")), out_specs=(specs, P())))
  with pytest.raises(ValueError, match=r"reduction over axis_name='model' the loss still varies over \['data'\]"):
    step(state, batch, weights)


def test_a_loss_summed_over_a_manual_model_axis_inside_loss_fn_is_accepted():
  """Tensor parallelism by hand: W and v split over a manual "model" axis, the loss psum'ed over it in loss_fn.
  The check for a loss still varying after the reduction read the packed all-reduce's type (the gradient's
  "model" split) and refused this correct program; it reads the local sums now (found by the diff review)."""
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:4])
  opt = optax.sgd(0.1)
  rng = np.random.default_rng(3)
  params = {"W": rng.normal(size=(D, 4)).astype(np.float32), "v": rng.normal(size=(4,)).astype(np.float32)}
  x, y = rng.normal(size=(6, D)).astype(np.float32), rng.normal(size=(6,)).astype(np.float32)
  weights = np.array([1, 1, 0, 1, 1, 1], np.float32)
  specs = {"W": P(None, "model"), "v": P("model")}

  def loss_fn(p, batch):
    return (jax.lax.psum(jnp.tanh(batch["x"] @ p["W"]) @ p["v"], "model") - batch["y"]) ** 2

  def body(p, batch, w):
    state = jaxdp.TrainState(p, opt.init(p), jnp.zeros((), jnp.int32), None)
    return jaxdp.train_step(loss_fn, opt, state, batch, w, axis_name="data")[0].params

  place = lambda tree, spec: jax.device_put(tree, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), spec))  # noqa: E731
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("data"), P("data")), out_specs=specs))
  new = step(place(params, specs), place({"x": x, "y": y}, {"x": P("data"), "y": P("data")}), place(weights, P("data")))

  def reference(p):
    return jnp.sum(weights * ((jnp.tanh(x @ p["W"]) @ p["v"] - y) ** 2)) / weights.sum()

  grads = jax.grad(reference)(params)
  for k in params:
    np.testing.assert_allclose(np.asarray(new[k]), params[k] - 0.1 * grads[k], rtol=RTOL, atol=ATOL)


def test_scatter_needs_the_types_that_tell_chunks_apart():
  """Under check_vma=False (or pmap) the chunks look like agreed leaves: each device's own norm and skip."""

  def replica(params, batch, weights):
    local = jaxdp.local_gradient(loss_fn, params, batch, weights, axis_name="data")
    return jaxdp.reduce_gradient(local, axis_name="data", scatter=True).loss

  with pytest.raises(ValueError, match=r"scatter needs shard_map with check_vma=True"):
    _mapped(replica, check_vma=False)(init_params(), *_global(*device_data(0)))
  def scalar_leaf(params, batch, weights):  # scatter=True splits every leaf: a scalar one cannot be
    loss = lambda p, b: (jnp.sum(b["x"], -1) * jnp.sum(p["w"]) + p["b"] - b["y"]) ** 2  # noqa: E731
    local = jaxdp.local_gradient(loss, params, batch, weights, axis_name="data")
    return jaxdp.reduce_gradient(local, axis_name="data", scatter=True).loss

  with pytest.raises(ValueError, match=r"gradient leaf of shape \(\) has no dimension 0.*P\(\)"):  # was IndexError
    _mapped(scalar_leaf)({"w": np.ones(K, np.float32), "b": np.float32(0)}, *_global(*device_data(0)))


def test_the_norm_of_chunks_on_a_hybrid_axis_counts_each_chunk_once():
  """Chunks scattered over "data" are the same over "replica": the norm summed them once per replica (sqrt 2 too
  large on 2 x 4 devices)."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("replica", "data"), axis_types=(AxisType.Auto,) * 2)
  axes = ("replica", "data")
  params = {"w": np.arange(8 * 3, dtype=np.float32).reshape(8, 3) / 10, "b": np.float32(0.5)}
  loss = lambda p, b: jnp.sum((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2, -1)  # noqa: E731
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16, 3)).astype(np.float32)
  specs = {"w": P("data"), "b": P()}

  def replica(params, batch, weights):
    local = jaxdp.local_gradient(loss, params, batch, weights, axis_name=axes)
    reduced = jaxdp.reduce_gradient(local, axis_name=axes, scatter=specs)
    return jaxdp.global_norm(reduced.grads, axes, reduced.grad_divisor)

  step = jax.jit(jax.shard_map(replica, mesh=mesh, in_specs=(P(), P(axes), P(axes)), out_specs=P()))
  norm = step(params, {"x": x, "y": y}, np.ones(16, np.float32))
  grads = jax.grad(lambda p: jnp.mean(loss(p, {"x": x, "y": y})))(jax.tree.map(jnp.asarray, params))
  np.testing.assert_allclose(float(norm), float(optax.tree.norm(grads)), rtol=1e-5)


def test_model_state_without_any_weight_keeps_a_replicas_value():
  """With a global weight of 0 the weighted mean of per-replica statistics was 0 (train_step skips such a step,
  but reduce_model_state alone returned zeros); it is now replica 0's value."""

  def replica(state, batch, weights):
    mine = jnp.asarray(lax_index() + 1.0)
    return (jaxdp.reduce_model_state({"mean": mine}, jnp.zeros(()), axis_name="data"),
            jaxdp.reduce_model_state({"mean": mine}, mine, axis_name="data"))  # weights 1..4: Σ w·s / Σ w

  def lax_index():
    return jax.lax.axis_index("data").astype(jnp.float32)

  without, weighted = _mapped(replica, out_specs=(P(), P()))(init_params(), *_global(*device_data(0)))
  assert float(without["mean"]) == 1.0
  assert float(weighted["mean"]) == (1 + 4 + 9 + 16) / 10


def test_replica_divergence_of_varying_replicas():
  """Under check_vma=True a reduction='none' state made as_varying is all varying leaves, which are skipped as
  ZeRO chunks by default (0 whatever they hold): skip_varying=False compares them."""

  def replica(state, batch, weights):
    mine = jaxdp.as_varying({"w": jnp.zeros(())}, "data")["w"] + jax.lax.axis_index("data").astype(jnp.float32)
    return (jaxdp.replica_divergence({"w": mine}, "data"),
            jaxdp.replica_divergence({"w": mine}, "data", skip_varying=False))

  skipped, compared = _mapped(replica, out_specs=(P(), P()))(init_params(), *_global(*device_data(0)))
  assert float(skipped) == 0.0 and float(compared) == 3.0


def test_none_inside_a_typed_shard_map_says_what_to_do():
  def replica(state, batch, weights):
    return jaxdp.train_step(loss_fn, OPT, state, batch, weights, reduction="none")

  with pytest.raises(ValueError, match=r"reduction='none' inside shard_map with check_vma=True.*as_varying"):
    _mapped(replica, out_specs=(P(), P()))(jaxdp.init_state(init_params(), OPT, MESH), *_global(*device_data(0)))


@pytest.mark.parametrize("options", [{}, {"bucket_bytes": 0}, {"bucket_bytes": 10**5}, {"accum_steps": 2}])
def test_tensor_parallel_by_hand_with_replicated_parameters_and_the_global_norm(options):
  """Tensor parallelism by hand with parameters replicated over the manual "model" axis next to split ones.
  The packed all-reduce put the replicated small leaves in one operand with the split ones, typing their sums
  as varying over "model": JAX refused the step ("cond branches must have equal output types"). The gradient
  norm (the metric and the skip decision) counted only each model shard's part: it is completed over "model".
  Buckets had the same mix (by dtype only, and each tied to the one before), and the accumulation's carry
  was typed as varying over the data axis only (JAX: "scan body ... carry ... must have equal types")."""
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:4])
  opt = optax.adam(0.1)
  rng = np.random.default_rng(3)
  params = {"W": rng.normal(size=(D, 4)).astype(np.float32), "v": rng.normal(size=(4,)).astype(np.float32),
            "c": np.float32(0.3), "d": rng.normal(size=(D,)).astype(np.float32)}
  x, y = rng.normal(size=(8, D)).astype(np.float32), rng.normal(size=(8,)).astype(np.float32)
  weights = np.array([1, 1, 0, 1, 3, 1, 2, 0], np.float32)
  specs = {"W": P(None, "model"), "v": P("model"), "c": P(), "d": P()}

  def predict(p, x):
    return jax.lax.psum(jnp.tanh(x @ p["W"]) @ p["v"], "model") + p["c"] + x @ p["d"]

  def body(p, batch, w):
    state = jaxdp.TrainState(p, opt.init(p), jnp.zeros((), jnp.int32), None)
    state, metrics = jaxdp.train_step(lambda p, b: (predict(p, b["x"]) - b["y"]) ** 2, opt, state, batch, w,
                                      axis_name="data", **options)
    return state.params, metrics["grad_norm"]

  place = lambda tree, spec: jax.device_put(tree, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), spec))  # noqa: E731
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("data"), P("data")), out_specs=(specs, P())))
  new, grad_norm = step(place(params, specs), place({"x": x, "y": y}, {"x": P("data"), "y": P("data")}),
                        place(weights, P("data")))

  def reference(p):
    out = jnp.tanh(x @ p["W"]) @ p["v"] + p["c"] + x @ p["d"]
    return jnp.sum(weights * (out - y) ** 2) / weights.sum()

  grads = jax.grad(reference)(params)
  updates, _ = opt.update(grads, opt.init(params), params)
  expected = optax.apply_updates(params, updates)
  for k in params:
    np.testing.assert_allclose(np.asarray(new[k]), expected[k], rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(float(grad_norm), float(optax.tree.norm(grads)), rtol=RTOL)


def test_a_whole_gradient_transformation_of_a_tensor_parallel_shard_is_named():
  """optax.clip_by_global_norm inside a hand-written tensor-parallel shard_map reads each model shard's norm:
  the update of a parameter replicated over "model" would vary over it. JAX said only that the cond's branch
  types differ; jaxdp names the parameter, the axis and the way out."""
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:4])
  opt = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1))
  rng = np.random.default_rng(4)
  params = {"W": rng.normal(size=(D, 4)).astype(np.float32), "c": np.float32(0.3)}
  specs = {"W": P(None, "model"), "c": P()}

  def body(p, batch):
    state = jaxdp.TrainState(p, opt.init(p), jnp.zeros((), jnp.int32), None)
    loss_fn = lambda p, b: (jax.lax.psum(jnp.sum(b["x"] @ p["W"], -1), "model") + p["c"] - b["y"]) ** 2  # noqa: E731
    return jaxdp.train_step(loss_fn, opt, state, batch, axis_name="data")[0].params

  place = lambda tree, spec: jax.device_put(tree, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), spec))  # noqa: E731
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("data")), out_specs=specs))
  batch = {"x": rng.normal(size=(4, D)).astype(np.float32), "y": rng.normal(size=(4,)).astype(np.float32)}
  with pytest.raises(ValueError, match=r"params\['c'\] varies over the manual mesh axes \['model'\].*make_train_step"):
    step(place(params, specs), place(batch, {"x": P("data"), "y": P("data")}))



def test_each_replica_keeps_its_own_norm_under_none_in_a_typed_shard_map():
  """reduction="none" gives each replica its own step: its grad_norm is its own gradient's, and a NaN on one
  replica skips that replica only. The completion of the norm over manual axes (for hand-written tensor
  parallelism) summed every replica's squares when finish_step got no axis_name (found by the diff review)."""
  mesh = jaxdp.data_mesh(jax.devices()[:4])
  opt = optax.sgd(0.1)
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(3,)).astype(np.float32)}
  x, y = rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8,)).astype(np.float32)
  y_nan = y.copy()
  y_nan[0] = np.nan
  loss = lambda p, b: (b["x"] @ p["w"] - b["y"]) ** 2  # noqa: E731

  def body(p, batch):
    p = jaxdp.as_varying(p, "data")
    state = jaxdp.TrainState(p, opt.init(p), jnp.zeros((), jnp.int32), None)
    _, metrics = jaxdp.train_step(loss, opt, state, batch, reduction="none")
    return metrics["grad_norm"][None], metrics["skipped"][None]

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P("data"), P("data"))))
  norms, skipped = step(params, {"x": x, "y": y})
  own = [float(optax.tree.norm(jax.grad(lambda p: jnp.mean(loss(p, {"x": x[2 * i:2 * i + 2], "y": y[2 * i:2 * i + 2]})))(
      params))) for i in range(4)]
  np.testing.assert_allclose(np.asarray(norms), own, rtol=RTOL)
  assert not np.any(np.asarray(skipped))
  _, skipped = step(params, {"x": x, "y": y_nan})
  np.testing.assert_array_equal(np.asarray(skipped), [1, 0, 0, 0])


def test_a_reduce_scatter_by_hand_keeps_replicated_leaves_replicated_over_a_manual_model_axis():
  """reduce_gradient(scatter=...) in the user's shard_map with "model" manual too: the default packing of small
  leaves put a leaf replicated over "model" in one row with a model-split one, and its slice came back typed as
  varying over "model" (shard_map refused the out_specs). Leaves are packed by varying type (packing review)."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(8, 8)).astype(np.float32), "v": rng.normal(size=(8,)).astype(np.float32)}
  x, y = rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16,)).astype(np.float32)

  def loss(p, batch):
    out = jax.lax.psum(jnp.tanh(batch["x"] @ p["w"]).sum(-1), "model") + batch["x"] @ p["v"]
    return 0.5 * (out - batch["y"]) ** 2

  scatter = {"w": P("data"), "v": P("data")}
  grads = {}
  for bucket_bytes in (None, 0):
    def replica(params, batch, weights):
      local = jaxdp.local_gradient(loss, params, batch, weights, axis_name="data")
      return jaxdp.reduce_gradient(local, axis_name="data", scatter=scatter, bucket_bytes=bucket_bytes).grads

    step = jax.jit(jax.shard_map(replica, mesh=mesh, in_specs=({"w": P(None, "model"), "v": P()}, P("data"), P("data")),
                                 out_specs={"w": P("data", "model"), "v": P("data")}))
    place = lambda tree, spec: jax.device_put(tree, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), spec))  # noqa: E731
    grads[bucket_bytes] = step(place(params, {"w": P(None, "model"), "v": P()}),
                               place({"x": x, "y": y}, {"x": P("data"), "y": P("data")}), place(np.ones(16, np.float32), P("data")))
  expected = jax.grad(lambda p: jnp.sum(0.5 * ((jnp.tanh(x @ p["w"]).sum(-1) + x @ p["v"]) - y) ** 2) / 16)(params)
  for got in grads.values():
    for k in params:
      np.testing.assert_allclose(np.asarray(got[k]), expected[k], rtol=RTOL, atol=ATOL)


def test_buckets_in_a_shard_map_manual_over_data_only_with_an_explicit_model_split():
  """The user's shard_map is manual over "data" only and "model" is Explicit, parameters split over it: each
  bucket's ordering tie sliced one element of a model-split bucket (ShardingTypeError), a 2-D leaf split on its
  columns could not be flattened into a bucket's row, and accum_steps=2's zero carry lost the split (scan's type
  error). Such leaves are reduced on their own; the carry keeps their sharding (from two diff reviews)."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  rng = np.random.default_rng(0)
  params = {"v": rng.normal(size=(8,)).astype(np.float32), "W": rng.normal(size=(4, 6)).astype(np.float32),
            "c": rng.normal(size=(6,)).astype(np.float32)}
  specs = {"v": P("model"), "W": P(None, "model"), "c": P()}
  x, w = rng.normal(size=(8, 4)).astype(np.float32), rng.uniform(0.5, 2.0, size=(8,)).astype(np.float32)

  def loss(p, batch):
    return jnp.tanh(batch @ p["W"]) @ p["c"] * jnp.sum(p["v"]) / 8

  place = lambda tree, spec: jax.device_put(tree, jax.tree.map(lambda s: jax.NamedSharding(mesh, s), spec))  # noqa: E731
  expected = jax.grad(lambda p: jnp.sum(w * loss(p, x)) / jnp.sum(w))(params)
  for bucket_bytes, accum_steps in ((None, 1), (0, 1), (16, 1), (0, 2)):
    def replica(params, batch, weights):
      local = jaxdp.local_gradient(loss, params, batch, weights, axis_name="data", accum_steps=accum_steps)
      return jaxdp.reduce_gradient(local, axis_name="data", bucket_bytes=bucket_bytes).grads

    step = jax.jit(jax.shard_map(replica, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(),
                                 axis_names={"data"}))
    got = step(place(params, specs), place(x, P("data")), place(w, P("data")))
    for k in params:
      np.testing.assert_allclose(np.asarray(got[k]), expected[k], rtol=RTOL, atol=ATOL,
                                 err_msg=f"{bucket_bytes} {accum_steps} {k}")
