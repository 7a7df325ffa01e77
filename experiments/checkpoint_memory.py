"""Peak host memory of saving and restoring a checkpoint, against the state's size and ``gather_state``.

Model state: an MLP of ``--layers`` square ``--width`` x ``--width`` float32
weights (default 4 x 2048 x 2048, plus biases) with Adam, at ZeRO stage 3 on 8
simulated CPU devices in one process. Each measurement runs in a fresh
subprocess, which builds the state, then measures one operation:

* ``gather_state``: ``jaxdp.gather_state(state)``, the whole state as numpy
  (what version 1 checkpoints did on every process before saving);
* ``save``: ``CheckpointManager.save`` (synchronous: the write is included),
  which hands orbax the sharded arrays and checksums them shard by shard;
* ``save async``: the same with asynchronous saving, up to ``wait()``;
* ``restore``: ``CheckpointManager.restore`` of that checkpoint onto stage 3.

Two numbers per operation:

* ``peak RSS +``: the process's peak resident memory during the operation
  (Linux ``VmHWM``, reset through ``/proc/self/clear_refs`` just before it)
  minus its resident memory just before it: everything, orbax's and
  tensorstore's C++ buffers included;
* ``numpy peak``: ``tracemalloc``'s peak of Python-visible allocations
  (numpy arrays) during the operation: whole-leaf host copies show here.

With 8 devices in one process every shard is this process's, so a save must
copy the whole state to the host once (orbax stages each shard before
writing it; on the CPU backend a device buffer already is host memory). The
column ``per process at 8 procs`` is what each of 8 processes (1 device
each) would own at stage 3: the save path copies only that much per
process, where ``gather_state`` needs the whole state on every process.

Measured (default size, 2-core CPU machine; state 192 MiB)::

  operation         peak RSS +  x state    numpy peak  x state  seconds
  gather_state         193 MiB     1.00       192 MiB     1.00     0.29
  save                  81 MiB     0.42        16 MiB     0.08     1.52
  save async            88 MiB     0.46        16 MiB     0.08     1.51
  restore              329 MiB     1.71       193 MiB     1.01     1.59

Saving allocates no whole-leaf numpy array (its numpy peak is the
checksum's bounded temporaries; on the CPU backend orbax's host copy of a
shard is the device buffer itself), so it stays well under the state's size
where ``gather_state`` needs all of it. Restoring's numpy peak is the
restored state itself: orbax reads each device's slice into a shard-sized
host buffer, which the CPU backend then uses as the device buffer; the rest
of its RSS is tensorstore's read and decompression buffers.

Run from the repository root (about 30 s on 2 cores)::

  .venv/bin/python experiments/checkpoint_memory.py
  .venv/bin/python experiments/checkpoint_memory.py --width 1024
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc

MIB = 2**20
OPERATIONS = ("gather_state", "save", "save async", "restore")


def _status(field: str) -> int:
  """A ``/proc/self/status`` size field in bytes (Linux), or -1."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return -1


def _reset_peak() -> bool:
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")  # resets VmHWM to the current RSS
    return True
  except OSError:
    return False


def _measure(operation: str, directory: str, width: int, layers: int) -> dict:
  """In a fresh process: builds the stage-3 state, runs ``operation`` once, returns its numbers."""
  import jax

  jax.config.update("jax_num_cpu_devices", 8)
  import numpy as np
  import optax

  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import jaxdp

  mesh = jaxdp.data_mesh()
  optimizer = optax.adam(1e-3)
  weight, bias = jax.ShapeDtypeStruct((width, width), np.float32), jax.ShapeDtypeStruct((width,), np.float32)
  params = {
      f"layer{i}": {"w": weight, "b": bias}
      for i in range(layers)
  }
  make = jax.jit(
      lambda: jax.tree.map(lambda s: jax.random.normal(jax.random.key(0), s.shape, s.dtype), params),
      out_shardings=jax.tree.map(lambda _: jaxdp.layout.replicated(mesh), params),
  )
  # Moments filled too (as after training), so the saved data is not trivially compressible.
  abstract = jaxdp.layout.abstract_state(params, optimizer)
  layout = jaxdp.layout.make_layout(abstract, jaxdp.auto_mesh(mesh), "data", 3)
  fill = jax.jit(
      lambda p: jaxdp.TrainState.create(p, optimizer)._replace(
          opt_state=jax.tree.map(lambda x: x + 1 if x.ndim else x, optimizer.init(p))
      ),
      out_shardings=layout.shardings(jaxdp.auto_mesh(mesh)),
  )
  state = fill(make())
  jax.block_until_ready(state)
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  per_device = max(
      sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards if s.device == d)
      for d in mesh.devices.flat
  )
  ckpt = os.path.join(directory, "ckpt")

  def run():
    if operation == "gather_state":
      return jaxdp.gather_state(state)
    if operation.startswith("save"):
      shutil.rmtree(ckpt, ignore_errors=True)
      with jaxdp.CheckpointManager(ckpt, enable_async_checkpointing=operation == "save async") as manager:
        manager.save(1, state)
        manager.wait()
      return None
    with jaxdp.CheckpointManager(ckpt) as manager:
      restored = manager.restore(params=params, optimizer=optimizer, mesh=mesh, zero_stage=3)
      jax.block_until_ready(restored.state)
      return restored

  rss_before = _status("VmRSS")
  exact = _reset_peak()
  maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  tracemalloc.start()
  start = time.perf_counter()
  result = run()
  seconds = time.perf_counter() - start
  _, numpy_peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  peak = _status("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  del result
  return {
      "operation": operation,
      "state_bytes": state_bytes,
      "per_device_bytes": per_device,
      "peak_rss_increase": peak - (rss_before if exact else maxrss_before),
      "numpy_peak": numpy_peak,
      "seconds": seconds,
      "exact_peak": exact,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--width", type=int, default=2048)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child is not None:
    print(json.dumps(_measure(args.child, args.dir, args.width, args.layers)))
    return

  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env["JAX_PLATFORMS"] = "cpu"
  rows = []
  with tempfile.TemporaryDirectory() as directory:
    for operation in OPERATIONS:  # "restore" reads what the last save wrote
      out = subprocess.run(
          [sys.executable, os.path.abspath(__file__), "--child", operation, "--dir", directory,
           "--width", str(args.width), "--layers", str(args.layers)],
          env=env, capture_output=True, text=True, check=False,
      )
      if out.returncode:
        sys.exit(f"{operation} failed:\n{out.stderr[-4000:]}")
      rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
  state = rows[0]["state_bytes"]
  print(f"state: {args.layers} x ({args.width} x {args.width} + {args.width}) float32 params with Adam, ZeRO stage 3, "
        f"8 CPU devices, 1 process; state {state / MIB:.0f} MiB, per process at 8 procs "
        f"{rows[0]['per_device_bytes'] / MIB:.0f} MiB")
  print(f"{'operation':<14}{'peak RSS +':>14}{'x state':>9}{'numpy peak':>14}{'x state':>9}{'seconds':>9}")
  for r in rows:
    print(f"{r['operation']:<14}{r['peak_rss_increase'] / MIB:>10.0f} MiB{r['peak_rss_increase'] / state:>9.2f}"
          f"{r['numpy_peak'] / MIB:>10.0f} MiB{r['numpy_peak'] / state:>9.2f}{r['seconds']:>9.2f}")
  if not all(r["exact_peak"] for r in rows):
    print("(no /proc/self/clear_refs: peak RSS + is the growth of ru_maxrss, a lower bound)")


if __name__ == "__main__":
  main()
