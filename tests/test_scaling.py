"""The α-β scaling model: properties of its formulas, never timings.

The model is arithmetic, so most checks are exact identities (volumes,
memory, latency per bucket) or equalities of two code paths (hierarchical
vs ring on one node) up to float round-off (rel 1e-12: a handful of ulps of
sums of a few terms). One test compiles tiny jaxdp steps (stages 0-3, 3 and 4
devices, leaves that split and leaves that stay whole) and checks that the
model's collective bytes equal those counted in their HLO.
"""

import math
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp.analysis import scaling

ROUND_OFF = 1e-12

# A topology with round numbers: 1 GB/s and 1 µs inside a node of 4, 0.1 GB/s and 10 µs between nodes.
FAST = scaling.Link("fast", 1e9, 1e-6)
SLOW = scaling.Link("slow", 1e8, 1e-5)
TOY = scaling.Topology("toy", FAST, 4, SLOW, launch_latency=5e-6)
MODEL = scaling.ModelCost(params=10_000_000, seconds_per_example=1e-3, update_seconds=2e-3)
# The layer count each schedule needs (only "layerwise" takes one).
LAYERS = {"jaxdp": None, "layerwise": 80, "paper": None}



def test_the_cost_model_is_imported_on_first_access_only():
  """No library path needs the model: ``import jaxdp`` and the training, data, checkpoint and report names leave it
  unimported, ``jaxdp.analysis.scaling`` imports it."""
  code = "\n".join([
      "import sys, jaxdp",
      "jaxdp.make_train_step, jaxdp.DataPipeline, jaxdp.CheckpointManager, jaxdp.comm_report, jaxdp.runtime.distributed",
      "assert 'jaxdp.analysis.scaling' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jaxdp'))",
      "assert jaxdp.analysis.scaling.FP32_ADAM and 'jaxdp.analysis.scaling' in sys.modules",
  ])
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr

def test_ring_all_reduce_volume_is_2_n_minus_1_over_n_psi_bytes():
  for precision in (scaling.MIXED_ADAM, scaling.FP32_ADAM):
    for n in range(1, 10):
      volume = scaling.communication_volume(1_000_003, n, 0, precision)
      assert volume == pytest.approx(2 * (n - 1) / n * 1_000_003 * precision.grad_bytes, rel=ROUND_OFF)


def test_ring_traffic_uses_the_convention_of_collectives_from_hlo():
  hlo = "\n".join([
      "%a = f32[1000]{0} all-reduce(%x), replica_groups={{0,1,2,3,4}}",
      "%b = f32[200]{0} reduce-scatter(%y), dimensions={0}",
      "%c = bf16[1000]{0} all-gather(%z), dimensions={0}",
  ])
  counted = jaxdp.collectives_from_hlo(hlo, 5)
  for kind, report in counted.items():
    assert scaling.ring_traffic(kind, report.bytes, 5) == pytest.approx(report.traffic_bytes, rel=ROUND_OFF)


def test_each_collective_is_counted_over_its_own_device_group():
  """A model-axis op on a 4 x 2 mesh spans 2 devices, not the 4 of the data axis: its ring share is 1/2."""
  hlo = "\n".join([
      "%a = f32[1000]{0} all-reduce(%x), replica_groups={{0,2,4,6},{1,3,5,7}}",
      "%b = f32[1000]{0} all-reduce(%x), replica_groups=[4,2]<=[8]",
      "%c = f32[1000]{0} all-gather(%z), replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, dimensions={0}",
      "%d = f32[250]{0} reduce-scatter(%y), replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}",
      # XLA's spelling with the device order in between: was not parsed, and counted over all 4 data devices.
      "%e = f32[1000]{0} all-gather(%z), replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) "
      "{'axis_1'}, dimensions={0}",
  ])
  counted = jaxdp.collectives_from_hlo(hlo, 4)
  assert counted["all-reduce"].traffic_bytes == pytest.approx(2 * 4000 * 3 / 4 + 2 * 4000 * 1 / 2, rel=ROUND_OFF)
  assert counted["all-gather"].traffic_bytes == pytest.approx(2 * 4000 * 1 / 2, rel=ROUND_OFF)
  assert counted["reduce-scatter"].bytes == 4 * 1000  # the input of a 4-device scatter of 250 floats each
  assert counted["reduce-scatter"].traffic_bytes == pytest.approx(4000 * 3 / 4, rel=ROUND_OFF)


def test_an_async_collective_counts_once_sized_by_its_done_result():
  start = "%ag = (f32[250]{0}, f32[1000]{0}) all-gather-start(%z), replica_groups=[2,4]<=[8], dimensions={0}"
  sync = "%r = f32[8]{0} all-reduce(%x)"
  hlo = "\n".join([start, "%ag.1 = f32[1000]{0} all-gather-done(%ag)", sync])
  assert jaxdp.analysis.reports.hlo_collectives(hlo) == [
      jaxdp.analysis.reports.HloCollective("all-gather", 4000, 4, start),
      jaxdp.analysis.reports.HloCollective("all-reduce", 32, None, sync),
  ]
  assert jaxdp.collectives_from_hlo(hlo, 8)["all-gather"] == jaxdp.Collective(1, 4000, 4000 * 3 / 4)


