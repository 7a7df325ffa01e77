"""A byte-level language model trained data-parallel with jaxdp.

A small decoder-only transformer (Flax nnx, vocabulary of 256 bytes, dropout
keyed per replica through the step's ``rng``) learns next-byte prediction on
real text: by default the sources of this Python's standard library. Every
document is cut into chunks of at most ``--seq-len`` bytes, the last one
shorter, so the batches carry token masks and the devices hold uneven token
counts. The loss is the per-token weighted mean over the global batch; a
held-out set of documents gives the validation loss, evaluated data-parallel
with the same weighted mean.

  python experiments/train_lm.py                    # N devices, --reduction mean
  python experiments/train_lm.py --compare          # 1 device vs N "mean" vs N "rank_mean"
  python experiments/train_lm.py --quick            # 20 steps on a 200 kB corpus
  python experiments/train_lm.py --compare --publish   # also copy loss_curves.png to docs/loss_curves.png

--quick: about 10 s on an idle 2-core CPU machine.

On CPU, ``--devices N`` simulates N devices (default 4); on GPU/TPU every
visible device is used unless ``--devices`` says fewer.

``--mesh`` lays the devices out on more axes than the data axis (on CPU it
simulates as many devices as the mesh has)::

  python experiments/train_lm.py --mesh data=4,model=2 --zero-stage 3   # tensor x data parallel
  python experiments/train_lm.py --mesh replica=2,data=4 --zero-stage 3 # hybrid: ZeRO within a group, replicas across
  python experiments/train_lm.py --mesh data=8 --zero-stage 3 --scan-layers --layers 8   # layer-wise ZeRO-3
  python experiments/train_lm.py --mesh stage=2,data=4 --compare       # pipeline x data parallel
  python experiments/train_lm.py --mesh stage=2,data=2,model=2 --layers 4 --schedule circular --repeats 2

With a ``model`` axis the transformer is split Megatron-style (its
``nnx.with_partitioning`` metadata, read by ``jaxdp.adapters.nnx.partition_specs``;
see ``experiments/lm/model.py``) and the batch is replicated over ``model``.
With a ``replica`` axis the data axes are ``("replica", "data")``: the batch
is split over both. ``--zero-stage`` (0-3) shards the optimizer state (1, 2)
and the params (3) over ``data``. ``--scan-layers`` stacks the blocks
(``nnx.vmap``) and runs them with ``nnx.scan``; at ``--zero-stage 3`` the
step then gathers one layer at a time inside the loop (the layout
``jaxdp.data_parallel(mesh, zero_stage=3, layers="blocks")``, jaxdp's
layer-wise stage 3; the ``rank_mean`` run of ``--compare`` keeps the
whole gather, which that reduction needs).
With a ``stage`` axis the blocks are stacked (``--scan-layers`` is implied)
and run through ``jaxdp.scan_layers``, which in the step is a pipeline over
``stage`` (the layout ``jaxdp.data_parallel(mesh, layers="blocks",
pipeline=jaxdp.pipeline(--microbatches, --schedule, repeats=--repeats))``;
``--microbatches`` defaults to 2·P): each
stage holds ``--layers / P`` blocks, the embedding and the head run on every
stage, and the batch is replicated over ``stage`` (see docs/pipeline.md).

Outputs (``--out``, default ``out/lm``; ``out/lm_quick`` with ``--quick``): ``metrics.jsonl`` (one line per step:
step, loss, tokens, grad_norm, time; with ``--tensorboard`` also as TensorBoard scalars in ``tensorboard/``, which
needs tensorboardX: ``pip install 'jaxdp[tensorboard]'``) and ``summary.json``; with ``--compare``
one sub-folder per run, ``compare.json`` and ``loss_curves.png``. With
``--ckpt-dir DIR`` the run checkpoints every ``--ckpt-every`` steps and, started
again with the same flags, resumes from the latest checkpoint (bitwise the
same run on CPU). Under ``python -m jaxdp.launch`` (or SLURM, Open MPI, a TPU
slice) it joins the multi-process job.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import sys
import time

DEFAULT_CPU_DEVICES = 4
FULL = {"steps": 150, "max_bytes": 1_000_000}
QUICK = {"steps": 20, "max_bytes": 200_000}


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--devices", type=int, default=None, help=f"data-parallel devices (CPU: simulated, default {DEFAULT_CPU_DEVICES}; else all)")
  p.add_argument("--mesh", default=None, help="mesh axes as name=size,...: data (required), model (tensor parallel), "
                 "replica (hybrid), stage (pipeline), e.g. data=4,model=2, replica=2,data=4 or stage=2,data=4 "
                 "(default: one data axis over --devices)")
  p.add_argument("--microbatches", type=int, default=None, help="with a stage axis: microbatches per device and step "
                 "(default 2 x stages)")
  p.add_argument("--schedule", default="gpipe", choices=("gpipe", "circular"), help="with a stage axis: the pipeline "
                 "schedule")
  p.add_argument("--repeats", type=int, default=1, help="with --schedule circular: rounds of the ring of stages")
  p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage over the data axis")
  p.add_argument("--reduction", default="mean", choices=("mean", "rank_mean", "sum"), help="gradient reduction")
  p.add_argument("--accum-steps", type=int, default=1, help="micro-batches per device and step")
  p.add_argument("--compute-dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="forward/backward dtype (params stay float32)")
  p.add_argument("--loss-scaling", default="none", choices=("none", "dynamic"),
                 help="dynamic: float16 loss scaling, torch GradScaler's rule and defaults (jaxdp.dynamic_loss_scale)")
  p.add_argument("--grad-reduce-dtype", default="float32", choices=("float32", "bfloat16"), help="dtype of the gradient all-reduce")
  p.add_argument("--bucket-bytes", type=int, default=None, help="reduce the gradient in buckets of this size (default: one all-reduce)")
  p.add_argument("--diloco-inner-steps", type=int, default=None, help="DiLoCo: H inner steps per outer sync across "
                 "the replica axis (needs --mesh replica=R,data=D); default: the exact step")
  p.add_argument("--diloco-delta-dtype", default="float32", choices=("float32", "bfloat16", "int8"),
                 help="DiLoCo: dtype of the outer sync's all-reduce of the deltas")
  p.add_argument("--powersgd-rank", type=int, default=None, help="PowerSGD gradient compression at this rank (default: exact)")
  p.add_argument("--powersgd-start-iter", type=int, default=10, help="exact steps before PowerSGD compresses")
  p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK} unless given")
  p.add_argument("--steps", type=int, default=None, help=f"training steps ({FULL['steps']}; {QUICK['steps']} with --quick)")
  p.add_argument("--batch-size", type=int, default=32, help="global batch, in sequences")
  p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence (the last chunk of a document is shorter)")
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--scan-layers", action="store_true", help="stack the blocks (nnx.vmap) and run them with nnx.scan; "
                 "with --zero-stage 3 each layer is gathered inside the loop (layer-wise stage 3)")
  p.add_argument("--d-model", type=int, default=64)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--d-ff", type=int, default=256)
  p.add_argument("--dropout", type=float, default=0.1, help="set to 0 under --compare")
  p.add_argument("--corpus", default=None, help="text file or directory (default: the Python standard library's *.py)")
  p.add_argument("--max-bytes", type=int, default=None,
                 help=f"corpus budget in bytes, 0: no limit ({FULL['max_bytes']:,}; {QUICK['max_bytes']:,} with --quick)")
  p.add_argument("--val-every", type=int, default=10, help="hold out every k-th document for validation")
  from experiments import common  # here, not above: the parser runs before JAX is imported, to set the device count

  common.add_output_args(p, "out/lm", quick="out/lm_quick")
  p.add_argument("--compare", action="store_true", help="1 device vs N devices with mean vs N with rank_mean")
  p.add_argument("--ckpt-dir", default=None, help="checkpoint here every --ckpt-every steps and resume from the latest")
  p.add_argument("--ckpt-every", type=int, default=50)
  p.add_argument("--no-progress", dest="progress", action="store_false")
  p.add_argument("--tensorboard", action="store_true",
                 help="also write the step metrics as TensorBoard scalars in OUT/tensorboard (needs tensorboardX)")
  return p


MESH_AXES = ("replica", "data", "model", "stage")
"""The axis names ``--mesh`` accepts: ``data`` (always), ``model`` (tensor parallel), ``replica`` (hybrid),
``stage`` (pipeline)."""
STAGE_AXIS = "stage"


def parse_mesh(spec: str) -> dict[str, int]:
  """``"data=4,model=2"`` -> ``{"data": 4, "model": 2}`` (in the order given: the mesh's axis order)."""
  axes = {}
  for item in spec.split(","):
    name, sep, size = item.strip().partition("=")
    name = name.strip()
    if not sep or not size.strip().isdigit() or int(size) < 1:
      raise ValueError(f"--mesh {spec!r}: {item!r} is not name=size with a positive size (e.g. data=4,model=2)")
    if name not in MESH_AXES:
      raise ValueError(f"--mesh {spec!r}: unknown axis {name!r}; use {', '.join(MESH_AXES)}")
    if name in axes:
      raise ValueError(f"--mesh {spec!r} names axis {name!r} twice")
    axes[name] = int(size)
  if "data" not in axes:
    raise ValueError(f"--mesh {spec!r} has no data axis; the data-parallel axis is always called 'data'")
  return axes


def _simulate_cpu_devices(argv: list[str]) -> None:
  """Asks for ``--devices`` (or ``--mesh``'s) CPU devices, only when the platform is CPU or unspecified (before JAX starts)."""
  if os.environ.get("JAX_PLATFORMS", "").strip().lower() not in ("", "cpu"):
    return
  parser = _parser()
  args = parser.parse_known_args(argv)[0]
  try:
    devices = args.devices if args.mesh is None else math.prod(parse_mesh(args.mesh).values())
  except ValueError as e:
    parser.error(str(e))
  if devices is not None:
    os.environ["JAX_NUM_CPU_DEVICES"] = str(devices)
  else:
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(DEFAULT_CPU_DEVICES))
  # The parser imported JAX (experiments.common), which read the environment then: set its flag too.
  import jax

  jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))


