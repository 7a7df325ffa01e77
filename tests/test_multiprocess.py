"""Several real processes: the same answer in every layout, cross-process checks, faults.

Jobs are started with ``python -m jaxdp.launch`` (workers in
``tests/mp_workers/``) on simulated CPU devices over loopback, and their
results compared with a single-device reference computed here. Every job is
bounded in time and checked for processes left behind.

Layout tolerance: every layout computes the same float32 arithmetic on the
same examples; only the order of the sums differs (per-device partial sums,
then a psum over 4 devices in-process or through gloo, against one sum on one
device). Such reorderings move each gradient by a few float32 ulps of the
partial sums; over 3 SGD-with-momentum steps on parameters of size ~1 that
stays below 1e-6 (measured: see the test), so ``ATOL = 1e-5`` has a 10x margin
while any real error (a dropped or double-counted example, a wrong
normalisation) moves the parameters by more than 1e-3.
"""

import json
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxdp.core import processes
from jaxdp.runtime import distributed
from helpers import float64
from mp_workers import harness, problem

ATOL = 1e-5
JOB_SECONDS = 120  # a generous bound on one launched job; the assertions below are tighter
WORKER = harness.WORKERS / "train_layout.py"

LAYOUTS = {
    # name: (launcher options, worker options); None: one plain process, no launcher.
    "2 processes x 2 devices": (["--nproc", "2", "--devices-per-proc", "2"], ["--checks"]),
    "4 processes x 1 device": (["--nproc", "4", "--devices-per-proc", "1"], ["--explicit"]),
    "1 process x 4 devices": (None, []),
}


