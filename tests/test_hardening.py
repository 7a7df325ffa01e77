"""Failures found by attacking the public API, each fixed as a class and pinned here.

Crashes (a donated or shared buffer reaching XLA), silent wrong results
(half-precision sums, negative or subnormal weights) and weak errors (the
message must name the argument and the fix, before anything runs or is
donated).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py: plumbing and float32 agreement

K = 4
MESH = jaxdp.data_mesh(jax.devices()[:K])
OPT = optax.sgd(0.1)


def loss_fn(params, batch):
  return 0.5 * (batch["x"] @ params["w"] + params["b1"] + params["b2"] - batch["y"]) ** 2


def params():
  return {"w": np.ones((3,), np.float32), "b1": np.zeros((), np.float32), "b2": np.zeros((), np.float32)}


def data(counts=(2, 1, 0, 3), seed=0):
  rng = np.random.default_rng(seed)
  batches = [{"x": rng.normal(size=(n, 3)).astype(np.float32), "y": rng.normal(size=(n,)).astype(np.float32)} for n in counts]
  return jaxdp.shard_uneven(batches, MESH)


# Crashes ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", jaxdp.BACKENDS)
def test_reusing_a_donated_state_is_a_value_error(backend):
  step = jaxdp.make_train_step(loss_fn, OPT, MESH, backend=backend)
  state = jaxdp.init_state(params(), OPT, MESH)
  new, _ = step(state, *data())
  with pytest.raises(ValueError, match=r"donated to an earlier step.*Pass the state that step returned"):
    step(state, *data())
  step(new, *data())  # the returned state goes on


@pytest.mark.parametrize("backend", jaxdp.BACKENDS)
def test_a_donated_state_is_refused_whatever_views_of_it_are_alive(backend):
  """On CPU a live numpy view of a buffer keeps XLA from deleting it when donated: is_deleted() missed the
  consumed state, and running it again crashed the process (SIGSEGV). gather_state also returned such views."""
  step = jaxdp.make_train_step(loss_fn, OPT, MESH, backend=backend)
  evaluate = jaxdp.make_eval_step(loss_fn, MESH, backend=backend)
  state = jaxdp.init_state(params(), OPT, MESH)
  host = jaxdp.gather_state(state)
  views = [np.asarray(x) for x in jax.tree.leaves(state)]  # the user's own views, alive across the step
  w = np.asarray(state.params["w"])
  for leaf in jax.tree.leaves(host):
    assert leaf.flags.owndata and leaf.flags.writeable  # a real copy, not a view of a device buffer
  new, _ = step(state, *data())
  donated = r"donated to an earlier step.*Pass the state that step returned"
  with pytest.raises(ValueError, match=donated):
    step(state, *data())
  with pytest.raises(ValueError, match=donated):
    evaluate(state, *data())
  with pytest.raises(ValueError, match=donated):
    jaxdp.gather_state(state)
  np.testing.assert_array_equal(host.params["w"], w)
  step(new, *data())  # the returned state goes on
  del views


def test_a_consumed_state_is_a_value_error_everywhere_it_can_go(tmp_path):
  """Not only the step: a consumed state reaching a compiled eval step crashed the process (SIGSEGV), and the
  host-side helpers gave JAX's bare "Array has been deleted". Each now names the argument and the fix."""
  step = jaxdp.make_train_step(loss_fn, OPT, MESH)
  evaluate = jaxdp.make_eval_step(loss_fn, MESH)
  state = jaxdp.init_state(params(), OPT, MESH)
  evaluate(state, *data())  # compiled before the state is consumed: the crashing order
  new, _ = step(state, *data())
  donated = r"state.* was donated to an earlier step.*Pass the state that step returned"
  with pytest.raises(ValueError, match=donated):
    evaluate(state, *data())
  with pytest.raises(ValueError, match=donated):
    jaxdp.gather_state(state)
  with pytest.raises(ValueError, match="full_" + donated):
    jaxdp.place_state(state, OPT, MESH)
  with pytest.raises(ValueError, match=r"tree.* was donated"):
    jaxdp.per_replica(state.params)
  with pytest.raises(ValueError, match=r"tree.* was donated"):
    jaxdp.assert_replicas_equal(state)
  with jaxdp.CheckpointManager(tmp_path, enable_async_checkpointing=False) as ckpt:
    with pytest.raises(ValueError, match=donated):
      ckpt.save(1, state)
    assert ckpt.all_steps() == []
    assert ckpt.save(1, new)
  evaluate(new, *data())  # the returned state goes on
  jaxdp.assert_replicas_equal(new)