def test_stage_volumes_relative_to_stage_0():
  """jaxdp: stage 1 moves 1.5x stage 0, stages 2-3 the same (p = g); the paper's stage 3 1.5x."""
  for n in (2, 8, 64):
    base = scaling.communication_volume(10**6, n, 0, scaling.FP32_ADAM)
    volume = lambda stage, schedule="jaxdp": scaling.communication_volume(
        10**6, n, stage, scaling.FP32_ADAM, schedule=schedule)
    assert volume(1) == pytest.approx(1.5 * base, rel=ROUND_OFF)
    assert volume(2) == pytest.approx(base, rel=ROUND_OFF)
    assert volume(3) == pytest.approx(base, rel=ROUND_OFF)
    assert volume(1, "paper") == pytest.approx(base, rel=ROUND_OFF)
    assert volume(3, "paper") == pytest.approx(1.5 * base, rel=ROUND_OFF)
    assert volume(3, "layerwise") == pytest.approx(1.5 * base, rel=ROUND_OFF)
    assert volume(1, "layerwise") == pytest.approx(1.5 * base, rel=ROUND_OFF)  # stages 0-2: jaxdp's


@pytest.mark.parametrize("algorithm", scaling.ALGORITHMS)
@pytest.mark.parametrize("zero_stage", scaling.ZERO_STAGES)
def test_efficiency_is_1_on_one_device(algorithm, zero_stage):
  for bucket_bytes in (None, 1e6):
    for overlap in (0.0, 0.5, 1.0):
      t = scaling.step_time(MODEL, 1, TOY, batch_per_device=32, zero_stage=zero_stage, algorithm=algorithm,
                            bucket_bytes=bucket_bytes, overlap=overlap)
      assert (t.communication, t.hidden, t.launches, t.efficiency) == (0.0, 0.0, 0, 1.0)
      assert t.total == t.compute == 32 * MODEL.seconds_per_example + MODEL.update_seconds


def test_efficiency_below_1_with_communication_and_no_zero_update_saving():
  for n in (2, 4, 8, 64):
    assert scaling.step_time(MODEL, n, TOY, batch_per_device=32).efficiency < 1


def test_memory_reproduces_the_zero_paper_7_5b_on_64_gpus():
  """Rajbhandari et al. (2020): 7.5B params, N = 64, K = 12: 120, 31.4, 16.6, 1.88 GB (3 significant digits)."""
  paper = (120, 31.4, 16.6, 1.88)
  for stage, gb in zip(scaling.ZERO_STAGES, paper):
    bytes_ = scaling.memory_per_device(7.5e9, 64, stage, scaling.MIXED_ADAM, schedule="paper")
    assert float(f"{bytes_ / scaling.GB:.3g}") == gb
  # jaxdp's stage 3 keeps the 7.5B gathered bf16 params too: 1.875 + 2 x 7.5 = 16.875 GB.
  assert scaling.memory_per_device(7.5e9, 64, 3, scaling.MIXED_ADAM) == pytest.approx(16.875e9, rel=ROUND_OFF)


def test_memory_fp32_formulas():
  """Model state (paper): 16Ψ, (8 + 8/N)Ψ, (4 + 12/N)Ψ, 16Ψ/N; jaxdp's stage 3 adds the 4Ψ it gathers."""
  psi = 1_000_000
  for n in (2, 8, 1024):
    paper = [scaling.memory_per_device(psi, n, s, scaling.FP32_ADAM, schedule="paper") for s in scaling.ZERO_STAGES]
    jaxdp_ = [scaling.memory_per_device(psi, n, s, scaling.FP32_ADAM) for s in scaling.ZERO_STAGES]
    assert paper == pytest.approx([16 * psi, (8 + 8 / n) * psi, (4 + 12 / n) * psi, 16 * psi / n], rel=ROUND_OFF)
    assert jaxdp_ == pytest.approx([16 * psi, (8 + 8 / n) * psi, (4 + 12 / n) * psi, (4 + 16 / n) * psi],
                                   rel=ROUND_OFF)


def test_stage_3_memory_follows_jaxdps_schedule_as_measured():
  """docs/zero_memory.json, MLP 256-1024-1024-10, N = 8, stage 3, fp32 Adam: Ψ = 1,323,018, of which the
  10-element head bias stays whole. Model state: 16 x 1,323,008 / 8 + 16 x 10 = 2,646,176 bytes (measured
  2,646,180, the 4 more a step counter); jaxdp also holds all 1,323,008 split params gathered, 4 bytes each
  (5,292,032: measured temporaries 6,341,784 include them), 7,938,208 bytes in all."""
  psi, split = 1_323_018, 1_323_008
  paper = scaling.memory_per_device(psi, 8, 3, scaling.FP32_ADAM, split_params=split, schedule="paper")
  jaxdp_ = scaling.memory_per_device(psi, 8, 3, scaling.FP32_ADAM, split_params=split)
  assert paper == pytest.approx(2_646_176, rel=ROUND_OFF)
  assert jaxdp_ == pytest.approx(7_938_208, rel=ROUND_OFF)
  for stage in (0, 1, 2):  # only stage 3 depends on the schedule
    assert (scaling.memory_per_device(psi, 8, stage, split_params=split)
            == scaling.memory_per_device(psi, 8, stage, split_params=split, schedule="paper"))