# --- Reference and jobs ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> dict:
  """The parameters after ``problem.STEPS`` steps on one device, on the concatenated global batch."""
  opt = optax.sgd(problem.LR, momentum=problem.MOMENTUM)
  params = jax.device_put(problem.init_params(), jax.devices()[0])
  opt_state = opt.init(params)

  def loss(params, batch, weights):
    return jnp.sum(weights * problem.loss_fn(params, batch)) / jnp.sum(weights)

  @jax.jit
  def step(params, opt_state, batch, weights):
    updates, opt_state = opt.update(jax.grad(loss)(params, batch, weights), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for k in range(problem.STEPS):
    batches, weights = problem.portions(k)
    batch = jax.tree.map(lambda *xs: np.concatenate(xs), *batches)
    params, opt_state = step(params, opt_state, batch, np.concatenate(weights))
  return jax.tree.map(np.asarray, params)


_jobs: dict = {}


def _layout_job(name: str, tmp_path_factory):
  """Runs the layout's job once per module; returns ``(result, output directory)``."""
  if name not in _jobs:
    out = tmp_path_factory.mktemp("layout")
    launcher, worker = LAYOUTS[name]
    if launcher is None:
      result = harness.run([sys.executable, str(WORKER), str(out), *worker], timeout=JOB_SECONDS, JAX_NUM_CPU_DEVICES="4")
    else:
      result = harness.launch([*launcher, "--timeout", "100"], [WORKER, out, *worker], timeout=JOB_SECONDS)
    harness.assert_no_leftovers(str(out))
    _jobs[name] = (result, out)
  return _jobs[name]


def _succeeded(result) -> None:
  assert result.returncode == 0, f"job failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_gives_the_reference_params(layout, reference, tmp_path_factory):
  result, out = _layout_job(layout, tmp_path_factory)
  _succeeded(result)
  with np.load(out / "params.npz", allow_pickle=False) as saved:
    params = {k: saved[k] for k in saved.files}
  assert sorted(params) == sorted(reference)
  diff = max(float(np.max(np.abs(params[k] - reference[k]))) for k in reference)
  moved = max(float(np.max(np.abs(reference[k] - problem.init_params()[k]))) for k in reference)
  print(f"\n{layout}: max |param - reference| = {diff:.3g} (parameters moved by up to {moved:.3g}); {result.seconds:.1f} s")
  assert moved > 1e-2, "the reference must actually train"
  for k in reference:
    np.testing.assert_allclose(params[k], reference[k], rtol=0, atol=ATOL, err_msg=f"{layout}: params[{k!r}]")


def test_launched_workers_see_their_layout(tmp_path_factory):
  result, _ = _layout_job("2 processes x 2 devices", tmp_path_factory)
  _succeeded(result)
  for rank in range(2):
    assert (f"[rank {rank}] ProcessInfo(process_index={rank}, process_count=2, local_device_count=2, "
            "device_count=4, coordinator_address='127.0.0.1:") in result.stdout
    assert f"[rank {rank}] mesh spans 4 devices of processes [0, 1]" in result.stdout
  explicit, _ = _layout_job("4 processes x 1 device", tmp_path_factory)
  _succeeded(explicit)
  assert "process_count=4, local_device_count=1, device_count=4" in explicit.stdout
  assert "source='arguments'" in explicit.stdout
  plain, _ = _layout_job("1 process x 4 devices", tmp_path_factory)
  _succeeded(plain)
  assert ("ProcessInfo(process_index=0, process_count=1, local_device_count=4, device_count=4, "
          "coordinator_address=None, source='none')") in plain.stdout


def test_zero3_with_parameters_split_across_processes():
  """The first step's input check copied every parameter to the host: with a parameter split across processes
  it failed ("spans non-addressable devices"), so no multi-process ZeRO-3 run could take a step."""
  result = harness.launch(["--nproc", "2", "--devices-per-proc", "2", "--timeout", "100"],
                          [harness.WORKERS / "zero_split.py"], timeout=JOB_SECONDS)
  _succeeded(result)
  assert "[rank 0] max |param - reference| = " in result.stdout


def test_assert_replicas_equal_across_processes(tmp_path_factory):
  result, _ = _layout_job("2 processes x 2 devices", tmp_path_factory)
  _succeeded(result)
  for rank, other in ((0, 1), (1, 0)):
    assert f"[rank {rank}] assert_replicas_equal passed on the trained state" in result.stdout
    # Process 1's replicas were shifted by 1e-3: every process sees it and names the other.
    assert f"[rank {rank}] assert_replicas_equal raised: replicas differ: ['w']: process {other} differ from" in result.stdout
    assert "largest |difference| 0.001" in result.stdout


def test_pipeline_gives_each_process_only_its_examples(tmp_path_factory):
  result, out = _layout_job("2 processes x 2 devices", tmp_path_factory)
  _succeeded(result)
  ranks = []
  for rank in range(2):
    with np.load(out / f"pipeline_rank{rank}.npz", allow_pickle=False) as f:
      ranks.append({k: f[k] for k in f.files})
  assert [r["positions"].tolist() for r in ranks] == [[0, 1], [2, 3]]
  # Each process placed exactly the examples the plan gives its devices ...
  for r in ranks:
    np.testing.assert_array_equal(r["seen"], r["planned"])
    # ... and read only those (plus example 0 once, to learn the shapes).
    assert set(r["reads"].tolist()) <= set(r["seen"].tolist()) | {0}
  # Over the epoch, every example is used exactly once across the processes.
  together = np.sort(np.concatenate([r["seen"] for r in ranks]))
  np.testing.assert_array_equal(together, np.arange(17))


# --- Faults ------------------------------------------------------------------------------------

FAULTS = {
    # mode: (launcher exit code, text that must name the failure)
    "exit3": (3, "jaxdp.runtime.launch: rank 1 exited with code 3"),
    "raise": (1, "jaxdp.runtime.launch: rank 1 exited with code 1"),
    "kill": (128 + signal.SIGKILL, "jaxdp.runtime.launch: rank 1 was killed by signal SIGKILL"),
    # Rank 1 hangs without heartbeats: the coordination service declares it dead and aborts rank 0.
    # (A hang with live heartbeats is only ended by the launcher's --timeout: test_launch.py.)
    "stop": (None, "stopped sending heartbeats"),
}


@pytest.mark.parametrize("mode", list(FAULTS))
def test_a_failing_worker_takes_the_job_down(mode, tmp_path):
  code, message = FAULTS[mode]
  options = ["--nproc", "2", "--grace-period", "2", "--heartbeat-timeout", "3", "--timeout", "50"]
  result = harness.launch(options, [harness.WORKERS / "fail.py", mode, tmp_path], timeout=JOB_SECONDS)
  output = result.stdout + result.stderr
  assert result.returncode != 0, output
  if code is not None:
    assert result.returncode == code, output
  assert message in output, output
  assert "[rank 0] rank 0 blocks in a collective" in output
  assert "unreachable" not in output
  assert result.seconds < 60, f"took {result.seconds:.1f} s"
  harness.assert_no_leftovers(str(tmp_path))


def test_disagreeing_processes_raise_on_every_process(tmp_path):
  result = harness.launch(["--nproc", "2", "--devices-per-proc", "2", "--grace-period", "2", "--timeout", "60"],
                          [harness.WORKERS / "disagree.py", tmp_path], timeout=JOB_SECONDS)
  output = result.stdout + result.stderr
  assert result.returncode == 2, output
  for rank in range(2):
    assert f"[rank {rank}] agreeing batch passes" in output
    shape = (f"[rank {rank}] shape ValueError on rank {rank}: processes disagree on batch (this is process "
             f"{rank} of 2); every process must pass the same batch: |   batch[0]['x']: process 0: float32[20,5], "
             "process 1: float32[24,5]")
    assert shape in output
    config = f"[rank {rank}] config ValueError on rank {rank}: processes disagree on config"
    assert config in output and "config['lr']: process 0: 0.1, process 1: 0.2" in output
    assert f"[rank {rank}] model_state ValueError on rank {rank}: processes disagree on initial values" in output
    assert f"[rank {rank}] pipeline ValueError on rank {rank}: processes disagree on DataPipeline arguments" in output
    assert f"[rank {rank}] iterate ValueError on rank {rank}: processes disagree on DataPipeline.iterate" in output
    assert f"[rank {rank}] save ValueError on rank {rank}: processes disagree on CheckpointManager.save" in output
    assert (f"[rank {rank}] streaming ValueError on rank {rank}: data-axis positions [0, 1] of this mesh hold "
            "devices of several processes") in output
    assert (f"[rank {rank}] pmap ValueError on rank {rank}: backend='pmap' runs on one process's devices only"
            in output)
  assert "initial values['model_state']['bn']['mean']" in output
  assert "DataPipeline arguments['seed']: process 0: 0, process 1: 1" in output
  assert "CheckpointManager.save['step']: process 0: 2, process 1: 3" in output
  assert "no error" not in output
  harness.assert_no_leftovers(str(tmp_path))


def test_a_batch_that_differs_on_one_process_fails_on_every_process(tmp_path):
  """The step checks its inputs across processes before any collective: no process is left blocked."""
  result = harness.launch(["--nproc", "2", "--devices-per-proc", "2", "--grace-period", "2", "--timeout", "60"],
                          [harness.WORKERS / "step_disagreement.py", tmp_path], timeout=JOB_SECONDS)
  output = result.stdout + result.stderr
  assert result.returncode == 2, output
  for rank in range(2):
    assert f"[rank {rank}] step ValueError on rank {rank}: processes disagree on step inputs" in output, output
  assert "step inputs['batch']['x']: process 0: float32[20,5], process 1: float32[20,6]" in output
  assert "no error" not in output
  harness.assert_no_leftovers(str(tmp_path))


# --- initialize() in this process --------------------------------------------------------------

_CLUSTER_VARIABLES = [
    "JAXDP_COORDINATOR", "JAXDP_NUM_PROCESSES", "JAXDP_PROCESS_ID", "JAXDP_DEVICES_PER_PROC",
    "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
    "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "JAX_COORDINATOR_ADDRESS",
    "TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS",
]


@pytest.fixture
def fresh(monkeypatch):
  """No cluster in the environment and no earlier ``initialize`` result."""
  for variable in _CLUSTER_VARIABLES:
    monkeypatch.delenv(variable, raising=False)
  monkeypatch.setattr(distributed, "_info", None)
  monkeypatch.setattr(distributed, "_on_cloud_tpu_vm", lambda: False)
  return monkeypatch


def test_importing_jaxdp_does_not_start_the_backend():
  code = (
      "import jaxdp, jaxdp.runtime.distributed, jaxdp.runtime.launch, jax\n"
      "from jax._src import xla_bridge\n"
      "assert not xla_bridge.backends_are_initialized()\n"
      "jax.config.update('jax_num_cpu_devices', 3)\n"
      "print(jax.device_count())\n"
  )
  result = harness.run([sys.executable, "-c", code], timeout=60)
  assert result.returncode == 0 and result.stdout.strip() == "3", result


def test_initialize_alone_does_nothing_and_twice_is_harmless(fresh):
  info = distributed.initialize()
  assert info == distributed.ProcessInfo(0, 1, jax.local_device_count(), jax.device_count(), None, "none")
  assert not jax.distributed.is_initialized()
  assert distributed.initialize(num_processes=7) is info  # a second call is a no-op


@pytest.mark.parametrize(
    "variables, expected",
    [
        ({}, None),
        ({"JAXDP_COORDINATOR": "127.0.0.1:1234"}, "launcher"),
        ({"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
          "SLURM_LOCALID": "0"}, "slurm"),
        ({"SLURM_JOB_ID": "1"}, None),  # an allocation without a job step is not a job of several processes
        ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, "openmpi"),
        ({"TPU_WORKER_HOSTNAMES": "a,b"}, "tpu"),
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "jax"),
    ],
)
def test_detect_cluster(fresh, variables, expected):
  for k, v in variables.items():
    fresh.setenv(k, v)
  assert distributed.detect_cluster() == expected


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_processes": 0}, "num_processes must be an integer >= 1"),
        ({"process_id": -1}, "process_id must be an integer >= 0"),
        ({"num_processes": 2.0}, "num_processes must be an integer"),
        ({"coordinator_address": "localhost"}, "coordinator_address must be a 'host:port' string"),
        ({"num_cpu_devices": 0}, "num_cpu_devices must be an integer >= 1"),
        ({"cpu_collectives": "nccl"}, "cpu_collectives must be 'gloo', 'mpi' or None"),
        ({"heartbeat_timeout_seconds": 0, "coordinator_address": "127.0.0.1:1", "num_processes": 2, "process_id": 0},
         "heartbeat_timeout_seconds must be an integer >= 1"),
    ],
)
def test_initialize_rejects_bad_arguments(fresh, kwargs, match):
  jax.devices()  # started: a bad argument must be reported before that matters
  with pytest.raises(ValueError, match=match):
    distributed.initialize(**kwargs)


