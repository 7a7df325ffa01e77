# A linear model trained data-parallel on 100 rows, uneven over the devices (README.md shows this file).
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # simulated devices on CPU; set before JAX starts

import jax, jax.numpy as jnp, numpy as np, optax, jaxdp

def loss_fn(params, batch):  # per-example losses [b]; jaxdp takes their exact weighted mean
  return 0.5 * (batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2

rng = np.random.default_rng(0)
x = rng.normal(size=(100, 3)).astype(np.float32)  # 100 rows: uneven over 8 devices (13 or 12 each)
data = {"x": x, "y": x @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3}

mesh = jaxdp.data_mesh()  # every device on one "data" axis
opt = optax.sgd(0.1)
state = jaxdp.init_state({"w": jnp.zeros(3), "b": jnp.zeros(())}, opt, mesh)
step = jaxdp.make_train_step(loss_fn, opt, mesh)  # jitted shard_map; the state is donated
evaluate = jaxdp.make_eval_step(loss_fn, mesh)

batch, weights = jaxdp.split_batch(data, mesh)  # padding rows get weight 0
for _ in range(100):
  state, metrics = step(state, batch, weights)

print(f"{mesh.devices.size} devices, loss {float(metrics['loss']):.2e}")
print("w =", np.round(np.asarray(state.params["w"]), 3), "b =", round(float(state.params["b"]), 3))
print("eval:", {k: float(v) for k, v in evaluate(state, batch, weights).items()})  # exact loss over the 100 rows
assert np.allclose(state.params["w"], [1.0, -2.0, 0.5], atol=1e-2)