def test_largest_model_at_stage_3_by_hand():
  """80 GB, N = 1,024, mixed-precision Adam: jaxdp's stage 3 holds (2 + 16/1024) bytes per param,
  80e9 x 1024 / 2064 = 39,689,922,480.6 -> 39.7B; the paper's layer-by-layer stage 3 16/1024 bytes, 5.12T.
  Stage 2 (2 + 14/1024 bytes): 80e9 x 1024 / 2062 = 39,728,419,010.6."""
  assert scaling.largest_model(80e9, 1024, 3) == 39_689_922_480
  assert scaling.largest_model(80e9, 1024, 3, schedule="paper") == 5_120_000_000_000
  assert scaling.largest_model(80e9, 1024, 2) == 39_728_419_010
  assert scaling.largest_model(80e9, 1024, 2, schedule="paper") == 39_728_419_010


def test_stage_3_is_stage_0_over_n_and_all_stages_agree_on_one_device():
  for precision in (scaling.MIXED_ADAM, scaling.FP32_ADAM):
    for schedule in scaling.SCHEDULES:
      full = scaling.memory_per_device(7e9, 1, 0, precision, schedule=schedule, layers=LAYERS[schedule])
      assert all(scaling.memory_per_device(7e9, 1, s, precision, schedule=schedule, layers=LAYERS[schedule]) == full
                 for s in scaling.ZERO_STAGES)
    assert scaling.memory_per_device(7e9, 256, 3, precision, schedule="paper") == pytest.approx(
        full / 256, rel=ROUND_OFF)
    assert scaling.memory_per_device(7e9, 256, 3, precision) == pytest.approx(
        full / 256 + precision.param_bytes * 7e9, rel=ROUND_OFF)


def test_layerwise_stage_3_memory_holds_two_gathered_layers():
  """(p+g+K)Ψ/N + 2pΨ/L at stage 3 (the current layer and the prefetched next one), pΨ at L = 1; unsplit
  leaves whole as at every stage; stages 0-2 and one device as the other schedules."""
  for precision in (scaling.MIXED_ADAM, scaling.FP32_ADAM):
    p, g, k = precision.param_bytes, precision.grad_bytes, precision.optimizer_bytes
    for n in (2, 8, 1024):
      for layers in (2, 3, 80):
        for psi in (10**6, 7e9):
          got = scaling.memory_per_device(psi, n, 3, precision, schedule="layerwise", layers=layers)
          assert got == pytest.approx((p + g + k) * psi / n + 2 * p * psi / layers, rel=ROUND_OFF)
      one = scaling.memory_per_device(10**6, n, 3, precision, schedule="layerwise", layers=1)
      assert one == pytest.approx((p + g + k) * 10**6 / n + p * 10**6, rel=ROUND_OFF)  # the one layer
      assert one == scaling.memory_per_device(10**6, n, 3, precision)  # = the whole gather
      # Ψ_s split, Ψ - Ψ_s whole: the formula for Ψ_s plus (p+g+K)(Ψ - Ψ_s).
      psi, split = 1_000_000, 999_000
      got = scaling.memory_per_device(psi, n, 3, precision, split_params=split, schedule="layerwise", layers=80)
      assert got == pytest.approx((p + g + k) * split / n + 2 * p * split / 80 + (p + g + k) * (psi - split),
                                  rel=ROUND_OFF)
      for stage in (0, 1, 2):
        assert (scaling.memory_per_device(7e9, n, stage, precision, schedule="layerwise", layers=80)
                == scaling.memory_per_device(7e9, n, stage, precision)
                == scaling.memory_per_device(7e9, n, stage, precision, schedule="paper"))
    # One device: nothing is split or gathered.
    assert (scaling.memory_per_device(7e9, 1, 3, precision, schedule="layerwise", layers=80)
            == (p + g + k) * 7e9)


def test_layerwise_largest_model_by_hand_and_between_the_other_schedules():
  """80 GB, N = 1,024, mixed-precision Adam, L = 80: 16/1024 + 2·2/80 = 0.065625 bytes per param,
  80e9 / 0.065625 = 1,219,047,619,047.6 -> 1.22T; between jaxdp's 39.7B and the paper's 5.12T."""
  assert scaling.largest_model(80e9, 1024, 3, schedule="layerwise", layers=80) == 1_219_047_619_047
  assert scaling.largest_model(80e9, 8, 3, schedule="layerwise", layers=80) == math.floor(80e9 / (16 / 8 + 4 / 80))
  for n in (2, 8, 64, 256, 1024):
    jaxdp_ = scaling.largest_model(80e9, n, 3)
    paper = scaling.largest_model(80e9, n, 3, schedule="paper")
    by_layers = [scaling.largest_model(80e9, n, 3, schedule="layerwise", layers=layers)
                 for layers in (1, 2, 4, 8, 16, 80, 1000)]
    assert by_layers[0] == jaxdp_  # L = 1: the one layer is the whole model
    assert jaxdp_ <= by_layers[1]  # L = 2: both layers gathered, as much as the whole gather
    assert by_layers == sorted(by_layers) and by_layers[-1] <= paper  # more layers, a smaller gathered share
    for stage in (0, 1, 2):
      assert (scaling.largest_model(80e9, n, stage, schedule="layerwise", layers=80)
              == scaling.largest_model(80e9, n, stage) == scaling.largest_model(80e9, n, stage, schedule="paper"))
  # More devices never fit a smaller model; at most N·M/16 (the paper's) and at least stage 0's.
  sizes = [scaling.largest_model(80e9, n, 3, schedule="layerwise", layers=80) for n in (1, 2, 8, 64, 256, 1024)]
  assert sizes == sorted(sizes) and sizes[0] == scaling.largest_model(80e9, 1, 0)


