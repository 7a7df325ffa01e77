"""Peak host memory of saving and restoring a checkpoint, against the state's size and ``gather_state``.

Model state: an MLP of ``--layers`` square ``--width`` x ``--width`` float32
weights (default 4 x 2048 x 2048, plus biases) with Adam, at ZeRO stage 3 on 8
simulated CPU devices (one process unless ``--processes``). Each measurement runs in a fresh
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

``--processes P`` runs each measurement as a ``jax.distributed`` job of P
processes on localhost with 8/P devices each, and reports the worst
process; ``x own`` is against what each process holds (state / P). With one
process every shard is this process's, so a save must copy the whole state
to the host once (orbax stages each shard before writing it).

Measured (default size, 2-core CPU machine; state 192 MiB; worst process)::

  processes  held    gather_state    save    save async   restore
  1         192 MiB   193 MiB        74 MiB    73 MiB      276 MiB
  2          96 MiB   309 MiB        49 MiB    46 MiB      174 MiB
  4          48 MiB   261 MiB        32 MiB    32 MiB      113 MiB

Saving allocates no whole-leaf numpy array (its numpy peak, 16 MiB, is the
checksum's bounded temporaries) and its peak falls with the process count:
0.38, 0.51 and 0.67 of each process's share (a fixed part of tensorstore's
and the checksum's buffers stays), where ``gather_state`` needs the whole
state on every process (more than the state with several processes: the
cross-process gather's buffers). Restoring's peak is the restored share
itself (orbax reads each device's slice into a shard-sized host buffer,
which the CPU backend then uses as the device buffer) plus about 65-85 MiB
of tensorstore's read buffers.

Run from the repository root (about 40 s with one process, 60 s with 2 or 4)::

  .venv/bin/python experiments/checkpoint_memory.py
  .venv/bin/python experiments/checkpoint_memory.py --processes 2
  .venv/bin/python experiments/checkpoint_memory.py --width 1024
  .venv/bin/python experiments/checkpoint_memory.py --quick    # width 512 (4 MiB of params)

--quick: about 11 s on an idle 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
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
DEVICES = 8
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


def _trim() -> None:
  """Returns freed heap to the system (glibc), so that the RSS before an operation is what is live."""
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    pass


def _reset_peak() -> bool:
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")  # resets VmHWM to the current RSS
    return True
  except OSError:
    return False


def _measure(operation: str, directory: str, width: int, layers: int, job: tuple | None = None) -> dict:
  """In a fresh process: builds the stage-3 state, runs ``operation`` once, returns its numbers.

  ``job`` is ``(coordinator, processes, process_id)`` to run as one process of
  a ``jax.distributed`` job on localhost, each with ``8 / processes`` devices.
  """
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import jaxdp

  if job is None:
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES)
  else:
    coordinator, processes, process_id = job
    jaxdp.runtime.distributed.initialize(coordinator, processes, process_id, num_cpu_devices=DEVICES // processes)
    import jax
  import numpy as np
  import optax

  mesh = jaxdp.data_mesh()
  optimizer = optax.adam(1e-3)
  weight, bias = jax.ShapeDtypeStruct((width, width), np.float32), jax.ShapeDtypeStruct((width,), np.float32)
  params = {
      f"layer{i}": {"w": weight, "b": bias}
      for i in range(layers)
  }
  # Made in place at stage 3 (no replicated transient that the allocator would keep and reuse, hiding growth).
  abstract = jaxdp.sharding.layout.abstract_state(params, optimizer)
  layout = jaxdp.sharding.layout.make_layout(abstract, jaxdp.sharding.layout.auto_mesh(mesh), "data", 3)
  make = jax.jit(
      lambda: jax.tree.map(lambda s: jax.random.normal(jax.random.key(0), s.shape, s.dtype), params),
      out_shardings=layout.shardings(jaxdp.sharding.layout.auto_mesh(mesh)).params,
  )
  # Moments filled too (as after training), so the saved data is not trivially compressible.
  fill = jax.jit(
      lambda p: jaxdp.TrainState.create(p, optimizer)._replace(
          opt_state=jax.tree.map(lambda x: x + 1 if x.ndim else x, optimizer.init(p))
      ),
      out_shardings=layout.shardings(jaxdp.sharding.layout.auto_mesh(mesh)),
  )
  state = fill(make())
  jax.block_until_ready(state)
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  per_device = max(
      sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards if s.device == d)
      for d in jax.local_devices()
  )
  own = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards)
  ckpt = os.path.join(directory, "ckpt")

  def run():
    if operation == "gather_state":
      return jaxdp.gather_state(state)
    if operation.startswith("save"):
      with jaxdp.CheckpointManager(ckpt, enable_async_checkpointing=operation == "save async") as manager:
        manager.save(1, state)
        manager.wait()
      return None
    with jaxdp.CheckpointManager(ckpt) as manager:
      restored = manager.restore(params=params, optimizer=optimizer, layout=jaxdp.data_parallel(mesh, zero_stage=3))
      jax.block_until_ready(restored.state)
      return restored

  gc.collect()
  _trim()
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
      "process_bytes": own,
      "peak_rss_increase": peak - (rss_before if exact else maxrss_before),
      "numpy_peak": numpy_peak,
      "seconds": seconds,
      "exact_peak": exact,
  }


def measure(width: int = 2048, layers: int = 4, processes: int = 1) -> list[dict]:
  """One row per operation of :data:`OPERATIONS`, each measured in fresh processes (the worst process)."""
  args = argparse.Namespace(width=width, layers=layers, processes=processes)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env["JAX_PLATFORMS"] = "cpu"
  with tempfile.TemporaryDirectory() as directory:
    return [_run_children(operation, directory, args, env) for operation in OPERATIONS]  # restore reads the last save


def _run_children(operation: str, directory: str, args, env) -> dict:
  """``operation`` in fresh processes (one, or a ``jax.distributed`` job of ``--processes``); the worst process."""
  print(f"[checkpoint {operation}] {args.processes} fresh process(es)", file=sys.stderr, flush=True)
  if operation.startswith("save"):
    shutil.rmtree(os.path.join(directory, "ckpt"), ignore_errors=True)
  command = [sys.executable, os.path.abspath(__file__), "--child", operation, "--dir", directory,
             "--width", str(args.width), "--layers", str(args.layers)]
  if args.processes > 1:
    from jaxdp.runtime.launch import free_port

    coordinator = f"127.0.0.1:{free_port()}"
    commands = [command + ["--job", f"{coordinator},{args.processes},{i}"] for i in range(args.processes)]
  else:
    commands = [command]
  children = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
  rows = []
  for child in children:
    out, err = child.communicate(timeout=600)
    if child.returncode:
      for other in children:
        other.kill()
      sys.exit(f"{operation} failed:\n{err[-4000:]}")
    rows.append(json.loads(out.strip().splitlines()[-1]))
  worst = max(rows, key=lambda r: r["peak_rss_increase"])
  return {**worst, "numpy_peak": max(r["numpy_peak"] for r in rows), "seconds": max(r["seconds"] for r in rows),
          "exact_peak": all(r["exact_peak"] for r in rows)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="smoke run: --width 512 unless given")
  parser.add_argument("--width", type=int, default=None, help="width of each square layer (default 2048; 512 with --quick)")
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--processes", type=int, default=1, choices=(1, 2, 4, 8),
                      help="a jax.distributed job of this many processes on localhost, 8/P devices each")
  parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--job", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  args.width = args.width or (512 if args.quick else 2048)
  if args.child is not None:
    job = None
    if args.job:
      coordinator, processes, process_id = args.job.split(",")
      job = (coordinator, int(processes), int(process_id))
    print(json.dumps(_measure(args.child, args.dir, args.width, args.layers, job)))
    return

  rows = measure(args.width, args.layers, args.processes)
  state, own = rows[0]["state_bytes"], rows[0]["process_bytes"]
  print(f"state: {args.layers} x ({args.width} x {args.width} + {args.width}) float32 params with Adam, ZeRO stage 3, "
        f"{DEVICES} CPU devices, {args.processes} process(es); state {state / MIB:.0f} MiB, held by each process "
        f"{own / MIB:.0f} MiB (state / processes)")
  print(f"{'operation':<14}{'peak RSS +':>14}{'x state':>9}{'x own':>8}{'numpy peak':>14}{'x state':>9}{'seconds':>9}")
  for r in rows:
    print(f"{r['operation']:<14}{r['peak_rss_increase'] / MIB:>10.0f} MiB{r['peak_rss_increase'] / state:>9.2f}"
          f"{r['peak_rss_increase'] / own:>8.2f}{r['numpy_peak'] / MIB:>10.0f} MiB{r['numpy_peak'] / state:>9.2f}"
          f"{r['seconds']:>9.2f}")
  if args.processes > 1:
    print("(the worst process of the job; peak RSS + is that process's own growth)")
  if not all(r["exact_peak"] for r in rows):
    print("(no /proc/self/clear_refs: peak RSS + is the growth of ru_maxrss, a lower bound)")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"processes": args.processes, "devices": DEVICES, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
