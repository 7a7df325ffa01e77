"""ZeRO stages 1-3: the same training run as stage 0, with the state sharded.

ZeRO changes where each number lives, never the mathematics of the step. So
every sharded stage is checked against stage 0 (itself checked against
single-device references elsewhere): after the same steps, the gathered state
and the metrics must agree leaf by leaf. The layout's costs are checked too:
the collectives in the compiled HLO and the per-device model-state bytes
against the formulas of Rajbhandari et al. (2020).
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import Phase, given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdp
from jaxdp.sharding import gather_chunks, my_chunk

FEATURES, HIDDEN, TOKENS = 3, 7, 4
ROWS = 6  # the largest per-device portion: divisible by every accum_steps drawn (1, 3)
CLIP = 1e-3  # below any gradient norm of the data drawn here (checked), so clipping is always active
# Stage s and stage 0 differ only in the order of float32 sums: reduce-scatter vs
# all-reduce, per-chunk vs whole-tree squared norms (clipping, grad_norm) and XLA's
# fusion of the elementwise update: a few ulps of values of order 1 (up to ~10 for a
# loss summed under "sum"). Measured over 27 runs (3 optimizers x 3 draws x 3 stages,
# 3 steps each): stage 1 is bitwise equal unless clipping reorders the norm; the
# largest gap was 9.5e-7 absolute, one ulp in [8, 16): 2% of this tolerance.
RTOL, ATOL = 1e-5, 1e-6

OPTIMIZERS = {
    "sgd": optax.sgd(0.1),
    "momentum": optax.sgd(0.1, momentum=0.9),
    "adam": optax.adam(0.05),
    "clip_adam": optax.chain(jaxdp.clip_by_global_norm(CLIP), optax.adam(0.05)),
}


def loss_fn(params, batch):
  """Per-example ``[b]`` (x ``[b, F]``) or per-token ``[b, t]`` (x ``[b, t, F]``) squared errors."""
  x = batch["x"]
  bias = params["dense"]["b"].reshape((1,) * (x.ndim - 1) + (HIDDEN,))
  hidden = jnp.tanh(x @ params["dense"]["w"] + bias)
  out = hidden @ params["head"]["w"] + params["head"]["b"]
  return 0.5 * (out - batch["y"]) ** 2


def init_params(seed=0):
  """Nested leaves of awkward sizes 21, 7 (prime), 7 and 1 (a scalar): every one needs padding for some N <= 8."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return {
      "dense": {"w": jax.random.normal(k1, (FEATURES, HIDDEN)) * 0.5, "b": jax.random.normal(k2, (HIDDEN,)) * 0.1},
      "head": {"w": jax.random.normal(k3, (HIDDEN,)) * 0.5, "b": jnp.asarray(0.1)},
  }


@functools.lru_cache(maxsize=None)
def mesh_of(n):
  return jaxdp.data_mesh(jax.devices()[:n])


@functools.lru_cache(maxsize=None)
def step_of(opt_name, n, stage, accum=1, reduction="mean"):
  """One compiled step per configuration: hypothesis examples that share one reuse it (shapes are bucketed)."""
  return jaxdp.make_train_step(
      loss_fn, OPTIMIZERS[opt_name], mesh_of(n), zero_stage=stage, accum_steps=accum, reduction=reduction
  )


def portions(seed, n, per_token=False):
  """Uneven per-device batches (some possibly empty) with weights, one device pinned to ``ROWS`` rows."""
  rng = np.random.default_rng(seed)
  sizes = [int(s) for s in rng.integers(0, ROWS + 1, n)]
  sizes[rng.integers(n)] = ROWS
  lead = (lambda s: (s, TOKENS)) if per_token else (lambda s: (s,))
  batches = [
      {"x": rng.normal(size=(*lead(s), FEATURES)).astype(np.float32), "y": rng.normal(size=lead(s)).astype(np.float32)}
      for s in sizes
  ]
  weights = [rng.uniform(0, 2, size=lead(s)).astype(np.float32) * (rng.random() > 0.2) for s in sizes]
  return jaxdp.shard_uneven(batches, mesh_of(n), weights=weights)