def test_layerwise_collectives_are_the_papers_stage_3_and_jaxdps_stages_0_to_2():
  """reshard_after_forward=True: all-gather forward and backward, reduce-scatter the gradient: 3(N-1)/N·Ψ
  elements; 1.5x jaxdp's whole-gather stage 3 (p = g). Stages 0-2 compile as with the whole gather."""
  for n in (2, 8, 1024):
    for split in (None, 999_000):
      options = dict(split_params=split, scalar_bytes=8, norm_bytes=12)
      assert (scaling.collectives(10**6, n, 3, scaling.FP32_ADAM, schedule="layerwise", **options)
              == scaling.collectives(10**6, n, 3, scaling.FP32_ADAM, schedule="paper", **options))
      for stage in (0, 1, 2):
        assert (scaling.collectives(10**6, n, stage, scaling.FP32_ADAM, schedule="layerwise", **options)
                == scaling.collectives(10**6, n, stage, scaling.FP32_ADAM, **options))
    volume = scaling.communication_volume(10**6, n, 3, scaling.FP32_ADAM, schedule="layerwise")
    assert volume == pytest.approx(3 * (n - 1) / n * 10**6 * 4, rel=ROUND_OFF)
    assert volume == pytest.approx(1.5 * scaling.communication_volume(10**6, n, 3, scaling.FP32_ADAM),
                                   rel=ROUND_OFF)
  # step_time takes the schedule without a layer count: the bytes do not depend on it.
  layerwise = scaling.step_time(MODEL, 8, TOY, batch_per_device=2, zero_stage=3, schedule="layerwise")
  assert layerwise == scaling.step_time(MODEL, 8, TOY, batch_per_device=2, zero_stage=3, schedule="paper")
  assert layerwise.communication > scaling.step_time(MODEL, 8, TOY, batch_per_device=2, zero_stage=3).communication


def test_largest_model_is_the_inverse_of_memory():
  for n in (1, 8, 64, 1000):
    for stage in scaling.ZERO_STAGES:
      for schedule in scaling.SCHEDULES:
        for layers in ((1, 2, 3, 80, 96) if schedule == "layerwise" else (None,)):
          psi = scaling.largest_model(80e9, n, stage, reserved_bytes=10e9, schedule=schedule, layers=layers)
          memory = lambda p: scaling.memory_per_device(p, n, stage, schedule=schedule, layers=layers)
          assert memory(psi) <= 70e9 < memory(psi + 1)
  assert scaling.largest_model(80e9, 8, 0) == 5_000_000_000  # 16 bytes per param, unsharded


def test_buckets_add_the_collective_latency_per_bucket():
  """k buckets pay k launches and k x 2(N-1) ring steps; the bandwidth term is the same."""
  n, gradient_bytes = 4, MODEL.params * MODEL.precision.grad_bytes
  per_call_latency = TOY.launch_latency + 2 * (n - 1) * FAST.latency
  one = scaling.step_time(MODEL, n, TOY, batch_per_device=8, algorithm="ring")
  for bucket_bytes, buckets in ((gradient_bytes, 1), (gradient_bytes / 4, 4), (3e6, 7)):
    t = scaling.step_time(MODEL, n, TOY, batch_per_device=8, algorithm="ring", bucket_bytes=bucket_bytes)
    assert t.launches == buckets == math.ceil(gradient_bytes / bucket_bytes)
    assert t.communication - one.communication == pytest.approx((buckets - 1) * per_call_latency, rel=1e-9)


@pytest.mark.parametrize("kind", scaling.KINDS)
def test_hierarchical_equals_ring_on_one_node(kind):
  for n in (1, 2, 3, 4):
    for nbytes in (0, 1, 12345.0, 4e9):
      ring = scaling.collective_time(kind, nbytes, n, TOY, algorithm="ring")
      assert scaling.collective_time(kind, nbytes, n, TOY) == pytest.approx(ring, rel=ROUND_OFF)


def test_hierarchical_across_nodes_sends_1_over_g_between_nodes():
  """With a free intra-node link, the hierarchical all-reduce is the inter-node ring (or tree) on M/g."""
  free = TOY._replace(intra=FAST._replace(bandwidth=1e300, latency=0.0), launch_latency=0.0)
  nbytes, n, g = 1e9, 32, 4
  nodes = n // g
  ring_on_shard = 2 * (nodes - 1) * SLOW.latency + 2 * (nodes - 1) / nodes * (nbytes / g) / SLOW.bandwidth
  assert scaling.collective_time("all-reduce", nbytes, n, free) == pytest.approx(ring_on_shard, rel=ROUND_OFF)