def test_a_state_whose_leaves_share_one_buffer_runs():
  """TrainState.create with one array in two leaves: the step copies the duplicate instead of crashing."""
  z = jax.device_put(jnp.zeros(()), jax.sharding.NamedSharding(MESH, jax.sharding.PartitionSpec()))
  w = jax.device_put(jnp.ones(3), z.sharding)
  state = jaxdp.TrainState.create({"w": w, "b1": z, "b2": z}, OPT)
  reference = jaxdp.make_train_step(loss_fn, OPT, MESH, donate=False)(jaxdp.init_state(params(), OPT, MESH), *data())[0]
  new, _ = jaxdp.make_train_step(loss_fn, OPT, MESH)(state, *data())
  jax.tree.map(np.testing.assert_array_equal, new.params, reference.params)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_an_input_that_is_one_of_the_donated_state_arrays_gets_its_own_copy(zero_stage):
  """weights=state.params["v"] (split over the data axis at stages 1-3, as the batch is): the buffer reached the
  step twice, once donated, and XLA crashed the process (SIGSEGV); found by the host-side review."""
  def shared_loss(params, batch):
    return loss_fn(params, batch) + 0.0 * params["v"][0]

  fresh = lambda: jaxdp.init_state({**params(), "v": np.full(12, 0.5, np.float32)}, OPT, MESH, zero_stage=zero_stage)  # noqa: E731
  step = jaxdp.make_train_step(shared_loss, OPT, MESH, zero_stage=zero_stage)
  batch, _ = data(counts=(3, 3, 3, 3))
  expected, expected_metrics = step(fresh(), batch, np.full(12, 0.5, np.float32))
  state = fresh()
  v = state.params["v"]
  # The array itself, and another Array object on the same buffers (the second diff review's variant).
  for shared in (lambda: v, lambda: jax.make_array_from_single_device_arrays(
      v.shape, v.sharding, [s.data for s in v.addressable_shards])):
    state = fresh()
    v = state.params["v"]
    new, metrics = step(state, batch, shared())
    assert float(metrics["loss"]) == float(expected_metrics["loss"])
    jax.tree.map(np.testing.assert_array_equal, jaxdp.gather_state(new).params, jaxdp.gather_state(expected).params)


def test_the_guard_keeps_its_own_copy_of_the_nonfinite_flag():
  """The guard queued the very metrics["nonfinite"] array it handed back: a user who deleted or donated it
  crashed the next call ("Array has been deleted", or SIGSEGV). It still trips on the third NaN step."""
  step = jaxdp.make_train_step(loss_fn, OPT, MESH, max_consecutive_skips=3)
  state = jaxdp.init_state(params(), OPT, MESH)
  batch, weights = data()
  nan_batch = {**batch, "y": jnp.full_like(batch["y"], jnp.nan)}
  state, metrics = step(state, batch, weights)
  metrics["nonfinite"].delete()
  donate = jax.jit(lambda m: {k: v + 0 for k, v in m.items()}, donate_argnums=0)
  with pytest.raises(FloatingPointError, match=r"the last 3 steps"):
    for _ in range(6):
      state, metrics = step(state, nan_batch, weights)
      donate(metrics)
  assert int(state.step) == 1  # the NaN steps were skipped


def test_the_returned_state_in_another_tree_is_validated_again():
  """The returned state's own leaves put in another structure skipped validation (the fast path compared leaf
  identity only) and failed in shard_map's pytree check instead of jaxdp's message."""
  opt = optax.adam(0.1)
  step = jaxdp.make_train_step(loss_fn, opt, MESH)
  state, _ = step(jaxdp.init_state(params(), opt, MESH), *data())
  # The same leaves in the same order ("a" sorts where "b1" did), under another key.
  renamed = state._replace(params={"a": state.params["b1"], "b2": state.params["b2"], "w": state.params["w"]})
  with pytest.raises(ValueError, match=r"state.opt_state does not match optimizer.init\(state.params\)"):
    step(renamed, *data())
  step(state, *data())  # nothing was donated


def test_the_eval_step_compiles_again_for_params_of_another_structure():
  """Its compile cache was keyed by the params' specs only: a second state with other names (same specs) reused
  the first program and failed in shard_map's pytree check."""
  def total(params, batch):
    return (batch["y"] - sum(jnp.sum(x) for x in jax.tree.leaves(params))) ** 2

  evaluate = jaxdp.make_eval_step(total, MESH)
  first = evaluate(jaxdp.init_state({"a": np.ones(3, np.float32)}, OPT, MESH), *data())
  second = evaluate(jaxdp.init_state({"b": np.ones(3, np.float32)}, OPT, MESH), *data())
  assert float(first["loss"]) == float(second["loss"])
  with pytest.raises(TypeError, match=r"batches yields a dict; pass \(batch, weights\) pairs"):
    evaluate.evaluate(jaxdp.init_state({"a": np.ones(3, np.float32)}, OPT, MESH), [data()[0]])


# Silent wrong results -------------------------------------------------------------------------------------


def token_loss(dtype):
  def loss(params, batch):
    return (params["w"] * batch["x"]).astype(dtype)  # per-token losses [b, t] in half precision

  return loss


