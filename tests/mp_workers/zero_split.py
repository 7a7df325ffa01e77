"""Worker: ZeRO-3 with parameters split across processes, against a one-device reference on every process.

Usage: ``python -m jaxdp.launch --nproc 2 --devices-per-proc 2 -- zero_split.py``. ``w`` [8, 4] is split
over the 4 devices of 2 processes, so no process can read it whole; 3 Adam steps on uneven padded batches
(3/1/0/2 real rows), then the gathered parameters are compared with plain ``jax.grad`` and optax on the
concatenated real rows. Prints ``max |param - reference|`` and exits non-zero if it exceeds 1e-5.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp import distributed  # noqa: E402

COUNTS = (3, 1, 0, 2)


def loss_fn(params, batch):
  return jnp.sum((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2, axis=-1)


def main():
  distributed.initialize()
  mesh = jaxdp.data_mesh()
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(8, 4)).astype(np.float32), "b": np.zeros((4,), np.float32)}
  opt = optax.adam(0.05)
  state = jaxdp.init_state(params, opt, mesh, zero_stage=3)
  assert not state.params["w"].is_fully_addressable, state.params["w"].sharding
  step = jaxdp.make_train_step(loss_fn, opt, mesh, zero_stage=3)
  ref_params, ref_opt = params, opt.init(params)
  for k in range(3):
    r = np.random.default_rng(10 + k)
    portions = [{"x": r.normal(size=(n, 8)).astype(np.float32), "y": r.normal(size=(n, 4)).astype(np.float32)}
                for n in COUNTS]
    state, _ = step(state, *jaxdp.shard_uneven(portions, mesh))
    whole = jax.tree.map(lambda *a: np.concatenate(a), *portions)
    grads = jax.grad(lambda p: jnp.mean(loss_fn(p, whole)))(ref_params)
    updates, ref_opt = opt.update(grads, ref_opt, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
  got = jaxdp.gather_state(state).params  # collective: every process calls it
  diff = max(float(np.max(np.abs(np.asarray(got[k]) - np.asarray(ref_params[k])))) for k in ref_params)
  print(f"max |param - reference| = {diff:.3g}", flush=True)
  if not diff < 1e-5:
    raise SystemExit(f"ZeRO-3 across processes is off the reference by {diff}")


if __name__ == "__main__":
  main()