def test_tree_latency_is_logarithmic_in_nodes():
  no_bandwidth = TOY._replace(intra=FAST._replace(bandwidth=1e300), inter=SLOW._replace(bandwidth=1e300))
  for nodes in (2, 3, 8, 100, 256):
    t = scaling.collective_time("all-reduce", 1e6, 4 * nodes, no_bandwidth, algorithm="tree")
    want = TOY.launch_latency + 2 * (3 * FAST.latency + math.ceil(math.log2(nodes)) * SLOW.latency)
    assert t == pytest.approx(want, rel=ROUND_OFF)


def test_tree_steps_pay_the_links_tree_latency_not_the_rings():
  """A link's tree_latency (here 7 µs in a node, 50 µs between nodes) prices the tree's steps; rings keep α."""
  fast, slow = FAST._replace(tree_latency=7e-6), SLOW._replace(tree_latency=50e-6)
  no_bandwidth = TOY._replace(intra=fast._replace(bandwidth=1e300), inter=slow._replace(bandwidth=1e300))
  # 8 nodes of 4: 2 x (3 chain steps at 7 µs + 3 tree levels at 50 µs) + the 5 µs launch = 347 µs.
  tree = scaling.collective_time("all-reduce", 1e6, 32, no_bandwidth, algorithm="tree")
  assert tree == pytest.approx(5e-6 + 2 * (3 * 7e-6 + 3 * 50e-6), rel=ROUND_OFF)
  # The ring over the same 32 devices: 2 x (24 in-node steps at 1 µs + 7 node crossings at 10 µs) + 5 µs = 193 µs.
  ring = scaling.collective_time("all-reduce", 1e6, 32, no_bandwidth, algorithm="ring")
  assert ring == pytest.approx(5e-6 + 2 * (24 * 1e-6 + 7 * 10e-6), rel=ROUND_OFF)


def test_nccl_presets_carry_nccls_tree_and_ring_latencies():
  """NVIDIA/nccl v2.8.3-1 src/graph/tuning.cc, Simple protocol: hwLat NVLink ring 3.4 µs, tree 28 µs;
  network ring 9.6 µs, tree 28 µs; baseLat ring 8.4 µs."""
  for link in (scaling.NVLINK2_V100, scaling.NVLINK3_A100, scaling.NVLINK4_H100):
    assert (link.latency, link.tree_latency) == (3.4e-6, 28e-6)
  for link in (scaling.IB_EDR, scaling.IB_HDR, scaling.IB_NDR):
    assert (link.latency, link.tree_latency) == (9.6e-6, 28e-6)
  assert scaling.H100_NDR.launch_latency == 8.4e-6


def test_hierarchical_on_1024_h100s_by_hand():
  """128 nodes of 8, 8 MiB all-reduced: reduce-scatter and all-gather in the node (7 ring steps of 3.4 µs,
  7/8 of the bytes at 450 GB/s, each), then the 1 MiB shard between nodes by the tree (2 x 7 levels at
  28 µs, 2 MiB at 50 GB/s), which beats the ring (2 x 127 steps at 9.6 µs)."""
  nbytes = 8 * 2**20
  in_node = 7 * 3.4e-6 + 7 / 8 * nbytes / 450e9
  tree = 2 * 7 * 28e-6 + 2 * (nbytes / 8) / 50e9
  ring = 2 * 127 * 9.6e-6 + 2 * 127 / 128 * (nbytes / 8) / 50e9
  assert tree < ring
  want = 8.4e-6 + 2 * in_node + tree
  got = scaling.collective_time("all-reduce", nbytes, 1024, scaling.H100_NDR)
  assert got == pytest.approx(want, rel=ROUND_OFF)
  # Two nodes: the ring (2 steps at 9.6 µs) beats the tree (2 levels at 28 µs).
  two = scaling.collective_time("all-reduce", nbytes, 16, scaling.H100_NDR)
  ring2 = 2 * 1 * 9.6e-6 + 2 * 1 / 2 * (nbytes / 8) / 50e9
  assert two == pytest.approx(8.4e-6 + 2 * in_node + ring2, rel=ROUND_OFF)


def test_overlap_hides_at_most_the_backward_pass_and_never_the_last_bucket():
  kwargs = dict(batch_per_device=8, algorithm="ring")
  one_bucket = scaling.step_time(MODEL, 4, TOY, overlap=1.0, **kwargs)
  assert one_bucket.hidden == 0.0
  for overlap in (0.0, 0.3, 1.0):
    t = scaling.step_time(MODEL, 4, TOY, overlap=overlap, bucket_bytes=1e6, **kwargs)
    assert t.hidden <= overlap * MODEL.backward_fraction * 8 * MODEL.seconds_per_example + 1e-15
    assert t.total == pytest.approx(t.compute + t.communication - t.hidden, rel=ROUND_OFF)
    assert (t.hidden == 0.0) == (overlap == 0.0)