@pytest.mark.parametrize(
    "dtype,tokens",
    [(jnp.float16, 70_000), (jnp.bfloat16, 1_204)],
    ids=["float16-beyond-65504", "bfloat16-1204"],
)
def test_half_precision_losses_are_summed_in_float32(dtype, tokens):
  """The weights and weighted sums stay float32: the global weight is exact and the step is the float32 one.

  float16 sums overflow past 65,504 tokens (weight inf, gradient 0, nothing flagged); bfloat16 counts
  1,204 tokens as 1,200. The gradient of Σ w·w·x / Σ w with x = 1 is exactly 1 per token.
  """
  mesh = jaxdp.data_mesh(jax.devices()[:2])
  opt = optax.sgd(1.0)
  rows = tokens // 4
  portions = [{"x": np.ones((rows // 2 + r, 4), np.float32)} for r in (0, rows % 2)]
  weights = [np.ones((p["x"].shape[0], 4), np.float32) for p in portions]
  state = jaxdp.init_state({"w": np.zeros((), np.float32)}, opt, mesh)
  new, metrics = jaxdp.make_train_step(token_loss(dtype), opt, mesh)(state, *jaxdp.shard_uneven(portions, mesh, weights=weights))
  assert float(metrics["weight"]) == rows * 4 and int(metrics["skipped"]) == 0
  assert float(new.params["w"]) == -1.0  # w - lr * 1


def test_negative_weights_given_to_the_step_skip_it_everywhere():
  """Checked in the step (one reduction over the weights) and folded into the non-finite flag."""
  batch, weights = data()
  bad = weights.at[0].set(-1.0)
  state = jaxdp.init_state(params(), OPT, MESH)
  new, metrics = jaxdp.make_train_step(loss_fn, OPT, MESH, donate=False)(state, batch, bad)
  assert int(metrics["nonfinite"]) == 1 and int(metrics["skipped"]) == 1
  jax.tree.map(np.testing.assert_array_equal, new.params, state.params)


def in_own_shard_map(replica):
  """``replica(state, batch, weights)`` in the user's own ``jit(shard_map)``: the pure functions' path."""
  spec = jax.sharding.PartitionSpec
  return jax.jit(jax.shard_map(replica, mesh=MESH, in_specs=(spec(), spec("data"), spec("data")),
                               out_specs=(spec(), spec())))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        # These trained silently: an int32 forward pass has a zero gradient (state.step still advanced), an int8
        # all-reduce quantised the gradient. make_train_step refused them; the pure functions did not.
        ({"compute_dtype": jnp.int32}, r"compute_dtype=.*int32.* is not a floating dtype"),
        ({"grad_reduce_dtype": jnp.int8}, r"grad_reduce_dtype=.*int8.* is not a floating dtype"),
        ({"bucket_bytes": -1}, r"bucket_bytes must be an integer >= 0"),
        # These raised a bare AssertionError (from lax.pcast) and an AttributeError.
        ({"axis_name": "batch"}, r"axis_name='batch': axis 'batch' is not an axis of the enclosing shard_map"),
        ({"optimizer": optax.adam}, r"optimizer is the function .*adam.* itself"),
    ],
    ids=["int-compute", "int-reduce", "negative-buckets", "unbound-axis", "optimizer-factory"],
)
def test_the_pure_step_checks_its_arguments_as_make_train_step_does(kwargs, match):
  optimizer = kwargs.pop("optimizer", OPT)
  kwargs.setdefault("axis_name", "data")
  step = in_own_shard_map(lambda s, b, w: jaxdp.train_step(loss_fn, optimizer, s, b, w, **kwargs))
  state = jaxdp.init_state(params(), OPT, MESH)
  with pytest.raises((ValueError, TypeError), match=match):
    step(state, *data())
  jaxdp.make_train_step(loss_fn, OPT, MESH)(state, *data())  # nothing was consumed


def test_weights_of_another_length_than_the_batch_are_named_as_the_mistake():
  """The weights, not loss_fn's output, were blamed: 'loss_fn must return ... b=3 rows ... returned (4,)'."""

  def replica(state, batch, weights):
    return jaxdp.train_step(loss_fn, OPT, state, batch, weights[:-1], axis_name="data")

  with pytest.raises(ValueError, match=r"weights has shape \(\d+,\) but the batch's leaves have \d+ rows"):
    in_own_shard_map(replica)(jaxdp.init_state(params(), OPT, MESH), *data(counts=(2, 2, 2, 2)))


@pytest.mark.parametrize("options", [{}, {"zero_stage": 3}, {"grad_reduce_dtype": jnp.bfloat16}],
                         ids=["stage0", "stage3", "bfloat16-reduce"])
def test_complex_parameters_keep_their_imaginary_part(options):
  """Complex params are accepted: grad_norm ignored the imaginary part (1.45 for 2.52), so a NaN there was not
  skipped, and grad_reduce_dtype cast the complex gradient to a real dtype (the update lost it)."""
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32)
  z = {"z": ((rng.normal(size=(4, 2)) + 1j * rng.normal(size=(4, 2))) * 0.3).astype(np.complex64)}
  loss = lambda p, b: jnp.sum(jnp.abs(b["x"] @ p["z"] - b["y"]) ** 2, -1)  # noqa: E731
  opt = optax.sgd(0.05)
  grads = jax.grad(lambda p: jnp.mean(loss(p, {"x": x, "y": y})))(z)  # one device, the whole batch
  expected = optax.apply_updates(z, opt.update(grads, opt.init(z), z)[0])
  state = jaxdp.init_state(z, opt, MESH, zero_stage=options.get("zero_stage", 0))
  state, metrics = jaxdp.make_train_step(loss, opt, MESH, **options)(state, {"x": x, "y": y})
  np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(grads)), rtol=1e-6)
  np.testing.assert_allclose(jaxdp.gather_state(state).params["z"], expected["z"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_a_typed_prng_key_in_the_optimizer_state_gathers_and_places(zero_stage):
  """optax.noisy_sgd keeps a typed key in its state: gather_state, assert_replicas_equal and per_replica raised
  numpy's TypeError on it."""
  opt = optax.noisy_sgd(0.1, eta=0.5, key=0)
  step = jaxdp.make_train_step(loss_fn, opt, MESH, zero_stage=zero_stage, donate=False)
  state, _ = step(jaxdp.init_state(params(), opt, MESH, zero_stage=zero_stage), *data())
  full = jaxdp.gather_state(state)
  key = full.opt_state[0].rng_key
  assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
  np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(state.opt_state[0].rng_key))
  jaxdp.assert_replicas_equal(state)
  copies = jaxdp.per_replica(state.opt_state[0].rng_key)
  assert copies.dtype == np.uint32 and (copies == copies[:1]).all()
  again, _ = step(jaxdp.place_state(full, opt, MESH, zero_stage=zero_stage), *data())
  expected, _ = step(state, *data())
  jax.tree.map(np.testing.assert_array_equal, jaxdp.gather_state(again).params, jaxdp.gather_state(expected).params)


@pytest.mark.parametrize(
    "tiny,match",
    [(np.float32(1e-39), "below .*smallest normal"),
     # float64 values were checked after the cast to float32, where 1e-50 is already 0: the row was dropped.
     (1e-50, "below .*smallest normal"),
     (1e300, "above .*largest"),  # was reported as "non-finite" (inf after the cast)
     ],
    ids=["float32-subnormal", "float64-below-float32", "float64-above-float32"],
)
def test_weights_float32_cannot_hold_are_refused_on_the_host(tiny, match):
  weights = [np.array([tiny, 1.0])] + [np.zeros(0)] * 3
  with pytest.raises(ValueError, match=r"weights\[0\] has 1 weights " + match):
    jaxdp.shard_uneven([{"x": np.ones((2, 3))}] + [{"x": np.ones((0, 3))}] * 3, MESH, weights=weights)
  examples = [(np.ones(3, np.float32), w) for w in (1.0, tiny, 1.0, 1.0)]
  collate = lambda rows: ({"x": np.stack([x for x, _ in rows])}, np.array([w for _, w in rows], np.float64))  # noqa: E731
  pipe = jaxdp.DataPipeline(examples, collate, MESH, per_device_batch=1, seed=0)
  with pytest.raises(ValueError, match=r"collate's weights has 1 weights " + match):
    list(pipe.iterate(num_steps=1))


# Weak errors: named argument and fix, before anything runs ------------------------------------------------


def test_integer_losses_are_a_type_error():
  step = jaxdp.make_train_step(lambda p, b: (b["x"] @ p["w"]).astype(jnp.int32), OPT, MESH)
  with pytest.raises(TypeError, match=r"losses of dtype int32.*must be floating point"):
    step(jaxdp.init_state(params(), OPT, MESH), *data())


def test_integer_params_are_a_type_error():
  with pytest.raises(TypeError, match=r"params\['w'\] has dtype int32.*floating point"):
    jaxdp.init_state({"w": np.ones(3, np.int32)}, OPT, MESH)


def test_a_zero_state_of_another_device_count_is_moved_onto_the_step_mesh():
  """Leaves keep their shapes at every stage, so a state placed on 2 devices runs on 4: the step moves it."""
  opt = optax.adam(1e-2)
  elsewhere = jaxdp.init_state(params(), opt, jaxdp.data_mesh(jax.devices()[:2]), zero_stage=2)
  here = jaxdp.init_state(params(), opt, MESH, zero_stage=2)
  step = jaxdp.make_train_step(loss_fn, opt, MESH, zero_stage=2, donate=False)
  moved, _ = step(elsewhere, *data())
  expected, _ = step(here, *data())
  np.testing.assert_array_equal(jaxdp.gather_state(moved).params["w"], jaxdp.gather_state(expected).params["w"])
  assert moved.params["w"].sharding.mesh.devices.size == 4


def test_an_optimizer_factory_is_a_type_error():
  with pytest.raises(TypeError, match=r"optax\.adam\(learning_rate"):
    jaxdp.init_state(params(), optax.adam, MESH)
  with pytest.raises(TypeError, match=r"optimizer is the function"):
    jaxdp.make_train_step(loss_fn, optax.adam, MESH)


def test_an_integer_rng_is_a_value_error():
  state = jaxdp.init_state(params(), OPT, MESH)
  with pytest.raises(ValueError, match=r"rng must be a PRNG key, e.g. rng=jax\.random\.key\(0\)"):
    jaxdp.make_train_step(loss_fn, OPT, MESH)(state, *data(), rng=0)
  assert not state.params["w"].is_deleted()


@pytest.mark.parametrize(
    "rng,match",
    [(np.zeros(3, np.uint32), r"rng must be a PRNG key.*uint32\[3\]"),  # passed, then JAX's "invalid PRNG key data"
     (jax.random.split(jax.random.key(0), 2), r"rng must be one PRNG key, got an array of \[2\] keys")],
    ids=["raw-key-of-another-shape", "batch-of-typed-keys"],
)
def test_a_key_of_the_wrong_shape_is_a_value_error(rng, match):
  state = jaxdp.init_state(params(), OPT, MESH)
  with pytest.raises(ValueError, match=match):
    jaxdp.make_train_step(loss_fn, OPT, MESH)(state, *data(), rng=rng)
  assert not state.params["w"].is_deleted()


def test_a_key_for_a_loss_fn_without_one_names_rng():
  """A key passed to a loss_fn that takes none gave Python's "takes 2 positional arguments but 3 were given"."""
  def keyword_weights(params, batch, weights):  # jaxdp fills weights by keyword: no room for a key
    return loss_fn(params, batch) * weights

  for fn in (loss_fn, keyword_weights):
    state = jaxdp.init_state(params(), OPT, MESH)
    with pytest.raises(TypeError, match=r"rng= was passed to the step, but loss_fn takes no PRNG key.*without rng="):
      jaxdp.make_train_step(fn, OPT, MESH, accum_steps=2)(state, *data(counts=(2, 2, 0, 4)), rng=jax.random.key(0))
    assert not state.params["w"].is_deleted()

  def with_key(params, batch, *rest):  # a key may arrive through *args
    return loss_fn(params, batch) + 0.0 * jax.random.uniform(rest[0])

  state = jaxdp.init_state(params(), OPT, MESH)
  _, metrics = jaxdp.make_train_step(with_key, OPT, MESH)(state, *data(), rng=jax.random.key(0))
  assert np.isfinite(metrics["loss"])

  def named_key_and_more(params, batch, rng, *extra):  # still requires its key: refused up front without one
    return loss_fn(params, batch) + 0.0 * jax.random.uniform(rng)

  with pytest.raises(TypeError, match=r"third argument \('rng'\) without a default"):
    jaxdp.make_train_step(named_key_and_more, OPT, MESH)(jaxdp.init_state(params(), OPT, MESH), *data())


def test_an_opt_state_leaf_of_another_dtype_is_named_with_the_fix():
  """An inject_hyperparams value set to a Python float (optax on one device takes it) was refused as "built for
  another optimizer, rebuild it", which names no leaf and would throw the optimizer state away."""
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
  step = jaxdp.make_train_step(loss_fn, opt, MESH)
  state = jaxdp.init_state(params(), opt, MESH)
  state.opt_state.hyperparams["learning_rate"] = 0.01
  with pytest.raises(ValueError, match=r"state\.opt_state\.hyperparams\['learning_rate'\] is a Python float where init "
                                       r"gives float32\[\]; set it as jnp\.asarray\(value, jnp\.float32\)"):
    step(state, *data())
  state.opt_state.hyperparams["learning_rate"] = jnp.asarray(0.01, jnp.float32)
  new, _ = step(state, *data())
  assert float(new.opt_state.hyperparams["learning_rate"]) == pytest.approx(0.01)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_an_optimizer_needing_more_than_the_loss_says_what_jaxdp_passes(zero_stage):
  """optax.lbfgs's zoom line search needs grad= and value_fn=: optax's bare "missing 2 required keyword-only
  arguments" said nothing of jaxdp or of the variant that works."""
  state = jaxdp.init_state(params(), optax.lbfgs(), MESH, zero_stage=zero_stage)
  with pytest.raises(TypeError, match=r"missing 2 required keyword-only arguments") as raised:
    jaxdp.make_train_step(loss_fn, optax.lbfgs(), MESH, zero_stage=zero_stage)(state, *data())
  assert any("optax.lbfgs(linesearch=None) works" in note for note in raised.value.__notes__)
  assert not state.params["w"].is_deleted()


def test_weights_as_a_list_are_one_array():
  """A list of weights was placed as a pytree of scalars (a sharding error about rank 0)."""
  batch, weights = data(counts=(1, 1, 1, 1))
  step = jaxdp.make_train_step(loss_fn, OPT, MESH, donate=False)
  state = jaxdp.init_state(params(), OPT, MESH)
  listed, _ = step(state, batch, [1.0, 0.0, 1.0, 1.0])
  arrayed, _ = step(state, batch, np.array([1.0, 0.0, 1.0, 1.0], np.float32))
  jax.tree.map(np.testing.assert_array_equal, listed.params, arrayed.params)


def test_flags_and_devices_of_the_wrong_type_are_refused():
  with pytest.raises(TypeError, match=r"donate must be True or False, got 'no'"):  # "no" is truthy: it donated
    jaxdp.make_train_step(loss_fn, OPT, MESH, donate="no")
  with pytest.raises(TypeError, match=r"check_replicas must be True or False"):
    jaxdp.make_train_step(loss_fn, OPT, MESH, check_replicas="yes")
  with pytest.raises(TypeError, match=r"devices must be an iterable of jax\.Device .* got int"):
    jaxdp.data_mesh(3)


def test_a_mesh_with_a_repeated_device_is_refused():
  with pytest.raises(ValueError, match=r"more than once"):
    jaxdp.data_mesh([jax.devices()[0]] * 2)


def test_shard_uneven_refuses_one_global_array():
  with pytest.raises(TypeError, match=r"one pytree per device"):
    jaxdp.shard_uneven(np.ones((4, 3)), MESH)


@pytest.mark.parametrize("make", [lambda: optax.adafactor(1e-3), lambda: optax.contrib.muon(1e-3)], ids=["adafactor", "muon"])
def test_shape_dependent_optimizers_keep_their_shapes_under_zero(make):
  """Factored and matrix optimizers see whole leaves: their state has stage 0's shapes at every stage."""
  big = {"w": np.ones((256, 256), np.float32), "b": np.ones((256,), np.float32)}
  whole = jax.eval_shape(make().init, big)
  sharded = jaxdp.init_state(big, make(), MESH, zero_stage=1).opt_state
  assert jax.tree.map(lambda x: x.shape, sharded) == jax.tree.map(lambda x: x.shape, whole)


def test_the_nonfinite_flag_is_read_at_the_latest_two_calls_later():
  """Dispatch never waits for the previous step's flag, but a flag two steps old is read, ready or not."""
  step = jaxdp.make_train_step(loss_fn, OPT, MESH, max_consecutive_skips=1)
  state = jaxdp.init_state(params(), OPT, MESH)
  batch, weights = data()
  state, _ = step(state, jax.tree.map(lambda x: x.at[0].set(jnp.nan), batch), weights)
  calls_after = 0
  with pytest.raises(FloatingPointError):  # the next call raises if the flag is ready by then; the one after must
    for calls_after in range(1, 4):
      state, _ = step(state, batch, weights)
  assert calls_after <= 2


def test_with_several_processes_the_flags_are_read_by_count_only(monkeypatch):
  """Whether a flag is ready depends on each process's timing: read when ready, processes tripped at different
  calls (one left the job while another waited in a collective). With several, only a flag two calls old is read."""
  step = jaxdp.make_train_step(loss_fn, OPT, MESH, max_consecutive_skips=1)
  nan = jax.block_until_ready(jnp.ones((), jnp.int32))  # a finished step's non-finite flag
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  step._pending.append(nan)
  step._check_previous_steps()  # ready, but only one call old: not read
  assert len(step._pending) == 1 and step.consecutive_skips == 0
  step._pending.append(nan)
  with pytest.raises(FloatingPointError):  # two calls old: read, and the guard trips on every process alike
    step._check_previous_steps()


def test_the_nonfinite_guard_stays_tripped_until_reset():
  step = jaxdp.make_train_step(loss_fn, OPT, MESH, max_consecutive_skips=1)
  state = jaxdp.init_state(params(), OPT, MESH)
  batch, weights = data()
  state, _ = step(state, jax.tree.map(lambda x: x.at[0].set(jnp.nan), batch), weights)
  jax.block_until_ready(state)  # the next call reads the flag of a finished step without waiting
  for _ in range(2):  # raises on every call, not every other one
    with pytest.raises(FloatingPointError, match="reset_nonfinite_guard"):
      step(state, batch, weights)
  step.reset_nonfinite_guard()
  state, metrics = step(state, batch, weights)
  assert int(metrics["skipped"]) == 0


def test_under_none_the_nonfinite_guard_sees_every_replica():
  """Each replica's metrics are its own and the host reads device 0's: a replica stuck on NaN steps (here
  device 2, every step) went unnoticed, its step count frozen, with no FloatingPointError."""
  step = jaxdp.make_train_step(loss_fn, OPT, MESH, reduction="none", max_consecutive_skips=3)
  state = jaxdp.init_state(params(), OPT, MESH)
  batch, weights = data(counts=(1, 1, 1, 1))
  batch = jax.tree.map(lambda x: x.at[2].set(jnp.inf), batch)  # device 2's row
  with pytest.raises(FloatingPointError, match="the last 3 steps"):
    for _ in range(6):
      state, metrics = step(state, batch, weights)
      assert int(metrics["nonfinite"]) == 1 and int(metrics["skipped"]) == 0  # device 0 stepped
  steps = [int(s) for s in jaxdp.per_replica(state.step)]  # the guard reads flags up to two calls late
  assert steps[2] == 0 and steps[0] == steps[1] == steps[3] >= 3, steps


def test_has_more_needs_a_reducing_step():
  """Under "none" the streams' flags are not summed: processes would stop at different steps."""
  step = jaxdp.make_train_step(loss_fn, OPT, MESH, reduction="none")
  state = jaxdp.init_state(params(), OPT, MESH)
  with pytest.raises(ValueError, match=r"has_more is summed over the replicas.*reduction='none' has none"):
    step(state, *data(), has_more=np.ones(K, np.int32))
  assert not state.params["w"].is_deleted()


def test_numpy_tolerances_and_device_iterables_are_accepted():
  """The argument checks added for bad types must not refuse good ones of another type."""
  state = jaxdp.init_state(params(), OPT, MESH)
  jaxdp.assert_replicas_equal(state, atol=np.float32(1e-6))
  jaxdp.assert_replicas_equal(state, atol=np.finfo(np.float32).eps)
  with pytest.raises(ValueError, match="atol must be a number >= 0"):
    jaxdp.assert_replicas_equal(state, atol=float("nan"))
  assert jaxdp.data_mesh(d for d in jax.devices()[:2]).devices.size == 2  # a generator, as list() took it


def test_the_pure_step_refuses_has_more_under_none():
  def replica(state, batch, weights):
    reduced = jaxdp.gradient_step(loss_fn, state, batch, weights, reduction="none", has_more=jnp.ones((), jnp.int32))
    return state, {"has_more": reduced.totals}

  step = in_own_shard_map(replica)
  with pytest.raises(ValueError, match=r"totals \(has_more\) are summed over the replicas.*'none' has none"):
    step(jaxdp.init_state(params(), OPT, MESH), *data())


def test_the_step_axis_is_known_in_a_custom_vjp_backward_rule():
  """A custom_vjp backward rule is traced after loss_fn returns: BatchNorm's default axis must still be the step's."""
  seen = []

  @jax.custom_vjp
  def identity(x):
    return x

  def forward(x):
    seen.append(("fwd", jaxdp.core.loss.step_axis()))
    return x, None

  def backward(_, g):
    seen.append(("bwd", jaxdp.core.loss.step_axis()))
    return (g,)

  identity.defvjp(forward, backward)
  mesh = jaxdp.data_mesh(jax.devices()[:K], axis_name="batch")
  loss = lambda p, b: loss_fn({**p, "w": identity(p["w"])}, b)  # noqa: E731
  state = jaxdp.init_state(params(), OPT, mesh, axis_name="batch")
  jaxdp.make_train_step(loss, OPT, mesh, axis_name="batch")(state, *jaxdp.shard_uneven(
      [{"x": np.ones((1, 3), np.float32), "y": np.ones((1,), np.float32)}] * K, mesh, axis_name="batch"))
  assert ("fwd", "batch") in seen and ("bwd", "batch") in seen, seen


def test_replica_divergence_reads_complex_parts_and_keys():
  """Its float32 checksum dropped the imaginary part (a cast), and a typed key could not be cast at all."""
  spec = jax.sharding.PartitionSpec

  def divergence(i):
    tree = {"z": (1.0 + 1j * i[0]).astype(jnp.complex64), "key": jax.random.key(0)}
    return jaxdp.replica_divergence(tree, "data")

  out = jax.jit(jax.shard_map(divergence, mesh=MESH, in_specs=spec("data"), out_specs=spec(), check_vma=False))(
      jnp.arange(K, dtype=jnp.float32))
  assert float(out) > 0  # the replicas differ in the imaginary part only


def test_a_global_weight_whose_reciprocal_flushes_to_zero_skips_the_step():
  """1/Σw is below float32's smallest normal from Σw = 2**126 on: the gradient, loss and norm read 0 and the step
  applied (Adam's count and moments moved). Such a step is now non-finite, skipped on every replica."""
  batch, weights = data(counts=(1, 1, 1, 1))
  huge = jnp.full_like(weights, 3e37)  # Σw = 1.2e38 >= 2**126 = 8.5e37
  state = jaxdp.init_state(params(), OPT, MESH)
  new, metrics = jaxdp.make_train_step(loss_fn, OPT, MESH, donate=False)(state, batch, huge)
  assert int(metrics["nonfinite"]) == 1 and int(metrics["skipped"]) == 1
  jax.tree.map(np.testing.assert_array_equal, new.params, state.params)


@pytest.mark.parametrize("zero_stage", [0, 2])
@pytest.mark.parametrize("name", ["polyak_sgd", "reduce_on_plateau"])
def test_optimizers_that_take_the_loss_get_the_global_one(name, zero_stage):
  """optax.polyak_sgd and optax.contrib.reduce_on_plateau read the loss (update(..., value=)): the step raised
  optax's "missing 1 required keyword-only argument: 'value'". They get the step's global weighted mean loss,
  what one device passes, and match it on uneven 2/1/0/3 rows."""
  opt = {"polyak_sgd": lambda: optax.polyak_sgd(max_learning_rate=0.5),
         "reduce_on_plateau": lambda: optax.chain(optax.sgd(0.2), optax.contrib.reduce_on_plateau(patience=1,
                                                                                                 factor=0.5))}[name]()
  step = jaxdp.make_train_step(loss_fn, opt, MESH, zero_stage=zero_stage)
  state = jaxdp.init_state(params(), opt, MESH, zero_stage=zero_stage)
  reference, opt_state = jax.tree.map(jnp.asarray, params()), opt.init(params())
  for seed in range(4):
    batch, weights = data(seed=seed)
    state, metrics = step(state, batch, weights)
    real = np.asarray(weights) > 0
    rows = jax.tree.map(lambda v: np.asarray(v)[real], batch)  # the concatenated real rows
    value, grads = jax.value_and_grad(lambda p: jnp.mean(loss_fn(p, rows)))(reference)
    updates, opt_state = opt.update(grads, opt_state, reference, value=value)
    reference = optax.apply_updates(reference, updates)
    np.testing.assert_allclose(metrics["loss"], value, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), jaxdp.gather_state(state).params,
               reference)