def test_initialize_rejects_a_bad_launcher_environment(fresh):
  fresh.setenv("JAXDP_COORDINATOR", "127.0.0.1:1234")
  fresh.setenv("JAXDP_NUM_PROCESSES", "two")
  with pytest.raises(ValueError, match="JAXDP_NUM_PROCESSES='two' must be an integer >= 1"):
    distributed.initialize()


def test_initialize_after_the_backend_started_explains_the_order(fresh):
  jax.devices()
  with pytest.raises(RuntimeError, match="must run before anything touches a JAX device"):
    distributed.initialize(coordinator_address="127.0.0.1:1", num_processes=2, process_id=1)
  assert not jax.distributed.is_initialized()
  with pytest.raises(RuntimeError, match=r"num_cpu_devices=3 cannot be applied: the JAX backend already started with 8"):
    distributed.initialize(num_cpu_devices=3)


def test_assert_same_across_processes_alone(fresh):
  distributed.assert_same_across_processes({"lr": 0.1, "x": np.zeros(3)}, "config")  # one process: nothing to compare
  with pytest.raises(TypeError, match="name must be a string"):
    distributed.assert_same_across_processes(1, name=3)


def test_differences_name_every_leaf_that_differs():
  a = processes._describe({"lr": 0.1, "x": np.zeros((2, 3), np.float32), "n": 4, "s": np.float32(1)})
  b = processes._describe({"lr": 0.2, "x": jnp.zeros((2, 4), jnp.float32), "n": 4, "s": np.float32(2)})
  text = processes._differences("config", [a, b])
  assert text.splitlines() == [
      "config['lr']: process 0: 0.1, process 1: 0.2",
      "  config['s']: process 0: np.float32(1.0), process 1: np.float32(2.0)",
      "  config['x']: process 0: float32[2,3], process 1: float32[2,4]",
  ]
  c = processes._describe({"lr": 0.1})
  assert "config (pytree structure): process 0:" in processes._differences("config", [a, c])