def test_communication_bound_at_matches_the_closed_form():
  """α = 0: ring all-reduce time 2(N-1)/N · M/B exceeds compute c first at N > 2 / (2 - c B / M)."""
  link = scaling.Link("bandwidth only", 1e9, 0.0)
  topology = scaling.Topology("one big node", link, 1024)
  per_example = 0.0701  # no ties between compute and 2(N-1)/N at any integer N
  model = scaling.ModelCost(params=250_000_000, seconds_per_example=per_example, precision=scaling.FP32_ADAM)
  for batch, want in ((16, 3), (24, 7), (27, 19)):  # M/B = 1 s; compute 1.12 s, 1.68 s, 1.89 s
    assert want == math.floor(2 / (2 - batch * per_example)) + 1
    assert scaling.communication_bound_at(model, topology, batch_per_device=batch, algorithm="ring") == want
  assert scaling.communication_bound_at(model, topology, batch_per_device=29, algorithm="ring") is None


def test_presets_are_consistent():
  for topology in (scaling.H100_NDR, scaling.A100_HDR, scaling.V100_EDR, scaling.TPU_V4_POD, scaling.TPU_V5E_SLICES):
    links = [topology.intra] + ([topology.inter] if topology.inter else [])
    assert all(link.source and link.bandwidth > 0 and link.latency > 0 for link in links)
    for n in scaling.valid_device_counts(topology, 1024)[-3:]:
      assert 0 < scaling.step_time(MODEL, n, topology, batch_per_device=8).efficiency <= 1
  assert scaling.NVLINK4_H100.bandwidth == 450e9 and scaling.IB_NDR.bandwidth == 50e9
  assert scaling.TPU_V5E_ICI.bandwidth == 200e9


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: scaling.step_time(MODEL, 0, TOY, batch_per_device=1), "n_devices"),
        (lambda: scaling.step_time(MODEL, True, TOY, batch_per_device=1), "n_devices"),
        (lambda: scaling.step_time(MODEL, 6, TOY, batch_per_device=1), "n_devices=6"),
        (lambda: scaling.step_time(MODEL, 8, TOY._replace(inter=None), batch_per_device=1), "topology.inter"),
        (lambda: scaling.step_time(MODEL, 2, TOY, batch_per_device=0), "batch_per_device"),
        (lambda: scaling.step_time(MODEL, 2, TOY, batch_per_device=1, zero_stage=4), "zero_stage"),
        (lambda: scaling.step_time(MODEL, 2, TOY, batch_per_device=1, algorithm="butterfly"), "algorithm"),
        (lambda: scaling.step_time(MODEL, 2, TOY, batch_per_device=1, overlap=1.5), "overlap"),
        (lambda: scaling.step_time(MODEL, 2, TOY, batch_per_device=1, overlap=float("nan")), "overlap"),
        (lambda: scaling.step_time(MODEL, 2, TOY, batch_per_device=1, bucket_bytes=0), "bucket_bytes"),
        (lambda: scaling.step_time(MODEL, 2, TOY, batch_per_device=1, schedule="deepspeed"), "schedule"),
        (lambda: scaling.step_time(MODEL._replace(seconds_per_example=-1.0), 2, TOY, batch_per_device=1),
         "model.seconds_per_example"),
        (lambda: scaling.step_time(MODEL, 2, "H100", batch_per_device=1), "topology"),
        (lambda: scaling.step_time(MODEL, 2, TOY._replace(intra=FAST._replace(bandwidth=0.0)), batch_per_device=1),
         "topology.intra.bandwidth"),
        (lambda: scaling.collective_time("all-to-all", 1.0, 2, TOY), "kind"),
        (lambda: scaling.collective_time("all-reduce", 1.0, 8, TOY._replace(inter=SLOW._replace(tree_latency=-1.0)),
                                         algorithm="tree"), "topology.inter.tree_latency"),
        (lambda: scaling.communication_bound_at(MODEL, None, batch_per_device=1), "topology"),
        (lambda: scaling.communication_bound_at(MODEL, TOY, batch_per_device=1, max_devices=0), "max_devices"),
        (lambda: scaling.memory_per_device(-1, 8, 0), "psi"),
        (lambda: scaling.memory_per_device(1e9, 8, 0, precision="bf16"), "precision"),
        (lambda: scaling.largest_model(80e9, 8, 3, reserved_bytes=90e9), "reserved_bytes"),
        (lambda: scaling.largest_model(80e9, 8, 3, schedule="deepspeed"), "schedule"),
        (lambda: scaling.memory_per_device(80e9, 8, 3, schedule="fsdp"), "schedule"),
        (lambda: scaling.memory_per_device(80e9, 8, 3, schedule="layerwise"), "layers"),
        (lambda: scaling.memory_per_device(80e9, 8, 0, schedule="layerwise"), "layers"),
        (lambda: scaling.memory_per_device(80e9, 8, 3, schedule="layerwise", layers=0), "layers"),
        (lambda: scaling.memory_per_device(80e9, 8, 3, schedule="layerwise", layers=-2), "layers"),
        (lambda: scaling.memory_per_device(80e9, 8, 3, schedule="layerwise", layers=2.0), "layers"),
        (lambda: scaling.memory_per_device(80e9, 8, 3, schedule="layerwise", layers=True), "layers"),
        (lambda: scaling.memory_per_device(80e9, 8, 3, schedule="layerwise", layers="80"), "layers"),
        (lambda: scaling.memory_per_device(80e9, 8, 3, layers=80), "layers"),
        (lambda: scaling.memory_per_device(80e9, 8, 3, schedule="paper", layers=80), "layers"),
        (lambda: scaling.largest_model(80e9, 8, 3, schedule="layerwise"), "layers"),
        (lambda: scaling.largest_model(80e9, 8, 3, schedule="layerwise", layers=0), "layers"),
        (lambda: scaling.largest_model(80e9, 8, 3, layers=80), "layers"),
        (lambda: scaling.collectives(10, 4, 2, split_params=11), "split_params"),
        (lambda: scaling.collectives(10, 4, 2, split_params=-1), "split_params"),
        (lambda: scaling.collectives(10, 4, 2, norm_bytes=-4), "norm_bytes"),
        (lambda: scaling.jaxdp_norm_bytes(4, 3), "zero_stage"),
        (lambda: scaling.jaxdp_norm_bytes(2, -1), "split_leaves"),
        (lambda: scaling.memory_per_device(10, 4, 2, split_params=11), "split_params"),
        (lambda: scaling.seconds_per_example(1e12, 1e15, 0.0), "utilization"),
    ],
)
def test_bad_inputs_raise_value_errors_naming_the_argument(call, name):
  with pytest.raises(ValueError, match=name.replace(".", r"\.")):
    call()


