"""One benchmark suite: jaxdp against the bare shard_map step, automatic partitioning and PyTorch DDP.

Two workloads, each at 1, 2, 4 and 8 devices (sub-meshes over
``jax.devices()[:N]``):

* ``mlp``: MLP 784-1024-1024-10 (ReLU, 1.86M params), softmax cross-entropy,
  Adam (lr 1e-3), global batch 512 (``experiments/common.py``);
* ``lm``: the ``experiments/train_lm.py`` transformer at its default sizes
  (2 layers, d_model 64, 4 heads, d_ff 256), its AdamW schedule, dropout 0,
  a global batch of 32 full sequences of 64 bytes of the standard library.

Methods, all on the same initial parameters, batch and split:

* ``jaxdp``: ``jaxdp.make_train_step(loss_fn, opt, mesh)`` (shard_map, state
  donated, validation, metrics, the skip of non-finite steps), called as
  ``step(state, batch)``; ``jaxdp_pmap``: the layout
  ``jaxdp.data_parallel(mesh, backend="pmap")``; ``jaxdp_zero1..3``: the
  layout ``jaxdp.data_parallel(mesh, zero_stage=s)`` for the step and
  ``jaxdp.init_state``; ``jaxdp_buckets``, ``jaxdp_zero1_buckets`` ..
  ``jaxdp_zero3_buckets``: the same with
  ``reduction=jaxdp.reductions.bucketed(25 MiB)`` (the gradient all-reduced in flat
  buckets; at stages 1-3 one parameter gather, and at stages 2-3 one
  reduce-scatter, per bucket of flat slices instead of one per larger leaf
  and one for the leaves of up to 256 KiB);
* ``bare``: the step a JAX expert writes by hand: ``jit(shard_map)`` over an
  Auto mesh, grad of the local mean loss with respect to
  ``lax.pcast(params, "data", to="varying")``, ``psum`` of the gradients,
  divided by N, optax update; no weights, checks or metrics; state donated;
* ``auto_jit``: plain ``jax.jit`` of the one-device step on a batch sharded
  over the mesh (XLA's automatic partitioning), state donated;
* ``single``: the one-device step on the whole batch;
* ``ddp`` (MLP only): PyTorch ``DistributedDataParallel``, N processes on
  localhost (gloo on CPU, NCCL with one GPU per process), ``nn.Linear``
  layers holding the JAX initial parameters, each process on its slice of
  the same batch, ``torch.optim.Adam`` with the same hyper-parameters.
  Needs ``pip install -e .[bench]``; without PyTorch these rows are skipped.

The methods run interleaved step by step, in a new order each round
(``common.time_interleaved``); steps are chained, each donating its state
where the method donates. A JAX step is timed from its call to
``block_until_ready`` of its new state; a
DDP step on each process from a barrier to the end of ``optimizer.step()``
(the slowest process counts), so neither includes the other's host
messaging. Reported: median and p10–p90 over the timed steps, and ratios
to jaxdp computed within the run.

Cores. On CPU, jaxdp, the bare step and auto-jit run in this one process:
XLA's thread pool has one thread per core and all simulated devices share
it. Each of DDP's N processes gets ``torch.set_num_threads(max(1, cores // N))``
(``OMP_NUM_THREADS`` too), so both use every core and, up to
``N > cores``, no more.

Numerics: one Adam step from the same initial parameters on uneven
per-rank batches (3, 5, 1 and 7 examples): PyTorch DDP (each rank's mean
loss, gradients averaged over ranks) against jaxdp
``reduction=jaxdp.reductions.rank_mean()``, and PyTorch on the concatenated
batch in one process against jaxdp ``mean()``; with JAX-only references of
both rules.

Run from the repository root (sets ``JAX_NUM_CPU_DEVICES=8`` itself; writes
``results.json``, ``benchmarks.md`` and the plots under ``--out``;
``--publish`` also copies them to ``docs/data/benchmark/report.md``,
``docs/benchmark_*.png`` and ``docs/data/benchmark/results.json``; the
hand-written guide ``docs/benchmarks.md`` quotes that data and is not
rewritten):

  .venv/bin/python experiments/benchmark.py            # full: 1,2,4,8 devices, 30 steps
  .venv/bin/python experiments/benchmark.py --quick    # smoke: 2 devices, 5 steps, numerics on 2 ranks
  .venv/bin/python experiments/benchmark.py --publish  # full, and refresh the committed docs

--quick: about 59 s on an idle 2-core CPU machine.
  .venv/bin/python experiments/benchmark.py --models mlp --devices 2,8 --no-torch
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import sys
import textwrap
import time
from typing import Any, Callable

if __name__ == "__main__":  # must happen before JAX initialises its backend
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
  # On a GPU, leave memory to the PyTorch processes that share it.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxdp  # noqa: E402
from experiments import common  # noqa: E402

METHODS = ("jaxdp", "jaxdp_pmap", "jaxdp_zero1", "jaxdp_zero2", "jaxdp_zero3", "jaxdp_buckets",
           "jaxdp_zero1_buckets", "jaxdp_zero2_buckets", "jaxdp_zero3_buckets", "bare", "auto_jit", "single", "ddp")
LABELS = {
    "jaxdp": "jaxdp shard_map", "jaxdp_pmap": "jaxdp pmap", "jaxdp_zero1": "jaxdp ZeRO-1",
    "jaxdp_zero2": "jaxdp ZeRO-2", "jaxdp_zero3": "jaxdp ZeRO-3", "jaxdp_buckets": "jaxdp, 25 MB buckets",
    "jaxdp_zero1_buckets": "ZeRO-1, 25 MB buckets",
    "jaxdp_zero2_buckets": "ZeRO-2, 25 MB buckets",
    "jaxdp_zero3_buckets": "ZeRO-3, 25 MB buckets", "bare": "bare shard_map",
    "auto_jit": "auto-partitioned jit", "single": "1 device, whole batch", "ddp": "PyTorch DDP",
}
ZERO_METHODS = {0: "jaxdp", 1: "jaxdp_zero1", 2: "jaxdp_zero2", 3: "jaxdp_zero3"}
BUCKETED_METHODS = {0: "jaxdp_buckets", 1: "jaxdp_zero1_buckets", 2: "jaxdp_zero2_buckets", 3: "jaxdp_zero3_buckets"}
RATIOS = ("bare", "auto_jit", "ddp", "single")  # jaxdp ÷ each of these
UNEVEN = (3, 5, 1, 7)  # examples per rank in the numerics comparison
MIB = 2**20

FULL = {"devices": "1,2,4,8", "steps": 30, "warmup": 3, "ranks": len(UNEVEN)}
QUICK = {"devices": "2", "steps": 5, "warmup": 1, "ranks": 2}


# --------------------------------------------------------------------------
# Workloads.
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Workload:
  """A model, its loss, optimizer and global batch, the same for every method."""

  name: str
  title: str
  params: Any  # numpy leaves: every method copies them into buffers of its own
  loss_fn: Callable[[Any, dict], jax.Array]  # per-example [b] or per-token [b, t] losses
  optimizer: optax.GradientTransformation
  batch: dict  # the global batch, numpy
  unit: str  # what throughput counts: "examples" or "tokens"
  units_per_step: int
  short: str = ""  # plot title
  lr: float | None = None  # the Adam learning rate PyTorch reproduces (MLP only)


def mlp_workload(batch_size: int = 512, lr: float = 1e-3) -> Workload:
  """The benchmark MLP with Adam on a random batch (fixed seeds)."""
  return Workload(
      name="mlp", title=f"MLP {'-'.join(map(str, common.MLP_LAYERS))}, Adam, global batch {batch_size}",
      params=common.host_copy(common.mlp_params()), loss_fn=common.mlp_loss, optimizer=optax.adam(lr),
      batch=common.mlp_batch(common.MLP_LAYERS, batch_size), unit="examples", units_per_step=batch_size, lr=lr,
      short=f"MLP, Adam, batch {batch_size}",
  )


def lm_batch(seq_len: int, rows: int, seed: int = 0) -> dict:
  """``rows`` full-length next-byte chunks of the standard library (no padding, so no weights are needed)."""
  from experiments.lm import corpus

  chunks = corpus.chunk_documents(corpus.read_documents(None, 400_000), seq_len)
  full = [c for c in chunks if len(c) == seq_len + 1]
  picked = np.random.default_rng(seed).choice(len(full), rows, replace=False)
  batch, _ = corpus.make_collate(seq_len)([full[i] for i in sorted(picked)])
  return batch


def lm_token_losses(definition) -> Callable[[Any, dict], jax.Array]:
  """Per-token cross-entropy ``[b, t]`` of the transformer (no dropout, no metrics: the same for every method)."""

  def losses(params, batch):
    model = jaxdp.adapters.nnx.merge(definition, params)
    logits_BxTxV = model(batch["inputs"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, batch["targets"])

  return losses


def lm_workload(batch_size: int = 32) -> Workload:
  """``train_lm``'s transformer at its default sizes and optimizer, dropout 0."""
  from experiments import train_lm

  config = train_lm.Config(batch_size=batch_size, dropout=0.0, progress=False, out=None)
  definition, params = train_lm.make_model(config)
  return Workload(
      name="lm", title=(f"train_lm transformer ({config.layers} layers, d_model {config.d_model}), AdamW, "
                        f"global batch {batch_size} × {config.seq_len} bytes"),
      params=common.host_copy(params), loss_fn=lm_token_losses(definition), optimizer=train_lm.make_optimizer(config),
      batch=lm_batch(config.seq_len, batch_size), unit="tokens", units_per_step=batch_size * config.seq_len,
      short=f"train_lm transformer, AdamW, batch {batch_size} × {config.seq_len}",
  )