def run(opt_name, n, stage, batch, weights, steps, accum=1, reduction="mean"):
  """``steps`` steps from the same initial params: the gathered state and each step's metrics, on the host."""
  state = jaxdp.init_state(init_params(), OPTIMIZERS[opt_name], mesh_of(n), zero_stage=stage)
  step = step_of(opt_name, n, stage, accum, reduction)
  history = []
  for _ in range(steps):
    state, metrics = step(state, batch, weights)
    history.append(jax.tree.map(np.asarray, metrics))
  return jaxdp.gather_state(state), history


def assert_close(actual, expected, what=""):
  try:
    chex.assert_trees_all_close(actual, expected, rtol=RTOL, atol=ATOL)
  except AssertionError as e:
    raise AssertionError(f"{what}: {e}") from None


# Equivalence ---------------------------------------------------------------------------------


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
# Every example compiles up to four steps, so examples are few and failures are not
# shrunk (a shrink attempt compiles anew); print_blob reproduces a failing example.
@settings(max_examples=3, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(data=st.data())
def test_sharded_stages_match_stage_zero(opt_name, data):
  """Stages 1, 2 and 3 end in stage 0's state with stage 0's metrics, for any devices, weights and reduction.

  Covers 1..8 devices (padding of every leaf for some N), empty devices and
  zero-weight devices, accumulation, the three communicating reductions and
  global-norm clipping that is active (the drawn data's gradient norm always
  exceeds ``CLIP``).
  """
  n = data.draw(st.integers(1, 8), label="devices")
  accum = data.draw(st.sampled_from([1, 3]), label="accum_steps")
  reduction = data.draw(st.sampled_from(["mean", "rank_mean", "sum"]), label="reduction")
  steps = data.draw(st.integers(1, 3), label="steps")
  batch, weights = portions(data.draw(st.integers(0, 2**16), label="seed"), n)
  reference, reference_metrics = run(opt_name, n, 0, batch, weights, steps, accum, reduction)
  if opt_name == "clip_adam" and float(reference_metrics[0]["weight"]) > 0:
    assert reference_metrics[0]["grad_norm"] > CLIP, "clipping inactive: the test would not exercise the norm"
  for stage in (1, 2, 3):
    sharded, sharded_metrics = run(opt_name, n, stage, batch, weights, steps, accum, reduction)
    assert_close(sharded_metrics, reference_metrics, f"metrics of stage {stage}")
    assert_close(sharded, reference, f"state of stage {stage}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stateless_optimizer_runs_at_every_stage(stage):
  """Plain SGD (optimizer state ``EmptyState()``, nothing to shard) runs at every stage and matches stage 0.

  Stages 1 and 2 shard only the optimizer state; with SGD that state has no
  arrays, so the state holds no ``FlatShards`` node that records its stage.
  """
  batch, weights = portions(seed=3, n=4)
  sharded, sharded_metrics = run("sgd", 4, stage, batch, weights, steps=2)
  reference, reference_metrics = run("sgd", 4, 0, batch, weights, steps=2)
  assert_close(sharded_metrics, reference_metrics)
  assert_close(sharded, reference)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_per_leaf_norm_optimizer_is_refused(stage):
  """LAMB (trust ratio ``||param|| / ||update||`` per leaf) is refused at stages 1-3 with a ValueError.

  Per-leaf norms are the bug class of local-norm clipping: on a device's flat
  chunk they are the chunk's norms, not the leaf's (measured: 41% off after
  one step), so running it would be silently wrong.
  """
  with pytest.raises(ValueError, match="zero_stage=0"):
    jaxdp.init_state(init_params(), optax.lamb(0.05), mesh_of(4), zero_stage=stage)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_per_token_weights_with_accumulation(stage):
  """``[b, t]`` token weights and ``accum_steps=3`` together, with an empty device, match stage 0 (Adam, clipped)."""
  n = 4
  batch, weights = portions(seed=11, n=n, per_token=True)
  assert weights.shape == (n * ROWS, TOKENS)
  sharded, sharded_metrics = run("clip_adam", n, stage, batch, weights, steps=2, accum=3)
  reference, reference_metrics = run("clip_adam", n, 0, batch, weights, steps=2, accum=3)
  assert reference_metrics[0]["grad_norm"] > CLIP  # clipping is active
  assert_close(sharded_metrics, reference_metrics, "metrics")
  assert_close(sharded, reference, "state")


@pytest.mark.parametrize("n", [3, 8])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_gathered_initial_state_is_the_same_at_every_stage(opt_name, n):
  """``gather_state(init_state(..., zero_stage=s))`` is ``TrainState.create(params, opt)`` exactly, for every s."""
  params = init_params()
  expected = jax.tree.map(np.asarray, jaxdp.TrainState.create(params, OPTIMIZERS[opt_name]))
  for stage in jaxdp.ZERO_STAGES:
    gathered = jaxdp.gather_state(jaxdp.init_state(params, OPTIMIZERS[opt_name], mesh_of(n), zero_stage=stage))
    chex.assert_trees_all_equal_structs(gathered, expected)
    chex.assert_trees_all_equal(gathered, expected)
    chex.assert_trees_all_equal_dtypes(gathered, expected)


# Clipping: the norm must be the global one --------------------------------------------------


def _clipped_run(clip, stage, n=4):
  """Params after one momentum-SGD step on clipped gradients (lr 10: an update far above rounding)."""
  optimizer = optax.chain(clip, optax.sgd(10.0, momentum=0.9))
  mesh = mesh_of(n)
  batch, weights = portions(seed=5, n=n)
  state = jaxdp.init_state(init_params(), optimizer, mesh, zero_stage=stage)
  state, metrics = jaxdp.make_train_step(loss_fn, optimizer, mesh, zero_stage=stage)(state, batch, weights)
  assert float(metrics["grad_norm"]) > CLIP  # clipping is active
  return jaxdp.gather_state(state).params


@functools.lru_cache(maxsize=None)
def _clipped_reference():
  """Stage 0 with optax's clipping, checked once against stage 0 with jaxdp's (the same transform there)."""
  reference = _clipped_run(optax.clip_by_global_norm(CLIP), 0)
  assert_close(_clipped_run(jaxdp.clip_by_global_norm(CLIP), 0), reference, "stage 0")
  return reference


def _max_difference(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_local_norm_clipping_is_refused_and_global_norm_clipping_matches(stage):
  """``optax.clip_by_global_norm`` at a sharded stage would clip each chunk by its own, smaller norm.

  ``init_state`` probes the optimizer on chunks (``jaxdp.sharding.check_chunkable``)
  and refuses it, naming the fix; ``jaxdp.clip_by_global_norm`` all-reduces
  the squared chunk norms and lands on stage 0's params (with momentum SGD at
  lr 10 the update is far above rounding, so the match is meaningful).
  """
  reference = _clipped_reference()
  assert_close(_clipped_run(jaxdp.clip_by_global_norm(CLIP), stage), reference, "jaxdp.clip_by_global_norm")
  assert _max_difference(reference, init_params()) > 1e3 * ATOL
  with pytest.raises(ValueError, match="jaxdp.clip_by_global_norm"):
    _clipped_run(optax.clip_by_global_norm(CLIP), stage)


def _reference_grads(params, batch, weights):
  """The gradient of the global weighted mean loss, on one device."""

  def mean_loss(p):
    return jnp.sum(loss_fn(p, batch) * weights) / jnp.sum(weights)

  return jax.grad(mean_loss)(jax.device_get(params))


def test_the_probe_sees_what_local_clipping_would_do():
  """Run by hand on chunks, optax's clipping really lands elsewhere: the refusal above is not a false alarm."""
  n, optimizer = 4, optax.chain(optax.clip_by_global_norm(CLIP), optax.sgd(10.0, momentum=0.9))
  mesh = mesh_of(n)
  batch, weights = portions(seed=5, n=n)
  params = init_params()
  grads = _reference_grads(params, jax.device_get(batch), jax.device_get(weights))
  whole = optax.apply_updates(params, optimizer.update(grads, optimizer.init(params), params)[0])

  def chunked(params, grads):
    chunks = my_chunk(params, "data", 1)
    updates, _ = optimizer.update(my_chunk(grads, "data", 1), optimizer.init(chunks), chunks)
    return gather_chunks(optax.apply_updates(chunks, updates), "data")

  run = jax.jit(jax.shard_map(chunked, mesh=mesh, in_specs=(P(), P()), out_specs=P()))
  local = run(*jax.device_put((params, grads), NamedSharding(mesh, P())))
  update = _max_difference(whole, params)
  assert _max_difference(local, whole) > 0.1 * update


# Refused inputs --------------------------------------------------------------------------------


def test_state_of_another_stage_is_refused_and_stays_usable():
  """A state built for stage s, given to a step built for stage t != s, raises before donating anything.

  Uses the MLP steps of the cost tests below (compiled once, shared).
  """
  n = 4
  for built in jaxdp.ZERO_STAGES:
    for wanted in jaxdp.ZERO_STAGES:
      if built == wanted:
        continue
      step, state, batch = mlp_setup(n, built)
      with pytest.raises(ValueError, match="zero_stage"):
        mlp_step(n, wanted)(state, batch)
      state, _ = step(state, batch)  # donates: the buffers were still alive
      assert int(state.step) == 1


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_pmap_and_independent_replicas_are_refused(stage):
  """pmap passes the state unmapped, ``"none"`` keeps diverging replicas: neither can hold shards."""
  optimizer = OPTIMIZERS["adam"]
  with pytest.raises(ValueError, match="backend"):
    jaxdp.make_train_step(loss_fn, optimizer, mesh_of(2), backend="pmap", zero_stage=stage)
  with pytest.raises(ValueError, match="reduction"):
    jaxdp.make_train_step(loss_fn, optimizer, mesh_of(2), reduction="none", zero_stage=stage)
  state = jaxdp.TrainState.create(init_params(), optimizer)
  with pytest.raises(ValueError, match="reduction"):
    jaxdp.train_step(loss_fn, optimizer, state, {}, reduction="none", zero_stage=stage)


@pytest.mark.parametrize("stage", [-1, 4, True])
def test_unknown_stage_is_refused(stage):
  """Only the stages of ``jaxdp.ZERO_STAGES`` are accepted (a bool is not a stage)."""
  with pytest.raises(ValueError, match="zero_stage"):
    jaxdp.init_state(init_params(), OPTIMIZERS["adam"], mesh_of(2), zero_stage=stage)
  with pytest.raises(ValueError, match="zero_stage"):
    jaxdp.make_train_step(loss_fn, OPTIMIZERS["adam"], mesh_of(2), zero_stage=stage)


# Costs: collectives and memory ------------------------------------------------------------------

MLP_SHAPES = {"w1": (13, 97), "w2": (97, 31), "v": (31,)}  # 4299 params in 3 leaves, none divisible by 2


def mlp_loss(params, batch):
  hidden = jax.nn.relu(batch["x"] @ params["w1"])
  out = jnp.tanh(hidden @ params["w2"]) @ params["v"]
  return 0.5 * (out - batch["y"]) ** 2


@functools.lru_cache(maxsize=None)
def mlp_step(n, stage):
  """Adam steps shared by the tests below: ``lower().compile()`` is cached per step, so each compiles once."""
  return jaxdp.make_train_step(mlp_loss, OPTIMIZERS["adam"], mesh_of(n), zero_stage=stage)


def mlp_setup(n, stage):
  """``(step, fresh state, batch)`` for the MLP on ``n`` devices at ``stage``."""
  keys = jax.random.split(jax.random.key(0), len(MLP_SHAPES))
  params = {name: jax.random.normal(k, shape) * 0.1 for k, (name, shape) in zip(keys, MLP_SHAPES.items())}
  batch = {"x": np.ones((2 * n, 13), np.float32), "y": np.ones((2 * n,), np.float32)}
  state = jaxdp.init_state(params, OPTIMIZERS["adam"], mesh_of(n), zero_stage=stage)
  return mlp_step(n, stage), state, batch


def padded_bytes(n):
  """Bytes of the whole model flattened and padded per leaf to a multiple of ``n`` (float32)."""
  return 4 * sum(max(1, -(-math.prod(s) // n)) * n for s in MLP_SHAPES.values())


@pytest.mark.parametrize("stage", jaxdp.ZERO_STAGES)
def test_collectives_of_each_stage(stage):
  """The compiled step moves what the stage says, and a full gradient is never all-reduced at stages 2-3.

  Sizes are exact: the all-gathers produce the padded parameters once per step
  (stage 3 gathers before the forward pass and keeps them for the backward
  pass: 2Ψ moved per step, not the paper's 3Ψ); reduce-scatters consume the
  padded gradient once. Stages 2-3 all-reduce only scalars (loss, weight,
  norms, the non-finite count): fewer bytes than the smallest gradient leaf.
  """
  n = 4
  psi_bytes = 4 * sum(math.prod(s) for s in MLP_SHAPES.values())
  smallest_leaf = 4 * min(math.prod(s) for s in MLP_SHAPES.values())
  report = jaxdp.comm_report(*mlp_setup(n, stage))
  reduce, scatter, gather = report["all-reduce"], report["reduce-scatter"], report["all-gather"]
  if stage <= 1:
    assert reduce.count >= 1 and psi_bytes <= reduce.bytes < psi_bytes + smallest_leaf, report
    assert scatter.count == 0, report
  else:
    assert reduce.bytes < smallest_leaf, report
    assert scatter.count >= 1 and scatter.bytes == padded_bytes(n), report
  if stage == 0:
    assert gather.count == 0, report
  else:
    assert gather.count >= 1 and gather.bytes == padded_bytes(n), report


# Model-state bytes per parameter at each stage (fp32 params and grads, Adam's two fp32 moments, K = 8):
# (replicated, sharded), so that the ZeRO paper's per-device formula is replicated·Ψ + sharded·Ψ/N.
PAPER_BYTES = {0: (4 + 4 + 8, 0), 1: (4 + 4, 8), 2: (4, 4 + 8), 3: (0, 4 + 4 + 8)}


def test_model_state_bytes_follow_the_paper():
  """Measured per-device params+opt+grads bytes match the ZeRO formulas up to padding, for N = 1, 2, 4, 8.

  Exact bounds, no fudge: every sharded float32 array of a leaf holds
  ``ceil(size/N) <= size/N + (N-1)/N`` elements per device, so padding adds
  at most ``sharded · L · (N-1)/N`` bytes (L leaves); Adam's replicated step
  ``count`` adds its bytes at every stage. At N = 8, stage 3 needs at most
  1/7 of stage 0.
  """
  psi = sum(math.prod(s) for s in MLP_SHAPES.values())
  opt_state = OPTIMIZERS["adam"].init({name: jnp.zeros(shape) for name, shape in MLP_SHAPES.items()})
  scalar_bytes = sum(x.nbytes for x in jax.tree.leaves(opt_state) if x.ndim == 0)
  measured = {}
  for n in (1, 2, 4, 8):
    for stage, (replicated, sharded) in PAPER_BYTES.items():
      measured[stage, n] = jaxdp.memory_report(*mlp_setup(n, stage)).model_state
      formula = replicated * psi + sharded * psi / n + scalar_bytes
      padding = sharded * len(MLP_SHAPES) * (n - 1) / n
      assert padding <= 0.01 * formula  # the bound itself is tight: padding is a small share here
      assert formula <= measured[stage, n] <= formula + padding, (stage, n, measured[stage, n], formula, padding)
  assert measured[3, 8] <= measured[0, 8] / 7, measured
