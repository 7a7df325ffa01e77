"""PowerSGD (jaxdp.powersgd): against a plain reference of the algorithm, exact where it must be, its bytes, its
state's checkpoint and its bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from helpers import assert_close_to_scale
from helpers import float64, mesh_of as _mesh

pytestmark = pytest.mark.usefixtures("fast_compiles")

LR = 0.1


def _params(seed=0, shapes=None):
  shapes = shapes or {"w1": (8, 12), "b1": (12,), "w2": (12, 6)}
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return {name: 0.3 * np.asarray(jax.random.normal(k, shape), np.float32) for (name, shape), k in zip(shapes.items(), keys)}


def loss_fn(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None, :])
  out = h @ params["w2"]
  if "conv" in params:  # a flax-layout convolution kernel [kh, kw, in, out] over x seen as a 2 x 2 x 2 image
    out = out + jnp.einsum("rhwc,hwco->ro", batch["x"].reshape(-1, 2, 2, 2), params["conv"])
  return jnp.sum((out - batch["y"]) ** 2, axis=-1)


def _batch(rows=16, seed=1):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, 8)).astype(np.float32)
  y = rng.normal(size=(rows, 6)).astype(np.float32)
  return {"x": x, "y": y}


def _uneven_weights(rows=16, n=4, seed=2):
  w = np.random.default_rng(seed).uniform(0.2, 2.0, size=rows).astype(np.float32)
  w[rows - rows // n:] = 0.0  # the last replica holds only padding
  return w


def _run(params, batches, weights, *, n=4, compression=None, zero_stage=0, layers=None, loss=loss_fn, steps=None):
  mesh = _mesh(n)
  opt = optax.sgd(LR)
  layout = jaxdp.data_parallel(mesh, zero_stage=zero_stage, layers=layers)
  state = jaxdp.init_state(params, opt, layout, reduction=compression)
  step = jaxdp.make_train_step(loss, opt, layout, reduction=compression)
  if steps is not None:
    steps.append(step)
  states = [jaxdp.gather_state(state)]
  for batch in batches:
    state, _ = step(state, batch, weights)
    states.append(jaxdp.gather_state(state))
  return states


def _reference(params, q0, batches, weights, n, rank_of, loss=loss_fn):
  """PowerSGD with error feedback and warm start, one replica at a time, in plain jnp (float32)."""
  params = {k: jnp.asarray(v) for k, v in params.items()}
  q = {k: jnp.asarray(v) for k, v in q0.items()}
  errors = {k: [jnp.zeros(params[k].shape) for _ in range(n)] for k in q}
  trace = []
  for batch in batches:
    rows = len(weights) // n
    local = []
    for i in range(n):
      part = {k: v[i * rows:(i + 1) * rows] for k, v in batch.items()}
      w = weights[i * rows:(i + 1) * rows]
      local.append(jax.grad(lambda p: jnp.sum(w * loss(p, part)))(params))
    total_weight = float(np.sum(weights))
    summed = {}
    for k in params:
      if k not in q:
        summed[k] = sum(g[k] for g in local)
        continue
      # the matrix of a leaf: the split shape[:k] x shape[k:] closest to square (ties: the first found, smaller k)
      shape = params[k].shape
      splits = [(int(np.prod(shape[:j])), int(np.prod(shape[j:]))) for j in range(1, len(shape))]
      cols = min(splits, key=lambda mn: max(mn) / min(mn))[1]
      ms = [(local[i][k] + errors[k][i]).reshape(-1, cols) for i in range(n)]
      p = sum(m @ q[k] for m in ms)
      p = jnp.linalg.qr(p)[0]
      q[k] = sum(m.T @ p for m in ms)
      approx = p @ q[k].T
      errors[k] = [(m - approx / n).reshape(params[k].shape) for m in ms]
      summed[k] = approx.reshape(params[k].shape)
    params = {k: params[k] - LR * summed[k] / total_weight for k in params}
    trace.append((params, dict(q), {k: list(v) for k, v in errors.items()}))
  return trace


def _assert_follows(states, trace, n):
  """Each step's params, Q and every replica's error against the reference's `trace` (float32 round-off)."""
  for state, (ref_params, ref_q, ref_errors) in zip(states[1:], trace):
    for k in ref_params:
      np.testing.assert_allclose(state.params[k], ref_params[k], rtol=2e-5, atol=2e-6)
    for k in ref_q:
      np.testing.assert_allclose(state.compression.q[k], ref_q[k], rtol=2e-4, atol=2e-5)
      for i in range(n):
        np.testing.assert_allclose(state.compression.error[k][i], ref_errors[k][i], rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_matches_a_plain_reference_with_uneven_weights(zero_stage):
  # At stages 2-3 the low-rank factors are all-reduced and each device keeps its slice of the decompressed sum.
  # conv [2, 2, 2, 6] is the matrix 8 x 6 (rank 2 loses; shape[0] x rest, 2 x 24, would be exact at rank 2).
  params, n = _params(shapes={"w1": (8, 12), "b1": (12,), "w2": (12, 6), "conv": (2, 2, 2, 6)}), 4
  compression = jaxdp.powersgd(rank=2, start_iter=0, min_compression_rate=0)
  batches = [_batch(seed=s) for s in (1, 2, 3)]
  weights = _uneven_weights(n=n)
  states = _run(params, batches, weights, n=n, compression=compression, zero_stage=zero_stage)
  q0 = {k: v for k, v in states[0].compression.q.items() if v is not None}
  assert set(q0) == {"w1", "w2", "conv"} and states[0].compression.q["b1"] is None
  assert q0["conv"].shape == (6, 2) and states[0].compression.error["conv"].shape == (n, 2, 2, 2, 6)
  _assert_follows(states, _reference(params, q0, batches, weights, n, None), n)
  assert int(states[-1].compression.iteration) == 3


def stacked_loss(params, batch):
  """`loss_fn` with a stack of three 12 x 12 layers (`jaxdp.scan_layers`) between `w1` and `w2`."""
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None, :])
  # (the stack under its own name, which a layer's leaf is matched by)
  h, _ = jaxdp.scan_layers(lambda h, layer, _: (jnp.tanh(h @ layer["blocks"]), None), h, {"blocks": params["blocks"]})
  return jnp.sum((h @ params["w2"] - batch["y"]) ** 2, axis=-1)


