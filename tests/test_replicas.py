"""per_replica and assert_replicas_equal on replicated arrays, and on arrays whose copies differ.

An array whose per-device copies differ is built the way a bug would leave
one: ``jax.make_array_from_single_device_arrays`` with a replicated
NamedSharding and a different buffer on some devices.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdp

K = 4
DEVICES = jax.devices()[:K]
MESH = jaxdp.data_mesh(DEVICES)
BASE = np.arange(6, dtype=np.float32).reshape(2, 3)


def with_copies(copies):
  """A "replicated" array whose device i holds ``copies[i]``."""
  buffers = [jax.device_put(np.asarray(c), d) for c, d in zip(copies, DEVICES)]
  return jax.make_array_from_single_device_arrays(BASE.shape, NamedSharding(MESH, P()), buffers)


def offsets(deltas):
  """Copies of BASE, with deltas[i] added to one element on device i."""
  copies = [BASE.copy() for _ in DEVICES]
  for copy, delta in zip(copies, deltas):
    copy[1, 2] += delta
  return copies


def state_tree():
  params = {"dense": {"kernel": BASE, "bias": np.ones((3,), np.float32)}}
  return jaxdp.init_state(params, optax.adam(1e-3), MESH)


def test_per_replica_stacks_every_device_copy():
  """Each leaf becomes [K, ...]: row i is device i's copy, here the same everywhere."""
  state = state_tree()
  stacked = jaxdp.per_replica(state)
  assert stacked.params["dense"]["kernel"].shape == (K, *BASE.shape)
  assert stacked.step.shape == (K,)
  for leaf, host in zip(jax.tree.leaves(stacked), jax.tree.leaves(jax.tree.map(np.asarray, state))):
    for i in range(K):
      np.testing.assert_array_equal(leaf[i], host)


def test_per_replica_shows_differing_copies_in_device_order():
  copies = offsets([0.0, 0.25, 0.0, -0.75])
  np.testing.assert_array_equal(jaxdp.per_replica(with_copies(copies)), np.stack(copies))


def test_assert_replicas_equal_passes_on_replicated_state():
  jaxdp.assert_replicas_equal(state_tree())


def test_assert_replicas_equal_names_leaf_devices_and_largest_difference():
  """Devices 1 and 3 differ by 0.25 and 0.75: the message names the leaf, both devices and 0.75."""
  state = state_tree()
  kernel = with_copies(offsets([0.0, 0.25, 0.0, -0.75]))
  bad = state._replace(params={"dense": {"kernel": kernel, "bias": state.params["dense"]["bias"]}})
  with pytest.raises(AssertionError) as e:
    jaxdp.assert_replicas_equal(bad)
  message = str(e.value)
  assert ".params['dense']['kernel']" in message
  assert "bias" not in message and ".step" not in message  # the equal leaves are not reported
  named = re.search(r"kernel'\]: (.*) differ from", message).group(1)
  assert str(DEVICES[1]) in named and str(DEVICES[3]) in named
  assert str(DEVICES[2]) not in named
  assert "0.75" in message


def test_assert_replicas_equal_names_integer_leaf():
  """A step counter that differs on device 2 is reported under .step, difference 3."""
  state = state_tree()
  steps = [np.int32(5), np.int32(5), np.int32(8), np.int32(5)]
  buffers = [jax.device_put(s, d) for s, d in zip(steps, DEVICES)]
  bad = state._replace(step=jax.make_array_from_single_device_arrays((), NamedSharding(MESH, P()), buffers))
  with pytest.raises(AssertionError, match=r"\.step: .*differ.*largest \|difference\| 3\b") as e:
    jaxdp.assert_replicas_equal(bad)
  assert str(DEVICES[2]) in str(e.value).split("differ from")[0]


def test_atol_is_honoured():
  """A difference of 1e-3 passes under atol=1e-2 and fails under atol=1e-4 (and the default 0)."""
  tree = {"w": with_copies(offsets([0.0, 0.0, 1e-3, 0.0]))}
  jaxdp.assert_replicas_equal(tree, atol=1e-2)
  with pytest.raises(AssertionError, match=r"\['w'\].*atol=0\.0001"):
    jaxdp.assert_replicas_equal(tree, atol=1e-4)
  with pytest.raises(AssertionError, match=r"\['w'\]"):
    jaxdp.assert_replicas_equal(tree)


def _shifted_on(x, device_id):
  """``x`` with 0.5 added to every element of the copy (or shard) held by device ``device_id``."""
  buffers = [jax.device_put(np.asarray(s.data) + (0.5 if s.device.id == device_id else 0.0), s.device)
             for s in x.addressable_shards]
  return jax.make_array_from_single_device_arrays(x.shape, x.sharding, buffers)


@pytest.mark.parametrize(
    "shape,names,axis_name,zero_stage,leaf",
    [((4, 2), ("data", "model"), "data", 0, "b"),  # a bias replicated over "model"
     ((4, 2), ("data", "model"), "data", 2, "b"),
     ((2, 4), ("replica", "data"), ("replica", "data"), 3, "w")],  # a ZeRO chunk, copied over "replica"
    ids=["data-model-stage0", "data-model-stage2", "hybrid-stage3"],
)
def test_check_replicas_sees_copies_on_every_mesh_axis(shape, names, axis_name, zero_stage, leaf):
  """The divergence was computed in a shard_map over the data axes only: a bias differing on a device of model
  column 1 (where the compiler takes the copies to agree) and a hybrid ZeRO chunk differing across "replica"
  (skipped as a chunk) read 0.0 while assert_replicas_equal named the devices."""
  mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * 2)
  opt = optax.sgd(0.1)

  def loss_fn(params, batch):
    return 0.5 * jnp.sum((batch["x"] @ params["w"] + params["b"][None] - batch["y"]) ** 2, -1)

  step = jaxdp.make_train_step(loss_fn, opt, mesh, axis_name=axis_name, zero_stage=zero_stage, check_replicas=True)
  batch = {"x": np.ones((8, 8), np.float32), "y": np.zeros((8, 4), np.float32)}
  fresh = lambda: jaxdp.init_state({"w": np.ones((8, 4), np.float32), "b": np.zeros(4, np.float32)}, opt, mesh,  # noqa: E731
                                   axis_name=axis_name, zero_stage=zero_stage)
  _, metrics = step(fresh(), batch)
  assert float(metrics["replica_divergence"]) == 0.0
  for device_id in (4, 5):  # model column 0 and 1; replica 1
    state = fresh()
    state = state._replace(params={**state.params, leaf: _shifted_on(state.params[leaf], device_id)})
    new, metrics = step(state, batch)
    with pytest.raises(AssertionError, match="replicas differ"):
      jaxdp.assert_replicas_equal(new)
    assert float(metrics["replica_divergence"]) > 0.0, device_id