# --------------------------------------------------------------------------
# The JAX methods.
# --------------------------------------------------------------------------


class Case:
  """One method at one device count: ``advance(state) -> state`` and the state it chains.

  ``lower(state)``, where given, lowers the step for that state (to read its compiled HLO).
  """

  def __init__(self, advance: Callable[[Any], Any], state: Any, params_of: Callable[[Any], Any],
               lower: Callable[[Any], Any] | None = None):
    self.advance, self.state, self.params_of, self.lower = advance, state, params_of, lower
    self.memory: dict | None = None

  def __call__(self) -> None:
    self.state = self.advance(self.state)
    jax.block_until_ready(self.state)

  def params(self):
    """The current parameters as numpy arrays, full shapes."""
    return self.params_of(self.state)


def _split(mesh: Mesh, tree):
  return jax.device_put(tree, NamedSharding(mesh, P("data")))


def _replicate(mesh: Mesh, tree):
  return jax.device_put(tree, NamedSharding(mesh, P()))


def auto_mesh(devices) -> Mesh:
  """A 1-D ``data`` mesh, axis type Auto: what the bare step and auto-jit use."""
  return Mesh(np.asarray(devices), ("data",), axis_types=(AxisType.Auto,))


def jaxdp_case(w: Workload, devices, backend: str = "shard_map", zero_stage: int = 0, memory: bool = False,
               bucket_bytes: int | None = None) -> Case:
  """``jaxdp.make_train_step`` as a user calls it on an even batch: ``step(state, batch)``."""
  mesh = jaxdp.data_mesh(devices)
  dp = jaxdp.data_parallel(mesh, zero_stage=zero_stage, backend=backend)
  reduction = None if bucket_bytes is None else jaxdp.reductions.bucketed(bucket_bytes)
  step = jaxdp.make_train_step(w.loss_fn, w.optimizer, dp, reduction=reduction)
  batch = _split(mesh, w.batch)
  state = jaxdp.init_state(common.host_copy(w.params), w.optimizer, dp)
  case = Case(lambda s: step(s, batch)[0], state, lambda s: jaxdp.gather_state(s).params,
              lambda s: step.lower(s, batch))
  if memory:
    case.memory = jaxdp.memory_report(step, state, batch)._asdict()
    case.memory["model_state"] = case.memory.pop("training_state")  # results.json keeps 0.1's field name
  return case