def test_layer_wise_zero3_compresses_each_stacks_local_gradient_and_matches_the_reference():
  """Layer-wise ZeRO-3 (layers=: the stack split along a layer's dimension, gathered a layer at a time by
  jaxdp.scan_layers): the stack's local gradient leaves the backward pass whole (it is not reduce-scattered
  there) and is compressed as at ZeRO-3, each device keeping its slice of the decompressed sum. Against the plain
  reference, uneven weights; the step still never gathers the whole stack."""
  params, n = _params(shapes={"w1": (8, 12), "b1": (12,), "blocks": (3, 12, 12), "w2": (12, 6)}), 4
  compression = jaxdp.reductions.powersgd(rank=2, start_iter=0, min_compression_rate=0)
  batches = [_batch(seed=s) for s in (1, 2, 3)]
  weights = _uneven_weights(n=n)
  steps = []
  states = _run(params, batches, weights, n=n, compression=compression, zero_stage=3, layers="blocks",
                loss=stacked_loss, steps=steps)
  q0 = {k: v for k, v in states[0].compression.q.items() if v is not None}
  assert set(q0) == {"w1", "w2", "blocks"} and q0["blocks"].shape == (12, 2)  # the stack as one 36 x 12 matrix
  _assert_follows(states, _reference(params, q0, batches, weights, n, None, loss=stacked_loss), n)
  state = jaxdp.init_state(params, optax.sgd(LR), jaxdp.data_parallel(_mesh(n), zero_stage=3, layers="blocks"),
                           reduction=compression)
  assert state.params["blocks"].sharding.spec == jax.P(None, "data")
  hlo = steps[0].lower(state, batches[0], weights).compile().as_text()
  gathers = [line.split("=")[1] for line in hlo.splitlines() if " all-gather(" in line]
  assert gathers and not [g for g in gathers if "[3,12,12]" in g]  # gathered one 12 x 12 layer at a time

  def own_loop(params, batch):  # jaxdp.gather in a scan of one's own: its transpose would reduce-scatter
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None, :])
    h, _ = jax.lax.scan(lambda h, u: (jnp.tanh(h @ jaxdp.gather({"blocks": u})["blocks"]), None), h,
                        params["blocks"])
    return jnp.sum((h @ params["w2"] - batch["y"]) ** 2, axis=-1)

  layout = jaxdp.data_parallel(_mesh(n), zero_stage=3, layers="blocks")
  step = jaxdp.make_train_step(own_loop, optax.sgd(LR), layout, reduction=compression)
  with pytest.raises(ValueError, match="jaxdp.gather in a loop of your own with PowerSGD"):
    step(state, batches[0], weights)


