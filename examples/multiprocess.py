"""Data-parallel training across processes, started by jaxdp's launcher.

  python -m jaxdp.launch --nproc 2 --devices-per-proc 2 -- examples/multiprocess.py [--steps 20]

Two processes with two (simulated CPU) devices each form one 4-device data
axis; the launcher prefixes their output with ``[rank i]``. The same script
on a cluster runs under ``srun`` (SLURM) or ``mpirun``, and alone as one
process on its local devices. Every process builds the same global list of
uneven per-device batches; each places only its own devices' portions. The
result is compared with plain full-batch gradient descent in numpy.
"""

import argparse
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "4")  # alone; under the launcher initialize() sets the count

import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdp  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

info = jaxdp.runtime.distributed.initialize()  # joins the launcher's job; alone it does nothing
mesh, lr = jaxdp.data_mesh(), 0.1      # every device of every process on one "data" axis
n = mesh.devices.size

rng = np.random.default_rng(0)         # the same seed on every process: the same global data
true_w = rng.normal(size=(4,)).astype(np.float32)
sizes = [1 + 2 * i for i in range(n)]  # uneven examples per device: 1, 3, 5, 7
portions = []
for size in sizes:
  x = rng.normal(size=(size, 4)).astype(np.float32)
  portions.append({"x": x, "y": x @ true_w})


def loss_fn(params, batch):
  return 0.5 * (batch["x"] @ params["w"] - batch["y"]) ** 2  # per example [b]


opt = optax.sgd(lr)
state = jaxdp.init_state({"w": np.zeros(4, np.float32)}, opt, mesh)
step = jaxdp.make_train_step(loss_fn, opt, mesh)
batch, weights = jaxdp.shard_uneven(portions, mesh)  # places this process's devices' portions only
for i in range(args.steps):
  state, metrics = step(state, batch, weights)
  if info.process_index == 0 and (i == 0 or i + 1 == args.steps):
    print(f"step {i + 1}: loss {float(metrics['loss']):.6f}", flush=True)

# The reference: gradient descent on the whole batch, one process, numpy.
x = np.concatenate([p["x"] for p in portions])
y = np.concatenate([p["y"] for p in portions])
w = np.zeros(4, np.float32)
for _ in range(args.steps):
  w = w - lr * x.T @ (x @ w - y) / len(y)
ours = np.asarray(state.params["w"].addressable_data(0))  # replicated: this process's copy
if info.process_index == 0:
  print(f"{info.process_count} process(es), {n} devices, examples per device {sizes}: largest difference "
        f"to one-process full-batch gradient descent {np.max(np.abs(ours - w)):.1e}", flush=True)