def test_unsplit_leaves_are_all_reduced_at_every_stage():
  """Ψ_u = Ψ - Ψ_s elements: 2(N-1)/N·g each at every stage; the split ones as before."""
  psi, split, n = 1_000_000, 999_000, 8
  fp32 = scaling.FP32_ADAM
  for stage in scaling.ZERO_STAGES:
    ops = scaling.collectives(psi, n, stage, fp32, split_params=split)
    gathered = sum(op.nbytes for op in ops if op.kind == "all-gather")
    scattered = sum(op.nbytes for op in ops if op.kind == "reduce-scatter")
    reduced = sum(op.nbytes for op in ops if op.kind == "all-reduce")
    assert gathered == (0 if stage == 0 else split * 4)
    assert scattered == (split * 4 if stage >= 2 else 0)
    assert reduced == (psi * 4 if stage <= 1 else (psi - split) * 4)
  # Nothing split: stages 2-3 all-reduce everything, like stage 0, and gather nothing.
  for stage in (2, 3):
    ops = scaling.collectives(psi, n, stage, fp32, split_params=0, scalar_bytes=8)
    assert {op.kind for op in ops} == {"all-reduce"} and sum(op.nbytes for op in ops) == psi * 4 + 8
  volume = lambda stage: scaling.communication_volume(psi, n, stage, fp32, split_params=split)
  assert volume(2) == pytest.approx(volume(0), rel=ROUND_OFF)  # p = g: the unsplit part costs the same
  assert volume(1) == pytest.approx(volume(0) + (n - 1) / n * split * 4, rel=ROUND_OFF)


def test_stage_1_without_optimizer_state_is_stage_0():
  """K = 0 (SGD): stage 1 has nothing to split, so XLA gathers nothing; stage 2 still gathers the update."""
  sgd = scaling.Precision("fp32 SGD", 4, 4, 0)
  assert scaling.collectives(1000, 8, 1, sgd) == scaling.collectives(1000, 8, 0, sgd)
  assert [op.kind for op in scaling.collectives(1000, 8, 2, sgd)] == ["reduce-scatter", "all-gather"]


def test_norm_and_scalar_bytes_are_separate_all_reduces_at_stages_2_and_3():
  for stage in (2, 3):
    ops = scaling.collectives(100, 4, stage, scaling.FP32_ADAM, split_params=90, scalar_bytes=8, norm_bytes=12)
    assert [op.nbytes for op in ops if op.kind == "all-reduce"] == [8, 10 * 4 + 12]
  ops = scaling.collectives(100, 4, 1, scaling.FP32_ADAM, split_params=90, scalar_bytes=8, norm_bytes=12)
  assert [op.nbytes for op in ops if op.kind == "all-reduce"] == [100 * 4 + 8]  # the norm needs no collective
  # Stage 0: the gradient with the scalars, then the partial sums of squares on their own.
  ops = scaling.collectives(100, 4, 0, scaling.FP32_ADAM, split_params=90, scalar_bytes=8, norm_bytes=4)
  assert [op.nbytes for op in ops if op.kind == "all-reduce"] == [100 * 4 + 8, 4]
  assert [op.gradient for op in ops] == [True, False]


def test_jaxdp_norm_bytes_follow_the_compiled_norm():
  """One float32 per split leaf at stages 2-3, one in all at stage 0 (none with a compiler-split model axis)."""
  assert [scaling.jaxdp_norm_bytes(stage, 3) for stage in (0, 1, 2, 3)] == [4, 0, 12, 12]
  assert scaling.jaxdp_norm_bytes(0, 3, model_axis=True) == 0


def test_memory_keeps_unsplit_leaves_whole():
  psi, split = 1_000_000, 600_000
  for n in (1, 2, 8):
    for stage in scaling.ZERO_STAGES:
      got = scaling.memory_per_device(psi, n, stage, scaling.FP32_ADAM, split_params=split)
      want = (scaling.memory_per_device(split, n, stage, scaling.FP32_ADAM)
              + scaling.memory_per_device(psi - split, 1, stage, scaling.FP32_ADAM))
      assert got == pytest.approx(want, rel=ROUND_OFF)
  assert scaling.memory_per_device(psi, 8, 3, split_params=0) == scaling.memory_per_device(psi, 8, 0)