# --- The experiment itself under the launcher -----------------------------------------------------


def test_train_lm_runs_unchanged_under_the_launcher(tmp_path):
  """2 processes x 1 device give the losses of 1 process x 2 devices (the same mesh positions, examples, keys).

  Both sides compile with most XLA optimisation passes skipped (as in test_train_lm.py): the test checks the
  launcher's plumbing and float32 agreement, not speed, and compiling the LM step is most of its time.
  """
  sys.path.insert(0, str(harness.ROOT))
  from experiments import train_lm

  flags = ["--steps", "3", "--batch-size", "4", "--seq-len", "32", "--layers", "1", "--d-model", "16",
           "--heads", "2", "--d-ff", "32", "--max-bytes", "30000", "--no-progress"]
  job = harness.in_background(
      harness.launch, ["--nproc", "2", "--devices-per-proc", "1", "--grace-period", "2", "--timeout", "150"],
      [harness.ROOT / "experiments" / "train_lm.py", *flags, "--out", tmp_path / "mp"],
      timeout=JOB_SECONDS + 60, JAX_DISABLE_MOST_OPTIMIZATIONS="1")
  config = train_lm.config_from_args(flags + ["--devices", "2"])
  before = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  try:  # the 1-process run, here while the launched job runs
    local = [r["loss"] for r in train_lm.train(config, devices=jax.devices()[:2], out=None)["records"]]
  finally:
    jax.config.update("jax_disable_most_optimizations", before)
    result = job()
  assert result.returncode == 0, result.stdout + result.stderr
  launched = [json.loads(line)["loss"] for line in (tmp_path / "mp" / "metrics.jsonl").read_text().splitlines()]
  assert len(launched) == len(local) == 3
  np.testing.assert_allclose(launched, local, rtol=0, atol=ATOL)
  harness.assert_no_leftovers(str(tmp_path))