def bare_step(w: Workload, mesh: Mesh, skip_nonfinite: bool = False):
  """The hand-written data-parallel step: local grad, one psum per leaf, / N, optax update.

  ``skip_nonfinite`` (a reference for ``experiments/step_cost.py``, not a benchmark method): the update
  under ``lax.cond``, skipped when the summed loss is not finite. The division by N happens inside the
  branch, in the update's own pass, as jaxdp's does: divided before the ``cond``, the quotient would be
  written out as a pass of its own (the branch's fusions cannot reach across the conditional).
  """
  n = mesh.shape["data"]

  def update(operand):
    params, opt_state, sums = operand
    updates, opt_state = w.optimizer.update(jax.tree.map(lambda g: g / n, sums), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def replica(params, opt_state, batch):
    # Differentiating the replicated params would give gradients already summed over devices (the
    # transpose of their implicit broadcast); the varying copy gives the local gradient to psum once.
    local = lax.pcast(params, "data", to="varying")
    loss, grads = jax.value_and_grad(lambda p: jnp.mean(w.loss_fn(p, batch)))(local)
    sums = jax.tree.map(lambda g: lax.psum(g, "data"), grads)
    if not skip_nonfinite:
      return update((params, opt_state, sums))
    keep = lambda operand: operand[:2]  # noqa: E731
    return lax.cond(jnp.isfinite(lax.psum(loss, "data")), update, keep, (params, opt_state, sums))

  mapped = jax.shard_map(replica, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()))
  return jax.jit(mapped, donate_argnums=(0, 1))


def plain_step(w: Workload):
  """The one-device step: grad of the mean loss, optax update. Under a sharded batch XLA partitions it."""

  def step(params, opt_state, batch):
    grads = jax.grad(lambda p: jnp.mean(w.loss_fn(p, batch)))(params)
    updates, opt_state = w.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.jit(step, donate_argnums=(0, 1))


def plain_case(w: Workload, mesh: Mesh, step) -> Case:
  """``step(params, opt_state, batch)`` with replicated state and the batch split over ``mesh``."""
  params = _replicate(mesh, common.host_copy(w.params))
  opt_state = _replicate(mesh, common.host_copy(w.optimizer.init(w.params)))
  batch = _split(mesh, w.batch)
  return Case(lambda s: step(*s, batch), (params, opt_state), lambda s: jax.device_get(s[0]),
              lambda s: step.lower(*s, batch))


def jax_cases(w: Workload, devices, memory: bool) -> dict[str, Case]:
  """Every JAX method at ``len(devices)`` devices, in the order they run within a round."""
  mesh = auto_mesh(devices)
  cases = {"jaxdp": jaxdp_case(w, devices, memory=memory), "jaxdp_pmap": jaxdp_case(w, devices, backend="pmap")}
  for stage in (1, 2, 3):
    cases[ZERO_METHODS[stage]] = jaxdp_case(w, devices, zero_stage=stage, memory=memory)
  for stage, method in BUCKETED_METHODS.items():
    cases[method] = jaxdp_case(w, devices, zero_stage=stage, bucket_bytes=jaxdp.analysis.scaling.DDP_BUCKET_BYTES)
  cases["bare"] = plain_case(w, mesh, bare_step(w, mesh))
  cases["auto_jit"] = plain_case(w, mesh, plain_step(w))
  cases["single"] = plain_case(w, auto_mesh(devices[:1]), plain_step(w))
  return cases


# --------------------------------------------------------------------------
# PyTorch DistributedDataParallel (MLP), in processes of its own.
# --------------------------------------------------------------------------


def torch_version() -> str | None:
  """PyTorch's version, or ``None`` when it is not importable."""
  try:
    import torch
  except ImportError:
    return None
  return torch.__version__


def torch_cuda_devices() -> int:
  import torch

  return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torch_mlp(params: dict):
  """``nn.Sequential`` of ``nn.Linear`` + ReLU holding the JAX MLP's parameters (``weight = w.T``)."""
  import torch

  modules = []
  for i in range(len(params)):
    w, b = np.asarray(params[f"layer{i}"]["w"]), np.asarray(params[f"layer{i}"]["b"])
    linear = torch.nn.Linear(*w.shape)
    with torch.no_grad():
      linear.weight.copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
      linear.bias.copy_(torch.from_numpy(b))
    modules += [linear, torch.nn.ReLU()]
  return torch.nn.Sequential(*modules[:-1])


def torch_to_jax_params(state_dict: dict) -> dict:
  """``nn.Sequential`` state dict (numpy) back to the JAX layout ``{"layer{i}": {"w", "b"}}``."""
  linears = sorted({int(k.split(".")[0]) for k in state_dict})
  return {f"layer{i}": {"w": state_dict[f"{m}.weight"].T, "b": state_dict[f"{m}.bias"]} for i, m in enumerate(linears)}


class TorchTrainer:
  """The PyTorch side of one rank: the MLP (under DDP when ``ddp``), Adam, and this rank's batch."""

  def __init__(self, spec: dict, device: str, ddp: bool):
    import torch

    self.torch, self.device, self.cuda = torch, torch.device(device), spec["cuda"]
    model = torch_mlp(spec["params"]).to(self.device)
    self.module = model
    if ddp:
      model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[self.device.index] if self.cuda else None)
    self.model = model
    self.optimizer = torch.optim.Adam(model.parameters(), lr=spec["lr"], betas=(0.9, 0.999), eps=1e-8)
    self.x = torch.from_numpy(spec["x"]).to(self.device)
    self.y = torch.from_numpy(spec["y"]).long().to(self.device)

  def step(self) -> tuple[float, float]:
    """One training step: ``(seconds, this rank's mean loss)``."""
    start = time.perf_counter()
    self.optimizer.zero_grad(set_to_none=True)
    loss = self.torch.nn.functional.cross_entropy(self.model(self.x), self.y)  # DDP averages over ranks
    loss.backward()
    self.optimizer.step()
    if self.cuda:
      self.torch.cuda.synchronize(self.device)
    return time.perf_counter() - start, loss.detach().item()

  def tensors(self, what: str) -> dict:
    """``"params"`` or ``"grads"`` (after DDP's averaging) as numpy, by ``nn.Sequential`` name."""
    named = self.module.named_parameters()
    return {k: (p if what == "params" else p.grad).detach().cpu().numpy() for k, p in named}


def _ddp_worker(rank: int, world: int, port: int, conn, spec: dict) -> None:
  """One PyTorch process: builds its :class:`TorchTrainer`, then runs the commands it is sent."""
  os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(spec["threads"]))
  import torch
  import torch.distributed as dist

  torch.set_num_threads(spec["threads"])
  if world > 1:  # one process: plain PyTorch, no process group at all
    dist.init_process_group("nccl" if spec["cuda"] else "gloo", rank=rank, world_size=world)
  trainer = TorchTrainer(spec, f"cuda:{rank}" if spec["cuda"] else "cpu", ddp=world > 1)
  conn.send("ready")
  while (command := conn.recv()) != "close":
    if command == "step":
      if world > 1:
        dist.barrier()  # start together: time the step, not the stagger of our messages
      conn.send(trainer.step())
    elif command in ("params", "grads"):
      conn.send(trainer.tensors(command))
  if world > 1:
    dist.destroy_process_group()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


