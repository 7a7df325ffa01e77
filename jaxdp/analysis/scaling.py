"""A latency-bandwidth (α-β) model of one data-parallel step: time and per-device memory.

Everything here is a **prediction** from nominal figures, not a measurement:
the presets below are vendors' peak numbers (datasheets, cloud documentation)
and a cost model's latencies, which real collectives reach only in part. Use
the model to compare configurations and to see which term dominates where,
and check its absolute numbers against a measurement on the hardware itself
(`experiments/scaling.py` does that on the simulated CPU devices here).
No training path uses it: `import jaxdp` leaves it unimported, and the
first `jaxdp.analysis.scaling` (or `from jaxdp import scaling`) imports it.

The step (one device's view, weak scaling: the per-device batch is fixed):

```python
compute       = batch_per_device · seconds_per_example + update_seconds (÷ N at ZeRO stages ≥ 1)
communication = Σ over the stage's collectives and buckets of
                launch + steps · α + bytes_sent · β      (β = 1 / bandwidth)
hidden        = overlap · min(gradient communication except its last bucket, backward time)
total         = compute + communication − hidden
efficiency    = (batch_per_device · seconds_per_example + update_seconds) / total
```

Collectives on N devices, message of M bytes (Thakur, Rabenseifner & Gropp
2005; Patarasuk & Yuan 2009; the same structure as NCCL's own tuning model,
`src/graph/tuning.cc`):

* ring all-reduce: 2(N−1) steps, each device sends 2(N−1)/N · M bytes;
  reduce-scatter and all-gather: N−1 steps, (N−1)/N · M bytes.
* tree all-reduce (NCCL's double binary tree across nodes, a chain inside a
  node; Sanders, Speck & Träff 2009; NCCL 2.4, 2019): 2((g−1) + ⌈log2 nodes⌉)
  steps and 2M bytes per device (NCCL converts bus to algorithm bandwidth with
  a factor ½ for trees). A tree step has its own latency, `Link.tree_latency`
  (NCCL's tuning model, v2.8.3: 28 µs per tree step over NVLink and over the
  network, against 3.4 and 9.6 µs per ring step; see the presets), so the
  tree pays 2((g−1)·α_tree,intra + ⌈log2 nodes⌉·α_tree,inter). (NCCL's tuner
  counts ⌊log2 nodes⌋; the same for a power of two.) Reduce-scatter and
  all-gather use the ring (NCCL has no tree for them).
* hierarchical: reduce-scatter inside each node of g devices, all-reduce of
  the 1/g shard between nodes (ring or tree, whichever is faster, as NCCL's
  tuner picks per call), all-gather inside the node. With one node it *is*
  the ring. Which one wins between nodes, and so the hierarchical figures
  at 16-1,024 GPUs, depends on the tree's per-step latency.

The flat ring and tree are paced by the slowest link they use, with one
logical ring (one channel): the textbook model. On clusters with one NIC per
accelerator ("rail-optimised"), NCCL's many parallel rings reach about the
hierarchical figure, where each device's NIC carries only 1/g of the data.

Memory (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC 2020), Ψ parameters, p/g bytes per parameter
and gradient element, K bytes of optimizer state per parameter, N devices:

  stage 0: (p + g + K) Ψ       stage 1: (p + g) Ψ + K Ψ / N
  stage 2: p Ψ + (g + K) Ψ / N  stage 3: (p + g + K) Ψ / N   (`schedule="paper"`)

The paper's stage 3 reaches (p + g + K) Ψ / N because it gathers the
parameters layer by layer, holding one layer's at a time. jaxdp does not:
its stage 3 gathers all split parameters once before the forward pass and
keeps them through the backward pass (see the communication below), so
each device holds a full copy of them during the step on top of its
1/N share: with `schedule="jaxdp"` (the default) stage 3 is

  stage 3: (p + g + K) Ψ / N + p Ψ   (N > 1)

(`experiments/zero_memory.py` measures it). With `layers=`
(`jaxdp.sharding.layerwise`) jaxdp gathers the stacks of layers one layer at
a time inside the loop; `schedule="layerwise"`
models that with room for prefetch: two layers' gathered parameters alive
at once, the current layer's and the next one's, whose gather
`jaxdp.scan_layers` issues during the current layer's compute (a double
buffer: one layer more than a loop that gathers only what it uses). For a
model of L equal layers (`layers=L`):

  stage 3: (p + g + K) Ψ / N + 2 p Ψ / L   (N > 1, L ≥ 2; p Ψ at L = 1)

Every split parameter is counted in the stack of L layers: the leaves
outside it (embeddings, head, final norm), which jaxdp still gathers whole,
are neglected; they add p Ψ_outside. Stages 0-2 are the same under every
schedule.

Mixed-precision Adam (the paper's notation): p = g = 2 (fp16/bf16), K = 12
(fp32 master weights, momentum and variance), 16 bytes/param unsharded. fp32
Adam (what jaxdp measures in `experiments/zero_memory.py`): p = g = 4,
K = 8, also 16 bytes/param: 16Ψ, (8 + 8/N)Ψ, (4 + 12/N)Ψ, 16Ψ/N (paper) or
(4 + 16/N)Ψ (jaxdp) or (16/N + 8/L)Ψ (layerwise). Model state (and, for jaxdp's stage 3, the gathered
parameters) only: activations, other temporary buffers and fragmentation
are not counted.

jaxdp's layout (`jaxdp.sharding.layout`): each leaf keeps its shape and is split
over the N devices along one dimension that divides by N
(`jaxdp.sharding.layout.zero_dim`); a leaf with no such dimension (an odd-sized
bias, a scalar) stays whole on every device, unpadded. So of the Ψ
parameters only Ψ_s (`split_params`, default Ψ; `split_params_of`
counts them) split; the other Ψ_u = Ψ − Ψ_s are replicated at every stage:
per-device memory is the formula above for Ψ_s plus (p + g + K) Ψ_u (jaxdp's
stage 3 gathers only the Ψ_s: it adds p Ψ_s).

Communication per ZeRO stage (`schedule="jaxdp"`, what jaxdp compiles:
read off the compiled HLO with `jaxdp.comm_report`, see docs/zero.md).
Stage 0 runs the whole step per replica; stages 1-3 compute the reduced
gradient per replica and run the optimizer on the global, sharded arrays,
where XLA partitions the update and inserts the collectives it needs:

* stage 0: all-reduce of the gradient, Ψ·g;
* stage 1: the same all-reduce, then jaxdp all-gathers the updated split
  parameters (the update of a split leaf runs on each device's slice,
  where its optimizer state lives), Ψ_s·p: 1.5× stage 0 at p = g. An
  optimizer without state (K = 0, SGD) splits nothing at stage 1, which is
  then stage 0;
* stage 2: reduce-scatter of the split gradient leaves (Ψ_s·g, each along
  its dimension), all-reduce of the unsplit ones (Ψ_u·g), all-gather of the
  updated split parameters (Ψ_s·p): stage 0's bytes when p = g;
* stage 3: all-gather of the split parameters once before the forward pass
  (kept for the backward pass), reduce-scatter Ψ_s·g, all-reduce Ψ_u·g; the
  update leaves the parameters split, so nothing is gathered after it.

Small all-reduces: `scalar_bytes` (jaxdp: Σ w·l and Σ w, 8 bytes, inside
the gradient all-reduce at stages 0-1, a separate one at stages 2-3) and
`norm_bytes`: at stages 2-3 the update's global gradient norm is computed
on the global arrays, and XLA partitions each split leaf's sum of squares
into a local sum and an all-reduce of one float32 scalar, 4 bytes per split
leaf (combined with the Ψ_u all-reduce on CPU). No other collective
appears: the optimizer state never moves.

`schedule="paper"`: stages 1 and 2 reduce-scatter + all-gather, stage 3
gathers the parameters twice (forward and backward): 3(N−1)/N Ψ elements
sent, against 2(N−1)/N Ψ for jaxdp's stage 3. Both schedules all-reduce
the unsplit Ψ_u.

`schedule="layerwise"`: stages 0-2 as `"jaxdp"`; stage 3 as the
paper's stage 3. jaxdp's layer-wise step with the default policy
(`jaxdp.gather_policy(reshard_after_forward=True)`) all-gathers each
layer in the forward pass and again in the backward pass and
reduce-scatters its gradient: 3(N−1)/N Ψ elements sent, the paper's
count. It issues them as L calls of Ψ/L each, which the model counts as
one call per kind (their per-call latencies are not added; `bucket_bytes`
splits them similarly); the bytes do not depend on L. With
`reshard_after_forward=False` the layer kept for the backward pass is
gathered once, 2(N−1)/N Ψ: `schedule="jaxdp"`'s communication.

Not modelled: tensor parallelism (a `("data", "model")` mesh, where the
model axis adds activation all-reduces and XLA's partitioning of the
data-axis collectives of model-split leaves; see
`experiments/zero_memory.py`), and optimizers whose state is not shaped
like the parameters (Adafactor's factored moments).
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction
from typing import NamedTuple

ALGORITHMS = ("ring", "tree", "hierarchical")
SCHEDULES = ("jaxdp", "layerwise", "paper")
ZERO_STAGES = (0, 1, 2, 3)
KINDS = ("all-reduce", "reduce-scatter", "all-gather")

GB = 1e9  # the ZeRO paper's and the datasheets' GB: 10^9 bytes
DDP_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket_cap_mb=25 (Li et al. 2020)


# ---------------------------------------------------------------------------
# Inputs: precision, hardware, model.
# ---------------------------------------------------------------------------


class Precision(NamedTuple):
  """Bytes per parameter of the training state.

  Attributes:
    name: a label.
    param_bytes: p, bytes per working parameter (what the forward pass reads
      and ZeRO all-gathers).
    grad_bytes: g, bytes per gradient element (what is all-reduced).
    optimizer_bytes: K, bytes of optimizer state per parameter (fp32 master
      weights included under mixed precision).
  """

  name: str
  param_bytes: int
  grad_bytes: int
  optimizer_bytes: int


# The ZeRO paper's mixed-precision Adam: fp16 params and grads, K = 12 (fp32 copy, m, v).
MIXED_ADAM = Precision("mixed-precision Adam (K=12)", 2, 2, 12)
# Plain fp32 Adam, jaxdp's default: fp32 params and grads, K = 8 (m, v).
FP32_ADAM = Precision("fp32 Adam (K=8)", 4, 4, 8)


class Link(NamedTuple):
  """One kind of interconnect, seen from one device.

  Attributes:
    name: a label.
    bandwidth: bytes per second one device can send (and, at the same time,
      receive) on this link: the per-direction figure, 1/β.
    latency: α, seconds per step of the ring (and of reduce-scatter,
      all-gather and the hierarchical collectives' rings) on this link.
    shared: the bandwidth is one medium shared by all devices on it (e.g.
      simulated devices copying through one host's memory): each of g
      devices then gets `bandwidth / g`. Point-to-point links: `False`.
    source: where the figures come from.
    tree_latency: α of one step of the tree all-reduce on this link (NCCL's
      tuning model gives trees their own, larger per-step latency: see
      `NCCL_TREE_LATENCY`). `None`: assumed equal to `latency`
      (no separate figure known).
  """

  name: str
  bandwidth: float
  latency: float
  shared: bool = False
  source: str = ""
  tree_latency: float | None = None


class Topology(NamedTuple):
  """Devices grouped into nodes: a fast link inside a node, a slower one between nodes.

  Attributes:
    name: a label.
    intra: the link between devices of one node (NVLink, TPU ICI).
    devices_per_node: g; more than g devices must be a multiple of g.
    inter: the link between nodes, per device (InfiniBand NIC, TPU DCN);
      `None`: no more than one node.
    launch_latency: seconds per collective call, whatever its size (the
      library's fixed cost; NCCL's model uses 8.4 µs for ring/Simple).
  """

  name: str
  intra: Link
  devices_per_node: int
  inter: Link | None = None
  launch_latency: float = 0.0


class Device(NamedTuple):
  """One accelerator's nominal peak figures (datasheet values)."""

  name: str
  peak_flops: float  # dense bf16/fp16 FLOP/s
  memory_bytes: float  # HBM capacity
  memory_bandwidth: float  # HBM bytes/s
  source: str = ""


class ModelCost(NamedTuple):
  """What one step of a model costs on one device.

  Attributes:
    params: Ψ, the number of parameters.
    seconds_per_example: forward + backward time per example on one device
      (measured, or FLOPs / achieved FLOP/s: see `seconds_per_example`).
    update_seconds: the optimizer update of all Ψ parameters on one device,
      per step (ZeRO stages ≥ 1 update 1/N of them per device).
    precision: bytes per parameter, gradient and optimizer state.
    backward_fraction: share of `seconds_per_example` spent in the backward
      pass, the time bucketed gradient communication can hide behind (about
      2/3: the backward pass costs about twice the forward).
  """

  params: int
  seconds_per_example: float
  update_seconds: float = 0.0
  precision: Precision = MIXED_ADAM
  backward_fraction: float = 2 / 3


class CollectiveOp(NamedTuple):
  """One collective of a step.

  Attributes:
    kind: `"all-reduce"`, `"reduce-scatter"` or `"all-gather"`.
    nbytes: per-device size of the full buffer, counted as
      `jaxdp.collectives_from_hlo` counts it: the all-reduced array,
      the reduce-scatter's input, the all-gather's output.
    gradient: it reduces the gradient as the backward pass produces it, so
      its buckets may overlap the backward pass.
  """

  kind: str
  nbytes: float
  gradient: bool


class StepTime(NamedTuple):
  """Predicted seconds of one step on one device.

  Attributes:
    compute: forward, backward and update.
    communication: every collective of the step, start to end.
    hidden: the part of `communication` overlapped with the backward pass.
    total: `compute + communication - hidden`.
    efficiency: single-device step time at the same per-device batch over
      `total` (weak scaling; 1 at one device). It can exceed 1 only when
      ZeRO's sharded update saves more than communication costs.
    launches: collective calls per step (buckets included).
  """

  compute: float
  communication: float
  hidden: float
  total: float
  efficiency: float
  launches: int


# ---------------------------------------------------------------------------
# Presets. Nominal peak figures: real collectives reach a fraction of them.
# ---------------------------------------------------------------------------

# NCCL's cost model, read from the source: NVIDIA/nccl tag v2.8.3-1 (2020-11-17,
# commit 920dbe5b359fe5817b8ba874476ca4ba2dc5f1ef), src/graph/tuning.cc, Simple
# protocol (the one used for large messages):
#   hwLat  NVLINK: Tree 28 µs, Ring 3.4 µs per step;  NET: Tree 28 µs, Ring 9.6 µs per step
#   baseLat (per call): Ring 8.4 µs, Tree 0 µs
# The same values from v2.8.3-1 to v2.11.4-1 (2021-09). NCCL's comment on the row:
# "Tree/Simple is the latency a 256kB chunk, which is ~ base lat + 256k/12GB/s
# (+ 256k/12GB/s for the network)", so the tree's figure includes one chunk's
# transfer, which the bandwidth term here counts again (an overestimate for large
# messages). Other versions: v2.7.x has NET Tree/Simple 50 µs; NET Ring/Simple is
# 28 µs in v2.12-v2.13, 9.6 µs again in v2.14-v2.17 and 14 µs from v2.18; from
# v2.23 (2024-09; still in v2.30.7-1, 2026-06) Tree/Simple is 4.0 µs over NVLink
# and 14 µs over the network.
# The model charges the ring's 8.4 µs per call (``Topology.launch_latency``) to
# trees too, 8.4 µs more than NCCL 2.8's Tree/Simple baseLat of 0.
_NCCL = ("latency: NCCL's tuning model (NVIDIA/nccl v2.8.3-1, src/graph/tuning.cc, hwLat, Simple protocol: "
         "ring {ring} µs, tree {tree} µs per step)")
NCCL_LAUNCH_LATENCY = 8.4e-6
NCCL_TREE_LATENCY = 28e-6  # hwLat Tree/Simple, NVLink and network alike, NCCL v2.8.3-1
_NCCL_NVLINK = _NCCL.format(ring=3.4, tree=28)
_NCCL_NET = _NCCL.format(ring=9.6, tree=28)

NVLINK2_V100 = Link(
    "NVLink 2 (V100 SXM2)", 150 * GB, 3.4e-6,
    source=f"NVIDIA Tesla V100 datasheet (2017-2018): 300 GB/s total per GPU, 150 GB/s per direction; {_NCCL_NVLINK}",
    tree_latency=NCCL_TREE_LATENCY)
NVLINK3_A100 = Link(
    "NVLink 3 (A100 SXM)", 300 * GB, 3.4e-6,
    source=f"NVIDIA A100 Tensor Core GPU datasheet (2020-2021): 600 GB/s total per GPU, "
           f"300 GB/s per direction; {_NCCL_NVLINK}",
    tree_latency=NCCL_TREE_LATENCY)
NVLINK4_H100 = Link(
    "NVLink 4 (H100 SXM)", 450 * GB, 3.4e-6,
    source=f"NVIDIA H100 Tensor Core GPU datasheet (2022-2023): 900 GB/s total per GPU, "
           f"450 GB/s per direction; {_NCCL_NVLINK}",
    tree_latency=NCCL_TREE_LATENCY)
IB_EDR = Link(
    "InfiniBand EDR 100 Gb/s per GPU", 12.5 * GB, 9.6e-6,
    source=f"InfiniBand EDR: 100 Gb/s per port = 12.5 GB/s per direction; {_NCCL_NET}",
    tree_latency=NCCL_TREE_LATENCY)
IB_HDR = Link(
    "InfiniBand HDR 200 Gb/s per GPU", 25 * GB, 9.6e-6,
    source=f"NVIDIA ConnectX-6 / DGX A100 datasheet (2020): 8 x 200 Gb/s HDR, one per GPU = 25 GB/s; {_NCCL_NET}",
    tree_latency=NCCL_TREE_LATENCY)
IB_NDR = Link(
    "InfiniBand NDR 400 Gb/s per GPU", 50 * GB, 9.6e-6,
    source=f"NVIDIA ConnectX-7 / DGX H100 datasheet (2022-2023): 8 x 400 Gb/s NDR, one per GPU = 50 GB/s; {_NCCL_NET}",
    tree_latency=NCCL_TREE_LATENCY)
TPU_V4_ICI = Link(
    "TPU v4 ICI", 1.1e15 / 4096, 1e-6,
    source="Google Cloud TPU v4 documentation (2023; Jouppi et al., ISCA 2023): all-reduce bandwidth 1.1 PB/s "
           "per 4,096-chip pod = 269 GB/s per chip; latency 1 µs per step assumed (no published figure)")
TPU_V5E_ICI = Link(
    "TPU v5e ICI", 51.2e12 / 256, 1e-6,
    source="Google Cloud TPU v5e documentation (2023): 400 GB/s bidirectional ICI per chip; all-reduce bandwidth "
           "51.2 TB/s per 256-chip pod = 200 GB/s per chip; latency 1 µs per step assumed (no published figure)")
TPU_V5E_DCN = Link(
    "TPU v5e DCN", 25e9 / 8, 30e-6,
    source="Google Cloud TPU v5e documentation (2023): 2 x 100 Gb/s NICs per host of 8 chips (6.4 Tbps per "
           "256-chip pod) = 25 Gb/s = 3.1 GB/s per chip; latency 30 µs per step assumed ('tens of µs')")

H100_NDR = Topology("H100 SXM, nodes of 8: NVLink 4 + NDR InfiniBand", NVLINK4_H100, 8, IB_NDR, NCCL_LAUNCH_LATENCY)
A100_HDR = Topology("A100 SXM, nodes of 8: NVLink 3 + HDR InfiniBand", NVLINK3_A100, 8, IB_HDR, NCCL_LAUNCH_LATENCY)
V100_EDR = Topology("V100 SXM2, nodes of 8: NVLink 2 + EDR InfiniBand", NVLINK2_V100, 8, IB_EDR, NCCL_LAUNCH_LATENCY)
TPU_V4_POD = Topology("TPU v4 pod (ICI, up to 4,096 chips)", TPU_V4_ICI, 4096)
TPU_V5E_SLICES = Topology("TPU v5e: 256-chip pods (ICI) joined by DCN", TPU_V5E_ICI, 256, TPU_V5E_DCN)

H100_SXM = Device("H100 SXM 80GB", 989e12, 80 * GB, 3.35e12,
                  "NVIDIA H100 datasheet: 1,979 TFLOPS bf16 with sparsity = 989 dense; 80 GB HBM3, 3.35 TB/s")
A100_SXM = Device("A100 SXM 80GB", 312e12, 80 * GB, 2.039e12,
                  "NVIDIA A100 datasheet: 312 TFLOPS bf16 dense; 80 GB HBM2e, 2,039 GB/s")
V100_SXM2 = Device("V100 SXM2 32GB", 125e12, 32 * GB, 900e9,
                   "NVIDIA V100 datasheet: 125 TFLOPS tensor (fp16); 32 GB HBM2, 900 GB/s")
TPU_V4 = Device("TPU v4", 275e12, 32 * 2**30, 1.2e12, "Cloud TPU v4 docs: 275 TFLOPS bf16; 32 GiB HBM2, 1,200 GB/s")
TPU_V5E = Device("TPU v5e", 197e12, 16 * GB, 819e9, "Cloud TPU v5e docs: 197 TFLOPS bf16; 16 GB HBM2, 819 GB/s")


# ---------------------------------------------------------------------------
# Validation: every error names the argument.
# ---------------------------------------------------------------------------


def _int(value, name: str, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
    raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
  return int(value)


def _real(value, name: str, minimum: float = 0.0, maximum: float = math.inf, *, open_min: bool = False) -> float:
  ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
  if not ok or value < minimum or (open_min and value == minimum) or value > maximum:
    bound = f"> {minimum}" if open_min else f">= {minimum}"
    upper = f" and <= {maximum}" if math.isfinite(maximum) else ""
    raise ValueError(f"{name} must be a finite number {bound}{upper}, got {value!r}.")
  return float(value)


def _choice(value, name: str, choices: tuple) -> None:
  if value not in choices:
    raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}.")


def _layers(layers, schedule: str) -> int | None:
  """`layers`: a positive int with `schedule="layerwise"` (the stacked layer count), else `None`."""
  if schedule == "layerwise":
    if isinstance(layers, bool) or not isinstance(layers, numbers.Integral) or layers < 1:
      raise ValueError(f"layers must be a positive int (the number of stacked layers, e.g. layers=80) with "
                       f"schedule='layerwise', got layers={layers!r}.")
    return int(layers)
  if layers is not None:
    raise ValueError(f"layers={layers!r} is only used with schedule='layerwise' (got schedule={schedule!r}); "
                     "leave it None.")
  return None


def _stage(value) -> int:
  """A ZeRO stage: an int in `ZERO_STAGES` (`True` and `1.0` refused: `True == 1` and `1.0 == 1`)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value not in ZERO_STAGES:
    raise ValueError(f"zero_stage must be an int, one of {', '.join(map(repr, ZERO_STAGES))}, got {value!r}.")
  return int(value)


def _check_precision(precision) -> Precision:
  if not isinstance(precision, Precision):
    raise ValueError(f"precision must be a jaxdp.analysis.scaling.Precision (e.g. MIXED_ADAM), got {precision!r}.")
  for field in ("param_bytes", "grad_bytes", "optimizer_bytes"):
    _int(getattr(precision, field), f"precision.{field}", 0)
  return precision


def _check_link(link, name: str) -> Link:
  if not isinstance(link, Link):
    raise ValueError(f"{name} must be a jaxdp.analysis.scaling.Link, got {link!r}.")
  _real(link.bandwidth, f"{name}.bandwidth", open_min=True)
  _real(link.latency, f"{name}.latency")
  if link.tree_latency is not None:
    _real(link.tree_latency, f"{name}.tree_latency")
  return link


def _tree_alpha(link: Link) -> float:
  """α of one tree step on `link`: its own figure, else (assumed) the ring's."""
  return link.latency if link.tree_latency is None else link.tree_latency


def _check_topology(topology, n_devices: int) -> int:
  """Validates `topology` for `n_devices`; returns the number of nodes."""
  if not isinstance(topology, Topology):
    raise ValueError(f"topology must be a jaxdp.analysis.scaling.Topology (e.g. H100_NDR), got {topology!r}.")
  _check_link(topology.intra, "topology.intra")
  g = _int(topology.devices_per_node, "topology.devices_per_node", 1)
  _real(topology.launch_latency, "topology.launch_latency")
  if n_devices <= g:
    return 1
  if topology.inter is None:
    raise ValueError(
        f"n_devices={n_devices} exceeds topology.devices_per_node={g} and topology {topology.name!r} "
        "has no inter-node link (topology.inter is None).")
  _check_link(topology.inter, "topology.inter")
  if n_devices % g:
    raise ValueError(f"n_devices={n_devices} spans several nodes, so it must be a multiple of "
                     f"topology.devices_per_node={g}.")
  return n_devices // g


def _check_model(model) -> ModelCost:
  if not isinstance(model, ModelCost):
    raise ValueError(f"model must be a jaxdp.analysis.scaling.ModelCost, got {model!r}.")
  _int(model.params, "model.params", 1)
  _real(model.seconds_per_example, "model.seconds_per_example")
  _real(model.update_seconds, "model.update_seconds")
  _real(model.backward_fraction, "model.backward_fraction", 0.0, 1.0)
  _check_precision(model.precision)
  return model


def valid_device_counts(topology: Topology, max_devices: int) -> list[int]:
  """Device counts the model accepts on `topology` up to `max_devices`: 1..g, then multiples of g."""
  max_devices = _int(max_devices, "max_devices", 1)
  _check_topology(topology, 1)
  g = topology.devices_per_node
  counts = list(range(1, min(g, max_devices) + 1))
  if topology.inter is not None:
    counts += list(range(2 * g, max_devices + 1, g))
  return counts


# ---------------------------------------------------------------------------
# Collectives.
# ---------------------------------------------------------------------------


def _per_device_bandwidth(link: Link, sharing: int) -> float:
  return link.bandwidth / sharing if link.shared else link.bandwidth


def _ring_time(kind: str, nbytes: float, n: int, nodes: int, topology: Topology) -> float:
  """One logical ring over all devices: intra-node steps at α_intra, node crossings at α_inter, slowest bandwidth."""
  passes = 2 if kind == "all-reduce" else 1
  g = n // nodes
  bandwidth = _per_device_bandwidth(topology.intra, g)
  latency = passes * (n - nodes) * topology.intra.latency
  if nodes > 1:
    bandwidth = min(bandwidth, topology.inter.bandwidth)
    latency += passes * (nodes - 1) * topology.inter.latency
  return latency + passes * (n - 1) / n * nbytes / bandwidth


def _tree_time(nbytes: float, n: int, nodes: int, topology: Topology) -> float:
  """NCCL's all-reduce tree: chain inside a node, double binary tree between nodes, 2M bytes per device."""
  g = n // nodes
  bandwidth = _per_device_bandwidth(topology.intra, g)
  latency = 2 * (g - 1) * _tree_alpha(topology.intra)
  if nodes > 1:
    bandwidth = min(bandwidth, topology.inter.bandwidth)
    latency += 2 * math.ceil(math.log2(nodes)) * _tree_alpha(topology.inter)
  return latency + 2 * nbytes / bandwidth


def _hierarchical_time(kind: str, nbytes: float, n: int, nodes: int, topology: Topology) -> float:
  """Reduce-scatter in the node, the 1/g shard across nodes, all-gather in the node."""
  g = n // nodes
  inside = Topology(topology.name, topology.intra, g)
  intra_rs = _ring_time("reduce-scatter", nbytes, g, 1, inside) if g > 1 else 0.0
  if nodes == 1:
    return intra_rs * (2 if kind == "all-reduce" else 1)
  across = Topology(topology.name, topology.inter, 1, topology.inter)  # one device per node: only inter steps
  shard = nbytes / g
  if kind == "all-reduce":
    # NCCL's tuner picks the faster algorithm per call; between nodes that is the tree for small shards.
    inter = min(_ring_time(kind, shard, nodes, nodes, across), _tree_time(shard, nodes, nodes, across))
    return 2 * intra_rs + inter
  return intra_rs + _ring_time(kind, shard, nodes, nodes, across)


def collective_time(kind: str, nbytes: float, n_devices: int, topology: Topology, *,
                    algorithm: str = "hierarchical") -> float:
  """Seconds of one collective call over `n_devices` devices of `topology`.

  Args:
    kind: `"all-reduce"`, `"reduce-scatter"` or `"all-gather"`.
    nbytes: per-device size of the full buffer (the all-reduced array, the
      reduce-scatter's input, the all-gather's output).
    n_devices: devices taking part: up to `topology.devices_per_node`, or
      a multiple of it.
    topology: the interconnect.
    algorithm: `"ring"`, `"tree"` (all-reduce only; reduce-scatter and
      all-gather fall back to the ring) or `"hierarchical"`.

  Returns:
    `launch_latency + steps · α + bytes sent · β`; 0 for one device or 0 bytes.
  """
  _choice(kind, "kind", KINDS)
  _choice(algorithm, "algorithm", ALGORITHMS)
  nbytes = _real(nbytes, "nbytes")
  n = _int(n_devices, "n_devices", 1)
  nodes = _check_topology(topology, n)
  if n == 1 or nbytes == 0:
    return 0.0
  if algorithm == "hierarchical":
    seconds = _hierarchical_time(kind, nbytes, n, nodes, topology)
  elif algorithm == "tree" and kind == "all-reduce":
    seconds = _tree_time(nbytes, n, nodes, topology)
  else:
    seconds = _ring_time(kind, nbytes, n, nodes, topology)
  return topology.launch_latency + seconds


def ring_traffic(kind: str, nbytes: float, n_devices: int) -> float:
  """Bytes one device sends in a ring collective: 2(N−1)/N·M for an all-reduce, (N−1)/N·M otherwise.

  The same convention as `jaxdp.Collective.traffic_bytes` (which also counts `"all-to-all"`: each
  device sends `(N−1)/N` of its buffer).
  """
  _choice(kind, "kind", KINDS + ("all-to-all",))
  n = _int(n_devices, "n_devices", 1)
  return (2 if kind == "all-reduce" else 1) * (n - 1) / n * _real(nbytes, "nbytes")


def collectives(psi: int, n_devices: int, zero_stage: int, precision: Precision = MIXED_ADAM, *,
                schedule: str = "jaxdp", split_params: int | None = None, scalar_bytes: int = 0,
                norm_bytes: int = 0) -> tuple[CollectiveOp, ...]:
  """The collectives of one step of ZeRO stage `zero_stage` (none on one device).

  Args:
    psi: Ψ, the number of parameters.
    n_devices: N.
    zero_stage: 0-3.
    precision: bytes per gradient (all-reduced, reduce-scattered) and per
      parameter (all-gathered) element; `optimizer_bytes == 0` (no
      optimizer state) makes stage 1 stage 0.
    schedule: `"jaxdp"` (what jaxdp compiles with the whole gather),
      `"layerwise"` (jaxdp's layer-wise stage 3 with
      `reshard_after_forward=True`: stage 3 as the paper's, stages 0-2 as
      jaxdp's; needs no layer count, the bytes do not depend on it) or
      `"paper"` (Rajbhandari et al. 2020); see the module docstring.
    split_params: Ψ_s, the parameter elements in leaves that ZeRO splits
      over the N devices (see `split_params_of`); they are
      reduce-scattered and all-gathered. The other Ψ − Ψ_s are all-reduced
      at every stage. Default Ψ.
    scalar_bytes: bytes of scalars reduced with the gradient (jaxdp: Σ w·l
      and Σ w, 8 bytes): inside the gradient all-reduce at stages 0-1, a
      separate all-reduce at stages 2-3.
    norm_bytes: bytes of the partial sums of squares all-reduced for the
      global gradient norm. Stages 2-3: those of the split gradient leaves,
      which XLA all-reduces with the unsplit gradient (jaxdp: 4 bytes per
      split leaf). Stage 0: the one float32 sum of each device's 1/N of the
      agreed gradient (jaxdp: 4 bytes; 0 when a model axis is left to the
      compiler), in an all-reduce of its own after the gradient's. Not
      used at stage 1 (the norm of the replicated gradient needs none).

  Returns:
    The step's `CollectiveOp` s in program order (ops of 0 bytes left out).
  """
  psi = _int(psi, "psi", 1)
  n = _int(n_devices, "n_devices", 1)
  zero_stage = _stage(zero_stage)
  _choice(schedule, "schedule", SCHEDULES)
  precision = _check_precision(precision)
  split = psi if split_params is None else _int(split_params, "split_params", 0)
  if split > psi:
    raise ValueError(f"split_params must be <= psi={psi}, got {split_params!r}.")
  scalar_bytes = _int(scalar_bytes, "scalar_bytes", 0)
  norm_bytes = _int(norm_bytes, "norm_bytes", 0)
  if n == 1:
    return ()
  g, p = precision.grad_bytes, precision.param_bytes
  all_reduce = CollectiveOp("all-reduce", psi * g + scalar_bytes, True)
  if zero_stage == 0:
    return (all_reduce,) + ((CollectiveOp("all-reduce", norm_bytes, False),) if norm_bytes else ())
  jaxdp_stages_1_2 = schedule in ("jaxdp", "layerwise")  # layerwise differs from jaxdp at stage 3 only
  if zero_stage == 1 and jaxdp_stages_1_2 and precision.optimizer_bytes == 0:
    return (all_reduce,)
  gather = (CollectiveOp("all-gather", split * p, False),) if split else ()
  if zero_stage == 1 and jaxdp_stages_1_2:
    return (all_reduce,) + gather
  scalars = (CollectiveOp("all-reduce", scalar_bytes, False),) if scalar_bytes else ()
  scatter = (CollectiveOp("reduce-scatter", split * g, True),) if split else ()
  rest = (psi - split) * g + norm_bytes
  unsplit = (CollectiveOp("all-reduce", rest, False),) if rest else ()
  if zero_stage in (1, 2):
    return scalars + scatter + unsplit + gather
  # The paper and jaxdp's layer-wise stage 3 (reshard_after_forward=True) gather again for the backward pass.
  gathers = gather * (2 if schedule in ("paper", "layerwise") else 1)
  return gathers + scalars + scatter + unsplit


def jaxdp_norm_bytes(zero_stage: int, split_leaves: int, *, model_axis: bool = False) -> int:
  """`norm_bytes` for `collectives` as jaxdp compiles the global gradient norm.

  Stages 2-3: one float32 partial sum of squares per split gradient leaf.
  Stage 0: one float32, each device's sum over its 1/N of the agreed
  gradient; none when a model axis is left to the compiler (`model_axis`:
  every device then sums the whole gradient, see `jaxdp.global_norm`).
  Stage 1: none (the norm of the replicated gradient needs no collective).
  """
  zero_stage = _stage(zero_stage)
  split_leaves = _int(split_leaves, "split_leaves", 0)
  if zero_stage >= 2:
    return 4 * split_leaves
  return 4 if zero_stage == 0 and not model_axis else 0


def split_params_of(params, n_devices: int, model_specs=None) -> tuple[int, int]:
  """`(Ψ_s, leaves)`: the parameter elements, and the leaves, that ZeRO splits over `n_devices`.

  A leaf splits when `jaxdp.sharding.layout.zero_dim` finds a dimension for it
  (one that divides by `n_devices` and is not split over a model axis).
  `params` is a pytree of arrays or `jax.ShapeDtypeStruct` s;
  `model_specs` an optional matching tree of model-axis `PartitionSpec` s.
  Pass the leaves to `norm_bytes = 4 * leaves` of `collectives`.
  """
  import jax  # the rest of this module is plain arithmetic

  from jaxdp.sharding.layout import zero_dim

  n = _int(n_devices, "n_devices", 1)
  leaves = jax.tree.leaves(params)
  specs = [None] * len(leaves) if model_specs is None else jax.tree.leaves(
      model_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  split = [math.prod(x.shape) for x, spec in zip(leaves, specs)
           if zero_dim(tuple(x.shape), spec, n) is not None]
  return sum(split), len(split)


def communication_volume(psi: int, n_devices: int, zero_stage: int, precision: Precision = MIXED_ADAM, *,
                         schedule: str = "jaxdp", split_params: int | None = None) -> float:
  """Bytes one device sends per step under ring algorithms (scalars not counted).

  With every leaf split (`split_params` = Ψ, the default): stage 0
  2(N−1)/N · Ψ · g; jaxdp stage 1 2(N−1)/N · Ψ · g + (N−1)/N · Ψ · p;
  stages 2 and 3 (N−1)/N · Ψ · (g + p); the paper's and the layer-wise
  stage 3 gather twice.
  Unsplit elements add 2(N−1)/N · g each at stages 2-3 (all-reduced)
  instead of (N−1)/N · (g + p).
  """
  ops = collectives(psi, n_devices, zero_stage, precision, schedule=schedule, split_params=split_params)
  return sum(ring_traffic(op.kind, op.nbytes, n_devices) for op in ops)


# ---------------------------------------------------------------------------
# The step.
# ---------------------------------------------------------------------------


def _buckets(nbytes: float, bucket_bytes: float | None) -> tuple[int, float, float]:
  """`(count, full, last)`: a collective of `nbytes` as `count - 1` full buckets and a last one."""
  if bucket_bytes is None or nbytes <= bucket_bytes:
    return 1, 0.0, nbytes
  count = math.ceil(nbytes / bucket_bytes)
  return count, bucket_bytes, nbytes - bucket_bytes * (count - 1)


def step_time(model: ModelCost, n_devices: int, topology: Topology, *, batch_per_device: int,
              zero_stage: int = 0, bucket_bytes: float | None = None, algorithm: str = "hierarchical",
              overlap: float = 0.0, schedule: str = "jaxdp", split_params: int | None = None,
              scalar_bytes: int = 0, norm_bytes: int = 0) -> StepTime:
  """Predicted time of one data-parallel step on `n_devices` devices.

  Args:
    model: what one step costs on one device.
    n_devices: N: up to `topology.devices_per_node`, or a multiple of it.
    topology: the interconnect (e.g. `H100_NDR`, `TPU_V5E_SLICES`).
    batch_per_device: examples per device per step.
    zero_stage: 0-3 (which collectives; ZeRO ≥ 1 also divides the update by N).
    bucket_bytes: split each collective into `ceil(bytes / bucket_bytes)`
      calls, each paying the launch and step latencies (PyTorch DDP's default
      is `DDP_BUCKET_BYTES`, 25 MiB); `None`: one call per collective.
    algorithm: `"ring"`, `"tree"` or `"hierarchical"`.
    overlap: fraction in [0, 1] of the gradient communication *before its last
      bucket* that runs during the backward pass (DDP's overlap: the last
      bucket can only start when the backward pass ends). 0: no overlap.
    schedule: `"jaxdp"`, `"layerwise"` or `"paper"` (see `collectives`).
    split_params: Ψ_s, parameters in leaves ZeRO splits (see `collectives`).
    scalar_bytes: scalars reduced with the gradient (see `collectives`).
    norm_bytes: partial gradient norms all-reduced at stages 2-3 (see `collectives`).

  Returns:
    A `StepTime`.
  """
  model = _check_model(model)
  n = _int(n_devices, "n_devices", 1)
  _check_topology(topology, n)
  batch = _int(batch_per_device, "batch_per_device", 1)
  zero_stage = _stage(zero_stage)
  if bucket_bytes is not None:
    _real(bucket_bytes, "bucket_bytes", open_min=True)
  _choice(algorithm, "algorithm", ALGORITHMS)
  overlap = _real(overlap, "overlap", 0.0, 1.0)
  ops = collectives(model.params, n, zero_stage, model.precision, schedule=schedule,
                    split_params=split_params, scalar_bytes=scalar_bytes, norm_bytes=norm_bytes)
  forward_backward = batch * model.seconds_per_example
  update = model.update_seconds / (n if zero_stage >= 1 else 1)  # ZeRO updates one chunk per device
  communication, before_last, launches = 0.0, 0.0, 0
  for op in ops:
    count, full, last = _buckets(op.nbytes, bucket_bytes)
    # Full buckets all cost the same: one evaluation, not thousands.
    earlier = (count - 1) * collective_time(op.kind, full, n, topology, algorithm=algorithm) if count > 1 else 0.0
    communication += earlier + collective_time(op.kind, last, n, topology, algorithm=algorithm)
    launches += count
    if op.gradient:
      before_last += earlier
  hidden = overlap * min(before_last, model.backward_fraction * forward_backward)
  compute = forward_backward + update
  total = compute + communication - hidden
  single = forward_backward + model.update_seconds
  return StepTime(compute, communication, hidden, total, single / total if total > 0 else 1.0, launches)


def communication_bound_at(model: ModelCost, topology: Topology, *, batch_per_device: int,
                           max_devices: int = 1024, **options) -> int | None:
  """The smallest device count at which exposed communication exceeds compute.

  Args:
    model, topology, batch_per_device: as in `step_time`.
    max_devices: search the counts `valid_device_counts` allows up to this.
    **options: other keywords of `step_time` (`zero_stage`, `overlap`, ...).

  Returns:
    That N, or `None` if communication stays below compute up to `max_devices`.
  """
  _check_model(model)
  if "zero_stage" in options:
    _stage(options["zero_stage"])
  for n in valid_device_counts(topology, max_devices):
    t = step_time(model, n, topology, batch_per_device=batch_per_device, **options)
    if t.communication - t.hidden > t.compute:
      return n
  return None


# ---------------------------------------------------------------------------
# Memory.
# ---------------------------------------------------------------------------


def _state_bytes(zero_stage: int, precision: Precision) -> tuple[int, int]:
  """(replicated, sharded) bytes per parameter: per-device bytes = Ψ (replicated + sharded / N)."""
  p, g, k = precision.param_bytes, precision.grad_bytes, precision.optimizer_bytes
  return {0: (p + g + k, 0), 1: (p + g, k), 2: (p, g + k), 3: (0, p + g + k)}[zero_stage]


def _gathered_layers(zero_stage: int, n: int, schedule: str, layers: int | None) -> tuple[int, int]:
  """`(a, b)`: stage 3 holds `a / b` of the split parameters gathered, `p` bytes each.

  `"jaxdp"`: all of them (1/1); `"layerwise"`: two of the L layers (the
  current one and the prefetched next one), 2/L, one at L = 1; `"paper"`:
  none counted (0/1). Stages 0-2 and one device: 0/1.
  """
  if zero_stage != 3 or n == 1 or schedule == "paper":
    return 0, 1
  if schedule == "layerwise":
    return min(2, layers), layers
  return 1, 1


def memory_per_device(psi: float, n_devices: int, zero_stage: int, precision: Precision = MIXED_ADAM, *,
                      split_params: float | None = None, schedule: str = "jaxdp",
                      layers: int | None = None) -> float:
  """Bytes per device of model state (params, gradients, optimizer state), plus stage 3's gathered params.

  Args:
    psi: Ψ, the number of parameters.
    n_devices: N, the data-parallel degree.
    zero_stage: 0-3.
    precision: `MIXED_ADAM` (2 + 2 + 12 bytes, the paper's K = 12) or
      `FP32_ADAM` (4 + 4 + 8), or your own.
    split_params: Ψ_s, the parameters in leaves ZeRO splits (see
      `split_params_of`); the other Ψ − Ψ_s stay whole on every device
      at every stage. Default Ψ (the paper's formulas).
    schedule: `"jaxdp"` (default, as `collectives`): stage 3 gathers
      all split parameters before the forward pass and keeps them through
      the backward pass, so it adds `p·Ψ_s` per device (N > 1). `"paper"`:
      the ZeRO paper's layer-by-layer gathering, counted as model state only
      (one layer's gathered parameters are not counted). `"layerwise"`:
      jaxdp's layer-wise stage 3 (`layers=` of `jaxdp.make_train_step`)
      counted with prefetch, two layers gathered at once: it adds `2·p·Ψ_s/L`
      (`p·Ψ_s` at L = 1), every split parameter counted in the stack of
      `layers` equal layers (the leaves outside the stack, which jaxdp
      gathers whole, are neglected: they add `p` bytes each). Stages 0-2
      do not depend on it.
    layers: L, the number of stacked layers: a positive int, required with
      `schedule="layerwise"` and refused with the others.

  Returns:
    `(p+g+K)Ψ`, `(p+g)Ψ + KΨ/N`, `pΨ + (g+K)Ψ/N`, and at stage 3
    `(p+g+K)Ψ/N + pΨ` (jaxdp), `(p+g+K)Ψ/N + 2pΨ/L` (layerwise) or
    `(p+g+K)Ψ/N` (paper) (with Ψ_s < Ψ: the formula for Ψ_s plus
    `(p+g+K)(Ψ − Ψ_s)`). Activations and other temporary buffers are not
    included.
  """
  psi = _real(psi, "psi")
  n = _int(n_devices, "n_devices", 1)
  zero_stage = _stage(zero_stage)
  _choice(schedule, "schedule", SCHEDULES)
  layers = _layers(layers, schedule)
  precision = _check_precision(precision)
  split = psi if split_params is None else _real(split_params, "split_params", 0.0, psi)
  replicated, sharded = _state_bytes(zero_stage, precision)
  held, of = _gathered_layers(zero_stage, n, schedule, layers)
  gathered = precision.param_bytes * held / of
  return split * (replicated + sharded / n + gathered) + (psi - split) * (replicated + sharded)


def largest_model(memory_bytes: float, n_devices: int, zero_stage: int, precision: Precision = MIXED_ADAM, *,
                  reserved_bytes: float = 0.0, schedule: str = "jaxdp", layers: int | None = None) -> int:
  """The most parameters whose model state (and jaxdp's stage-3 gathered params) fits `memory_bytes` per device.

  Args:
    memory_bytes: device memory.
    n_devices: N.
    zero_stage: 0-3.
    precision: as in `memory_per_device`.
    reserved_bytes: memory kept for activations, workspace and the runtime.
    schedule: as in `memory_per_device`: `"jaxdp"` (default; stage 3
      holds every split parameter gathered, `p` bytes each, so it fits
      little more than stage 2), `"layerwise"` (jaxdp's layer-wise stage 3
      counted with prefetch: two of the `layers` layers gathered at once) or
      `"paper"` (layer-by-layer gathering, one layer's gathered parameters
      not counted).
    layers: L, as in `memory_per_device` (`schedule="layerwise"` only).

  Returns:
    The largest integer Ψ with `memory_per_device(Ψ, ...) <= memory_bytes - reserved_bytes`, every
    leaf split (`split_params` = Ψ).
  """
  memory = _real(memory_bytes, "memory_bytes")
  reserved = _real(reserved_bytes, "reserved_bytes", 0.0, memory)
  n = _int(n_devices, "n_devices", 1)
  zero_stage = _stage(zero_stage)
  _choice(schedule, "schedule", SCHEDULES)
  layers = _layers(layers, schedule)
  precision = _check_precision(precision)
  replicated, sharded = _state_bytes(zero_stage, precision)
  held, of = _gathered_layers(zero_stage, n, schedule, layers)
  # Bytes per parameter (replicated + held/of · p + sharded/N), times N·of: integers, the division exact.
  per_n_devices = (replicated * of + held * precision.param_bytes) * n + sharded * of
  if per_n_devices == 0:
    raise ValueError(f"precision={precision!r} stores 0 bytes per parameter: every model fits.")
  # Rounded down twice: the exact floor (Fractions of the given floats), then down to where memory_per_device's
  # own float rounding fits the budget too (M = 16e9, N = 24, stage 1, FP32_ADAM: the exact 1.92e9 computes to
  # 16000000000.000002 bytes).
  psi = math.floor((Fraction(memory) - Fraction(reserved)) * n * of / per_n_devices)
  budget = memory - reserved
  while psi > 0 and memory_per_device(psi, n, zero_stage, precision, schedule=schedule, layers=layers) > budget:
    psi -= max(1, psi >> 50)  # one parameter, or a few ulps of Ψ where Ψ is beyond float's integers
  return psi


def seconds_per_example(flops_per_example: float, peak_flops: float, utilization: float) -> float:
  """Compute time of one example from its FLOPs: `flops / (peak_flops · utilization)`.

  Args:
    flops_per_example: forward + backward FLOPs (a transformer: about
      `6 · Ψ · tokens`, Kaplan et al. 2020, attention not counted).
    peak_flops: the device's peak FLOP/s (e.g. `H100_SXM.peak_flops`).
    utilization: achieved fraction of the peak (model FLOPs utilization, MFU).
  """
  flops = _real(flops_per_example, "flops_per_example")
  peak = _real(peak_flops, "peak_flops", open_min=True)
  mfu = _real(utilization, "utilization", 0.0, 1.0, open_min=True)
  return flops / (peak * mfu)


def transformer_flops(params: float, tokens: int) -> float:
  """Training FLOPs of `tokens` tokens through a `params`-parameter transformer: 6 Ψ T (Kaplan et al. 2020)."""
  return 6.0 * _real(params, "params") * _int(tokens, "tokens", 0)