def test_q_identical_on_every_device_and_errors_split():
  mesh, opt = _mesh(4), optax.sgd(LR)
  compression = jaxdp.powersgd(rank=1, start_iter=0, min_compression_rate=0)
  state = jaxdp.init_state(_params(), opt, mesh, compression=compression)
  step = jaxdp.make_train_step(loss_fn, opt, mesh, compression=compression)
  state, _ = step(state, _batch(), _uneven_weights())
  shards = [np.asarray(s.data) for s in state.compression.q["w1"].addressable_shards]
  assert len(shards) == 4 and all(np.array_equal(shards[0], s) for s in shards[1:])
  error = state.compression.error["w1"]
  assert error.shape == (4, 8, 12)
  assert [s.data.shape for s in error.addressable_shards] == [(1, 8, 12)] * 4  # each device holds its own
  jaxdp.assert_replicas_equal(state.params)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_full_rank_equals_the_exact_step(zero_stage):
  # The exact step at the same stage and at stage 0 (one device's answer, tested elsewhere) both.
  params, batches, weights = _params(), [_batch(seed=s) for s in (1, 2)], _uneven_weights()
  exact = _run(params, batches, weights)
  if zero_stage:
    same_stage = _run(params, batches, weights, zero_stage=zero_stage)
    for k in params:
      np.testing.assert_allclose(same_stage[-1].params[k], exact[-1].params[k], rtol=1e-5, atol=1e-6)
  full = _run(params, batches, weights, zero_stage=zero_stage,
              compression=jaxdp.powersgd(rank=12, start_iter=0, min_compression_rate=0))
  for k in params:
    np.testing.assert_allclose(full[-1].params[k], exact[-1].params[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_full_rank_of_a_conv_kernel_equals_the_exact_step(zero_stage):
  # conv [2, 2, 2, 6] is the matrix 8 x 6 (its rank is capped at 6), so it is sent whole like w1 and w2; the
  # trained parameters carry QR's float32 round-off (1.2e-5 of the scale measured).
  params = _params(shapes={"w1": (8, 12), "b1": (12,), "w2": (12, 6), "conv": (2, 2, 2, 6)})
  batches, weights = [_batch(seed=s) for s in (1, 2)], _uneven_weights()
  exact = _run(params, batches, weights)
  compression = jaxdp.powersgd(rank=12, start_iter=0, min_compression_rate=0)
  full = _run(params, batches, weights, zero_stage=zero_stage, compression=compression)
  assert full[0].compression.q["conv"].shape == (6, 6)
  assert_close_to_scale(full[-1].params, exact[-1].params, rtol=5e-5)


@pytest.mark.parametrize("zero_stage, layers", [(2, None), (3, None), (3, "blocks")])
def test_a_user_reduction_under_zero_two_and_three_equals_the_exact_step(zero_stage, layers):
  """A user's reduction returns whole-leaf sums; at stages 2-3 each device keeps its slice of them. At layer-wise
  ZeRO-3 the stack's local gradient leaves jaxdp.scan_layers' backward pass whole for it (not reduce-scattered
  there), and its parameters are still gathered a layer at a time."""
  def plain_sum():
    def reduce(sums, state, axis_name):
      return jax.lax.psum(sums, axis_name), state + 1
    return jaxdp.reductions.Reduction(lambda params, layout: jnp.zeros((), jnp.int32), reduce)

  shapes = None if layers is None else {"w1": (8, 12), "b1": (12,), "blocks": (3, 12, 12), "w2": (12, 6)}
  loss = loss_fn if layers is None else stacked_loss
  params, batches, weights = _params(shapes=shapes), [_batch(seed=s) for s in (1, 2)], _uneven_weights()
  exact = _run(params, batches, weights, loss=loss)
  mesh, opt = _mesh(4), optax.sgd(LR)
  layout = jaxdp.data_parallel(mesh, zero_stage=zero_stage, layers=layers)
  state = jaxdp.init_state(params, opt, layout, reduction=plain_sum())
  step = jaxdp.make_train_step(loss, opt, layout, reduction=plain_sum())
  for batch in batches:
    state, _ = step(state, batch, weights)
  assert ("data" in tuple(state.params["w1"].sharding.spec)) == (zero_stage == 3)
  gathered = jaxdp.gather_state(state)
  for k in params:
    np.testing.assert_allclose(gathered.params[k], exact[-1].params[k], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(gathered.compression), [2, 2, 2, 2])


def test_a_layer_wise_stack_also_used_outside_scan_layers_keeps_that_gradient():
  """A loss that also reads the split stack directly (a penalty on this device's slice, besides scan_layers): with
  a reduction that takes whole stacks, that slice's gradient is added in the device's place of the whole local
  gradient, not dropped, so the step is the same as layer-wise ZeRO-3's exact step on the same loss."""
  def plain_sum():
    return jaxdp.reductions.Reduction(lambda params, layout: None,
                                      lambda sums, state, axis_name: (jax.lax.psum(sums, axis_name), state))

  def penalised(params, batch):
    return stacked_loss(params, batch) + 0.1 * jnp.sum(params["blocks"] ** 2)

  params = _params(shapes={"w1": (8, 12), "b1": (12,), "blocks": (3, 12, 12), "w2": (12, 6)})
  batches, weights = [_batch(seed=s) for s in (1, 2)], _uneven_weights()
  finals = [_run(params, batches, weights, zero_stage=3, layers="blocks", loss=penalised, compression=reduction)[-1]
            for reduction in (None, plain_sum())]
  for k in params:
    np.testing.assert_allclose(finals[1].params[k], finals[0].params[k], rtol=1e-5, atol=1e-6)


def test_full_rank_with_accumulation_equals_the_exact_step():
  params, batches, weights = _params(), [_batch(seed=s) for s in (1, 2)], _uneven_weights()
  exact = _run(params, batches, weights)
  mesh, opt = _mesh(4), optax.sgd(LR)
  reduction = jaxdp.reductions.powersgd(12, start_iter=0, min_compression_rate=0)
  state = jaxdp.init_state(params, opt, mesh, reduction=reduction)
  step = jaxdp.make_train_step(loss_fn, opt, mesh, reduction=reduction, accum_steps=2)
  for batch in batches:
    state, _ = step(state, batch, weights)
  for k in params:
    np.testing.assert_allclose(jaxdp.gather_state(state).params[k], exact[-1].params[k], rtol=1e-5, atol=1e-6)


def test_stage_one_equals_stage_zero():
  params, batches, weights = _params(), [_batch(seed=s) for s in (1, 2)], _uneven_weights()
  compression = jaxdp.powersgd(rank=1, start_iter=0, min_compression_rate=0)
  zero = _run(params, batches, weights, compression=compression)
  one = _run(params, batches, weights, compression=compression, zero_stage=1)
  for a, b in zip(jax.tree.leaves(zero[-1]), jax.tree.leaves(one[-1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_start_iter_steps_are_exact_and_small_leaves_too():
  params, batches, weights = _params(), [_batch(seed=s) for s in (1, 2, 3)], _uneven_weights()
  exact = _run(params, batches, weights)
  compression = jaxdp.powersgd(rank=1, start_iter=2, min_compression_rate=0)
  compressed = _run(params, batches, weights, compression=compression)
  for k in params:  # the first two steps: the exact step's numbers
    np.testing.assert_allclose(compressed[2].params[k], exact[2].params[k], rtol=1e-6, atol=1e-7)
  assert int(compressed[2].compression.iteration) == 2
  assert all(not np.any(e) for e in jax.tree.leaves(compressed[2].compression.error))
  # The third is compressed: the matrices move off the exact path, the bias (a vector) is still reduced exactly.
  assert not np.allclose(compressed[3].params["w1"], exact[3].params["w1"], rtol=1e-4, atol=1e-5)
  assert np.any(compressed[3].compression.error["w1"])
  one = _run(params, batches[:1], weights, compression=jaxdp.powersgd(rank=1, start_iter=0, min_compression_rate=0))
  np.testing.assert_allclose(one[1].params["b1"], exact[1].params["b1"], rtol=1e-6, atol=1e-7)
  # min_compression_rate 2 at rank 2: w2 [12, 6] (72 <= 18*2*2) is reduced exactly, w1 [8, 12] (96 > 80) is not.
  state = jaxdp.init_state(params, optax.sgd(LR), _mesh(4), compression=jaxdp.powersgd(rank=2))
  assert state.compression.q["w2"] is None and state.compression.q["b1"] is None
  assert state.compression.q["w1"].shape == (12, 2) and state.compression.error["w1"].shape == (4, 8, 12)


def test_a_leaf_of_more_dims_is_its_most_square_split():
  # the split shape[:k] x shape[k:] closest to square: the fewest rank-r factor values r*(m+n)
  from jaxdp.reductions.compression import leaf_rank, matrix_shape

  assert matrix_shape((8, 12)) == (8, 12) and matrix_shape((12, 8)) == (12, 8)
  assert matrix_shape((3, 3, 16, 32)) == (144, 32) and matrix_shape((3, 3, 1, 16)) == (9, 16)
  assert matrix_shape((64, 3, 4, 16)) == (64, 192)  # tie with 192 x 64: the first split (inputs x outputs)
  assert matrix_shape((3, 3, 8, 64)) == (72, 64) and matrix_shape((5, 4, 7)) == (20, 7)
  compression = jaxdp.powersgd(rank=2)  # min_compression_rate 2: m*n > (m+n)*2*2
  assert leaf_rank((3, 3, 8, 64), compression) == 2  # 4608 > 544; as 3 x 1536 it was sent exactly (4608 <= 6156)
  assert leaf_rank((3, 3, 1, 4), compression) is None  # 9 x 4: 36 <= 52, too small to pay
  params = {"conv": np.zeros((3, 3, 8, 64), np.float32)}
  state = jaxdp.init_compression(params, compression, 4)
  assert state.q["conv"].shape == (64, 2) and state.error["conv"].shape == (4, 3, 3, 8, 64)


def _all_reduce_sizes(hlo):
  from jaxdp.analysis.reports import hlo_collectives

  return [size for kind, size, _, _ in hlo_collectives(hlo) if kind == "all-reduce"]


def test_hlo_sends_two_small_all_reduces_instead_of_the_matrix():
  params = _params(shapes={"w1": (8, 64), "b1": (64,), "w2": (64, 48)})
  batch = _batch()
  batch["y"] = np.zeros((16, 48), np.float32)
  mesh, opt = _mesh(4), optax.sgd(LR)

  def hlo(compression):
    state = jaxdp.init_state(params, opt, mesh, compression=compression)
    step = jaxdp.make_train_step(loss_fn, opt, mesh, compression=compression)
    return step.lower(state, batch).compile().as_text()

  exact = _all_reduce_sizes(hlo(None))
  compressed = _all_reduce_sizes(hlo(jaxdp.powersgd(rank=2, start_iter=0)))
  assert max(exact) >= 64 * 48 * 4  # the matrix travels whole
  assert max(compressed) < 64 * 48 * 4 // 4
  # w2's factors: P [64, 2] and Q' [48, 2] (w1 [8, 64] at rank 2 is compressed too: 8*64 > 72*2*2).
  assert sum(compressed) <= sum(exact) - 4 * (64 * 48 + 8 * 64) + 4 * 2 * (64 + 48 + 8 + 64) + 64
  assert sum(compressed) * 5 < sum(exact)


def test_checkpoint_round_trip(tmp_path):
  params, mesh, opt = _params(), _mesh(4), optax.sgd(LR)
  compression = jaxdp.powersgd(rank=1, start_iter=0, min_compression_rate=0)
  state = jaxdp.init_state(params, opt, mesh, compression=compression)
  step = jaxdp.make_train_step(loss_fn, opt, mesh, compression=compression)
  state, _ = step(state, _batch(), _uneven_weights())
  saved = jaxdp.gather_state(state)
  with jaxdp.CheckpointManager(tmp_path / "ckpt") as ckpt:
    ckpt.save(1, state, force=True)
    ckpt.wait()
    restored = ckpt.restore(params=params, optimizer=opt, mesh=mesh, compression=compression).state
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(jaxdp.gather_state(restored))):
      np.testing.assert_array_equal(a, b)
    assert restored.compression.error["w1"].sharding.spec == jax.sharding.PartitionSpec("data")
    step(restored, _batch(), _uneven_weights())  # the restored state steps on
    with pytest.raises(ValueError, match="error feedback of 4 replicas"):
      ckpt.restore(params=params, optimizer=opt, mesh=_mesh(2), compression=compression)
    with pytest.raises(ValueError, match="compression"):
      ckpt.restore(params=params, optimizer=opt, mesh=mesh)


def test_a_checkpoint_of_the_old_matrix_view_is_refused(tmp_path):
  """Before, a leaf of 3+ dims was the matrix shape[0] x rest, so its saved Q was [prod(shape[1:]), r]; such a
  checkpoint is refused by name, not restored into a step that would multiply by the wrong Q."""
  params = _params(shapes={"w1": (8, 12), "b1": (12,), "w2": (12, 6), "conv": (2, 2, 2, 6)})
  mesh, opt = _mesh(4), optax.sgd(LR)
  compression = jaxdp.powersgd(rank=1, start_iter=0, min_compression_rate=0)
  state = jaxdp.init_state(params, opt, mesh, compression=compression)
  assert state.compression.q["conv"].shape == (6, 1)
  old_q = jax.device_put(np.ones((2 * 2 * 6, 1), np.float32), state.compression.q["conv"].sharding)
  old = state._replace(compression=state.compression._replace(q={**state.compression.q, "conv": old_q}))
  with jaxdp.CheckpointManager(tmp_path / "ckpt") as ckpt:
    ckpt.save(1, old, force=True)
    ckpt.wait()
    with pytest.raises(ValueError, match=r"compression/q/conv: shape \(24, 1\) in the checkpoint, \(6, 1\) in the target"):
      ckpt.restore(params=params, optimizer=opt, mesh=mesh, compression=compression)


@pytest.mark.parametrize("rank", [0, -1, 1.5, True, "2"])
def test_bad_rank(rank):
  with pytest.raises(ValueError, match="rank must be an integer >= 1"):
    jaxdp.powersgd(rank=rank)


def test_bad_settings():
  with pytest.raises(ValueError, match="start_iter"):
    jaxdp.powersgd(start_iter=-1)
  with pytest.raises(ValueError, match="min_compression_rate"):
    jaxdp.powersgd(min_compression_rate=-1.0)
  opt, compression = optax.sgd(LR), jaxdp.powersgd()
  for kwargs, match in [({"reduction": "none"}, "reduction='none'"), ({"reduction": "rank_mean"}, "rank_mean"),
                        ({"grad_reduce_dtype": jnp.bfloat16}, "bfloat16"),
                        ({"backend": "pmap"}, "pmap")]:
    with pytest.raises(ValueError, match=match):
      jaxdp.make_train_step(loss_fn, opt, _mesh(4), compression=compression, **kwargs)
  with pytest.raises(TypeError, match="compression"):
    jaxdp.make_train_step(loss_fn, opt, _mesh(4), compression={"rank": 2})


def test_settings_the_int32_state_or_the_key_cannot_hold_are_refused():
  """The state counts steps in an int32 (start_iter beyond it raised an OverflowError naming 'y' at the first
  step); jax.random.key keeps a seed's low 32 bits (2**32 gave seed 0's Q). A PowerSGD built by hand is checked."""
  assert jaxdp.powersgd(start_iter=2**31 - 1, seed=2**32 - 1).start_iter == 2**31 - 1
  with pytest.raises(ValueError, match=r"start_iter must be <= 2147483647 \(2\*\*31 - 1.*int32"):
    jaxdp.powersgd(start_iter=2**40)
  with pytest.raises(ValueError, match=r"seed must be < 2\*\*32.*low 32 bits"):
    jaxdp.powersgd(seed=2**32)
  with pytest.raises(ValueError, match="start_iter must be <= 2147483647"):
    jaxdp.make_train_step(loss_fn, optax.sgd(LR), _mesh(2), compression=jaxdp.PowerSGD(start_iter=2**40))


def test_state_and_step_mismatch_refused_before_donation():
  params, mesh, opt = _params(), _mesh(4), optax.sgd(LR)
  compression = jaxdp.powersgd(rank=1, start_iter=0, min_compression_rate=0)
  plain = jaxdp.init_state(params, opt, mesh)
  with_state = jaxdp.init_state(params, opt, mesh, compression=compression)
  before = [jaxdp.gather_state(plain), jaxdp.gather_state(with_state)]
  cases = [
      (jaxdp.make_train_step(loss_fn, opt, mesh, compression=compression), plain, "state.compression is None"),
      (jaxdp.make_train_step(loss_fn, opt, mesh), with_state, "built without compression"),
      (jaxdp.make_train_step(loss_fn, opt, mesh, compression=jaxdp.powersgd(rank=2, min_compression_rate=0)),
       with_state, "does not match"),
      (jaxdp.make_train_step(loss_fn, opt, _mesh(2), compression=compression), with_state, "of 4 replicas"),
  ]
  for step, state, match in cases:
    with pytest.raises(ValueError, match=match):
      step(state, _batch(), _uneven_weights())
  for old, state in zip(before, (plain, with_state)):  # nothing donated, nothing changed
    for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(jaxdp.gather_state(state))):
      np.testing.assert_array_equal(a, b)


def test_hybrid_data_axes_equal_one_data_axis():
  params, batches, weights = _params(), [_batch(seed=s) for s in (1, 2)], _uneven_weights()
  compression = jaxdp.powersgd(rank=1, start_iter=0, min_compression_rate=0)
  flat = _run(params, batches, weights, compression=compression)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("replica", "data"),
                           axis_types=(jax.sharding.AxisType.Auto,) * 2)
  opt, axes = optax.sgd(LR), ("replica", "data")
  state = jaxdp.init_state(params, opt, mesh, axis_name=axes, zero_stage=1, compression=compression)
  step = jaxdp.make_train_step(loss_fn, opt, mesh, axis_name=axes, zero_stage=1, compression=compression)
  for batch in batches:
    state, _ = step(state, batch, weights)
  for a, b in zip(jax.tree.leaves(flat[-1]), jax.tree.leaves(jaxdp.gather_state(state))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_train_step_in_your_own_shard_map_equals_make_train_step():
  from jax.sharding import PartitionSpec as P

  params, batch, weights = _params(), _batch(), _uneven_weights()
  mesh, opt = _mesh(4), optax.sgd(LR)
  compression = jaxdp.powersgd(rank=1, start_iter=0, min_compression_rate=0)
  expected = _run(params, [batch, batch], weights, compression=compression)[-1]
  state = jaxdp.gather_state(jaxdp.init_state(params, opt, mesh, compression=compression))
  state_specs = jaxdp.TrainState(P(), P(), P(), None, compression=jaxdp.PowerSGDState(
      jax.tree.map(lambda _: P(), state.compression.q), jax.tree.map(lambda _: P("data"), state.compression.error),
      P()))

  def replica(state, batch, weights):  # each device: q whole, its own [1, *shape] row of each error
    return jaxdp.train_step(loss_fn, opt, state, batch, weights, compression=compression)[0]

  step = jax.jit(jax.shard_map(replica, mesh=mesh, in_specs=(state_specs, P("data"), P("data")),
                               out_specs=state_specs))
  for _ in range(2):
    state = step(state, batch, weights)
  for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(state)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


PS_POLICIES = {  # name: (precision policy keywords, parameter tolerance relative to each leaf's largest value)
    "float32": ({}, 1e-5),
    "bf16 compute": ({"compute_dtype": jnp.bfloat16}, 3e-2),
    "float16 loss scaling": ({"compute_dtype": jnp.float16, "loss_scaling": "dynamic"}, 5e-3),
}


@pytest.mark.parametrize("policy", PS_POLICIES)
def test_full_rank_with_batchnorm_dropout_and_a_precision_policy_is_one_devices(policy):
  """A linen model with jaxdp's BatchNorm and layout-invariant dropout, PowerSGD at full rank on 4 devices with
  uneven weights (the last device padding only) against the same program on one device without compression,
  under the same precision policy: its round-off apart, the same parameters and BatchNorm statistics."""
  from test_composition_precision import Net, make_loss

  keywords, rtol = PS_POLICIES[policy]
  keywords = dict(keywords)
  if keywords.get("loss_scaling") == "dynamic":
    keywords["loss_scaling"] = jaxdp.dynamic_loss_scale(init_scale=2.0**8)  # 2**16 overflows float16 at once
  precision = jaxdp.precision(**keywords)
  model = Net()
  rng = np.random.default_rng(4)
  rows = 16
  data = [{"x": rng.normal(size=(rows, 4)).astype(np.float32), "y": rng.normal(size=(rows, 2)).astype(np.float32),
           "id": np.arange(rows * k, rows * (k + 1), dtype=np.int32)} for k in range(3)]
  weights = _uneven_weights(rows)
  variables = model.init(jax.random.key(0), data[0]["x"][:1], False)
  opt, key = optax.sgd(0.1), jax.random.key(3)  # not Adam: Dense_0.bias, under BatchNorm, has a gradient of round-off
  results = []
  for n, reduction in ((1, None), (4, jaxdp.reductions.powersgd(8, start_iter=0, min_compression_rate=0))):
    mesh = _mesh(n)
    state = jaxdp.init_state(variables["params"], opt, mesh, model_state=variables["batch_stats"],
                             reduction=reduction, precision=precision)
    step = jaxdp.make_train_step(make_loss(model), opt, mesh, reduction=reduction, precision=precision,
                                 example_ids="id")
    for batch in data:
      state, metrics = step(state, batch, weights, rng=key)
      assert int(metrics["skipped"]) == 0
    results.append(jaxdp.gather_state(state))
  # Relative to the largest value of the tree: Dense_0's bias, under BatchNorm, has a gradient of round-off only
  # and stays near its initial zeros, where a leaf's own scale would measure nothing but that round-off.
  for ours, one in ((results[1].params, results[0].params), (results[1].model_state, results[0].model_state)):
    scale = max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree.leaves(one))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(one)):
      err = float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) / scale
      assert err <= rtol, f"{jax.tree_util.keystr(path)}: {err:.2e} of the largest value > {rtol}"