SETTLE_S = 0.05  # longer than libgomp's default spin after a parallel region; not timed


class DDPGroup:
  """N PyTorch processes, one per rank, each on its own slice of the batch; a context manager.

  Args:
    params: the JAX MLP params (copied into every process).
    shards: one ``{"x", "y"}`` per rank (sizes may differ).
    lr: Adam's learning rate.
    threads: ``torch.set_num_threads`` of each process.
    cuda: NCCL and one GPU per process instead of gloo on CPU.
    settle: seconds to wait after each step, untimed, before anything else
      runs. PyTorch's OpenMP threads (a team when ``threads > 1``) spin for
      some milliseconds after a parallel region (libgomp's default
      ``GOMP_SPINCOUNT``) and would take cores from the method timed next;
      default ``SETTLE_S`` when ``threads > 1`` on CPU, else 0.
  """

  def __init__(self, params: dict, shards: list[dict], lr: float, threads: int, cuda: bool = False,
               timeout: float = 300, settle: float | None = None):
    import multiprocessing

    self.settle = (SETTLE_S if threads > 1 and not cuda else 0.0) if settle is None else settle

    context = multiprocessing.get_context("spawn")  # a fork of a process with XLA's threads is unsafe
    port, self.timeout, self.conns, self.procs = _free_port(), timeout, [], []
    params = common.host_copy(params)
    for rank, shard in enumerate(shards):
      spec = {"params": params, "x": shard["x"], "y": shard["y"], "lr": lr, "threads": threads, "cuda": cuda}
      ours, theirs = context.Pipe()
      proc = context.Process(target=_ddp_worker, args=(rank, len(shards), port, theirs, spec), daemon=True)
      proc.start()
      theirs.close()  # the child holds its end: if it dies, ours reads EOF instead of waiting
      self.conns.append(ours)
      self.procs.append(proc)
    self._gather()  # "ready" from every rank

  def _receive(self, rank: int):
    deadline = time.monotonic() + self.timeout
    while not self.conns[rank].poll(1.0):
      if not self.procs[rank].is_alive():
        raise RuntimeError(f"PyTorch rank {rank} exited with code {self.procs[rank].exitcode} (its error is above)")
      if time.monotonic() > deadline:
        raise TimeoutError(f"PyTorch rank {rank} did not answer within {self.timeout} s")
    try:
      return self.conns[rank].recv()
    except EOFError:
      raise RuntimeError(f"PyTorch rank {rank} closed its pipe (its error is above)") from None

  def _gather(self) -> list:
    return [self._receive(rank) for rank in range(len(self.conns))]

  def _broadcast(self, command: str) -> list:
    for conn in self.conns:
      conn.send(command)
    return self._gather()

  def step(self) -> float:
    """Runs one step on every rank; returns the slowest rank's seconds (for ``time_interleaved``)."""
    replies = self._broadcast("step")
    time.sleep(self.settle)
    self.last_loss = float(np.mean([loss for _, loss in replies]))
    return float(max(seconds for seconds, _ in replies))

  def fetch(self, what: str = "params") -> dict:
    """Rank 0's ``"params"`` or ``"grads"`` (after DDP's averaging) in the JAX layout."""
    self.conns[0].send(what)
    return torch_to_jax_params(self._receive(0))

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    for conn in self.conns:
      with contextlib.suppress(OSError):
        conn.send("close")
    for proc in self.procs:
      proc.join(30)
      if proc.is_alive():  # only our own children, by their handle
        proc.kill()
        proc.join()


