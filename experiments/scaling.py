"""The α-β scaling model (``jaxdp.analysis.scaling``): checked on 1-8 simulated CPU devices, then used for 8-1,024.

1. **Check against what can be measured here.** MLP 784-1024-1024-10 (1.86M
   params), Adam, fp32, global batch 512, ``jaxdp.make_train_step`` on
   sub-meshes of 1, 2, 4, 8 simulated CPU devices (2 shared cores):

   * step time with the gradient all-reduce (``jaxdp.reductions.mean()``) and
     without any communication (``jaxdp.reductions.none()``, same work otherwise),
     every case one runner of ``common.time_interleaved`` (a new shuffled
     order each round) and summarised by ``common.stats``; the communication
     in the step is the median over rounds of (with - without) in the same
     round;
   * the one-device step at batches 64 and 512: the slope is the compute time
     per example, the intercept the per-step update (and fixed overhead);
   * a ``psum`` micro-benchmark (64 KiB, 1, 4 and 16 MiB, plus the
     gradient's 7.45 MB; 2/4/8 devices), each psum interleaved with a no-op
     dispatch on the same mesh and input (both runners of one
     ``time_interleaved`` call), its time the median over rounds of the
     per-round difference: a least-squares fit (non-negative) of the
     model's all-reduce ``launch + 2(N-1)·α + 2(N-1)/N·M / bandwidth`` gives
     the "simulated CPU" link. Both a point-to-point link and a *shared* one
     (the devices copy through one host memory, each getting bandwidth/N)
     are fitted; the one with the smaller residual is used;
   * collective bytes from the compiled HLO (``jaxdp.comm_report``) at every
     N (stage 0) and stages 1-3 at the largest N, against the model's
     schedule (exact: they are counted, not timed).

   Predicted step = model compute + model communication ("ideal devices":
   each device its own cores) and = measured no-communication step + model
   communication (isolates the communication model; out of sample with the
   psum-fitted link, which never sees the steps), next to the measured
   no-communication step alone (zero modelled communication: the baseline
   error) and the ratio of modelled to measured communication in the step.
   Timing on 2 shared
   cores is noisy (p10-p90 spread ±15%) and 8 "devices" share 2 cores, so
   the ideal-device prediction is *not* expected to hold beyond 2 devices.

2. **Predict** 8, 64, 256, 1,024 devices: H100 SXM nodes of 8 (NVLink 4 +
   NDR InfiniBand) and TPU v5e (256-chip pods over DCN); transformers of 1.3B
   and 7B params, 6·Ψ FLOPs per token (Kaplan et al. 2020), sequences of
   2,048 tokens, 4 per device, 40% MFU assumed; mixed-precision Adam (K=12);
   DDP's 25 MiB buckets; overlap 0 and 1.

3. **Compare** with the ZeRO paper's memory table (7.5B params, 64 GPUs) and
   with the near-linear 256-GPU scaling of PyTorch DDP (Li et al. 2020).
   Memory: jaxdp's schedule (stage 3 keeps every split parameter gathered
   through the step) for the predictions and the fit marks; the largest
   model per stage at 80 GB (H100) and 16 GB (v5e) under jaxdp's whole
   gather, jaxdp's layer-wise stage 3 (``data_parallel(mesh, zero_stage=3, layers=...)``, counted with two layers
   gathered at once, room for prefetch; L = 80 stacked layers, a large transformer's, every
   split parameter counted in the stack) and the paper's layer-by-layer
   stage 3 (one gathered layer, not counted).

4. Writes ``scaling.png``, ``scaling.md`` and ``scaling.json`` under
   ``--out`` (default ``out/scaling``; ``out/scaling_quick`` with
   ``--quick``); ``--publish`` also copies them to ``docs/scaling.png``,
   ``docs/data/scaling_report.md`` and ``docs/data/scaling.json`` (the
   guide ``docs/scaling.md`` quotes that data and is not rewritten). Prints a summary,
   with the largest-model table. ``--model-only`` measures nothing: it reads
   section 1's measurements from the ``scaling.json`` under ``--out`` (or,
   when there is none, the published ``docs/data/scaling.json``), recomputes
   sections 2-3 (pure arithmetic) and rewrites the three files (a second or two).

Run from the repository root (sets ``JAX_NUM_CPU_DEVICES=8`` itself):

  .venv/bin/python experiments/scaling.py            # 40-90 s on 2 shared cores
  .venv/bin/python experiments/scaling.py --quick    # devices 1, 2, 8; fewer steps
  .venv/bin/python experiments/scaling.py --model-only  # sections 2-3 again from the last run's measurements

--quick: about 12 s on an idle 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

if __name__ == "__main__":  # must happen before JAX initialises its backend
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from scipy.optimize import nnls

import jaxdp
from experiments import common
from jaxdp.analysis import scaling

LAYERS = (784, 1024, 1024, 10)
GLOBAL_BATCH = 512
SMALL_BATCH = 64  # second one-device batch: the slope between the two is the time per example
MICRO_BYTES = (2**16, 2**20, 2**22, 2**24)  # psum sizes around the gradient's (7.45 MB), which is added
JAXDP_SCALARS = 8  # Σw·l and Σw, all-reduced with the gradient (alone at stages 2-3)
MS = 1e3

SEQ_LEN, SEQS_PER_DEVICE, MFU = 2048, 4, 0.40
MODELS = {"1.3B": 1.3e9, "7B": 7e9}
PREDICT_DEVICES = (8, 64, 256, 1024)
PREDICT_LAYERS = 80  # stacked layers for schedule="layerwise" (a large transformer's depth, e.g. Llama 2 70B's)
CLUSTERS = {
    "H100 + NDR IB": (scaling.H100_NDR, scaling.H100_SXM),
    "TPU v5e (+DCN)": (scaling.TPU_V5E_SLICES, scaling.TPU_V5E),
}
# A mixed-precision Adam update reads and writes about 28 bytes per param (bf16 grad 2;
# fp32 master, m and v read and written 24; bf16 param 2): memory-bound at HBM speed.
ADAM_UPDATE_BYTES = 28
ZERO_PAPER_64 = (120, 31.4, 16.6, 1.88)  # GB per device, 7.5B params, 64 GPUs, K=12 (Rajbhandari et al. 2020)


# --------------------------------------------------------------------------
# The measured model.
# --------------------------------------------------------------------------


def mlp_params(seed=0):
  """He-initialised weights, zero biases (numpy: jax.random would compile a sampler per shape, ~5 s here)."""
  rng = np.random.default_rng(seed)
  return {f"layer{i}": {"w": (rng.standard_normal((a, b)) * math.sqrt(2 / a)).astype(np.float32),
                        "b": np.zeros((b,), np.float32)}
          for i, (a, b) in enumerate(zip(LAYERS[:-1], LAYERS[1:]))}


def loss_fn(params, batch):
  """Per-example softmax cross-entropy ``[b]`` of a ReLU MLP."""
  h = batch["x"]
  for i in range(len(LAYERS) - 1):
    h = h @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"][None, :]
    h = jax.nn.relu(h) if i < len(LAYERS) - 2 else h
  return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"])


def make_batch(rows, seed=0):
  rng = np.random.default_rng(seed)
  return {"x": rng.standard_normal((rows, LAYERS[0]), dtype=np.float32),
          "y": rng.integers(0, LAYERS[-1], rows).astype(np.int32)}


def param_count():
  return sum(a * b + b for a, b in zip(LAYERS[:-1], LAYERS[1:]))


def split_count(n):
  """``(Ψ_s, leaves)``: parameters (and leaves) ZeRO splits over ``n`` devices; the others stay whole."""
  return scaling.split_params_of(jax.eval_shape(mlp_params), n)


class Case:
  """A step bound to its state and batch; ``run()`` advances it by one step (the state is donated)."""

  def __init__(self, n, reduction="mean", batch_size=GLOBAL_BATCH, zero_stage=0):
    dp = jaxdp.data_parallel(jaxdp.data_mesh(jax.devices()[:n]), zero_stage=zero_stage)
    self.optimizer = optax.adam(1e-3)
    self.step = jaxdp.make_train_step(loss_fn, self.optimizer, dp, reduction=common.reduction_of(reduction))
    self.state = jaxdp.init_state(mlp_params(), self.optimizer, dp)
    self.batch = make_batch(batch_size)

  def run(self):
    self.state, metrics = self.step(self.state, self.batch)
    jax.block_until_ready((self.state, metrics))

  def comm(self):
    return jaxdp.comm_report(self.step, self.state, self.batch)


def seconds(times_ms):
  """``common.time_interleaved`` reports ms; the model works in seconds."""
  return [t / MS for t in times_ms]


def paired_difference(a, b):
  """Median over rounds of a - b, both timed in the same round (``time_interleaved``): drift cancels."""
  return statistics.median(x - y for x, y in zip(a, b))


def measure_steps(devices, rounds, warmup=2):
  """Step times (with and without communication), the one-device batch sweep, and counted collectives.

  Every case is one runner of ``common.time_interleaved``: one step of each per round, in a new shuffled
  order each round, so load drift and what a step leaves behind hit all cases alike.
  """
  cases = {(n, red): Case(n, red) for n in devices for red in ("mean", "none")}
  cases["small"] = Case(1, "none", SMALL_BATCH)
  names = {str(key): key for key in cases}
  times = common.time_interleaved({name: cases[key].run for name, key in names.items()}, rounds, warmup)
  times = {key: seconds(times[name]) for name, key in names.items()}
  timed = {key: common.stats(t) for key, t in times.items()}
  comm = {n: paired_difference(times[n, "mean"], times[n, "none"]) for n in devices}
  counted = {n: cases[n, "mean"].comm() for n in devices if n > 1}
  return timed, comm, counted


def count_stages(n):
  """Counted collectives of stages 1-3 at ``n`` devices (compiled, not run)."""
  return {stage: Case(n, zero_stage=stage).comm() for stage in (1, 2, 3)}


# --------------------------------------------------------------------------
# The "simulated CPU" link: psum micro-benchmark and fit.
# --------------------------------------------------------------------------


def measure_allreduce(devices, sizes, reps, warmup=2):
  """Seconds of one ``psum`` of ``nbytes`` per device, less a no-op dispatch on the same mesh and input.

  Per device count, every size's psum and its no-op are runners of one ``common.time_interleaved`` call
  (shuffled each round); a sample's time is the median over rounds of (psum - no-op) in the same round.
  """
  samples = []
  for n in (d for d in devices if d > 1):
    mesh = jaxdp.data_mesh(jax.devices()[:n])
    psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()))
    noop = jax.jit(jax.shard_map(lambda v: v[:, :1], mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    runners, counted = {}, {}
    for nbytes in sizes:
      x = jax.device_put(np.ones((n, nbytes // 4), np.float32), NamedSharding(mesh, P("data")))
      counted[nbytes] = jaxdp.analysis.reports.collectives_from_hlo(psum.lower(x).compile().as_text(), n)["all-reduce"].bytes
      runners[f"psum {nbytes}"] = lambda x=x: jax.block_until_ready(psum(x))
      runners[f"noop {nbytes}"] = lambda x=x: jax.block_until_ready(noop(x))
    times = common.time_interleaved(runners, reps, warmup)
    for nbytes in sizes:
      call, dispatch = seconds(times[f"psum {nbytes}"]), seconds(times[f"noop {nbytes}"])
      difference = common.stats([c - d for c, d in zip(call, dispatch)])
      samples.append({"n": n, "bytes": counted[nbytes], "call": statistics.median(call),
                      "dispatch": statistics.median(dispatch), "seconds": difference["median"],
                      "p10": difference["p10"], "p90": difference["p90"], "rounds": difference["n"]})
  return samples


def _features(n, nbytes, shared):
  """Columns of the all-reduce model, linear in (launch, α, 1/bandwidth), on one node of n devices."""
  return [1.0, 2 * (n - 1), 2 * (n - 1) / n * nbytes * (n if shared else 1)]


def cpu_topology(launch, alpha, bandwidth, shared, source):
  link = scaling.Link("simulated CPU (fitted)", bandwidth, alpha, shared, source)
  return scaling.Topology("8 simulated CPU devices on 2 cores", link, 8, None, launch)


def fit_link(samples, shared):
  """Non-negative least squares of the collective's time, each sample's error relative to its whole call.

  Returns the topology and the RMS of those relative residuals. (The collective's own time, the call less
  a no-op's dispatch, can be near 0 or even negative for small messages: it cannot be the denominator.)
  """
  a = np.array([_features(s["n"], s["bytes"], shared) for s in samples])
  t = np.array([s["seconds"] for s in samples])
  w = 1 / np.array([s["call"] for s in samples])
  (launch, alpha, inv_bw), _ = nnls(a * w[:, None], t * w)
  topology = cpu_topology(launch, alpha, 1 / max(inv_bw, 1e-15), shared, "fitted to psum micro-benchmarks")
  predicted = a @ np.array([launch, alpha, inv_bw])
  return topology, float(np.sqrt(np.mean(((predicted - t) * w) ** 2)))


def refit_bandwidth(topology, comm, nbytes):
  """The bandwidth that best explains the steps' own communication (least squares), α and launch kept.

  One parameter for the 2-3 device counts measured: the steps' all-reduce also waits for the slowest of
  the device threads sharing 2 cores, which an isolated psum does not.
  """
  unit = topology._replace(intra=topology.intra._replace(bandwidth=1.0, latency=0.0), launch_latency=0.0)
  fixed = topology._replace(intra=topology.intra._replace(bandwidth=1e300))  # latency terms only
  ns = [n for n in comm if n > 1]
  x = np.array([scaling.collective_time("all-reduce", nbytes, n, unit) for n in ns])  # bytes / (bytes/s)
  y = np.array([comm[n] - scaling.collective_time("all-reduce", nbytes, n, fixed) for n in ns])
  inv_bw = max(float(x @ y / (x @ x)), 1e-15)
  return topology._replace(intra=topology.intra._replace(bandwidth=1 / inv_bw, source="fitted to the steps"))


def cpu_model(one_device):
  """ModelCost from the one-device steps at two batches: slope per example, intercept per step."""
  big, small = one_device[GLOBAL_BATCH], one_device[SMALL_BATCH]
  per_example = (big - small) / (GLOBAL_BATCH - SMALL_BATCH)
  return scaling.ModelCost(param_count(), per_example, max(small - SMALL_BATCH * per_example, 0.0),
                           scaling.FP32_ADAM)


def check_rows(devices, timed, comm, topologies, model):
  """Predicted vs measured step per device count: ideal devices, and measured no-comm step + model comm."""
  rows = []
  for n in devices:
    norm_bytes = scaling.jaxdp_norm_bytes(0, split_count(n)[1])  # the stage-0 norm's 4-byte all-reduce
    predicted = {name: scaling.step_time(model, n, topology, batch_per_device=GLOBAL_BATCH // n,
                                         scalar_bytes=JAXDP_SCALARS, norm_bytes=norm_bytes)
                 for name, topology in topologies.items()}
    measured, quiet = timed[n, "mean"]["median"], timed[n, "none"]["median"]
    row = {"n": n, "measured": measured, "p10": timed[n, "mean"]["p10"], "p90": timed[n, "mean"]["p90"],
           "no_comm": quiet, "measured_comm": comm[n], "model_ideal": predicted["psum"].total}
    for name, t in predicted.items():
      row[f"model_comm_{name}"] = t.communication
      row[f"hybrid_{name}"] = quiet + t.communication
      row[f"error_hybrid_{name}"] = (quiet + t.communication) / measured - 1
      # modelled / measured communication in the step (None where the measured difference is not positive)
      row[f"comm_ratio_{name}"] = t.communication / comm[n] if n > 1 and comm[n] > 0 else None
    row["error_ideal"] = row["model_ideal"] / measured - 1
    row["error_no_comm"] = quiet / measured - 1  # zero modelled communication: the baseline for the hybrid errors
    rows.append(row)
  return rows


def bytes_rows(counted, stage_counts, n_max):
  """Counted collective bytes per kind against the model's schedule (unsplit leaves and scalars included)."""
  rows = []
  for n, stage, report in [(n, 0, c) for n, c in counted.items()] + [(n_max, s, c) for s, c in stage_counts.items()]:
    split, leaves = split_count(n)
    ops = scaling.collectives(param_count(), n, stage, scaling.FP32_ADAM, split_params=split,
                              scalar_bytes=JAXDP_SCALARS, norm_bytes=scaling.jaxdp_norm_bytes(stage, leaves))
    for kind in scaling.KINDS:
      model = sum(op.nbytes for op in ops if op.kind == kind)
      model_traffic = sum(scaling.ring_traffic(kind, op.nbytes, n) for op in ops if op.kind == kind)
      if model or report[kind].bytes:
        rows.append({"n": n, "stage": stage, "kind": kind, "counted": report[kind].bytes, "model": model,
                     "counted_traffic": report[kind].traffic_bytes, "model_traffic": model_traffic,
                     "ops": report[kind].count})
  return rows


# --------------------------------------------------------------------------
# Predictions for clusters, and the two papers.
# --------------------------------------------------------------------------


def transformer(psi, device):
  """ModelCost of a ``psi``-param transformer on ``device``: 6Ψ FLOPs/token at MFU; Adam update at HBM speed."""
  per_sequence = scaling.seconds_per_example(scaling.transformer_flops(psi, SEQ_LEN), device.peak_flops, MFU)
  update = ADAM_UPDATE_BYTES * psi / device.memory_bandwidth
  return scaling.ModelCost(int(psi), per_sequence, update, scaling.MIXED_ADAM)


def predict(options):
  rows = []
  for cluster, (topology, device) in CLUSTERS.items():
    for name, psi in MODELS.items():
      model = transformer(psi, device)
      for stage in scaling.ZERO_STAGES:
        for n in PREDICT_DEVICES:
          t0, t1 = (scaling.step_time(model, n, topology, batch_per_device=SEQS_PER_DEVICE, zero_stage=stage,
                                      overlap=overlap, **options) for overlap in (0.0, 1.0))
          whole = scaling.step_time(model, n, topology, batch_per_device=SEQS_PER_DEVICE, zero_stage=stage,
                                    **(options | {"bucket_bytes": None}))
          memory = scaling.memory_per_device(psi, n, stage)  # jaxdp's schedule: stage 3 keeps the gathered params
          memory_paper = scaling.memory_per_device(psi, n, stage, schedule="paper")
          rows.append({"cluster": cluster, "model": name, "stage": stage, "n": n, "compute": t0.compute,
                       "communication": t0.communication, "total": t0.total, "efficiency": t0.efficiency,
                       "total_overlap": t1.total, "efficiency_overlap": t1.efficiency, "launches": t0.launches,
                       "efficiency_one_bucket": whole.efficiency,
                       "memory": memory, "fits": memory <= device.memory_bytes,
                       "memory_paper": memory_paper, "fits_paper": memory_paper <= device.memory_bytes})
  return rows


def comm_bound(options, max_devices=65536):
  """First N where exposed communication exceeds compute, per cluster, model, algorithm and stage (overlap 0)."""
  rows = []
  for cluster, (topology, device) in CLUSTERS.items():
    for name, psi in MODELS.items():
      model = transformer(psi, device)
      for algorithm in scaling.ALGORITHMS:
        for stage in scaling.ZERO_STAGES:
          if algorithm != "hierarchical" and stage:
            continue
          kwargs = dict(options, algorithm=algorithm, zero_stage=stage)
          n = scaling.communication_bound_at(model, topology, batch_per_device=SEQS_PER_DEVICE,
                                             max_devices=max_devices, **kwargs)
          rows.append({"cluster": cluster, "model": name, "algorithm": algorithm, "stage": stage, "n": n})
  return rows


def largest_models():
  """Largest model per device, N and stage: jaxdp's whole gather (``params``), its layer-wise stage 3 with
  ``PREDICT_LAYERS`` layers (``params_layerwise``) and the paper's schedule (``params_paper``)."""
  return [{"memory_gb": device.memory_bytes / scaling.GB, "device": device.name, "n": n, "stage": stage,
           "layers": PREDICT_LAYERS,
           "params": scaling.largest_model(device.memory_bytes, n, stage),
           "params_layerwise": scaling.largest_model(device.memory_bytes, n, stage, schedule="layerwise",
                                                     layers=PREDICT_LAYERS),
           "params_paper": scaling.largest_model(device.memory_bytes, n, stage, schedule="paper")}
          for _, device in CLUSTERS.values() for n in PREDICT_DEVICES for stage in scaling.ZERO_STAGES]


def largest_table(out, device=scaling.H100_SXM):
  """Markdown rows: the largest model per stage (and stage 3 per schedule) on ``device``, billions of params."""
  lines = ["| stage (schedule) | bytes/param | " + " | ".join(f"N = {n:,}" for n in PREDICT_DEVICES) + " |",
           "|---|---|" + "---:|" * len(PREDICT_DEVICES)]
  cases = [(0, "params", "0", "16"), (1, "params", "1", "4 + 12/N"), (2, "params", "2", "2 + 14/N"),
           (3, "params", "3, jaxdp (whole gather)", "2 + 16/N"),
           (3, "params_layerwise", f"3, jaxdp layer-wise (`layers=`, L = {PREDICT_LAYERS})",
            f"16/N + 2·2/{PREDICT_LAYERS}"),
           (3, "params_paper", "3, paper (one layer, not counted)", "16/N")]
  for stage, key, label, formula in cases:
    rows = [next(r for r in out["largest"] if (r["device"], r["n"], r["stage"]) == (device.name, n, stage))
            for n in PREDICT_DEVICES]
    lines.append(f"| {label} | {formula} | " + " | ".join(_billions(r[key]) for r in rows) + " |")
  return lines


def _billions(params):
  return f"{params / 1e12:,.2f}T" if params >= 1e12 else f"{params / 1e9:,.1f}B"


def zero_table():
  """The ZeRO paper's 7.5B / 64-GPU row from its formulas (K=12, layer-by-layer stage 3), and jaxdp's schedule."""
  memory = lambda stage, precision, schedule: scaling.memory_per_device(
      7.5e9, 64, stage, precision, schedule=schedule) / scaling.GB
  return [{"stage": s, "paper_gb": ZERO_PAPER_64[s],
           "formula_gb": memory(s, scaling.MIXED_ADAM, "paper"),
           "jaxdp_gb": memory(s, scaling.MIXED_ADAM, "jaxdp"),
           "fp32_gb": memory(s, scaling.FP32_ADAM, "jaxdp")}
          for s in scaling.ZERO_STAGES]


# DDP paper setting, as far as it is comparable: fp32 gradients, 25 MiB buckets, V100 nodes of 8.
V100_FP32 = scaling.Device("V100 SXM2 (fp32)", 15.7e12, 32 * scaling.GB, 900e9,
                           "NVIDIA V100 datasheet: 15.7 TFLOPS fp32")
DDP_MODELS = {  # params, training FLOPs per example (3 x forward), per-GPU batch: assumptions, see docs
    "ResNet50": (25.6e6, 3 * 2 * 3.8e9, 32),  # He et al. 2016: 3.8e9 multiply-adds per 224x224 image
    "BERT-base": (110e6, scaling.transformer_flops(110e6, 128), 32),  # Devlin et al. 2019; 128 tokens
}
DDP_NETWORKS = {
    "100 Gb/s per GPU": scaling.V100_EDR,
    "100 Gb/s per node": scaling.V100_EDR._replace(
        name="V100 nodes of 8, one 100 Gb/s NIC per node",
        inter=scaling.IB_EDR._replace(name="EDR shared by 8 GPUs", bandwidth=12.5 * scaling.GB / 8)),
}


def ddp_comparison():
  rows = []
  for name, (psi, flops, batch) in DDP_MODELS.items():
    model = scaling.ModelCost(int(psi), scaling.seconds_per_example(flops, V100_FP32.peak_flops, MFU),
                              precision=scaling.FP32_ADAM)
    for network, topology in DDP_NETWORKS.items():
      for overlap in (0.0, 1.0):
        t = scaling.step_time(model, 256, topology, batch_per_device=batch, bucket_bytes=scaling.DDP_BUCKET_BYTES,
                              overlap=overlap)
        rows.append({"model": name, "network": network, "overlap": overlap, "compute": t.compute,
                     "communication": t.communication, "efficiency": t.efficiency})
  return rows


# --------------------------------------------------------------------------
# Output.
# --------------------------------------------------------------------------


def plot(out, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(2, 2, figsize=(12, 9))
  time_ax, eff_ax, mem_ax, cpu_ax = axes.ravel()
  predictions = out["predictions"]
  for stage in scaling.ZERO_STAGES:
    color = f"C{stage}"
    for cluster, style in zip(CLUSTERS, ("-", "--")):
      rows = [r for r in predictions if r["cluster"] == cluster and r["model"] == "1.3B" and r["stage"] == stage]
      ns = [r["n"] * (1 + 0.04 * (stage - 1.5)) for r in rows]  # stages 2 and 3 coincide: keep both visible
      time_ax.plot(ns, [r["total"] * MS for r in rows], style, color=color, marker="o", ms=3,
                   label=f"stage {stage}, {cluster}")
      eff_ax.plot(ns, [r["efficiency"] for r in rows], style, color=color, marker="o", ms=3,
                  label=f"stage {stage}, {cluster}")
      eff_ax.plot(ns, [r["efficiency_overlap"] for r in rows], style, color=color, alpha=0.35, lw=3)
    ns = np.geomspace(8, 1024, 50)
    mem_ax.plot(ns, [scaling.memory_per_device(7e9, int(n), stage) / scaling.GB for n in ns], color=color,
                label=f"stage {stage}" + (" (jaxdp: keeps the gathered params)" if stage == 3 else ""))
    if stage == 3:
      mem_ax.plot(ns, [scaling.memory_per_device(7e9, int(n), 3, schedule="layerwise", layers=PREDICT_LAYERS)
                       / scaling.GB for n in ns],
                  "--", color=color, label=f"stage 3, jaxdp layer-wise (layers=, L = {PREDICT_LAYERS}, 2 gathered)")
      mem_ax.plot(ns, [scaling.memory_per_device(7e9, int(n), 3, schedule="paper") / scaling.GB for n in ns],
                  ":", color=color, label="stage 3, paper's layer-by-layer gather (one layer, not counted)")
  for (topology, device), style in zip(CLUSTERS.values(), ("-", "--")):
    compute = transformer(1.3e9, device)
    time_ax.axhline((SEQS_PER_DEVICE * compute.seconds_per_example + compute.update_seconds) * MS, color="k",
                    ls=style, lw=0.8, label=f"one device ({device.name})")
    mem_ax.axhline(device.memory_bytes / scaling.GB, color="k", ls=style, lw=0.8, label=f"{device.name} memory")
  time_ax.set(title=f"1.3B params: predicted step ({SEQS_PER_DEVICE}x{SEQ_LEN} tokens/device, MFU {MFU:.0%})",
              ylabel="ms per step (no overlap)", yscale="log")
  eff_ax.set(title="1.3B: predicted efficiency (faint: overlap 1)", ylabel="single-device step / step", ylim=(0, 1.08))
  mem_ax.set(title="7B params: model state (+ stage 3's gathered params) per device (K=12)",
             ylabel="GB per device", yscale="log")
  for ax in (time_ax, eff_ax, mem_ax):
    ax.set_xscale("log", base=2)
    ax.set_xticks(PREDICT_DEVICES, [str(n) for n in PREDICT_DEVICES])
    ax.set_xlabel("devices N")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6.5, ncol=1 if ax is mem_ax else 2, loc="lower left" if ax is mem_ax else "best")
  check = out["check"]
  ns = [r["n"] for r in check]
  measured = np.array([r["measured"] for r in check]) * MS
  spread = np.array([[r["measured"] - r["p10"], r["p90"] - r["measured"]] for r in check]).T * MS
  cpu_ax.errorbar(ns, measured, yerr=spread, fmt="ko-", capsize=3, label="measured (median, p10-p90)")
  cpu_ax.plot(ns, [r["model_ideal"] * MS for r in check], "s--", color="C1", label="model, ideal devices")
  cpu_ax.plot(ns, [r["hybrid_psum"] * MS for r in check], "^-", color="C2",
              label="measured no-comm step + model comm (psum fit)")
  cpu_ax.plot(ns, [r["hybrid_step"] * MS for r in check], "v-", color="C4",
              label="measured no-comm step + model comm (bandwidth fitted to steps)")
  cpu_ax.plot(ns, [r["no_comm"] * MS for r in check], ":", color="grey", label="measured, reductions.none()")
  cpu_ax.set(title="measured here: MLP 1.86M params, batch 512, 2 cores", xlabel="devices N",
             ylabel="ms per step")
  cpu_ax.set_xscale("log", base=2)
  cpu_ax.set_xticks(ns, [str(n) for n in ns])
  cpu_ax.grid(True, alpha=0.3)
  cpu_ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _fmt_n(n):
  return "—" if n is None else f"{n:,}"


def _comm_ratios(check):
  """Modelled (psum fit) / measured communication in the step, N > 1."""
  return [r["comm_ratio_psum"] for r in check if r["n"] > 1 and r["comm_ratio_psum"] is not None]


def _span(values, fmt):
  values = [v for v in values if v is not None and not math.isnan(v)]
  return "n/a" if not values else (fmt.format(min(values)) + "…" + fmt.format(max(values)))


def _check_md(out):
  fit = out["fit"]
  link, step_link = fit["psum"], fit["step"]
  lines = [
      "## 1. Check on simulated CPU devices (measured here)",
      "",
      f"MLP 784-1024-1024-10 (Ψ = {param_count():,}), Adam, fp32, global batch {GLOBAL_BATCH}; "
      f"jax {jax.__version__}, {os.cpu_count()} cores, median of {out['rounds']} interleaved steps "
      "(`common.time_interleaved`: one step of every case per round, a new shuffled order each round); load "
      f"average {out['load'][0]:.1f} at the start, {out['load'][1]:.1f} after the timings (other jobs share "
      "the cores, hence the wide p10–p90).",
      "",
      f"Calibration: compute {out['cpu_model']['seconds_per_example'] * 1e6:.1f} µs per example and "
      f"{out['cpu_model']['update_seconds'] * MS:.1f} ms per step (update and fixed cost), from the one-device "
      f"step at batches {SMALL_BATCH} and {GLOBAL_BATCH}. Link, fitted (non-negative least squares on "
      f"error, relative to each whole call) to {len(out['allreduce'])} psum timings (64 KiB to 16 MiB and the "
      "gradient's 7.45 MB on 2, 4 and 8 devices), each the median over rounds of the psum less a no-op "
      "dispatch timed in the same round: "
      f"launch {link['launch'] * 1e6:.0f} µs, "
      f"α {link['alpha'] * 1e6:.1f} µs per step, bandwidth {link['bandwidth'] / 1e9:.2f} GB/s"
      f"{' shared by the devices (each gets bandwidth/N)' if link['shared'] else ' per device'}; "
      f"RMS relative residual {fit['residual']:.0%} (the other form: {fit['other_residual']:.0%}). "
      f"Refitting only the bandwidth to the steps' own communication (the median over rounds of the step "
      f"with the all-reduce minus the step without, timed in the same round) gives "
      f"{step_link['bandwidth'] / 1e9:.2f} GB/s (in-sample: one parameter fitted to the same differences). "
      "The likely reason the two differ (not verified): inside a step the all-reduce also waits for the "
      "slowest of the device threads sharing 2 cores, which an isolated psum does not.",
      "",
      "| N | measured ms (p10–p90) | no-comm step ms (error as a prediction) | comm in step ms | "
      "model comm ms: psum fit / step fit | model / measured comm (psum fit) | "
      "model, ideal devices ms (error) | no-comm step + model comm ms: psum fit (error) / step fit (error) |",
      "|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in out["check"]:
    ratio = "—" if r["comm_ratio_psum"] is None else f"{r['comm_ratio_psum']:.2f}"
    lines.append(
        f"| {r['n']} | {r['measured'] * MS:.1f} ({r['p10'] * MS:.1f}–{r['p90'] * MS:.1f}) | "
        f"{r['no_comm'] * MS:.1f} ({r['error_no_comm']:+.0%}) | "
        f"{r['measured_comm'] * MS:+.1f} | {r['model_comm_psum'] * MS:.1f} / {r['model_comm_step'] * MS:.1f} | "
        f"{ratio} | "
        f"{r['model_ideal'] * MS:.1f} ({r['error_ideal']:+.0%}) | {r['hybrid_psum'] * MS:.1f} "
        f"({r['error_hybrid_psum']:+.0%}) / {r['hybrid_step'] * MS:.1f} ({r['error_hybrid_step']:+.0%}) |")
  multi = [r for r in out["check"] if r["n"] > 1]
  ratios = _comm_ratios(out["check"])
  lines += [
      "",
      "The ideal-device model assumes each device has its own cores; here 2, 4 or 8 devices share 2 cores, so "
      "the measured step *grows* with N even without communication (the no-comm column) while the model's "
      "compute shrinks as 1/N. That error comes from the machine, which the model does not describe; on "
      "real accelerators the compute term is the one to measure (one device, two batch sizes) and the link "
      "is the one to look up.",
      "",
      "How much the communication model adds, at N = " + ", ".join(str(r["n"]) for r in multi) + ": the "
      "measured no-comm step plus the modelled communication (psum-fitted link: out of sample, it never saw "
      "the steps) is off by " + _span([r["error_hybrid_psum"] for r in multi], "{:+.0%}") + "; the no-comm "
      "step alone (no communication modelled at all) by " + _span([r["error_no_comm"] for r in multi],
                                                                  "{:+.0%}") + ". The modelled "
      "communication is " + _span(ratios, "{:.2f}") + " times the communication measured in the step "
      "(measured / modelled " + _span([1 / x for x in ratios if x > 0], "{:.1f}") + "). The measured "
      "communication is " + _span([r["measured_comm"] / r["measured"] for r in multi], "{:.0%}") + " of the "
      "measured step, so the hybrid error is the communication model's error scaled down by that share; the "
      "ratio is its direct check. The step fit's errors are in sample (its bandwidth is fitted to these "
      "differences) and are not a check.",
  ]
  lines += [
      "",
      "Collective bytes per step, counted in the compiled HLO (`jaxdp.comm_report`) vs the model's schedule "
      "(`scaling.collectives` with the parameters in leaves that split over N, the rest all-reduced, 8 bytes of "
      "loss and weight sums, and for the global gradient norm 4 bytes per split leaf at stages 2-3 and, at stage 0, "
      "4 bytes in an all-reduce of their own: each device's sum of squares over its 1/N of the gradient):",
      "",
      "| N | stage | kind | ops in HLO | counted bytes | model bytes | counted ring traffic | model ring traffic |",
      "|---:|---:|---|---:|---:|---:|---:|---:|",
  ]
  lines += [f"| {r['n']} | {r['stage']} | {r['kind']} | {r['ops']} | {r['counted']:,} | {r['model']:,.0f} | "
            f"{r['counted_traffic']:,.0f} | {r['model_traffic']:,.0f} |" for r in out["bytes"]]
  return lines


def _predict_md(out):
  lines = [
      "## 2. Predictions (nominal figures; not measured)",
      "",
      f"Transformers of 1.3B and 7B params; 6Ψ FLOPs per token (Kaplan et al. 2020; attention FLOPs not "
      f"counted); {SEQS_PER_DEVICE} sequences of {SEQ_LEN:,} tokens per device; {MFU:.0%} MFU assumed; "
      f"mixed-precision Adam (K=12) whose update reads and writes {ADAM_UPDATE_BYTES} bytes/param at HBM speed; "
      "hierarchical all-reduce; PyTorch DDP's 25 MiB buckets. Step ms with no overlap; efficiency without / "
      "with full overlap of all but the last gradient bucket. ✗: the model state does not fit the device "
      "(80 GB H100, 16 GB v5e; activations not counted), with jaxdp's schedule: its stage 3 also holds "
      "all the gathered parameters (2 bytes each) through the step.",
      "",
      "| cluster | model | stage | " + " | ".join(f"N={n}: ms, eff." for n in PREDICT_DEVICES) + " |",
      "|---|---|---:|" + "---:|" * len(PREDICT_DEVICES),
  ]
  rows = out["predictions"]
  for cluster in CLUSTERS:
    for name in MODELS:
      for stage in scaling.ZERO_STAGES:
        cells = []
        for n in PREDICT_DEVICES:
          r = next(r for r in rows if (r["cluster"], r["model"], r["stage"], r["n"]) == (cluster, name, stage, n))
          cells.append(f"{r['total'] * MS:,.0f}, {r['efficiency']:.2f}/{r['efficiency_overlap']:.2f}"
                       + ("" if r["fits"] else " ✗"))
        lines.append(f"| {cluster} | {name} | {stage} | " + " | ".join(cells) + " |")
  lines += ["", "Efficiency above 1 (stages 1–3: TPU v5e, and H100 at N = 8 with overlap): the sharded Adam update (1/N of the parameters per "
            "device) saves more than the collectives cost. At 1,024 H100s the stage 1–3 collectives fall behind "
            "stage 0 because reduce-scatter and all-gather only have a ring (NCCL has no tree for them): with "
            "25 MiB buckets each of their buckets pays 127 inter-node ring steps. One collective per kind "
            "instead (no buckets, no overlap), efficiency at N=1,024:", "",
            "| cluster | model | " + " | ".join(f"stage {s}: 25 MiB / one" for s in scaling.ZERO_STAGES) + " |",
            "|---|---|" + "---:|" * len(scaling.ZERO_STAGES)]
  for cluster in CLUSTERS:
    for name in MODELS:
      cells = [next(r for r in rows if (r["cluster"], r["model"], r["stage"], r["n"]) == (cluster, name, s, 1024))
               for s in scaling.ZERO_STAGES]
      lines.append(f"| {cluster} | {name} | " + " | ".join(
          f"{r['efficiency']:.2f} / {r['efficiency_one_bucket']:.2f}" for r in cells) + " |")
  lines += ["", "Device count at which exposed communication first exceeds compute (no overlap; — = not up "
            "to 65,536):", "",
            "| cluster | model | ring, stage 0 | tree, stage 0 | hierarchical, stages 0 / 1 / 2 / 3 |",
            "|---|---|---:|---:|---:|"]
  bound = out["comm_bound"]
  for cluster in CLUSTERS:
    for name in MODELS:
      get = lambda alg, s: next(r["n"] for r in bound if (r["cluster"], r["model"], r["algorithm"], r["stage"])
                                == (cluster, name, alg, s))
      hier = " / ".join(_fmt_n(get("hierarchical", s)) for s in scaling.ZERO_STAGES)
      lines.append(f"| {cluster} | {name} | {_fmt_n(get('ring', 0))} | {_fmt_n(get('tree', 0))} | {hier} |")
  lines += ["", "Largest model whose state (mixed-precision Adam, K=12: p = g = 2 bytes) fits the device's "
            "memory (activations not counted). Stages 0–2 are the same under every schedule. Stage 3: jaxdp's "
            "whole gather keeps every gathered parameter through the step (barely more room than stage 2); "
            "jaxdp's layer-wise stage 3 (`data_parallel(mesh, zero_stage=3, layers=...)`, the stacks gathered one "
            "layer at a time) is counted with two "
            f"layers gathered at once (the current one and the next, prefetched), here L = {PREDICT_LAYERS} "
            "stacked layers with every parameter in the stack (the embeddings and head, gathered whole, "
            "neglected); the paper's layer-by-layer stage 3 counts model state only."]
  for _, device in CLUSTERS.values():
    lines += ["", f"{device.name}:", ""] + largest_table(out, device)
  return lines


def _papers_md(out):
  lines = ["## 3. Against published figures", "",
           "ZeRO (Rajbhandari et al., SC 2020), 7.5B params on 64 GPUs, K=12, GB per device:", "",
           "| stage | paper | formula, paper's schedule (layer-by-layer stage 3) | jaxdp's schedule, K=12 | "
           "jaxdp's schedule, fp32 Adam (jaxdp's setting) |", "|---:|---:|---:|---:|---:|"]
  lines += [f"| {r['stage']} | {r['paper_gb']} | {r['formula_gb']:.4g} | {r['jaxdp_gb']:.4g} | {r['fp32_gb']:.4g} |"
            for r in out["zero"]]
  z3 = out["zero"][3]
  lines += ["", "The formulas give the paper's row to its rounding (31.41 → 31.4, 16.64 → 16.6, 1.875 → "
            f"1.88). jaxdp's stage 3 gathers all parameters before the forward pass and keeps them through the "
            f"backward pass, so it also holds the 7.5B gathered parameters: {z3['jaxdp_gb']:.4g} GB, not "
            f"{z3['formula_gb']:.4g} (measured at small scale in `docs/zero_memory.json`: at N = 8 the "
            "temporaries include a full parameter copy). jaxdp trains in fp32, where stages 1–2 keep twice the "
            "replicated bytes (p + g = 8) and stage 3 gathers 4-byte parameters.", "",
            "PyTorch DDP (Li et al., VLDB 2020) reports that DDP 'attains near-linear scalability using 256 "
            "GPUs' (abstract) for ResNet50 and BERT with NCCL, relying on gradient bucketing (25 MiB by default) "
            "and overlapping the all-reduce with the backward pass. Their per-GPU throughputs and network are not "
            "re-checked here, so this setting is assumed, not copied: 256 V100s in nodes of 8 (NVLink 2), "
            "100 Gb/s InfiniBand either per GPU or per node, fp32 (15.7 TFLOP/s peak, 40% MFU), fp32 "
            "gradients, 25 MiB buckets, batch 32 per GPU; ResNet50 (25.6M params, 3 × 2 × 3.8 GFLOP per "
            "224² image, He et al. 2016), BERT-base (110M params, 128 tokens). Predicted efficiency:", "",
            "| model | network | no overlap | full overlap | compute ms | communication ms |",
            "|---|---|---:|---:|---:|---:|"]
  for name in DDP_MODELS:
    for network in DDP_NETWORKS:
      r0, r1 = (next(r for r in out["ddp"] if (r["model"], r["network"], r["overlap"]) == (name, network, o))
                for o in (0.0, 1.0))
      lines.append(f"| {name} | {network} | {r0['efficiency']:.2f} | {r1['efficiency']:.2f} | "
                   f"{r0['compute'] * MS:.0f} | {r0['communication'] * MS:.0f} |")
  lines += ["", "With overlap, as DDP runs, the model predicts near-linear scaling (≥ 0.96) at 256 GPUs in both "
            "network cases, in line with the paper's claim; without overlap a single NIC per node of 8 would "
            "cost about 15%, which is why DDP overlaps. That agreement is qualitative: the inputs are "
            "assumptions, not the paper's measured setup."]
  return lines


PROSE = """# Scaling model: predictions for 8 to 1,024 devices

Generated by `experiments/scaling.py` from `jaxdp/analysis/scaling.py`. **Everything
in sections 2 and 3 is a prediction** from nominal peak figures (datasheets,
cloud documentation) and a cost model's latencies; real collectives reach a
fraction of those peaks, and the compute times rest on an assumed MFU. Only
section 1 is measured, on simulated CPU devices sharing 2 cores.

The model (module docstring of `jaxdp/analysis/scaling.py`): per step,
compute = batch · time per example + update (÷N at ZeRO ≥ 1); each
collective costs launch + steps·α + bytes sent/bandwidth (ring all-reduce
2(N−1) steps and 2(N−1)/N·M bytes; NCCL-style tree 2((g−1) + ⌈log2 nodes⌉)
steps, each at the link's own tree latency, and 2M bytes; hierarchical =
reduce-scatter in the node, the 1/g shard between nodes by ring or tree,
whichever is faster, all-gather in the node); buckets each pay the latency; a
fraction `overlap` of the gradient communication before its last bucket hides
behind the backward pass. Memory per device: the ZeRO paper's formulas for
stages 0–2; for stage 3, jaxdp's whole gather, which gathers all parameters
before the forward pass and keeps them through the backward pass: (p+g+K)Ψ/N +
pΨ; next to it where it matters, jaxdp's layer-wise stage 3 (`layers=`, two of
the L stacked layers counted gathered at once, room for prefetch): (p+g+K)Ψ/N +
2pΨ/L, and the paper's layer-by-layer (p+g+K)Ψ/N.
The run's data: [`docs/data/scaling.json`](data/scaling.json).

![scaling](scaling.png)

Figures used (nominal; per device, per direction unless stated):

| link / device | figure | source |
|---|---|---|
| NVLink 4 (H100 SXM) | 900 GB/s total, 450 GB/s per direction | NVIDIA H100 datasheet (2022–23) |
| NVLink 3 (A100 SXM) | 600 GB/s total, 300 GB/s per direction | NVIDIA A100 datasheet (2020–21) |
| NVLink 2 (V100 SXM2) | 300 GB/s total, 150 GB/s per direction | NVIDIA V100 datasheet (2017–18) |
| InfiniBand NDR / HDR / EDR | 400 / 200 / 100 Gb/s = 50 / 25 / 12.5 GB/s per NIC, one NIC per GPU | NVIDIA ConnectX-7 / DGX H100, ConnectX-6 / DGX A100 datasheets |
| NVLink / network step latency, per call | ring 3.4 µs / 9.6 µs per step, tree 28 µs / 28 µs per step, 8.4 µs per call | NCCL's tuning model, NVIDIA/nccl v2.8.3-1 (2020-11, commit 920dbe5), `src/graph/tuning.cc`: `hwLat` Ring and Tree rows, Simple protocol, and `baseLat` Ring/Simple (same values through v2.11.4; from v2.23 the Tree/Simple row is 4.0 µs / 14 µs and the ring's network step 14 µs) |
| TPU v5e ICI | 400 GB/s bidirectional per chip; 51.2 TB/s all-reduce per 256-chip pod = 200 GB/s per chip; 1 µs per step assumed | Google Cloud TPU v5e documentation (2023) |
| TPU v5e DCN | 2 × 100 Gb/s per host of 8 chips = 3.1 GB/s per chip; 30 µs per step assumed | Google Cloud TPU v5e documentation (2023) |
| TPU v4 ICI | 1.1 PB/s all-reduce per 4,096-chip pod = 269 GB/s per chip | Google Cloud TPU v4 documentation; Jouppi et al., ISCA 2023 |
| H100 SXM / TPU v5e | 989 / 197 TFLOP/s bf16 dense; 80 / 16 GB; 3.35 TB/s / 819 GB/s HBM | NVIDIA H100 datasheet; Cloud TPU v5e documentation |

Known simplifications: the flat ring and tree use one channel paced by the
slowest link (NCCL's parallel rings on rail-optimised clusters come close to
the hierarchical figure instead); the ring's 2(N−1) latency steps overstate a
TPU torus's latency (a 16×16 torus needs about 2·(15+15)); NCCL's NVLS,
CollNet/SHARP and PAT algorithms are not modelled; the tree is charged the
ring's 8.4 µs per call (NCCL 2.8's Tree/Simple base latency is 0) and NCCL's
28 µs tree step already includes one 256 kB chunk's transfer, which the
bandwidth term counts again; the hierarchical figures across nodes depend on
the tree's per-step latency (whichever of ring and tree is faster is used);
no congestion, stragglers, input pipeline or activation memory; the
per-device compute does not change with N (weak scaling, a fixed per-device
batch).
"""


def markdown(out):
  footer = [f"_Generated in {out['seconds']:.0f} s on this machine (`{' '.join(out['argv'])}`)"
            + (f"; sections 2–3 recomputed from the model with `{' '.join(out['model_argv'])}`"
               if "model_argv" in out else "") + "._"]
  return "\n".join([PROSE] + _check_md(out) + [""] + _predict_md(out) + [""] + _papers_md(out) + [""] + footer) + "\n"


# --------------------------------------------------------------------------
# Main.
# --------------------------------------------------------------------------


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="devices 1,2,8; 4 timed steps; fewer psum sizes; no stage 1-3 HLO")
  parser.add_argument("--rounds", type=int, help="timed steps per case (default 60: the communication in a step, "
                                                   "a few ms, is the difference of two noisy ~60-100 ms steps; "
                                                   "4 with --quick)")
  parser.add_argument("--model-only", action="store_true",
                      help="measure nothing: reuse section 1 from the scaling.json under --out and recompute the "
                           "model's predictions and tables (sections 2-3), rewriting the three files")
  common.add_output_args(parser, "out/scaling", quick="out/scaling_quick")
  args = parser.parse_args(argv)
  common.check_publish(parser, args)
  args.devices = [d for d in ((1, 2, 8) if args.quick else (1, 2, 4, 8)) if d <= jax.device_count()]
  args.rounds = args.rounds or (4 if args.quick else 60)
  if args.model_only and args.quick:
    parser.error("--model-only reuses a run's measurements; --quick sets how to measure: pass one of them.")
  if max(args.devices) < 8 and not args.model_only:
    parser.error(f"needs 8 devices, {jax.device_count()} exist; set JAX_NUM_CPU_DEVICES=8.")
  return args


def _topology_dict(topology):
  return {"launch": topology.launch_latency, "alpha": topology.intra.latency,
          "bandwidth": topology.intra.bandwidth, "shared": topology.intra.shared}


def calibrate(args):
  start, load = time.perf_counter(), [os.getloadavg()[0]]
  print(f"[1/3] timing steps on devices {args.devices}, {args.rounds} rounds", flush=True)
  timed, comm, counted = measure_steps(args.devices, args.rounds)
  load.append(os.getloadavg()[0])
  if not args.quick:
    print("[2/3] counting the collectives of stages 1-3", flush=True)
  stage_counts = {} if args.quick else count_stages(max(args.devices))
  grad_bytes = param_count() * 4
  sizes = (MICRO_BYTES[::2] if args.quick else MICRO_BYTES) + (grad_bytes,)
  print(f"[3/3] timing psum of {len(sizes)} sizes", flush=True)
  samples = measure_allreduce(args.devices, sizes, reps=3 if args.quick else 10)
  fits = {shared: fit_link(samples, shared) for shared in (False, True)}
  shared = fits[True][1] <= fits[False][1]
  psum_topology, residual = fits[shared]
  topologies = {"psum": psum_topology, "step": refit_bandwidth(psum_topology, comm, grad_bytes + JAXDP_SCALARS)}
  model = cpu_model({GLOBAL_BATCH: timed[1, "none"]["median"], SMALL_BATCH: timed["small"]["median"]})
  print(f"measured in {time.perf_counter() - start:.0f} s", flush=True)
  return {
      "rounds": args.rounds, "load": load, "timed": {str(k): v for k, v in timed.items()}, "allreduce": samples,
      "fit": {"residual": residual, "other_residual": fits[not shared][1],
              **{name: _topology_dict(t) for name, t in topologies.items()}},
      "cpu_model": model._asdict() | {"precision": model.precision.name},
      "check": check_rows(args.devices, timed, comm, topologies, model),
      "bytes": bytes_rows(counted, stage_counts, max(args.devices)),
  }


def summary(out):
  psum, step = out["fit"]["psum"], out["fit"]["step"]
  lines = [f"Check (1-{max(r['n'] for r in out['check'])} simulated CPU devices): psum-fitted link "
           f"{psum['bandwidth'] / 1e9:.2f} GB/s ({'shared' if psum['shared'] else 'per device'}), "
           f"α {psum['alpha'] * 1e6:.1f} µs, launch {psum['launch'] * 1e6:.0f} µs, "
           f"residual {out['fit']['residual']:.0%};"
           f" bandwidth refitted to the steps {step['bandwidth'] / 1e9:.2f} GB/s"]
  for r in out["check"]:
    lines.append(f"  N={r['n']}: measured {r['measured'] * MS:6.1f} ms; model ideal {r['model_ideal'] * MS:6.1f} "
                 f"({r['error_ideal']:+.0%}); no-comm alone {r['no_comm'] * MS:6.1f} ({r['error_no_comm']:+.0%}); "
                 f"model/measured comm {_span([r['comm_ratio_psum']], '{:.2f}')}; "
                 f"no-comm + model comm {r['hybrid_psum'] * MS:6.1f} "
                 f"({r['error_hybrid_psum']:+.0%}) / {r['hybrid_step'] * MS:6.1f} ({r['error_hybrid_step']:+.0%}); "
                 f"comm in step {r['measured_comm'] * MS:+.1f} vs model {r['model_comm_psum'] * MS:.1f} / "
                 f"{r['model_comm_step'] * MS:.1f} ms")
  exact = all(r["counted"] == r["model"] for r in out["bytes"])
  lines.append(f"  collective bytes: {len(out['bytes'])} (N, stage, kind) rows, counted == model: {exact}")
  for r in out["predictions"]:
    if r["model"] == "1.3B" and r["stage"] in (0, 3) and r["n"] in (8, 1024):
      lines.append(f"Predict {r['cluster']}, 1.3B, stage {r['stage']}, N={r['n']}: {r['total'] * MS:.0f} ms, "
                   f"efficiency {r['efficiency']:.2f} (overlap: {r['efficiency_overlap']:.2f})")
  lines.append("ZeRO 7.5B/64 GPUs, GB: " + ", ".join(f"{r['formula_gb']:.3g} (paper {r['paper_gb']})"
                                                      for r in out["zero"])
               + f"; jaxdp's stage 3 {out['zero'][3]['jaxdp_gb']:.4g}")
  lines += [f"Largest model, {scaling.H100_SXM.name} (mixed-precision Adam, activations not counted):"]
  lines += largest_table(out)
  lines += [f"DDP-like 256 V100s, {r['model']}, {r['network']}, overlap {r['overlap']:.0f}: efficiency "
            f"{r['efficiency']:.2f}" for r in out["ddp"]]
  return "\n".join(lines)


MEASURED = ("rounds", "load", "timed", "allreduce", "fit", "cpu_model", "check", "bytes", "seconds", "argv")


def reuse_measurements(args):
  """Section 1 (measurements, duration, command) of the run under ``--out``, else the published one, for ``--model-only``."""
  path = os.path.join(args.out, "scaling.json")
  if not os.path.exists(path):
    path = os.path.join(common.DOCS, "data", "scaling.json")
  if not os.path.exists(path):
    raise SystemExit(f"--model-only reuses {args.out}/scaling.json, which does not exist: run without --model-only "
                     "first.")
  with open(path) as f:
    saved = json.load(f)
  return {key: saved[key] for key in MEASURED}


def main(argv=None) -> dict:
  args = parse_args(argv)
  start = time.perf_counter()
  argv = ["experiments/scaling.py"] + list(sys.argv[1:] if argv is None else argv)
  if args.model_only:  # the measurements keep their run's duration and command
    out = reuse_measurements(args)
    run = {"seconds": out.pop("seconds"), "argv": out.pop("argv"), "model_argv": argv}
  else:
    out = calibrate(args)
  options = {"bucket_bytes": scaling.DDP_BUCKET_BYTES}
  out |= {"predictions": predict(options), "comm_bound": comm_bound(options), "largest": largest_models(),
          "zero": zero_table(), "ddp": ddp_comparison()}
  out |= run if args.model_only else {"seconds": time.perf_counter() - start, "argv": argv}
  os.makedirs(args.out, exist_ok=True)
  plot(out, os.path.join(args.out, "scaling.png"))
  with open(os.path.join(args.out, "scaling.md"), "w") as f:
    f.write(markdown(out))
  common.write_json(os.path.join(args.out, "scaling.json"), out)
  print(summary(out))
  print(f"wrote {args.out}/scaling.png, scaling.md and scaling.json in {time.perf_counter() - start:.0f} s")
  common.publish(args, {"scaling.png": "scaling.png", "scaling.md": "data/scaling_report.md", "scaling.json": "data/scaling.json"})
  return out


if __name__ == "__main__":
  main()