@pytest.mark.usefixtures("fast_compiles")  # plumbing and float64 agreement: most XLA passes skipped
def test_low_rank_on_a_tensor_parallel_zero2_mesh_is_the_same_powersgd_on_one_device():
  """PowerSGD's output depends on the replicas' gradients only through their sums (P = Σ M_i Q, Q' = Σ M_iᵀ P̂,
  and the errors sum to one device's), so rank 1 on ("data", "model") = (4, 2) at ZeRO-2, the model's matrices
  split over "model", with BatchNorm and layout-invariant dropout on uneven weights, is rank 1 on one device:
  float64, within 1e-12 after 3 steps (its round-off is about 1e-16)."""
  from jax.sharding import AxisType, Mesh
  from test_composition_precision import Net, make_loss
  from test_compositions import TP_SPECS as specs

  tensor = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  powersgd = jaxdp.reductions.powersgd(1, start_iter=1)  # Dense_0's [4, 8] kernel compressed from step 2 on
  model, rng, rows = Net(), np.random.default_rng(5), 16
  results = []
  with float64():
    data = [{"x": rng.normal(size=(rows, 4)), "y": rng.normal(size=(rows, 2)),
             "id": np.arange(rows * k, rows * (k + 1), dtype=np.int32)} for k in range(3)]
    variables = jax.tree.map(lambda a: np.asarray(a, np.float64), model.init(jax.random.key(0), data[0]["x"][:1], False))
    for layout in (jaxdp.data_parallel(_mesh(1)), jaxdp.data_parallel(tensor, param_specs=specs, zero_stage=2)):
      opt = optax.sgd(0.1, momentum=0.9)
      state = jaxdp.init_state(variables["params"], opt, layout, model_state=variables["batch_stats"],
                               reduction=powersgd)
      step = jaxdp.make_train_step(make_loss(model), opt, layout, reduction=powersgd, example_ids="id")
      for batch in data:
        state, metrics = step(state, batch, _uneven_weights(rows), rng=jax.random.key(3))
      assert int(state.compression.iteration) == 3
      results.append(jaxdp.gather_state(state))
  assert tuple(state.params["Dense_0"]["kernel"].sharding.spec)[-1] == "model"
  for a, b in zip(jax.tree.leaves((results[1].params, results[1].model_state, results[1].opt_state)),
                  jax.tree.leaves((results[0].params, results[0].model_state, results[0].opt_state))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-12)