def ddp_plan(n: int, backend: str) -> dict | None:
  """How DDP runs at ``n`` ranks here (``{"threads", "cuda"}``), or ``None`` when it cannot.

  On CPU every process gets ``cores // n`` threads (at least 1). With a GPU
  backend, DDP needs ``n`` CUDA devices: comparing JAX on GPUs with PyTorch
  on the host would compare hardware, not systems.
  """
  if backend == "cpu":
    return {"threads": max(1, common.cpu_cores() // n), "cuda": False}
  if torch_cuda_devices() >= n:
    return {"threads": max(1, common.cpu_cores() // n), "cuda": True}
  return None


def split_batch(batch: dict, counts) -> list[dict]:
  """Consecutive slices of ``batch`` of ``counts`` rows each."""
  edges = np.cumsum([0, *counts])
  return [jax.tree.map(lambda x, a=a, b=b: x[a:b], batch) for a, b in zip(edges[:-1], edges[1:])]


# --------------------------------------------------------------------------
# Numerics: one step on uneven per-rank batches.
# --------------------------------------------------------------------------


def numerics_setup(counts=UNEVEN, layers=common.MLP_LAYERS, seed: int = 0):
  """Initial MLP params and one batch per rank, ``counts[i]`` examples on rank ``i``."""
  params = common.host_copy(common.mlp_params(layers, seed))
  return params, split_batch(common.mlp_batch(layers, sum(counts), seed + 1), counts)


@jax.jit
def _adam_step(params, grads, lr: float):
  optimizer = optax.adam(lr)
  updates, _ = optimizer.update(grads, optimizer.init(params), params)
  return optax.apply_updates(params, updates)


@jax.jit
def _mean_grad(params, batch):
  return jax.grad(lambda p: jnp.mean(common.mlp_loss(p, batch)))(params)


def recording(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
  """``optimizer`` whose state also keeps the gradient it was last given: ``(grads, inner_state)``.

  The reduced gradient of a jaxdp step is then in ``state.opt_state[0]``,
  exactly, from the same step that updates the params.
  """

  def init(params):
    return jax.tree.map(jnp.zeros_like, params), optimizer.init(params)

  def update(grads, state, params=None):
    updates, inner = optimizer.update(grads, state[1], params)
    return updates, (grads, inner)

  return optax.GradientTransformation(init, update)


def numerics_jax(counts=UNEVEN, layers=common.MLP_LAYERS, lr: float = 1e-3) -> dict[str, dict]:
  """Gradient and params after one Adam step, per side: jaxdp ``mean()``/``rank_mean()`` and plain JAX references.

  jaxdp runs on ``len(counts)`` devices, ``counts[i]`` examples on device
  ``i`` (``jaxdp.shard_uneven``). ``jax_concat`` is the one-device step on
  the concatenated batch (what ``mean()`` must equal); ``jax_rank_mean``
  averages each rank's gradient of its own mean loss over the ranks, DDP's
  rule (what ``rank_mean()`` must equal). ``initial`` holds the initial params.
  """
  params, shards = numerics_setup(counts, layers)
  mesh = jaxdp.data_mesh(jax.devices()[: len(counts)])
  optimizer = recording(optax.adam(lr))
  batch, weights = jaxdp.shard_uneven(shards, mesh)
  out = {"initial": {"params": params}}
  for reduction in ("mean", "rank_mean"):
    step = jaxdp.make_train_step(common.mlp_loss, optimizer, mesh, reduction=common.reduction_of(reduction))
    state, _ = step(jaxdp.init_state(params, optimizer, mesh), batch, weights)
    state = jaxdp.gather_state(state)
    out[f"jaxdp_{reduction}"] = {"grads": state.opt_state[0], "params": state.params}
  concat = jax.tree.map(lambda *xs: np.concatenate(xs), *shards)
  rank_grads = [_mean_grad(params, shard) for shard in shards]
  references = {"jax_concat": _mean_grad(params, concat),
                "jax_rank_mean": jax.tree.map(lambda *gs: sum(gs) / len(gs), *rank_grads)}
  for name, grads in references.items():
    out[name] = jax.device_get({"grads": grads, "params": _adam_step(params, grads, lr)})
  return out


def numerics_torch(counts=UNEVEN, layers=common.MLP_LAYERS, lr: float = 1e-3, cuda: bool = False) -> dict[str, dict]:
  """Gradient and params after one Adam step: PyTorch DDP on the per-rank batches, one process on them concatenated.

  The one-process reference runs here, in this process, with every core.
  """
  import torch

  params, shards = numerics_setup(counts, layers)
  with DDPGroup(params, shards, lr, max(1, common.cpu_cores() // len(counts)), cuda) as group:
    group.step()
    out = {"torch_ddp": {"grads": group.fetch("grads"), "params": group.fetch("params")}}
  concat = jax.tree.map(lambda *xs: np.concatenate(xs), *shards)
  threads = torch.get_num_threads()
  torch.set_num_threads(common.cpu_cores())
  try:
    single = TorchTrainer({"params": params, **concat, "lr": lr, "cuda": cuda}, "cuda:0" if cuda else "cpu", ddp=False)
    single.step()
    out["torch_concat"] = {k: torch_to_jax_params(single.tensors(k)) for k in ("grads", "params")}
  finally:
    torch.set_num_threads(threads)
  return out


def max_abs_diff(a, b) -> float:
  """Largest ``|a − b|`` over every leaf of two trees of the same structure."""
  return float(max(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


def max_abs(tree) -> float:
  return float(max(np.max(np.abs(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree)))


COMPARISONS = (
    ("jaxdp_rank_mean", "torch_ddp", "jaxdp `rank_mean` vs PyTorch DDP (mean of per-rank means)"),
    ("jaxdp_mean", "torch_concat", "jaxdp `mean` vs PyTorch, one process, concatenated batch"),
    ("jaxdp_rank_mean", "jax_rank_mean", "jaxdp `rank_mean` vs plain JAX, DDP's rule written out"),
    ("jaxdp_mean", "jax_concat", "jaxdp `mean` vs plain JAX, one device, concatenated batch"),
    ("torch_ddp", "torch_concat", "PyTorch DDP vs PyTorch on the concatenated batch (the rules differ)"),
    ("jaxdp_rank_mean", "jaxdp_mean", "jaxdp `rank_mean` vs jaxdp `mean` (the rules differ)"),
)


def compare_numerics(sides: dict[str, dict]) -> list[dict]:
  """The :data:`COMPARISONS` whose two sides exist: gradient and parameter differences after one step.

  ``grad_rel``: largest ``|Δ gradient|`` over the largest ``|gradient|``.
  ``param``: largest ``|Δ param|`` after the Adam step; ``param_rel`` the
  same over the largest update. Adam's first step moves a parameter by
  ``lr · g / (|g| + eps)``: about lr wherever ``|g| >> eps``, so a different
  rule shows at about 1; but where ``|g|`` is near ``eps`` (1e-8) round-off
  in ``g`` moves the update by a fraction of lr, hence ``params_off``: how
  many parameters differ by more than 1% of the largest update.
  """
  update = max_abs_diff(sides["jaxdp_mean"]["params"], sides["initial"]["params"])
  rows = []
  for a, b, what in COMPARISONS:
    if a in sides and b in sides:
      grad = max_abs_diff(sides[a]["grads"], sides[b]["grads"]) / max_abs(sides[b]["grads"])
      param = max_abs_diff(sides[a]["params"], sides[b]["params"])
      off = sum(int(np.sum(np.abs(np.asarray(x) - np.asarray(y)) > 0.01 * update))
                for x, y in zip(jax.tree.leaves(sides[a]["params"]), jax.tree.leaves(sides[b]["params"])))
      rows.append({"a": a, "b": b, "what": what, "grad_rel": grad, "param": param, "param_rel": param / update,
                   "params_off": off})
  return rows


def numerics(args, torch_ok: bool) -> dict:
  """Runs the numerics comparison on ``args.ranks`` of :data:`UNEVEN`'s ranks (at most one per device)."""
  counts = UNEVEN[: min(args.ranks, jax.device_count())]
  if len(counts) < 2:
    return {"skipped": "needs at least 2 devices"}
  sides = numerics_jax(counts, lr=args.lr)
  plan = ddp_plan(len(counts), jax.default_backend()) if torch_ok else None
  if plan is not None:
    sides.update(numerics_torch(counts, lr=args.lr, cuda=plan["cuda"]))
  return {"counts": list(counts), "lr": args.lr, "params": common.param_count(common.MLP_LAYERS),
          "rows": compare_numerics(sides)}


# --------------------------------------------------------------------------
# Measuring.
# --------------------------------------------------------------------------


def final_losses(w: Workload, params_by_method: dict) -> dict[str, float]:
  """Mean loss on the global batch of every method's final params: the methods do the same maths."""
  loss = jax.jit(lambda p, b: jnp.mean(w.loss_fn(p, b)))
  return {m: float(loss(jax.device_put(p, jax.devices()[0]), w.batch)) for m, p in params_by_method.items()}


def ddp_runner(w: Workload, n: int, plan: dict, stack: contextlib.ExitStack) -> DDPGroup:
  shards = split_batch(w.batch, [w.units_per_step // n] * n)
  return stack.enter_context(DDPGroup(w.params, shards, w.lr, plan["threads"], plan["cuda"]))


def measure(w: Workload, n: int, args, torch_ok: bool) -> dict:
  """Every method on ``n`` devices, interleaved step by step; times, ratios, memory and final losses."""
  devices = jax.devices()[:n]
  cases = jax_cases(w, devices, memory=True)
  runners: dict[str, Callable] = dict(cases)
  plan = ddp_plan(n, jax.default_backend()) if (torch_ok and w.name == "mlp") else None
  with contextlib.ExitStack() as stack:
    group = ddp_runner(w, n, plan, stack) if plan else None
    if group is not None:
      runners["ddp"] = group.step
    times = common.time_interleaved(runners, args.steps, args.warmup)
    params = {m: c.params() for m, c in cases.items()}
    if group is not None:
      params["ddp"] = group.fetch("params")
  losses = final_losses(w, params)
  reference = params["jaxdp"]
  return {
      "devices": n,
      "ddp": plan,
      "times_ms": {m: {**common.stats(t), "samples": t} for m, t in times.items()},
      "ratios": {m: common.ratio_stats(times["jaxdp"], times[m]) for m in RATIOS if m in times},
      "vs_jaxdp": {m: float(np.median(t) / np.median(times["jaxdp"])) for m, t in times.items()},
      "throughput": {m: w.units_per_step / (np.median(t) / 1e3) for m, t in times.items()},
      "memory": {str(stage): cases[m].memory for stage, m in ZERO_METHODS.items()},  # str: JSON keys
      "final_loss": losses,
      "final_loss_spread": float(max(losses.values()) - min(losses.values())),
      "final_param_diff": {m: max_abs_diff(p, reference) for m, p in params.items()},
  }


# --------------------------------------------------------------------------
# Reporting.
# --------------------------------------------------------------------------


def _present(rows: list[dict]) -> list[str]:
  return [m for m in METHODS if any(m in r["times_ms"] for r in rows)]


def times_table(rows: list[dict]) -> str:
  methods = _present(rows)
  lines = ["| devices | " + " | ".join(LABELS[m] for m in methods) + " |", "|---:|" + "---:|" * len(methods)]
  for r in rows:
    cells = [common.fmt_ms(r["times_ms"][m]) if m in r["times_ms"] else "—" for m in methods]
    lines.append(f"| {r['devices']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def ratio_table(rows: list[dict]) -> str:
  present = [m for m in RATIOS if any(m in r["ratios"] for r in rows)]
  head = " | ".join(f"jaxdp ÷ {LABELS[m]}" for m in present)
  lines = [f"| devices | {head} |", "|---:|" + "---:|" * len(present)]
  for r in rows:
    cells = [f"{r['ratios'][m]['ratio']:.2f} ({r['ratios'][m]['p10']:.2f}–{r['ratios'][m]['p90']:.2f})"
             if m in r["ratios"] else "—" for m in present]
    lines.append(f"| {r['devices']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def throughput_table(rows: list[dict], unit: str) -> str:
  methods = _present(rows)
  lines = [f"| devices | " + " | ".join(LABELS[m] for m in methods) + " |", "|---:|" + "---:|" * len(methods)]
  for r in rows:
    cells = [f"{r['throughput'][m]:,.0f}" if m in r["throughput"] else "—" for m in methods]
    lines.append(f"| {r['devices']} | " + " | ".join(cells) + " |")
  return f"{unit}/s (global batch ÷ median step time):\n\n" + "\n".join(lines)


def memory_table(rows: list[dict]) -> str:
  head = " | ".join(f"N={r['devices']}" for r in rows)
  lines = [f"| ZeRO stage | {head} |", "|---|" + "---:|" * len(rows)]
  for stage in ZERO_METHODS:
    cells = " | ".join(f"{r['memory'][str(stage)]['model_state'] / MIB:.2f}" for r in rows)
    lines.append(f"| {stage} | {cells} |")
  return "\n".join(lines)


def numerics_table(result: dict) -> str:
  if "rows" not in result:
    return f"(skipped: {result['skipped']})"
  lines = [f"One step from the same initial MLP ({result['params']:,} params) on uneven per-rank batches of "
           f"{result['counts']} examples: the gradient each side applies, and the params after one Adam step "
           f"(lr {result['lr']}).", "",
           "| comparison | max \\|Δ gradient\\| ÷ max \\|gradient\\| | max \\|Δ param\\| after Adam "
           "| ÷ largest update | params off by > 1% of it |", "|---|---:|---:|---:|---:|"]
  lines += [f"| {r['what']} | {r['grad_rel']:.1e} | {r['param']:.1e} | {r['param_rel']:.1e} | {r['params_off']:,} |"
            for r in result["rows"]]
  return "\n".join(lines)


def headline(result: dict) -> str:
  """One line per workload: jaxdp ÷ bare, ÷ auto-jit, ÷ DDP at each device count."""
  lines = []
  for name, rows in result["workloads"].items():
    parts = []
    for m in RATIOS[:3]:
      cells = [f"N={r['devices']} {r['ratios'][m]['ratio']:.2f}" for r in rows if m in r["ratios"] and r["devices"] > 1]
      if cells:
        parts.append(f"jaxdp ÷ {LABELS[m]}: " + ", ".join(cells))
    lines.append(f"{name}: " + "; ".join(parts))
  return "\n".join(lines)


def machine_line(m: dict) -> str:
  kind = "simulated CPU devices" if m["backend"] == "cpu" else f"{m['device_kind']} devices"
  torch = f"torch {m['torch']}" if m["torch"] else "PyTorch not installed"
  return (f"{m['cpu_cores']} CPU cores ({m['processor']}), {m['device_count']} {kind}, backend {m['backend']}, "
          f"jax {m['jax']}, optax {m['optax']}, {torch}, Python {m['python']}; measured {m['date']}"
          + (f", 1-min load average {m['load_average_start']:.1f} at the start and "
             f"{m['load_average_end']:.1f} at the end" if "load_average_end" in m else ""))


FAIRNESS = """\
How the comparison is kept fair:

- Same model, initial parameters, global batch and split for every method;
  the same optimizer and hyper-parameters (PyTorch: `torch.optim.Adam`, with
  `optax.adam`'s defaults `betas=(0.9, 0.999)`, `eps=1e-8`). Every method
  runs the same number of steps; the mean loss of each one's final
  parameters on the batch is compared as a check that they did the same
  maths.
- Interleaved: one step of each method per round, so drift in the machine's
  load hits all of them alike; the order is shuffled each round, so no
  method always follows the same one; ratios are taken within one run.
- PyTorch's OpenMP threads spin for a while after its step (libgomp's
  default); the driver waits 50 ms, untimed, after each DDP step with more
  than one thread per process (on a 2-core machine, N = 1 only), so that
  the spinning does not take a core from the JAX step timed next. (Before
  this wait, the method run right after DDP measured 5-15% slower at N = 1
  on 2 cores.)
- Chained steps: each method's step consumes the state the previous one
  returned; jaxdp, the bare step and auto-jit donate it (XLA reuses the
  buffers), PyTorch updates in place.
- jaxdp is called as a user calls it, `step(state, batch)`, so its host work
  (input validation, placement, the check of the previous step's
  non-finite flag) is inside its time; the bare step has none of it.
- Cores: the JAX methods run in this one process, where XLA's CPU thread
  pool has one thread per core, shared by all simulated devices. Each of
  DDP's N processes gets `torch.set_num_threads(max(1, cores // N))` (and
  `OMP_NUM_THREADS`), so PyTorch, too, uses every core and no more, up to
  N > cores, where both oversubscribe (simulated devices also share the
  cores). XLA has no per-device thread setting for simulated devices; its
  pool follows the process's CPU affinity.
- DDP's step time on each process runs from a barrier to the end of
  `optimizer.step()`, the slowest process counting; a JAX step from its call
  to `block_until_ready` of the new state. Neither includes the driver's
  messages to the PyTorch processes.
- DDP (gloo on CPU, NCCL with a GPU per process) runs for the MLP only: a
  faithful PyTorch port of the Flax transformer was not written. At N = 1
  the PyTorch row is one plain process (no DDP wrapper, no process group).
- jaxdp's ZeRO rows use the same step on the layout
  `jaxdp.data_parallel(mesh, zero_stage=s)` and a state from
  `jaxdp.init_state(params, opt, that layout)`; pmap runs at stage 0 only. The
  "25 MB buckets" rows add `reduction=jaxdp.reductions.bucketed(25 MiB)`: one all-reduce of the
  gradient per flat bucket (stages 0-1), one parameter gather (stages 1-3)
  and one reduce-scatter (stages 2-3) per bucket of flat slices, where the
  plain rows have one all-reduce in all, and one gather and reduce-scatter
  per leaf over 256 KiB plus one for all the smaller ones."""


def markdown(result: dict) -> str:
  """The run's report (``benchmarks.md`` under ``--out``), written from ``result``."""
  m, cfg = result["machine"], result["config"]
  parts = [
      "# Benchmarks: jaxdp against the bare step, automatic partitioning and PyTorch DDP",
      "",
      "Written by `python experiments/benchmark.py --publish` from one run; rerun it to refresh every number here",
      "(without `--publish` it writes under `out/benchmark/` only; `--quick` is a smoke run).",
      "",
      f"**Machine:** {machine_line(m)}.",
      f"Median (p10–p90) of {cfg['steps']} timed steps per method after {cfg['warmup']} warm-up step{'s' if cfg['warmup'] != 1 else ''}.",
  ]
  if m["backend"] == "cpu":
    parts += ["", f"{m['device_count']} simulated devices share {m['cpu_cores']} cores: more devices means more "
              "overhead, not more speed. Absolute times drift about 2× from day to day on this machine; "
              "compare the ratios, which come from one run."]
  if not m["torch"]:
    parts += ["", "PyTorch was not importable (`pip install -e .[bench]`), so the DDP rows and the PyTorch side "
              "of the numerics are skipped."]
  parts += ["", "Headline (ratio of median step times, below 1: jaxdp is faster):", "", "```", headline(result), "```",
            "", FAIRNESS]
  for name, rows in result["workloads"].items():
    w = result["titles"][name]
    parts += ["", f"## {w['title']}", "", "Step time, ms:", "", times_table(rows), "",
              "jaxdp (shard_map, stage 0) ÷ the others: ratio of the medians (p10–p90 of the per-round ratios):", "",
              ratio_table(rows), "", throughput_table(rows, w["unit"]), "",
              "Model state (params + optimizer state + gradients) per device, MiB, from `jaxdp.memory_report`:", "",
              memory_table(rows), "",
              f"Every method ran the same {cfg['warmup'] + cfg['steps']} steps from the same parameters: "
              "the mean losses of their final parameters on the batch agree to within "
              f"{max(r['final_loss_spread'] for r in rows):.1e}, and the final parameters differ from jaxdp's "
              f"by at most {max(max(r['final_param_diff'].values()) for r in rows):.1e} (Adam turns "
              "round-off in near-zero gradients into steps of up to lr; see the numerics below)."]
  parts += ["", "## Numerics: uneven per-rank batches", "", numerics_table(result["numerics"]), "",
            "The gradients are the clean comparison: the same rule agrees to float32 round-off of reordered "
            "sums (about 1e-6 of the largest gradient), a different rule differs by order 1. Adam's first "
            "update, lr·g/(|g| + 1e-8), is about lr·sign(g) wherever |g| ≫ 1e-8, so a different rule moves "
            "parameters by up to 2·lr; but on the few parameters whose gradient is itself near 1e-8, "
            "round-off in g moves the update by a fraction of lr. That, not a different rule, is the largest "
            "Δ param of the same-rule rows; the last column counts such parameters.",
            "", "## Plots", "", "![throughput](benchmark_throughput.png)", "", "![ratio](benchmark_ratio.png)", "",
            "![memory](benchmark_memory.png)", ""]
  return "\n".join(parts)


def _axes_by_workload(result: dict, title: str):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = list(result["workloads"])
  fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4.2), squeeze=False)
  fig.suptitle(textwrap.fill(f"{title} — {machine_line(result['machine'])}", 140), fontsize=7)
  return plt, fig, dict(zip(names, axes[0]))


def _finish(plt, fig, axes, ticks, path) -> None:
  from matplotlib.ticker import NullFormatter

  for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("devices N")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, loc="best", framealpha=0.6)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot(result: dict, folder) -> list[str]:
  """``benchmark_throughput.png``, ``benchmark_ratio.png`` and ``benchmark_memory.png`` in ``folder``."""
  paths = [os.path.join(folder, f"benchmark_{k}.png") for k in ("throughput", "ratio", "memory")]
  styles = {m: ("o-" if m.startswith("jaxdp") else "s--") for m in METHODS}
  for path, kind in zip(paths, ("throughput", "ratio", "memory")):
    plt, fig, axes = _axes_by_workload(result, {"throughput": "throughput", "ratio": "step time ÷ jaxdp",
                                                "memory": "model state per device"}[kind])
    for name, ax in axes.items():
      rows, w = result["workloads"][name], result["titles"][name]
      ns = [r["devices"] for r in rows]
      if kind == "memory":
        for stage, m in ZERO_METHODS.items():
          ax.plot(ns, [r["memory"][str(stage)]["model_state"] / MIB for r in rows], "o-", label=f"stage {stage}")
        ax.set(ylabel="MiB per device (jaxdp.memory_report)", title=w["short"])
        continue
      key = "throughput" if kind == "throughput" else "vs_jaxdp"
      for m in _present(rows):
        pts = [(r["devices"], r[key][m]) for r in rows if m in r[key]]
        ax.plot(*zip(*pts), styles[m], ms=4, label=LABELS[m])
      if kind == "ratio":
        ax.axhline(1.0, color="k", lw=0.8)
      ax.set(ylabel=f"{w['unit']}/s" if kind == "throughput" else "median step time ÷ jaxdp's", title=w["short"])
    ticks = sorted({r["devices"] for rows in result["workloads"].values() for r in rows})
    _finish(plt, fig, list(axes.values()), ticks, path)
  return paths


# --------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help=f"smoke run; defaults become {QUICK}")
  p.add_argument("--devices", help=f"comma-separated device counts (default {FULL['devices']})")
  p.add_argument("--models", default="mlp,lm", help="workloads to run: mlp, lm or both")
  p.add_argument("--steps", type=int, help=f"timed steps per method after warm-up (default {FULL['steps']})")
  p.add_argument("--warmup", type=int, help=f"untimed steps per method, the first compiles (default {FULL['warmup']})")
  p.add_argument("--mlp-batch", type=int, default=512, help="global batch of the MLP")
  p.add_argument("--lm-batch", type=int, default=32, help="global batch of the transformer, in sequences")
  p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate of the MLP")
  p.add_argument("--ranks", type=int,
                 help=f"ranks of the numerics comparison, batches {UNEVEN} (default {FULL['ranks']})")
  p.add_argument("--no-torch", action="store_true", help="skip PyTorch even if it is installed")
  common.add_output_args(p, "out/benchmark", quick="out/benchmark_quick")
  p.add_argument("--render", metavar="RESULTS_JSON", help="measure nothing: write the report of an earlier run")
  args = p.parse_args(argv)
  common.check_publish(p, args)
  chosen = args.devices is not None
  args = common.fill_defaults(args, FULL, QUICK)
  counts = [int(d) for d in args.devices.split(",")]
  if not chosen:  # the default list, cut to the devices there are (a GPU machine has fewer than 8)
    counts = [n for n in counts if n <= jax.device_count()]
  args.device_counts = common.device_counts(counts)
  args.models = [m.strip() for m in args.models.split(",") if m.strip()]
  if not set(args.models) <= {"mlp", "lm"}:
    p.error(f"--models {args.models}: choose from mlp, lm")
  return args


WORKLOADS = {"mlp": lambda args: mlp_workload(args.mlp_batch, args.lr), "lm": lambda args: lm_workload(args.lm_batch)}


def run(args) -> dict:
  """Measures every workload and device count, then the numerics; returns the results."""
  version = None if args.no_torch else torch_version()
  result = {"machine": {**common.machine(), "torch": version, "date": time.strftime("%Y-%m-%d"),
                        "load_average_start": os.getloadavg()[0]},
            "config": {k: v for k, v in vars(args).items()}, "workloads": {}, "titles": {}}
  if version is None:
    print("PyTorch is not importable (pip install -e .[bench]) or --no-torch: skipping the DDP rows.", file=sys.stderr)
  for name in args.models:
    w = WORKLOADS[name](args)
    result["titles"][name] = {"title": w.title, "short": w.short, "unit": w.unit}
    rows = result["workloads"][name] = []
    for n in args.device_counts:
      if w.units_per_step % n:
        print(f"[{name}] skipping N={n}: the global batch does not split evenly", file=sys.stderr)
        continue
      start = time.perf_counter()
      print(f"[{name}] N={n}: compiling and timing {args.warmup} + {args.steps} steps per method", file=sys.stderr,
            flush=True)
      rows.append(measure(w, n, args, version is not None))
      print(f"[{name}] N={n} done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
  print(f"[numerics] one Adam step on {args.ranks} uneven ranks", file=sys.stderr, flush=True)
  result["numerics"] = numerics(args, version is not None)
  result["machine"]["load_average_end"] = os.getloadavg()[0]
  return result


def report(result: dict, args) -> None:
  """Prints the tables and writes results.json, benchmarks.md and the plots."""
  text = markdown(result)
  print(text)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "benchmarks.md"), "w") as f:
    f.write(text)
  plots = plot(result, args.out)
  path = common.write_json(os.path.join(args.out, "results.json"), result)
  print(f"wrote {path}, benchmarks.md and the plots in {args.out}", file=sys.stderr)
  common.publish(args, {"benchmarks.md": "data/benchmark/report.md", "results.json": "data/benchmark/results.json",
                        **{os.path.basename(p): os.path.basename(p) for p in plots}})


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.render:
    with open(args.render) as f:
      result = json.load(f)
    report(result, args)
    return result
  start = time.perf_counter()
  result = run(args)
  result["wall_seconds"] = time.perf_counter() - start
  report(result, args)
  print(f"total {result['wall_seconds']:.0f} s", file=sys.stderr)
  return result


if __name__ == "__main__":
  main()
