"""The precision policy with every data-parallel layout, against one device with the same policy.

Each case turns on several features at once (a layout, a ZeRO stage, accumulation, a 16-bit compute or reduction
dtype, float16 with dynamic loss scaling, jaxdp's BatchNorm and layout-invariant dropout) and runs the verifier
(float64 master state, teacher-forced) against one device running the same policy. A 16-bit policy is not exact:
the devices' partial sums are rounded where one device rounds the whole batch's, so the tolerance is the policy's
own round-off (a few units of bfloat16's 2**-8, float16's 2**-11), stated per case. A real layout error is larger:
a planted one, `reductions.rank_mean()` on the uneven rows (a device of padding only), must exceed each
tolerance, so the tolerance tells the two apart. docs/guarantees.md's composition table names these cases.
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

ROWS = 37  # over 4 or 8 devices: uneven
# Example weights by quarter of the batch, the last quarter 0 (rows that count as padding): each device's
# weighted mean is far from the global one, so the rank-mean is far from it too.
WEIGHTS = np.select([np.arange(ROWS) < 10, np.arange(ROWS) < 19, np.arange(ROWS) < 28], [4.0, 1.0, 0.25],
                    0.0).astype(np.float32)


class Net(nn.Module):
  batchnorm: bool = True

  @nn.compact
  def __call__(self, x, train, mask=None):
    h = nn.Dense(8)(x)
    if self.batchnorm:
      h = jaxdp.adapters.linen.BatchNorm(use_running_average=not train)(h, mask=mask)
    h = jaxdp.adapters.linen.Dropout(0.25, deterministic=not train)(nn.relu(h))
    return nn.Dense(2)(h)


def make_loss(model):
  def loss_fn(params, batch, rng=None, *, model_state=None, weights=None, train=True):
    variables = {"params": params} if model_state is None else {"params": params, "batch_stats": model_state}
    out = model.apply(variables, batch["x"], train, mask=weights, rngs={"dropout": rng} if rng is not None else {},
                      mutable=["batch_stats"] if model_state is not None else False)
    if model_state is None:
      return jnp.sum((out - batch["y"].astype(out.dtype)) ** 2, axis=-1)
    out, updates = out
    return jaxdp.LossOutput(jnp.sum((out - batch["y"].astype(out.dtype)) ** 2, axis=-1),
                            model_state=updates["batch_stats"])
  return loss_fn


TP_SPECS = {"Dense_0": {"kernel": P(None, "model"), "bias": P("model")}, "Dense_1": {"kernel": P("model", None),
                                                                                   "bias": P()}}
BF16, F16 = jnp.bfloat16, jnp.float16
# Round-off allowed, relative to each part's largest magnitude: bfloat16 carries 8 significant bits, float16 11.
TOL = {"bf16": 3e-2, "f16": 5e-3, "reduce": 1e-2}

CASES = {
    # name: (mesh shape, axis names, data axes, zero stage, tensor-parallel, accum_steps, BatchNorm, policy, tol)
    "hybrid x ZeRO-3 x bf16 compute": ((2, 4), ("replica", "data"), ("replica", "data"), 3, False, 1, True,
                                       dict(compute_dtype=BF16), "bf16"),
    "tensor parallel x ZeRO-1 x bf16 compute": ((4, 2), ("data", "model"), "data", 1, True, 1, True,
                                                dict(compute_dtype=BF16), "bf16"),
    "ZeRO-2 x bf16 compute and reduction": ((4,), ("data",), "data", 2, False, 1, True,
                                            dict(compute_dtype=BF16, reduce_dtype=BF16), "bf16"),
    "hybrid x ZeRO-2 x bf16 reduction": ((2, 4), ("replica", "data"), ("replica", "data"), 2, False, 1, True,
                                         dict(reduce_dtype=BF16), "reduce"),
    "ZeRO-1 x bf16 reduction": ((4,), ("data",), "data", 1, False, 1, True, dict(reduce_dtype=BF16), "reduce"),
    "ZeRO-3 x bf16 reduction": ((4,), ("data",), "data", 3, False, 1, True, dict(reduce_dtype=BF16), "reduce"),
    "accumulation x bf16 compute and reduction": ((4,), ("data",), "data", 0, False, 2, False,
                                                  dict(compute_dtype=BF16, reduce_dtype=BF16), "bf16"),
    "hybrid x ZeRO-2 x float16 loss scaling": ((2, 4), ("replica", "data"), ("replica", "data"), 2, False, 1, True,
                                               dict(compute_dtype=F16, loss_scaling="dynamic"), "f16"),
    "ZeRO-3 x float16 loss scaling x bf16 reduction": ((4,), ("data",), "data", 3, False, 1, True,
                                                       dict(compute_dtype=F16, reduce_dtype=BF16,
                                                            loss_scaling="dynamic"), "bf16"),
    "tensor parallel x float16 loss scaling": ((4, 2), ("data", "model"), "data", 0, True, 1, True,
                                               dict(compute_dtype=F16, loss_scaling="dynamic"), "f16"),
    # On CPU the bfloat16 sums with the model axis left to the compiler run in float32 and are rounded, as XLA's
    # CPU backend runs its own (jaxdp.core.precision.summed_in).
    "tensor parallel x ZeRO-2 x bf16 reduction": ((4, 2), ("data", "model"), "data", 2, True, 1, True,
                                                  dict(reduce_dtype=BF16), "reduce"),
}


def _mesh(shape, names):
  devices = np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def _verify(case, reduction=None):
  shape, names, axes, stage, tp, accum, batchnorm, policy, tol = CASES[case]
  model = Net(batchnorm=batchnorm)
  specs = None
  if tp:
    specs = dict(TP_SPECS, **({"BatchNorm_0": {"scale": P(), "bias": P()}} if batchnorm else {}))
  layout = jaxdp.data_parallel(_mesh(shape, names), axis_name=axes, zero_stage=stage, param_specs=specs)
  policy = dict(policy)
  if policy.get("loss_scaling") == "dynamic":
    # torch's first scale, 2**16, overflows float16 on the first step (skipped on both sides: nothing compared).
    policy["loss_scaling"] = jaxdp.dynamic_loss_scale(init_scale=2.0**8)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(ROWS, 4)).astype(np.float32)
  data = {"x": x, "y": rng.normal(size=(ROWS, 2)).astype(np.float32), "id": np.arange(ROWS, dtype=np.int32)}
  variables = model.init(jax.random.key(0), x[:1], False)
  per_device = -(-ROWS // layout.replicas)
  rows = -(-per_device // accum) * accum  # a device's rows divide into accum_steps micro-batches
  batches = [jaxdp.split_batch(data, layout.mesh, axis_name=axes, rows=rows, weights=WEIGHTS)]
  report = verify.verify(make_loss(model), optax.adam(0.05), layout, variables["params"], batches,
                         model_state=variables.get("batch_stats"), rng=jax.random.key(1), example_ids="id",
                         accum_steps=accum, precision=jaxdp.precision(**policy), reduction=reduction,
                         rtol=TOL[tol])
  return report, TOL[tol]


@pytest.mark.parametrize("case", CASES)
def test_a_precision_policy_on_a_layout_is_one_devices_up_to_its_round_off(case):
  report, _ = _verify(case)
  assert not report.diverged, str(report)
  # 16-bit rounding on uneven devices is never bit-identical to one device's: exactly 0 would mean nothing was
  # compared (a step skipped on both sides, as float16 at too large a loss scale would be).
  assert report.worst > 0, str(report)


# One case per tolerance: the planted layout error (the rank-mean on uneven rows) is well past it, so the
# tolerance tells round-off from a layout error (measured: 20-130 times the tolerance).
@pytest.mark.parametrize("case", ["tensor parallel x ZeRO-1 x bf16 compute", "ZeRO-1 x bf16 reduction",
                                  "hybrid x ZeRO-2 x float16 loss scaling"])
def test_the_round_off_tolerance_still_catches_a_layout_error(case):
  planted, tol = _verify(case, jaxdp.reductions.rank_mean())
  assert planted.diverged and planted.worst > 3 * tol, str(planted)