if __name__ == "__main__":  # must happen before JAX initialises its backend
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  _simulate_cpu_devices(sys.argv[1:])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import tqdm  # noqa: E402

import jaxdp  # noqa: E402
from experiments import common  # noqa: E402
from experiments.lm import corpus  # noqa: E402
from experiments.lm import model as lm  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402
from jaxdp.io.data import DataPipeline  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
  """Every setting of a run; the flags of :func:`main` map one to one (``--d-model`` -> ``d_model``)."""

  devices: int | None = None
  mesh: str | None = None
  zero_stage: int = 0
  reduction: str = "mean"
  accum_steps: int = 1
  compute_dtype: str = "float32"
  loss_scaling: str = "none"
  grad_reduce_dtype: str = "float32"
  bucket_bytes: int | None = None
  diloco_inner_steps: int | None = None
  diloco_delta_dtype: str = "float32"
  powersgd_rank: int | None = None
  powersgd_start_iter: int = 10
  microbatches: int | None = None
  schedule: str = "gpipe"
  repeats: int = 1
  steps: int = 150
  batch_size: int = 32
  seq_len: int = 64
  lr: float = 3e-3
  seed: int = 0
  layers: int = 2
  scan_layers: bool = False
  d_model: int = 64
  heads: int = 4
  d_ff: int = 256
  dropout: float = 0.1
  corpus: str | None = None
  max_bytes: int = 1_000_000
  val_every: int = 10
  out: str | None = "out/lm"
  compare: bool = False
  ckpt_dir: str | None = None
  ckpt_every: int = 50
  progress: bool = True
  tensorboard: bool = False