def test_split_params_of_follows_the_layout_rule():
  params = {"w": np.zeros((3, 8)), "b": np.zeros(8), "odd": np.zeros(7), "s": np.float32(0)}
  assert scaling.split_params_of(params, 4) == (24 + 8, 2)
  assert scaling.split_params_of(params, 3) == (24, 1)  # w along its first dimension
  assert scaling.split_params_of(params, 1) == (0, 0)
  specs = {"w": jax.sharding.PartitionSpec(None, "model"), "b": jax.sharding.PartitionSpec(),
           "odd": jax.sharding.PartitionSpec(), "s": jax.sharding.PartitionSpec()}
  assert scaling.split_params_of(params, 4, specs) == (8, 1)  # w's only divisible dimension is model-split


def _loss(params, batch):
  hidden = jax.numpy.tanh((batch["x"] + params["shift"][None, :]) @ params["w"] + params["b"][None, :])
  return 0.5 * (hidden @ params["head"] + params["bias"] - batch["y"]) ** 2


@pytest.mark.parametrize(
    "n, zero_stage, optimizer_name",
    [(4, 0, "adam"), (4, 1, "adam"), (4, 2, "adam"), (4, 3, "adam"), (3, 2, "adam"), (3, 3, "adam"), (4, 1, "sgd")],
)
def test_model_bytes_equal_bytes_counted_in_a_compiled_jaxdp_step(n, zero_stage, optimizer_name):
  """Leaves w [3, 8], b [8], head [8], shift [3] and a scalar bias: at N = 4 w (along its 8), b and head split,
  shift and bias stay whole; at N = 3 only w (along its 3) and shift split. jaxdp reduces Σw·l and Σw
  (8 bytes) with the gradient; for the global gradient norm, at stages 2-3 XLA all-reduces one float32
  partial sum of squares per split leaf, and at stage 0 each device all-reduces the sum of squares of its
  1/N of the agreed gradient (4 bytes). SGD (no optimizer state) splits nothing at stage 1."""
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(3, 8)).astype(np.float32), "b": np.zeros(8, np.float32),
            "head": rng.normal(size=(8,)).astype(np.float32), "shift": np.zeros(3, np.float32),
            "bias": np.float32(0.1)}
  batch = {"x": rng.normal(size=(12, 3)).astype(np.float32), "y": rng.normal(size=(12,)).astype(np.float32)}
  mesh = jaxdp.data_mesh(jax.devices()[:n])
  optimizer, precision = {
      "adam": (optax.adam(1e-3), scaling.FP32_ADAM),
      "sgd": (optax.sgd(0.1), scaling.Precision("fp32 SGD", 4, 4, 0)),
  }[optimizer_name]
  state = jaxdp.init_state(params, optimizer, mesh, zero_stage=zero_stage)
  step = jaxdp.make_train_step(_loss, optimizer, mesh, zero_stage=zero_stage)
  counted = jaxdp.comm_report(step, state, batch)
  split, split_leaves = scaling.split_params_of(params, n)
  assert (split, split_leaves) == ({4: 40, 3: 27}[n], {4: 3, 3: 2}[n])
  ops = scaling.collectives(sum(np.size(x) for x in jax.tree.leaves(params)), n, zero_stage, precision,
                            split_params=split, scalar_bytes=8, norm_bytes=4 if zero_stage == 0 else 4 * split_leaves)
  for kind in scaling.KINDS:
    assert counted[kind].bytes == sum(op.nbytes for op in ops if op.kind == kind), (kind, counted)


# Every public function that takes a ZeRO stage, called with ``stage``.
STAGE_TAKERS = {
    "collectives": lambda stage: scaling.collectives(1000, 4, stage),
    "communication_volume": lambda stage: scaling.communication_volume(1000, 4, stage),
    "jaxdp_norm_bytes": lambda stage: scaling.jaxdp_norm_bytes(stage, 3),
    "step_time": lambda stage: scaling.step_time(MODEL, 4, TOY, batch_per_device=2, zero_stage=stage),
    "communication_bound_at": lambda stage: scaling.communication_bound_at(
        MODEL, TOY, batch_per_device=2, max_devices=8, zero_stage=stage),
    "memory_per_device": lambda stage: scaling.memory_per_device(1e9, 8, stage),
    "largest_model": lambda stage: scaling.largest_model(80e9, 8, stage),
}


@pytest.mark.parametrize("function", sorted(STAGE_TAKERS))
@pytest.mark.parametrize("stage", [True, False, 1.0, 2.0, np.float64(3.0), "1", None, -1, 4])
def test_zero_stage_must_be_an_int_not_a_bool_or_a_float(function, stage):
  """True == 1 and 1.0 == 1, so a membership test alone accepted them as stage 1."""
  with pytest.raises(ValueError, match="zero_stage"):
    STAGE_TAKERS[function](stage)


@pytest.mark.parametrize("function", sorted(STAGE_TAKERS))
def test_zero_stage_accepts_numpy_ints(function):
  for stage in scaling.ZERO_STAGES:
    assert STAGE_TAKERS[function](np.int64(stage)) == STAGE_TAKERS[function](stage)