def test_a_third_parameter_filled_by_keyword_is_not_taken_for_a_key():
  """loss_fn(params, batch, weights) declares a keyword jaxdp passes; it must not be refused as a missing rng."""
  def weighted(params, batch, weights):
    return loss_fn(params, batch) * (weights > 0)

  step = jaxdp.make_train_step(weighted, OPT, MESH)
  state, metrics = step(jaxdp.init_state(params(), OPT, MESH), *data())
  assert int(metrics["skipped"]) == 0
  assert np.isfinite(float(jaxdp.make_eval_step(weighted, MESH)(state, *data())["loss"]))


def test_an_optimizer_whose_update_takes_no_value_is_not_given_one():
  """A GradientTransformationExtraArgs whose update names its extra arguments without **kwargs gets no value=."""
  sgd = optax.sgd(0.1)
  opt = optax.GradientTransformationExtraArgs(sgd.init, lambda u, s, p=None, scale=None: sgd.update(u, s, p))
  state, metrics = jaxdp.make_train_step(loss_fn, opt, MESH)(jaxdp.init_state(params(), opt, MESH), *data())
  assert int(metrics["skipped"]) == 0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -1.0])
def test_a_bad_weight_given_to_a_step_poisons_every_mean(bad):
  """Weights passed to the step directly are not checked on the host (shard_uneven's are). A NaN weight gave the
  metric's *sum* as its mean (the NaN total became a divisor of 1) and .evaluate reported loss 0.0; a negative one
  left the metrics finite. Every sum is now NaN: the step skips, and no mean reads as a number."""
  def with_metric(params, batch):
    losses = loss_fn(params, batch)
    return jaxdp.LossOutput(losses, metrics={"sq": losses * 2})

  batch, weights = data()
  weights = np.asarray(weights).copy()
  weights[0] = bad
  evaluate = jaxdp.make_eval_step(with_metric, MESH)
  state = jaxdp.init_state(params(), OPT, MESH)
  out = evaluate(state, batch, weights)
  assert np.isnan(float(out["loss"])) and np.isnan(float(out["sq"]))
  over_set = evaluate.evaluate(state, [(batch, weights)])
  assert np.isnan(over_set["loss"]) and np.isnan(over_set["sq"])
  state, metrics = jaxdp.make_train_step(with_metric, OPT, MESH)(state, batch, weights)
  assert int(metrics["skipped"]) == 1 and int(metrics["nonfinite"]) == 1 and np.isnan(float(metrics["sq"]))


def test_evaluate_says_how_to_pass_a_pipeline():
  """evaluate(state, pipeline.iterate(...)) got numpy's "inhomogeneous shape" error (the pairs carry the step)."""
  pipe = jaxdp.DataPipeline(list(range(7)), lambda ex: ({"x": np.ones((len(ex), 3), np.float32),
                                                         "y": np.zeros((len(ex),), np.float32)},
                                                        np.ones(len(ex), np.float32)), MESH, per_device_batch=2)
  evaluate = jaxdp.make_eval_step(loss_fn, MESH)
  state = jaxdp.init_state(params(), OPT, MESH)
  with pytest.raises(TypeError, match=r"\(step, \(batch, weights\)\) pairs.*for _, b in pipeline\.iterate"):
    evaluate.evaluate(state, pipe.iterate(num_steps=pipe.steps_per_epoch))
  out = evaluate.evaluate(state, (b for _, b in pipe.iterate(num_steps=pipe.steps_per_epoch)))
  assert out["weight"] == 7.0