def select_devices(n: int | None) -> list[jax.Device]:
  """The first ``n`` devices (default: every visible one)."""
  devices = jax.devices()
  if n is None:
    return devices
  if not 1 <= n <= len(devices):
    raise ValueError(f"--devices {n} but {len(devices)} {devices[0].platform} devices are visible")
  return devices[:n]


def build_mesh(config: Config, devices=None) -> Mesh:
  """The run's mesh: ``--mesh``'s axes (``AxisType.Auto``) or, without it, one data axis over ``devices``.

  ``devices`` defaults to ``select_devices(config.devices)``; with ``--mesh``
  the first ``prod(sizes)`` of them are used (``--devices``, if given, must
  be that product).
  """
  devices = select_devices(config.devices) if devices is None else list(devices)
  if config.mesh is None:
    return jaxdp.data_mesh(devices)
  axes = parse_mesh(config.mesh)
  n = math.prod(axes.values())
  if config.devices is not None and config.devices != n:
    raise ValueError(f"--devices {config.devices} but --mesh {config.mesh} has {n} devices; give one or the other")
  if len(devices) < n:
    raise ValueError(f"--mesh {config.mesh} needs {n} devices but {len(devices)} {devices[0].platform} devices are visible")
  return Mesh(np.asarray(devices[:n]).reshape(tuple(axes.values())), tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def data_axes(mesh: Mesh) -> str | tuple[str, ...]:
  """jaxdp's ``axis_name``: ``"data"``, or ``("replica", "data")`` (in mesh order) on a hybrid mesh."""
  axes = tuple(a for a in mesh.axis_names if a in ("replica", "data"))
  return axes[0] if len(axes) == 1 else axes


def data_parallel_size(mesh: Mesh) -> int:
  """How many ways the batch is split: the product of the data axes' sizes (``model`` replicates it)."""
  return math.prod(mesh.shape[a] for a in mesh.axis_names if a in ("replica", "data"))


def param_specs(params, mesh: Mesh):
  """The tensor-parallel ``param_specs`` for ``init_state`` on a mesh with a ``model`` axis, else ``None``."""
  return jaxdp.adapters.nnx.partition_specs(params) if lm.MODEL_AXIS in mesh.axis_names else None


def build_dataset(config: Config) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """``(train_chunks, val_chunks)``: next-byte chunks of the training and held-out documents."""
  docs = corpus.read_documents(config.corpus, config.max_bytes or None)
  train_docs, val_docs = corpus.split_documents(docs, config.val_every)
  return corpus.chunk_documents(train_docs, config.seq_len), corpus.chunk_documents(val_docs, config.seq_len)


def make_model(config: Config):
  """``(definition, params)`` of the transformer (``jaxdp.adapters.nnx.split``), initialised from ``config.seed``.

  With ``config.microbatches`` (a pipeline run, and the single device it is compared with) the stacked blocks
  run through ``jaxdp.scan_layers``.
  """
  sizes = {k: getattr(config, k) for k in ("seq_len", "layers", "d_model", "heads", "d_ff", "dropout")}
  return lm.make_model(seed=config.seed, scan_layers=config.scan_layers,
                       functional_scan=config.microbatches is not None, **sizes)


def stage_count(config: Config) -> int | None:
  """The size of ``--mesh``'s stage axis, or ``None`` without one."""
  return None if config.mesh is None else parse_mesh(config.mesh).get(STAGE_AXIS)


def make_pipeline(config: Config):
  """``jaxdp.pipeline(...)`` of a run whose mesh has a stage axis, else ``None``."""
  if stage_count(config) is None:
    return None
  return jaxdp.pipeline(config.microbatches, config.schedule, repeats=config.repeats, axis_name=STAGE_AXIS)


def make_optimizer(config: Config) -> optax.GradientTransformation:
  """AdamW with a linear warm-up over the first tenth of the steps, then cosine decay."""
  warmup = max(1, config.steps // 10)
  schedule = optax.warmup_cosine_decay_schedule(0.0, config.lr, warmup, max(config.steps, warmup + 1))
  return optax.adamw(schedule, weight_decay=0.01)


def layerwise_stack(config: Config, reduction: str | None = None) -> str | None:
  """``layers=`` of the run: the blocks' stack with ``--scan-layers --zero-stage 3``, else ``None`` (whole gather).

  ``"rank_mean"`` takes each replica's own mean before the reduce-scatter, which the layer-wise schedule runs
  inside the backward pass (jaxdp refuses the two together): that run keeps stage 3's whole gather.
  """
  reduction = reduction or config.reduction
  if stage_count(config) is not None:  # the pipeline runs the stack
    return lm.STACK
  return lm.STACK if config.scan_layers and config.zero_stage == 3 and reduction != "rank_mean" else None


def evaluate(loss_fn, state, dataset, mesh, collate, per_device_batch: int, axis_name="data",
             layers=None, pipeline_plan=None) -> dict | None:
  """Per-token weighted mean loss and accuracy over one pass of ``dataset`` (``None`` if it is empty).

  Data-parallel like training, with the training loss's own definition
  (``jaxdp.make_eval_step``): every device sums its own tokens, one psum per
  batch, and the per-batch sums are added in float64 on the host.
  """
  if not dataset:
    return None
  pipeline = DataPipeline(dataset, collate, mesh, per_device_batch=per_device_batch, seed=0, axis_name=axis_name)
  batches = (data for _, data in pipeline.iterate(num_steps=pipeline.steps_per_epoch))
  layout = jaxdp.data_parallel(mesh, axis_name=axis_name, layers=layers, pipeline=pipeline_plan)
  evaluation = jaxdp.make_eval_step(loss_fn, layout)
  return evaluation.evaluate(state, batches)


def _check_batch(config: Config, n: int) -> None:
  if config.batch_size % (n * config.accum_steps):
    raise ValueError(
        f"--batch-size {config.batch_size} must be a multiple of data-parallel devices x accum-steps = "
        f"{n} x {config.accum_steps}"
    )
  if stage_count(config) is not None and config.batch_size % (n * config.accum_steps * config.microbatches):
    raise ValueError(
        f"--batch-size {config.batch_size} must be a multiple of data-parallel devices x accum-steps x "
        f"microbatches = {n} x {config.accum_steps} x {config.microbatches} (each device cuts its rows into "
        "--microbatches); change --batch-size or --microbatches"
    )


def _device_tokens(weights) -> list[float]:
  """Σ w on each (addressable) data-parallel position, in mesh order: how uneven the step's split of tokens is.

  One entry per batch portion: the copies of a portion on other ``model`` devices are not counted again.
  """
  portions = {s.index[0].start or 0: s for s in weights.addressable_shards}
  return [float(np.sum(portions[start].data)) for start in sorted(portions)]


def _log(pending, clock: float, records: list, bar, sink) -> float:
  """Fetches one step's metrics (waiting for it), records, shows and writes them; returns the time."""
  step, metrics, weights = pending
  metrics = jax.device_get(metrics)
  now = time.perf_counter()
  rec = {"step": step, "loss": float(metrics["loss"]), "accuracy": float(metrics["accuracy"]), "tokens": float(metrics["weight"]),
         "grad_norm": float(metrics["grad_norm"]), "time": now - clock, "device_tokens": _device_tokens(weights)}
  if "loss_scale" in metrics:  # --loss-scaling dynamic: the scale the step used, and whether it was skipped
    rec.update(loss_scale=float(metrics["loss_scale"]), skipped=int(metrics["skipped"]))
  records.append(rec)
  if sink is not None:
    sink.write(json.dumps(rec) + "\n")
  bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens'] / rec['time']:.0f}", step=step, refresh=False)
  bar.update(1)
  return now


def fit(step_fn, state, pipeline, config: Config, rng, sink=None, desc: str = "train", start: int = 0, ckpt=None,
        done: int = 0):
  """Runs steps ``start .. config.steps - 1``; returns ``(state, records)``.

  Step ``i``'s metrics are fetched after step ``i + 1`` is dispatched, so the
  host prepares the next batch while the devices compute; a step's time is
  the wall time between two fetched results (the first includes compilation).
  With ``ckpt`` (a ``jaxdp.CheckpointManager``) the state is saved after every
  ``config.ckpt_every`` steps, with the pipeline position to resume from;
  checkpoints are numbered by the steps run (``done`` before this call), which
  only grows, whatever the batch size of a resumed run.
  """
  records, pending, clock = [], None, time.perf_counter()
  with tqdm.tqdm(total=config.steps, initial=start, desc=desc, disable=not config.progress, dynamic_ncols=True) as bar:
    for step, (batch, weights) in pipeline.iterate(start_step=start, num_steps=config.steps - start):
      state, metrics = step_fn(state, batch, weights, rng=rng)
      if ckpt is not None:
        ckpt.save(done + step - start + 1, state, rng=rng, data_step=step + 1, data=pipeline)
      if pending is not None:
        clock = _log(pending, clock, records, bar, sink)
      pending = (step, metrics, weights)
    if pending is not None:
      _log(pending, clock, records, bar, sink)
  return state, records


def _throughput(records: list[dict]) -> float:
  steady = records[1:] or records  # the first step includes compilation
  return sum(r["tokens"] for r in steady) / max(sum(r["time"] for r in steady), 1e-9)


def train(config: Config, *, devices=None, reduction: str | None = None, data=None, out: str | None = None, desc: str = "train",
          params=None) -> dict:
  """Trains one model; returns its records, validation loss, throughput and final params.

  Args:
    config: the run's settings.
    devices: the devices (default ``select_devices(config.devices)``), laid
      out as ``config.mesh`` says (default: one data axis over all of them).
    reduction: overrides ``config.reduction``.
    data: ``(train_chunks, val_chunks)``, default ``build_dataset(config)``.
    out: folder for ``metrics.jsonl`` and ``summary.json`` (``None``: write nothing).
    params: initial params of the model's layout (default: drawn from ``config.seed``), e.g. the list
      model's weights stacked with ``lm.stack_blocks`` for ``--scan-layers``.
  """
  if config.diloco_inner_steps is not None:
    return train_diloco(config, devices=devices, reduction=reduction, data=data, out=out, desc=desc, params=params)
  config = with_pipeline_defaults(config)
  mesh = build_mesh(config, devices)
  devices = list(mesh.devices.flat)
  axis_name, n = data_axes(mesh), data_parallel_size(mesh)
  reduction = reduction or config.reduction
  _check_batch(config, n)
  train_set, val_set = build_dataset(config) if data is None else data
  collate = corpus.make_collate(config.seq_len)
  definition, drawn = make_model(config)
  params = drawn if params is None else params
  layers = layerwise_stack(config, reduction)
  specs = param_specs(params, mesh)
  loss_fn, optimizer = lm.make_loss_fn(definition), make_optimizer(config)
  scaling = jaxdp.dynamic_loss_scale() if config.loss_scaling == "dynamic" else None
  powersgd = None if config.powersgd_rank is None else jaxdp.reductions.powersgd(
      config.powersgd_rank, start_iter=config.powersgd_start_iter)
  pipeline_plan = make_pipeline(config)
  # The step's three values: the layout, the reduction, the precision policy.
  dp = jaxdp.data_parallel(mesh, axis_name=axis_name, zero_stage=config.zero_stage, layers=layers,
                           pipeline=pipeline_plan, param_specs=specs)
  reduction_value = common.reduction_of(reduction, config.bucket_bytes, powersgd)
  policy = common.precision_of(config.compute_dtype, config.grad_reduce_dtype, scaling)
  step_fn = jaxdp.make_train_step(loss_fn, optimizer, dp, reduction=reduction_value, precision=policy,
                                  accum_steps=config.accum_steps)
  per_device = config.batch_size // n
  pipeline = DataPipeline(train_set, collate, mesh, per_device_batch=per_device, seed=config.seed, axis_name=axis_name)
  rng = jax.random.key(config.seed) if config.dropout > 0 else None  # made per replica/step by jaxdp
  with _checkpoints(config) as ckpt:
    # With a pipeline the layout places the stacks over the stages at once.
    state, start, done = jaxdp.init_state(params, optimizer, dp, reduction=reduction_value, precision=policy), 0, 0
    if ckpt is not None and ckpt.latest_step() is not None:
      if layers is None:
        replicated = jaxdp.data_parallel(mesh, axis_name=axis_name, zero_stage=config.zero_stage)  # no model split
        restored = ckpt.restore(params=params, optimizer=optimizer, layout=replicated, data=pipeline,
                                reduction=reduction_value)
      else:  # straight into the layer-wise layout (place_state knows only the whole-gather one)
        restored = ckpt.restore(params=params, optimizer=optimizer, layout=dp, data=pipeline,
                                reduction=reduction_value)
      state, start, done = restored.state, restored.data_step, restored.step
      if specs is not None and layers is None:  # restore places the params replicated over "model"; split them again
        state = jaxdp.place_state(state, optimizer, dp)
      print(f"resuming from {config.ckpt_dir} at step {start}")
    with _metrics_file(out, append=start > 0, tensorboard=config.tensorboard) as sink:
      state, records = fit(step_fn, state, pipeline, config, rng, sink, desc, start=start, ckpt=ckpt, done=done)
  val = evaluate(loss_fn, state, val_set, mesh, collate, per_device_batch=4 * per_device, axis_name=axis_name,
                 layers=layers, pipeline_plan=pipeline_plan)
  val_loss = None if val is None else val["loss"]
  summary = {
      "devices": len(devices), "mesh": dict(mesh.shape), "zero_stage": config.zero_stage,
      "scan_layers": config.scan_layers, "layerwise": layers is not None and pipeline_plan is None,
      "pipeline": None if pipeline_plan is None else pipeline_plan._asdict(),
      "platform": devices[0].platform, "reduction": reduction, "dropout": config.dropout,
      "train_sequences": len(train_set), "val_sequences": len(val_set), "start_step": start, "steps": len(records),
      "final_loss": records[-1]["loss"] if records else None, "val_loss": val_loss,
      "val_accuracy": None if val is None else val["accuracy"],
      "tokens_per_s": _throughput(records), "config": dataclasses.asdict(config),
  }
  if scaling is not None:  # the steps a non-finite gradient skipped (the scale backed off), and the last scale
    summary.update(skipped_steps=sum(r["skipped"] for r in records),
                   final_loss_scale=records[-1]["loss_scale"] if records else None)
  if out is not None:
    (pathlib.Path(out) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  return {"records": records, "summary": summary, "params": state.params}


def _diloco_metrics(metrics: dict) -> dict:
  """The groups' metrics (leading ``[R]``) as one run's: means weighted by each group's tokens, tokens summed."""
  weight = metrics["weight"]
  share = weight / jnp.maximum(jnp.sum(weight), 1.0)
  whole = {"weight": jnp.sum(weight), "synced": metrics["synced"]}
  if "loss_scale" in metrics:  # each group's own scale: the smallest, and whether any group skipped
    whole.update(loss_scale=jnp.min(metrics["loss_scale"]), skipped=jnp.max(metrics["skipped"]))
  return {**{k: jnp.sum(v * share) for k, v in metrics.items() if k not in whole}, **whole}


def train_diloco(config: Config, *, devices=None, reduction: str | None = None, data=None, out: str | None = None,
                 desc: str = "train", params=None) -> dict:
  """:func:`train` with DiLoCo (``jaxdp.make_diloco_step``): the exact step inside each group of the ``replica``
  axis, the outer Nesterov step every ``config.diloco_inner_steps`` steps; evaluated on the outer parameters.

  The logged loss, accuracy and gradient norm are the groups' means weighted by their tokens.
  """
  mesh = build_mesh(config, devices)
  reduction = reduction or config.reduction
  if "replica" not in mesh.axis_names or "model" in mesh.axis_names or STAGE_AXIS in mesh.axis_names:
    raise ValueError(f"--diloco-inner-steps needs --mesh replica=R,data=D (no model or stage axis), got --mesh "
                     f"{config.mesh}")
  devices = list(mesh.devices.flat)
  n = data_parallel_size(mesh)
  _check_batch(config, n)
  train_set, val_set = build_dataset(config) if data is None else data
  collate = corpus.make_collate(config.seq_len)
  definition, drawn = make_model(config)
  params = drawn if params is None else params
  loss_fn, optimizer = lm.make_loss_fn(definition), make_optimizer(config)
  layers = layerwise_stack(config, reduction)
  # Each group's data axis ("replica" is the outer axis), with its ZeRO stage (layer-wise with --scan-layers).
  groups = jaxdp.data_parallel(mesh, axis_name="data", zero_stage=config.zero_stage, layers=layers)
  scaling = jaxdp.dynamic_loss_scale() if config.loss_scaling == "dynamic" else None
  policy = common.precision_of(config.compute_dtype, config.grad_reduce_dtype, scaling)
  step = jaxdp.make_diloco_step(
      loss_fn, optimizer, groups, inner_steps=config.diloco_inner_steps,
      delta_dtype=None if config.diloco_delta_dtype == "float32" else jnp.dtype(config.diloco_delta_dtype),
      reduction=common.reduction_of(reduction), precision=policy,
      accum_steps=config.accum_steps,
  )
  per_device = config.batch_size // n
  axis_name = ("replica", "data")  # the pipeline splits the rows over both axes, as the step does
  pipeline = DataPipeline(train_set, collate, mesh, per_device_batch=per_device, seed=config.seed, axis_name=axis_name)
  rng = jax.random.key(config.seed) if config.dropout > 0 else None
  state, start, done = jaxdp.init_diloco_state(params, optimizer, groups, precision=policy), 0, 0

  def step_fn(state, batch, weights, rng=None):
    state, metrics = step(state, batch, weights, rng)
    return state, _diloco_metrics(metrics)

  with _checkpoints(config) as ckpt:
    if ckpt is not None and ckpt.latest_step() is not None:  # the groups' states, the outer state, the period
      restored = ckpt.restore_diloco(params=params, inner_optimizer=optimizer, layout=groups,
                                     precision=policy, data=pipeline)
      state, start, done = restored.state, restored.data_step, restored.step
      print(f"resuming from {config.ckpt_dir} at step {start}")
    with _metrics_file(out, append=start > 0, tensorboard=config.tensorboard) as sink:
      state, records = fit(step_fn, state, pipeline, config, rng, sink, desc, start=start, ckpt=ckpt, done=done)
  outer = jaxdp.TrainState(jaxdp.runtime.diloco.diloco_params(state), None, state.inner_step)
  val = evaluate(loss_fn, outer, val_set, mesh, collate, per_device_batch=4 * per_device, axis_name=axis_name,
                 layers=layers)
  summary = {
      "devices": len(devices), "mesh": dict(mesh.shape), "zero_stage": config.zero_stage,
      "scan_layers": config.scan_layers, "layerwise": layers is not None,
      "platform": devices[0].platform, "reduction": reduction, "dropout": config.dropout,
      "diloco_inner_steps": config.diloco_inner_steps, "diloco_delta_dtype": config.diloco_delta_dtype,
      "train_sequences": len(train_set), "val_sequences": len(val_set), "start_step": start, "steps": len(records),
      "final_loss": records[-1]["loss"] if records else None, "val_loss": None if val is None else val["loss"],
      "val_accuracy": None if val is None else val["accuracy"],
      "tokens_per_s": _throughput(records), "config": dataclasses.asdict(config),
  }
  if out is not None:
    (pathlib.Path(out) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  return {"records": records, "summary": summary, "params": jaxdp.runtime.diloco.diloco_params(state), "state": state,
          "step": step}


def _metrics_file(out: str | None, append: bool = False, tensorboard: bool = False):
  if out is None:
    return contextlib.nullcontext(None)
  return common.MetricsSink(out, append=append, tensorboard=tensorboard)


def _checkpoints(config: Config):
  if config.ckpt_dir is None:
    return contextlib.nullcontext(None)
  return jaxdp.CheckpointManager(config.ckpt_dir, save_interval_steps=config.ckpt_every, max_to_keep=2)


RUNS = (("single", "mean"), ("mean", "mean"), ("rank_mean", "rank_mean"))
"""The runs of :func:`compare`: (name, reduction); "single" is one device on the global batch."""


def _param_diff(a, b) -> dict:
  """Largest |a − b| over every parameter, and ‖a − b‖ / ‖b‖ over all of them."""
  a, b = (np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(t)]) for t in (a, b))
  return {"max_abs_param_diff": float(np.max(np.abs(a - b))), "rel_param_diff": float(np.linalg.norm(a - b) / np.linalg.norm(b))}


def compare(config: Config) -> dict:
  """Same init, same data: 1 device vs N devices ("mean") vs N devices ("rank_mean").

  With ``config.mesh`` the two N-device runs use that mesh (and
  ``config.zero_stage``); the single device has no mesh of its own.
  With ``--scan-layers --zero-stage 3`` the "mean" run is layer-wise stage 3 and
  the "rank_mean" run stage 3 with the whole gather; the single device runs
  the same stacked model. With a stage axis both N-device runs are pipelined
  and the single device runs the same stack through ``jaxdp.scan_layers``
  (a ``lax.scan`` there).
  Dropout is set to 0: the per-replica dropout keys depend on the layout, so
  with dropout on the runs would differ by their masks, not their reduction.
  Returns (and, with ``config.out``, saves) for each N-device run against the
  single device: the largest per-step |loss difference|, the difference of
  the validation losses and of the final parameters; and the number of steps
  in which the devices held uneven token counts.
  """
  config = with_pipeline_defaults(dataclasses.replace(config, dropout=0.0, ckpt_dir=None))  # no shared checkpoints
  devices = select_devices(config.devices)
  if len(devices) == 1:
    print("compare: only one device, so runs (1) and (2) have the same layout; use --devices N (N > 1).")
  data = build_dataset(config)
  single = dataclasses.replace(config, devices=None, mesh=None, zero_stage=0)
  runs = {}
  for name, reduction in RUNS:
    out = None if config.out is None else os.path.join(config.out, name)
    if name == "single":
      runs[name] = train(single, devices=devices[:1], reduction=reduction, data=data, out=out, desc=name)
    else:
      runs[name] = train(config, devices=devices, reduction=reduction, data=data, out=out, desc=name)
  result = _gaps(runs, runs["mean"]["summary"]["devices"])
  if config.out is not None:
    out = pathlib.Path(config.out)
    (out / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "summary.json").write_text(json.dumps({k: r["summary"] for k, r in runs.items()}, indent=2) + "\n")
    plot_curves(runs, result, out / "loss_curves.png")
  return {**result, "runs": runs}


def _gaps(runs: dict, n: int) -> dict:
  loss = {k: np.array([r["loss"] for r in run["records"]]) for k, run in runs.items()}
  val = {k: run["summary"]["val_loss"] for k, run in runs.items()}
  uneven = sum(len(set(r["device_tokens"])) > 1 for r in runs["mean"]["records"])
  ulp = float(np.spacing(np.float32(np.max(loss["single"]))))  # float32 spacing at the largest loss
  result = {"devices": n, "dropout": 0.0, "steps": len(loss["single"]), "uneven_steps": uneven,
            "float32_ulp_at_max_loss": ulp, "val_loss": val}
  for k in ("mean", "rank_mean"):
    result[f"{k}_vs_single"] = {
        "max_abs_loss_diff": float(np.max(np.abs(loss[k] - loss["single"]))),
        "final_val_loss_diff": None if val[k] is None else float(val[k] - val["single"]),
        **_param_diff(runs[k]["params"], runs["single"]["params"]),
    }
  return result


def plot_curves(runs: dict, result: dict, path) -> None:
  """Loss per step of every run, and |loss − single device| on a log scale."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  n = result["devices"]
  labels = {"single": "1 device, global batch", "mean": f"{n} devices, mean", "rank_mean": f"{n} devices, rank_mean"}
  loss = {k: np.array([r["loss"] for r in run["records"]]) for k, run in runs.items()}
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  for k, styles in (("single", "-"), ("mean", "--"), ("rank_mean", ":")):
    left.plot(loss[k], styles, label=labels[k])
  for k in ("mean", "rank_mean"):
    right.semilogy(np.maximum(np.abs(loss[k] - loss["single"]), 1e-10), label=labels[k])
  uneven = [r["step"] for r in runs["mean"]["records"] if len(set(r["device_tokens"])) > 1]
  right.plot(uneven, np.full(len(uneven), 1e-10), "|", color="gray", markersize=12, label="uneven token counts")
  right.axhline(result["float32_ulp_at_max_loss"], color="gray", lw=0.8, ls="--", label="float32 ulp at max loss")
  left.set(xlabel="step", ylabel="train loss (nats/byte)", title="byte-level LM, dropout 0")
  right.set(xlabel="step", ylabel="|loss − 1-device loss|", title="gap to the single-device run (0 drawn at 1e-10)")
  right.set_ylim(5e-11, 10.0)  # room above the curves for the legend
  left.legend(), right.legend(loc="upper center", ncol=2, fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """The command line with ``--quick``'s defaults filled in; ``--publish`` needs ``--compare``."""
  parser = _parser()
  args = parser.parse_args(argv)
  common.check_publish(parser, args)
  if args.publish and not args.compare:
    parser.error("--publish copies --compare's loss_curves.png: add --compare.")
  return common.fill_defaults(args, FULL, QUICK)


def config_from_args(argv: list[str] | None = None) -> Config:
  args = vars(parse_args(argv))
  config = Config(**{k: v for k, v in args.items() if k not in ("quick", "publish")})
  if stage_count(config) is None and (config.microbatches is not None or config.schedule != "gpipe"
                                      or config.repeats != 1):
    raise ValueError("--microbatches, --schedule and --repeats configure a pipeline: add a stage axis to --mesh "
                     "(e.g. --mesh stage=2,data=4)")
  return with_pipeline_defaults(config)


def with_pipeline_defaults(config: Config) -> Config:
  """With a stage axis: the blocks stacked (``scan_layers``), ``microbatches`` 2 x stages unless given."""
  stages = stage_count(config)
  if stages is None:
    return config
  return dataclasses.replace(config, scan_layers=True, microbatches=config.microbatches or 2 * stages)


def _report_train(summary: dict) -> str:
  val = summary["val_loss"]
  mesh = " x ".join(f"{k}={v}" for k, v in summary["mesh"].items())
  stage = f"ZeRO stage {summary['zero_stage']}{' layer-wise' if summary.get('layerwise') else ''}"
  scanned = ", scanned layers" if summary.get("scan_layers") else ""
  plan = summary.get("pipeline")
  if plan:
    scanned += (f", pipeline {plan['schedule']} M={plan['microbatches']}"
                f"{' R=%d' % plan['repeats'] if plan['repeats'] > 1 else ''}")
  return (f"{summary['devices']} {summary['platform']} device(s) (mesh {mesh}, {stage}{scanned}), "
          f"reduction={summary['reduction']!r}, "
          f"dropout={summary['dropout']}: {_train_figures(summary)}, "
          f"val loss {'n/a' if val is None else f'{val:.4f}'} nats/byte")


def _train_figures(summary: dict) -> str:
  if summary["final_loss"] is None:  # resumed from a checkpoint at the last step: nothing left to train
    return f"no step to run (resumed at step {summary['start_step']})"
  return f"final train loss {summary['final_loss']:.4f}, {summary['tokens_per_s']:.0f} tokens/s"


def _report_compare(result: dict) -> str:
  lines = [f"compare (dropout 0; same init, same data; {result['devices']} devices vs 1; "
           f"devices held uneven token counts in {result['uneven_steps']} of {result['steps']} steps):"]
  for k in ("mean", "rank_mean"):
    g = result[f"{k}_vs_single"]
    val = "n/a" if g["final_val_loss_diff"] is None else f"{g['final_val_loss_diff']:+.3e}"
    lines.append(f"  {k:>9} vs single: max |Δ train loss| {g['max_abs_loss_diff']:.3e}, "
                 f"Δ val loss {val}, ‖Δ params‖/‖params‖ {g['rel_param_diff']:.2e}")
  lines.append(f"  (float32 ulp at the largest loss: {result['float32_ulp_at_max_loss']:.3e}; rank_mean's reported "
               "loss is itself a mean of per-device means, so its gap includes that definition.)")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
  args = parse_args(argv)
  config = config_from_args(argv)
  # Under `python -m jaxdp.launch` (or SLURM, Open MPI, a TPU slice) this joins the job; alone it does nothing.
  info = jaxdp.runtime.distributed.initialize()
  if info.process_index != 0:  # one writer: every process computes the same metrics
    config = dataclasses.replace(config, out=None, progress=False)
  start = time.perf_counter()
  if config.compare:
    result = compare(config)
    for name, _ in RUNS:
      print(f"[{name}] " + _report_train(result["runs"][name]["summary"]))
    print(_report_compare(result))
    if config.out is not None:  # process 0
      common.publish(args, {"loss_curves.png": "loss_curves.png"})
  else:
    result = train(config, out=config.out)
    print(_report_train(result["summary"]))
  print(f"wall time {time.perf_counter() - start:.1f} s; outputs in {config.out}")
  return result


if __name__ == "__main__":
  main()