def test_diloco_with_a_group_per_process_equals_the_run_in_one_process(tmp_path):
  """DiLoCo on 2 processes (one replica group each: the outer sync goes through gloo), checkpointed mid-period
  and resumed, against the same run in this process on 4 devices: bit for bit (the inner all-reduces run inside
  a process either way, and the outer sum of two groups is the same sum in either order)."""
  from mp_workers import diloco

  wait = harness.in_background(harness.launch, ["--nproc", "2", "--devices-per-proc", "2", "--timeout", "100"],
                               [harness.WORKERS / "diloco.py", tmp_path], timeout=JOB_SECONDS)
  one = diloco.run(jax.devices()[:4], str(tmp_path / "one"))
  result = wait()
  _succeeded(result)
  harness.assert_no_leftovers(str(tmp_path))
  assert "[rank 0] groups on processes [{0}, {1}]" in result.stdout
  with np.load(tmp_path / "state.npz", allow_pickle=False) as saved:
    two = [saved[f"arr_{i}"] for i in range(len(saved.files))]
  assert len(two) == len(one)
  for a, b in zip(two, one):
    np.testing.assert_array_equal(a, b)


# A 16-bit policy's round-off after 3 steps of parameters of about 1, against one device under the same policy
# (measured on 4 devices of one process: at most 4.3e-3 under bfloat16, whose spacing is 7.8e-3; 8.5e-4 under
# float16, spacing 9.8e-4; the 2 processes are within 7e-5 of those 4 devices). A planted rank-mean is off by 7e-2.
ROUND_OFF = {"bfloat16 compute and reduction": 2e-2, "float16 with loss scaling": 4e-3}


@pytest.mark.usefixtures("fast_compiles")  # as the workers: most XLA passes skipped
def test_compositions_across_processes_equal_one_device(tmp_path):
  """A hybrid mesh with a replica row per process, tensor parallelism, ZeRO-1, ZeRO-2, layer-wise ZeRO-3, the
  three pipeline schedules with a stage per process, accumulation, BatchNorm, layout-invariant dropout and
  evaluation, on 2 processes, against one device in this process: float64, every step's loss, the final state and
  the evaluation within 1e-12 (round-off is about 1e-16; a planted rank-mean moves them by 7e-2). PowerSGD keeps
  one error per replica, which one device cannot hold: against the same run on 4 devices of this process.
  bfloat16 compute and reduction, and float16 with dynamic loss scaling: one device under the same policy, to the
  policy's round-off (ROUND_OFF)."""
  from mp_workers import compositions

  wait = harness.in_background(harness.launch, ["--nproc", "2", "--devices-per-proc", "2", "--timeout", "100"],
                               [harness.WORKERS / "compositions.py", tmp_path], timeout=JOB_SECONDS)
  with float64():
    want = {case: compositions.run(case, jax.devices()[:4] if case == "PowerSGD" else jax.devices()[:1])
            for case in compositions.CASES}
  result = wait()
  _succeeded(result)
  harness.assert_no_leftovers(str(tmp_path))
  for case, arrays in want.items():
    with np.load(tmp_path / f"{case}.npz", allow_pickle=False) as saved:
      got = {name: saved[name] for name in saved.files}
    assert sorted(got) == sorted(arrays), case
    assert float(arrays["eval weight"]) == compositions.ROWS, case  # every real row evaluated, no padding
    assert all(got[k].dtype == np.float64 for k in got if k.startswith("params")), case  # x64 on in both runs
    assert abs(float(arrays["loss 0"]) - float(arrays["loss 2"])) > 1e-3, case  # it trains
    for name, value in arrays.items():
      np.testing.assert_allclose(got[name], value, rtol=0, atol=ROUND_OFF.get(case, 1e-12), err_msg=f"{case}: {name}")
