"""The input pipeline: exactly-once epochs, determinism, resume, padding, the process split, training parity.

The plan (which example goes to which device at which step) is pure, so most
properties are checked on it directly over many shapes; the pipeline is then
checked to load and place exactly what the plan says. Multi-process runs are
simulated: each process is a contiguous group of devices
(``process_positions``) and ``DataPipeline.load(step, positions)`` is what
that process would read.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxdp
from helpers import mesh_of as _mesh
from jaxdp.io.data import DataPipeline, addressable_positions, device_indices, epoch_permutation, process_positions

T = 3  # tokens per example in the token-mask collate


def _steps(n_examples: int, n_devices: int, b: int) -> int:
  return -(-n_examples // (n_devices * b))


class CountingDataset:
  """Example ``i`` is the int ``i``; every read is recorded."""

  def __init__(self, n: int):
    self.n, self.reads = n, []

  def __len__(self) -> int:
    return self.n

  def __getitem__(self, i: int) -> int:
    if not 0 <= i < self.n:
      raise IndexError(i)
    self.reads.append(i)
    return i


def collate_examples(examples: list) -> tuple[dict, np.ndarray]:
  """Per-example weights 1 + i % 3 (non-uniform, so they can be traced); x is never 0 on a real row."""
  assert examples, "the pipeline must not call collate on an empty portion"
  ids = np.asarray(examples, np.int32)
  return {"id": ids, "x": np.stack([ids + 1, -(ids + 1)], 1).astype(np.float32)}, 1.0 + ids % 3


def collate_tokens(examples: list) -> tuple[dict, np.ndarray]:
  """Token masks [k, T]: example i has i % T + 1 real tokens."""
  assert examples, "the pipeline must not call collate on an empty portion"
  ids = np.asarray(examples, np.int32)
  mask = (np.arange(T) < ids[:, None] % T + 1).astype(np.float32)
  return {"id": ids, "tok": ids[:, None] * 10 + np.arange(T, dtype=np.int32) + 1}, mask


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.shape(x) == np.shape(y) and np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- The plan -------------------------------------------------------------------------------


@settings(max_examples=200)
@given(
    n_examples=st.integers(1, 100),
    n_devices=st.integers(1, 8),
    b=st.integers(1, 6),
    seed=st.integers(0, 2**64 - 1),
    epoch=st.integers(0, 3),
)
def test_plan_uses_every_example_once_per_epoch(n_examples, n_devices, b, seed, epoch):
  steps = _steps(n_examples, n_devices, b)
  plans = [device_indices(n_examples, n_devices, b, seed, epoch * steps + i) for i in range(steps)]
  # In order, the portions of an epoch are exactly that epoch's permutation: each example once.
  visited = np.concatenate([np.concatenate(p) for p in plans])
  np.testing.assert_array_equal(visited, epoch_permutation(n_examples, seed, epoch))
  assert sorted(visited.tolist()) == list(range(n_examples))
  for i, plan in enumerate(plans):
    sizes = [len(p) for p in plan]
    assert len(plan) == n_devices and max(sizes) <= b
    if i < steps - 1:
      assert sizes == [b] * n_devices
    else:  # the remainder r, as even as possible, extras on the first devices
      r = n_examples - (steps - 1) * n_devices * b
      assert sum(sizes) == r and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@settings(max_examples=100)
@given(n_examples=st.integers(10, 300), seed=st.integers(0, 2**32), epoch=st.integers(0, 1000))
def test_order_is_a_function_of_seed_and_epoch(n_examples, seed, epoch):
  order = epoch_permutation(n_examples, seed, epoch)
  np.testing.assert_array_equal(order, epoch_permutation(n_examples, seed, epoch))
  assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(n_examples))
  # 10! > 3e6 orders: a coincidence is not plausible.
  assert not np.array_equal(order, epoch_permutation(n_examples, seed, epoch + 1))
  assert not np.array_equal(order, epoch_permutation(n_examples, seed + 1, epoch))


def test_order_is_pinned():
  # Integer arithmetic only: the same in every process and numpy version, so a run resumed
  # from a checkpoint replays the same epochs. Changing these values breaks resumption.
  np.testing.assert_array_equal(epoch_permutation(10, 0, 0), [7, 4, 8, 2, 0, 9, 3, 1, 5, 6])
  np.testing.assert_array_equal(epoch_permutation(10, 0, 1), [9, 6, 3, 0, 8, 4, 5, 1, 7, 2])


def test_order_looks_shuffled():
  order = epoch_permutation(10_000, 0, 0)
  assert abs(np.corrcoef(order, np.arange(order.size))[0, 1]) < 0.05
  assert np.sum(order == np.arange(order.size)) < 10  # about 1 fixed point expected
  # Consecutive epochs are unrelated too.
  assert abs(np.corrcoef(order, epoch_permutation(10_000, 0, 1))[0, 1]) < 0.05


@settings(max_examples=50)
@given(n_examples=st.integers(1, 60), seed=st.integers(0, 100), epoch=st.integers(0, 2))
def test_global_batch_does_not_depend_on_the_device_split(n_examples, seed, epoch):
  """For a fixed global batch G, how G is split over devices changes nothing but the cut points."""
  splits = [(1, 8), (2, 4), (4, 2), (8, 1)]
  steps = _steps(n_examples, 1, 8)
  for step in range(epoch * steps, (epoch + 1) * steps):
    batches = [np.concatenate(device_indices(n_examples, n, b, seed, step)) for n, b in splits]
    for other in batches[1:]:
      np.testing.assert_array_equal(batches[0], other)


@settings(max_examples=100)
@given(n_devices=st.sampled_from([1, 2, 4, 6, 8]), data=st.data())
def test_process_positions_partition_the_devices(n_devices, data):
  n_processes = data.draw(st.sampled_from([p for p in range(1, n_devices + 1) if n_devices % p == 0]))
  groups = [list(process_positions(n_devices, n_processes, p)) for p in range(n_processes)]
  assert list(itertools.chain(*groups)) == list(range(n_devices))


# --- The pipeline ---------------------------------------------------------------------------


@settings(max_examples=30)
@given(
    n_examples=st.integers(1, 40),
    n_devices=st.integers(1, 8),
    b=st.integers(1, 4),
    tokens=st.booleans(),
    step=st.integers(0, 30),
    pad=st.sampled_from(["copy", "zeros"]),
)
def test_batches_follow_the_plan_with_zero_weight_padding(n_examples, n_devices, b, tokens, step, pad):
  collate = collate_tokens if tokens else collate_examples
  mesh = _mesh(n_devices)
  pipe = DataPipeline(list(range(n_examples)), collate, mesh, per_device_batch=b, seed=3, pad=pad)
  assert pipe.steps_per_epoch == _steps(n_examples, n_devices, b)
  assert pipe.global_batch == n_devices * b
  batch, weights = pipe.batch_at(step)
  plan = device_indices(n_examples, n_devices, b, 3, step)
  for got, want in zip(pipe.device_indices(step), plan):
    np.testing.assert_array_equal(got, want)

  sharding = NamedSharding(mesh, P("data"))
  for leaf in jax.tree.leaves((batch, weights)):
    assert leaf.shape[0] == n_devices * b and leaf.sharding == sharding
  assert weights.dtype == jnp.float32 and weights.shape == ((n_devices * b, T) if tokens else (n_devices * b,))

  host_batch, host_weights = _host((batch, weights))
  for d, indices in enumerate(plan):
    rows, k = slice(d * b, (d + 1) * b), len(indices)
    block_batch, block_weights = jax.tree.map(lambda x: x[rows], (host_batch, host_weights))
    if k:  # real rows: exactly what collate made of this device's examples, weights (as float32) included
      want_batch, want_weights = collate(list(indices))
      _assert_trees_equal(jax.tree.map(lambda x: x[:k], (block_batch, block_weights)), (want_batch, want_weights.astype(np.float32)))
      assert np.all(block_weights[:k].reshape(k, -1).sum(1) > 0)
    assert not np.any(block_weights[k:])  # padding: weight 0
    if pad == "zeros":
      for leaf in jax.tree.leaves(block_batch):
        assert not np.any(leaf[k:])
    else:  # copies of the device's first row, or of example 0 on a device with no example
      row = jax.tree.map(lambda x: x[:1], block_batch if k else collate([0])[0])
      for leaf, want in zip(jax.tree.leaves(block_batch), jax.tree.leaves(row)):
        np.testing.assert_array_equal(leaf[k:], np.repeat(want, b - k, axis=0))

  # Every device holds its own block, and the layout is shard_uneven's.
  positions = {dev: i for i, dev in enumerate(mesh.devices.flat)}
  for shard in weights.addressable_shards:
    assert (shard.index[0].start or 0) == positions[shard.device] * b
  padded = [jax.tree.map(lambda x: x[d * b : (d + 1) * b], host_batch) for d in range(n_devices)]
  padded_w = [host_weights[d * b : (d + 1) * b] for d in range(n_devices)]
  same_batch, same_weights = jaxdp.shard_uneven(padded, mesh, weights=padded_w, pad=pad)
  _assert_trees_equal((same_batch, same_weights), (host_batch, host_weights))
  assert same_weights.sharding == weights.sharding


@pytest.mark.parametrize("pad", ["copy", "zeros"])
def test_devices_without_examples_get_only_padding(pad):
  # 3 examples, 8 devices: devices 3..7 have nothing, and collate is never called with [].
  pipe = DataPipeline(list(range(3)), collate_tokens, _mesh(8), per_device_batch=2, pad=pad)
  assert pipe.steps_per_epoch == 1
  batch, weights = _host(pipe.batch_at(0))
  assert [len(p) for p in pipe.device_indices(0)] == [1, 1, 1, 0, 0, 0, 0, 0]
  assert weights.shape == (16, T) and not np.any(weights[6:])
  assert sorted(batch["id"][[0, 2, 4]].tolist()) == [0, 1, 2]
  if pad == "zeros":
    assert not np.any(batch["tok"][6:])
  else:  # copies of example 0 (read once at construction, whichever process loads the device)
    assert np.all(batch["id"][6:] == 0) and np.all(batch["tok"][6:] == collate_tokens([0])[0]["tok"])


@settings(max_examples=15)
@given(
    n_examples=st.integers(1, 30),
    n_devices=st.sampled_from([1, 3, 8]),
    b=st.integers(1, 3),
    start=st.integers(0, 12),
)
def test_batch_at_equals_iteration_and_resumes(n_examples, n_devices, b, start):
  make = functools.partial(DataPipeline, list(range(n_examples)), collate_examples, _mesh(n_devices), per_device_batch=b, seed=7)
  run = list(make().iterate(num_steps=start + 3))
  assert [s for s, _ in run] == list(range(start + 3))
  resumed = list(make().iterate(start_step=start, num_steps=3))  # a fresh pipeline: no hidden state
  assert [s for s, _ in resumed] == list(range(start, start + 3))
  for (_, got), (_, want) in zip(resumed, run[start:]):
    _assert_trees_equal(_host(got), _host(want))
  _assert_trees_equal(_host(make().batch_at(start)), _host(run[start][1]))


def test_iterate_runs_forever_across_epochs():
  pipe = DataPipeline(list(range(5)), collate_examples, _mesh(2), per_device_batch=2)  # 2 steps per epoch
  seen = [np.asarray(batch["id"])[np.asarray(weights) > 0] for _, (batch, weights) in itertools.islice(pipe.iterate(), 6)]
  epochs = [np.concatenate(seen[i : i + 2]) for i in (0, 2, 4)]
  assert all(sorted(e.tolist()) == list(range(5)) for e in epochs)
  assert not np.array_equal(epochs[0], epochs[1])  # reshuffled every epoch


@settings(max_examples=20)
@given(
    n_examples=st.integers(1, 40),
    n_devices=st.sampled_from([1, 2, 4, 6, 8]),
    b=st.integers(1, 3),
    data=st.data(),
)
def test_each_process_loads_only_its_own_devices_examples(n_examples, n_devices, b, data):
  n_processes = data.draw(st.sampled_from([p for p in range(1, n_devices + 1) if n_devices % p == 0]))
  dataset = CountingDataset(n_examples)
  pipe = DataPipeline(dataset, collate_examples, _mesh(n_devices), per_device_batch=b, seed=1)
  assert dataset.reads == [0]  # the one shape probe, at construction
  assert pipe.local_positions == tuple(range(n_devices))  # one real process owns every device
  epoch_reads = []
  for step in range(pipe.steps_per_epoch):
    plan, merged = pipe.device_indices(step), {}
    for process in range(n_processes):
      positions = process_positions(n_devices, n_processes, process)
      dataset.reads.clear()
      portions = pipe.load(step, positions)
      own = np.concatenate([plan[q] for q in positions]).tolist()
      assert sorted(dataset.reads) == sorted(own)  # its own examples, each once, nothing else
      assert set(portions) == set(positions)
      epoch_reads += dataset.reads
      merged.update(portions)
    if step == pipe.steps_per_epoch - 1:  # together, the processes' portions are the global batch
      stitched = jax.tree.map(lambda *xs: np.concatenate(xs), *(merged[q] for q in range(n_devices)))
      _assert_trees_equal(stitched, _host(pipe.batch_at(step)))
  assert sorted(epoch_reads) == list(range(n_examples))


def test_two_axis_mesh_replicates_the_batch_over_the_other_axis():
  devices = np.asarray(jax.devices()[:8]).reshape(4, 2)
  mesh = Mesh(devices, ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  assert addressable_positions(mesh, "data") == (0, 1, 2, 3)
  pipe = DataPipeline(list(range(7)), collate_examples, mesh, per_device_batch=2)
  batch, weights = pipe.batch_at(0)
  assert weights.sharding == NamedSharding(mesh, P("data"))
  for shard in weights.addressable_shards:
    row = int(np.argwhere(devices == shard.device)[0, 0])
    np.testing.assert_array_equal(shard.data, np.asarray(weights)[2 * row : 2 * row + 2])
  assert sorted(np.asarray(batch["id"])[np.asarray(weights) > 0].tolist()) == list(range(7))


@pytest.mark.parametrize(
    "kwargs, collate, match",
    [
        ({"per_device_batch": 0}, collate_examples, "per_device_batch"),
        ({"per_device_batch": 2, "seed": -1}, collate_examples, "seed"),
        ({"per_device_batch": 2, "axis_name": "batch"}, collate_examples, "axis_name"),
        ({"per_device_batch": 2}, lambda ex: {"id": np.asarray(ex)}, "tuple"),
        ({"per_device_batch": 2}, lambda ex: ({"id": np.asarray(ex)}, np.ones(2)), "weights"),
        ({"per_device_batch": 2}, lambda ex: ({"id": np.asarray(ex)}, -np.ones(len(ex))), ">= 0"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, collate, match):
  with pytest.raises(ValueError, match=match):
    DataPipeline(list(range(5)), collate, _mesh(2), **kwargs)


def test_bad_calls_name_the_argument():
  with pytest.raises(ValueError, match="len.dataset"):
    DataPipeline([], collate_examples, _mesh(2), per_device_batch=1)
  pipe = DataPipeline(list(range(5)), collate_examples, _mesh(2), per_device_batch=1)
  with pytest.raises(ValueError, match="step"):
    pipe.batch_at(-1)
  with pytest.raises(ValueError, match="start_step"):
    pipe.iterate(start_step=-1)
  with pytest.raises(ValueError, match="positions"):
    pipe.load(0, positions=[2])
  with pytest.raises(ValueError, match="n_processes"):
    process_positions(8, 3, 0)
  with pytest.raises(ValueError, match="num_examples"):
    device_indices(0, 2, 2, 0, 0)


def test_collate_with_varying_trailing_shape_is_rejected():
  def ragged(examples):  # pads to the longest in the portion: differs between portions
    return {"tok": np.zeros((len(examples), max(examples) + 1), np.int32)}, np.ones(len(examples))

  pipe = DataPipeline(list(range(6)), ragged, _mesh(2), per_device_batch=2)
  with pytest.raises(ValueError, match="fixed length"):
    for _ in pipe.iterate(num_steps=pipe.steps_per_epoch):
      pass


# --- End to end -----------------------------------------------------------------------------


def test_one_step_on_a_pipeline_batch_matches_a_single_device_reference():
  """13 examples, 4 devices x 2 rows: step 0 is full, step 1 splits 5 examples 2, 1, 1, 1."""
  rng = np.random.default_rng(0)
  n, d = 13, 3
  x, y = rng.normal(size=(n, d)).astype(np.float32), rng.normal(size=(n,)).astype(np.float32)
  w = (1.0 + np.arange(n) % 3).astype(np.float32)
  dataset = [{"x": x[i], "y": y[i], "w": w[i]} for i in range(n)]

  def collate(examples):
    return {"x": np.stack([e["x"] for e in examples]), "y": np.stack([e["y"] for e in examples])}, np.stack(
        [e["w"] for e in examples]
    )

  def loss_fn(params, batch):
    return 0.5 * (batch["x"] @ params["w"] + params["c"] - batch["y"]) ** 2

  params = {"w": np.linspace(-1, 1, d).astype(np.float32), "c": np.float32(0.5)}
  opt, mesh = optax.sgd(0.1), _mesh(4)
  pipe = DataPipeline(dataset, collate, mesh, per_device_batch=2, seed=5)
  step = jaxdp.make_train_step(loss_fn, opt, mesh, reduction="mean")

  def reference(idx):  # the plain weighted-mean step on one device, on the same examples
    batch = jax.device_put({"x": x[idx], "y": y[idx]}, jax.devices()[0])

    def mean_loss(p):
      return jnp.sum(w[idx] * loss_fn(p, batch)) / jnp.sum(w[idx])

    grads = jax.grad(mean_loss)(params)
    return optax.apply_updates(params, opt.update(grads, opt.init(params), params)[0])

  assert [len(p) for p in pipe.device_indices(1)] == [2, 1, 1, 1]
  for s in range(pipe.steps_per_epoch):
    state, metrics = step(jaxdp.init_state(params, opt, mesh), *pipe.batch_at(s))
    idx = np.concatenate(pipe.device_indices(s))
    # float32 sums in a different order (per device, then across): a few ulps apart.
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(reference(idx))):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["weight"]), w[idx].sum(), rtol=1e-6)


def test_values_the_devices_cannot_hold_are_refused_not_wrapped():
  """int64 ids above 2**31 were cut to int32 on placement (2**32 + 1 arrived as 1), strings failed in JAX with no
  leaf named, a generator gave "object of type 'generator' has no len()" and a seed of 2**64 or more passed the
  constructor (found by the pipeline review)."""
  mesh = _mesh(2)
  ids = lambda examples: ({"id": np.asarray(examples, np.int64)}, np.ones(len(examples), np.float32))  # noqa: E731
  with pytest.raises(ValueError, match=r"batches\[0\]\['id'\] holds int64 values outside int32's range"):
    jaxdp.shard_uneven([{"id": np.array([2**31 + 5])}, {"id": np.array([7])}], mesh)
  with pytest.raises(ValueError, match=r"collate's batch\['id'\] holds int64 values outside int32's range"):
    DataPipeline([2**32 + 1, 2**40 + 2, 5], ids, mesh, per_device_batch=2).batch_at(0)
  words = lambda examples: ({"s": np.asarray(examples)}, np.ones(len(examples), np.float32))  # noqa: E731
  with pytest.raises(ValueError, match=r"collate's batch\['s'\] has dtype <U1, which a JAX array cannot hold"):
    DataPipeline(["a", "b"], words, mesh, per_device_batch=1).batch_at(0)
  with pytest.raises(ValueError, match=r"dataset must be indexable with a length.*jaxdp.StreamingPipeline"):
    DataPipeline((i for i in range(3)), ids, mesh, per_device_batch=1)
  with pytest.raises(ValueError, match=r"seed must be < 2\*\*64"):
    DataPipeline([1, 2, 3], ids, mesh, per_device_batch=1, seed=2**64 + 3)
  # bfloat16 (an ml_dtypes type numpy does not call a number) is placed, not refused as a first version did.
  half, _ = jaxdp.shard_uneven([{"x": np.ones((2, 3), jnp.bfloat16)}, {"x": np.ones((1, 3), jnp.bfloat16)}], mesh)
  assert half["x"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match=r"batches\[0\]\['t'\] has dtype timedelta64"):
    jaxdp.shard_uneven([{"t": np.array([1, 2], "timedelta64[s]")}, {"t": np.array([3], "timedelta64[s]")}], mesh)
  # int64 within int32's range is placed as before.
  batch, weights = DataPipeline([2**31 - 1, 5, -7], ids, mesh, per_device_batch=2, seed=0).batch_at(0)
  assert sorted(np.asarray(batch["id"])[np.asarray(weights) > 0].tolist()) == [-7, 5, 2**31 - 1]
