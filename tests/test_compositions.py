"""Pairs of features at once, against one device: a linen model with jaxdp's BatchNorm (model state) and
layout-invariant Dropout (``example_ids=``), on hybrid, tensor-parallel and ZeRO layouts with accumulation,
checked by the verifier (float64, teacher-forced: every step's loss, gradient and model state within float64
round-off of one device's). The composition table in docs/guarantees.md names these cases.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import flax.linen as nn
from jax.sharding import AxisType, Mesh, PartitionSpec as P

import jaxdp
from jaxdp.runtime import verify

pytestmark = pytest.mark.usefixtures("fast_compiles")


class Net(nn.Module):
  @nn.compact
  def __call__(self, x, train, mask=None):
    h = nn.Dense(8)(x)
    h = jaxdp.adapters.linen.BatchNorm(use_running_average=not train)(h, mask=mask)
    h = jaxdp.adapters.linen.Dropout(0.25, deterministic=not train)(nn.relu(h))
    return nn.Dense(2)(h)


MODEL = Net()


def loss_fn(params, batch, rng=None, *, model_state, weights, train):
  out, updates = MODEL.apply({"params": params, "batch_stats": model_state}, batch["x"], train, mask=weights,
                             rngs={"dropout": rng} if rng is not None else {}, mutable=["batch_stats"])
  return jaxdp.LossOutput(jnp.sum((out - batch["y"]) ** 2, axis=-1), model_state=updates["batch_stats"])


def _mesh(shape, names):
  devices = np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


TP_SPECS = {"Dense_0": {"kernel": P(None, "model"), "bias": P("model")}, "BatchNorm_0": {"scale": P(), "bias": P()},
            "Dense_1": {"kernel": P("model", None), "bias": P()}}

CASES = {
    # name: (mesh shape, axis names, data axes, zero stage, tensor-parallel specs, accum_steps)
    "hybrid x ZeRO-3": ((2, 4), ("replica", "data"), ("replica", "data"), 3, None, 1),
    "tensor parallel x ZeRO-1": ((4, 2), ("data", "model"), "data", 1, TP_SPECS, 1),
    "hybrid x tensor parallel x ZeRO-2": ((2, 2, 2), ("replica", "data", "model"), ("replica", "data"), 2, TP_SPECS,
                                          1),
}


def test_batchnorm_with_accumulation_is_not_one_devices_and_the_verifier_says_so():
  """BatchNorm's batch statistics are per micro-batch, and which rows form a micro-batch depends on the device
  count (each device's own half, against one device's first and second half of the batch): the pair cannot be
  one device's, and the verifier reports it at the first step."""
  report = _verify(*CASES["hybrid x ZeRO-3"][:5], accum=2)
  assert report.diverged and report.first[0] == 1, str(report)


@pytest.mark.parametrize("case", CASES)
def test_batchnorm_and_dropout_on_combined_layouts_are_one_devices(case):
  report = _verify(*CASES[case])
  assert not report.diverged, str(report)
  assert report.worst < 1e-12, str(report)


def _verify(shape, names, axes, zero_stage, specs, accum):
  layout = jaxdp.data_parallel(_mesh(shape, names), axis_name=axes, zero_stage=zero_stage, param_specs=specs)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(37, 4)).astype(np.float32)
  data = {"x": x, "y": rng.normal(size=(37, 2)).astype(np.float32), "id": np.arange(37, dtype=np.int32)}
  variables = MODEL.init(jax.random.key(0), x[:1], False)
  per_device = -(-37 // layout.replicas)
  rows = -(-per_device // accum) * accum  # a device's rows divide into accum_steps micro-batches
  batches = [jaxdp.split_batch(data, layout.mesh, axis_name=axes, rows=rows)]
  report = verify.verify(loss_fn, optax.adam(0.05), layout, variables["params"], batches,
                         model_state=variables["batch_stats"], rng=jax.random.key(1), example_ids="id",
                         accum_steps=accum)
  return report


class Plain(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    h = jaxdp.adapters.linen.Dropout(0.25, deterministic=not train)(nn.relu(nn.Dense(8)(x)))
    return nn.Dense(2)(h)


def plain_loss(params, batch, rng=None, *, train):
  out = Plain().apply({"params": params}, batch["x"], train, rngs={"dropout": rng} if rng is not None else {})
  return jnp.sum((out - batch["y"]) ** 2, axis=-1)


PLAIN_SPECS = {"Dense_0": TP_SPECS["Dense_0"], "Dense_1": TP_SPECS["Dense_1"]}
ACCUMULATED = {
    # name: (mesh shape, axis names, data axes, zero stage, tensor-parallel specs)
    "hybrid x accumulation": ((2, 4), ("replica", "data"), ("replica", "data"), 0, None),
    "tensor parallel x ZeRO-3 x accumulation": ((4, 2), ("data", "model"), "data", 3, PLAIN_SPECS),
}


@pytest.mark.parametrize("case", ACCUMULATED)
def test_accumulation_with_dropout_on_combined_layouts_is_one_devices(case):
  shape, names, axes, zero_stage, specs = ACCUMULATED[case]
  layout = jaxdp.data_parallel(_mesh(shape, names), axis_name=axes, zero_stage=zero_stage, param_specs=specs)
  rng = np.random.default_rng(1)
  x = rng.normal(size=(29, 4)).astype(np.float32)
  data = {"x": x, "y": rng.normal(size=(29, 2)).astype(np.float32), "id": np.arange(29, dtype=np.int32)}
  params = Plain().init(jax.random.key(0), x[:1], False)["params"]
  rows = -(-(-(-29 // layout.replicas)) // 2) * 2
  report = verify.verify(plain_loss, optax.adam(0.05), layout, params,
                         [jaxdp.split_batch(data, layout.mesh, axis_name=axes, rows=rows)], rng=jax.random.key(1),
                         example_ids="id", accum_steps=2)
  assert not report.diverged and report.worst < 1e-12, str(report)
