"""Several processes, one job: starting `jax.distributed` and checking that processes agree.

`initialize` is a thin wrapper over `jax.distributed.initialize` that
reads its arguments from (in this order) the call, the environment set by
`python -m jaxdp.launch`, or a cluster scheduler that JAX knows how to read
(SLURM, Open MPI, Cloud TPU, `JAX_COORDINATOR_ADDRESS`). With none of these
it does nothing, so the same script runs as one plain process. Call it first,
before anything touches a JAX device.

Nothing here runs at import: importing `jaxdp` never starts the JAX
backend, so device counts can still be configured afterwards.

`assert_same_across_processes` turns a disagreement between processes
(batch shapes, configuration) into a `ValueError` on every process, instead
of mismatched collectives that hang.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from typing import Any, NamedTuple, Sequence

import jax

from jaxdp.core.checks import check_int
from jaxdp.core.processes import assert_same_across_processes  # noqa: F401 (part of this module's API)
# The environment written by ``python -m jaxdp.launch`` for each worker (defined there: the launcher imports no jax).
from jaxdp.runtime.launch import (
    ENV_COORDINATOR,
    ENV_COORDINATOR_BIND,
    ENV_DEVICES_PER_PROC,
    ENV_HEARTBEAT_TIMEOUT,
    ENV_INIT_TIMEOUT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_SHUTDOWN_TIMEOUT,
)

# Cluster schedulers whose variables JAX's own detection reads. All listed variables must be set.
_CLUSTER_VARIABLES = {
    "slurm": ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
    "openmpi": ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    "jax": ("JAX_COORDINATOR_ADDRESS",),
}
_TPU_VARIABLES = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS")

_DEFAULT_INIT_TIMEOUT = 300
_DEFAULT_HEARTBEAT_TIMEOUT = 100
_DEFAULT_SHUTDOWN_TIMEOUT = 300


class ProcessInfo(NamedTuple):
  """Where this process stands in the job, as `initialize` left it.

  Attributes:
    process_index: this process, `0 <= process_index < process_count`.
    process_count: the number of processes in the job.
    local_device_count: devices this process drives.
    device_count: devices of every process together (what
      `jaxdp.data_mesh` spans).
    coordinator_address: `host:port` of the coordinator, `None` for a
      plain single process.
    source: where the settings came from: `"arguments"`, `"launcher"`
      (`python -m jaxdp.launch`), a cluster (`"slurm"`, `"openmpi"`,
      `"tpu"`, `"jax"` for `JAX_COORDINATOR_ADDRESS`), `"external"`
      (`jax.distributed` was started by someone else) or `"none"` (one
      plain process).
  """

  process_index: int
  process_count: int
  local_device_count: int
  device_count: int
  coordinator_address: str | None
  source: str


_info: ProcessInfo | None = None


def detect_cluster() -> str | None:
  """The cluster environment `initialize` would use, without starting anything.

  Returns:
    `"launcher"` (`python -m jaxdp.launch`), `"slurm"`, `"openmpi"`,
    `"tpu"` (a multi-host Cloud TPU), `"jax"` (`JAX_COORDINATOR_ADDRESS`
    set) or `None` (no cluster: one plain process).
  """
  if ENV_COORDINATOR in os.environ:
    return "launcher"
  for name, variables in _CLUSTER_VARIABLES.items():
    if all(v in os.environ for v in variables):
      return name
  if any(v in os.environ for v in _TPU_VARIABLES) or _on_cloud_tpu_vm():
    return "tpu"
  return None


def _on_cloud_tpu_vm() -> bool:
  try:  # set by ``import jax`` on a Cloud TPU VM; private, so read defensively
    from jax._src import cloud_tpu_init
  except ImportError:
    return False
  return bool(getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False))


def _backend_started() -> bool:
  try:
    from jax._src import xla_bridge
  except ImportError:
    return False
  return bool(xla_bridge.backends_are_initialized())


def _optional_int(value: Any, name: str, minimum: int) -> int | None:
  return None if value is None else check_int(value, name, minimum, "or None.")


def _env_int(variable: str, minimum: int) -> int | None:
  raw = os.environ.get(variable)
  if raw is None or raw == "":
    return None
  try:
    value = int(raw)
  except ValueError:
    value = None
  if value is None or value < minimum:
    raise ValueError(f"environment variable {variable}={raw!r} must be an integer >= {minimum}; fix or unset it.")
  return value


def _check_address(address: Any, name: str) -> str | None:
  if address is None:
    return None
  if not isinstance(address, str) or ":" not in address or not address.rsplit(":", 1)[1].isdigit():
    raise ValueError(f"{name} must be a 'host:port' string such as '127.0.0.1:1234', got {address!r}.")
  return address


def _is_loopback(address: str) -> bool:
  host = address.rsplit(":", 1)[0].strip("[]")
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def _launcher_settings() -> dict[str, Any]:
  """The settings `python -m jaxdp.launch` left in the environment (empty if none)."""
  if ENV_COORDINATOR not in os.environ:
    return {}
  coordinator = _check_address(os.environ[ENV_COORDINATOR], f"environment variable {ENV_COORDINATOR}")
  return {
      "coordinator_address": coordinator,
      "coordinator_bind_address": _check_address(
          os.environ.get(ENV_COORDINATOR_BIND, coordinator), f"environment variable {ENV_COORDINATOR_BIND}"
      ),
      "num_processes": _env_int(ENV_NUM_PROCESSES, 1),
      "process_id": _env_int(ENV_PROCESS_ID, 0),
  }


def _current_info(coordinator_address: str | None, source: str) -> ProcessInfo:
  return ProcessInfo(
      process_index=jax.process_index(),
      process_count=jax.process_count(),
      local_device_count=jax.local_device_count(),
      device_count=jax.device_count(),
      coordinator_address=coordinator_address,
      source=source,
  )


def _configure_cpu(num_cpu_devices: int | None, cpu_collectives: str | None) -> None:
  """Sets the CPU backend's options, which only take effect before the backend starts."""
  if _backend_started():
    if num_cpu_devices is not None and num_cpu_devices != len(jax.devices("cpu")):
      raise RuntimeError(
          f"num_cpu_devices={num_cpu_devices} cannot be applied: the JAX backend already started with "
          f"{len(jax.devices('cpu'))} CPU devices. Call jaxdp.runtime.distributed.initialize() before anything "
          "touches a device (jax.devices(), creating an array, jitting)."
      )
    return
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  if num_cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", num_cpu_devices)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    *,
    num_cpu_devices: int | None = None,
    coordinator_bind_address: str | None = None,
    cluster_detection_method: str | None = None,
    initialization_timeout: int | None = None,
    heartbeat_timeout_seconds: int | None = None,
    shutdown_timeout_seconds: int | None = None,
    cpu_collectives: str | None = "gloo",
    fail_fast: bool = True,
) -> ProcessInfo:
  """Joins this process to the job (`jax.distributed.initialize`), or does nothing when alone.

  Settings come from the arguments, then from the environment of
  `python -m jaxdp.launch` (`JAXDP_COORDINATOR`, `JAXDP_NUM_PROCESSES`,
  `JAXDP_PROCESS_ID`, `JAXDP_DEVICES_PER_PROC`, `JAXDP_HEARTBEAT_TIMEOUT`,
  `JAXDP_INIT_TIMEOUT`), then from a cluster scheduler through JAX's own
  detection (SLURM, Open MPI, Cloud TPU, `JAX_COORDINATOR_ADDRESS`). With
  none of them (and no arguments) no service is started: the script runs as
  one process on the local devices.

  Before the backend starts it selects the CPU cross-process collectives
  (`jax_cpu_collectives_implementation`, gloo by default) and, if given, the
  number of simulated CPU devices (`jax_num_cpu_devices`). Call it first:
  JAX refuses to join a job once a device has been touched. It then starts
  the backend to count the devices it returns.

  Calling it again is a no-op that returns the first call's result (the
  arguments of later calls are ignored). If `jax.distributed` was already
  initialized by other code, the job is reported as it is.

  Args:
    coordinator_address: `host:port` of process 0's coordinator, the same
      on every process.
    num_processes: the number of processes in the job.
    process_id: this process, `0 <= process_id < num_processes`.
    local_device_ids: the accelerator ids this process may use (GPU); `None`
      for all (or what the cluster assigns).
    num_cpu_devices: simulated CPU devices for this process; default
      `JAXDP_DEVICES_PER_PROC` if set, else JAX's default.
    coordinator_bind_address: where process 0 listens; default: the
      coordinator address itself when that is a loopback address (or came
      from the launcher), else JAX's default (all interfaces).
    cluster_detection_method: passed to JAX to force one cluster detector
      (e.g. `"mpi4py"`, `"slurm"`); always joins a job.
    initialization_timeout: seconds to wait for every process to connect
      (default `JAXDP_INIT_TIMEOUT` or 300).
    heartbeat_timeout_seconds: seconds without a heartbeat after which a
      process is declared dead and the job fails (default
      `JAXDP_HEARTBEAT_TIMEOUT` or 100).
    shutdown_timeout_seconds: seconds a finishing process waits for the
      others at exit (default `JAXDP_SHUTDOWN_TIMEOUT` or 300). A process
      that ends with `sys.exit(code)` while the others are still working
      stays in that wait, then JAX aborts every process.
    cpu_collectives: `"gloo"`, `"mpi"` or `None` to leave JAX's setting.
    fail_fast: in a job of several processes, an uncaught exception prints
      its traceback and ends this process at once with exit code 1
      (`os._exit`: later `atexit` handlers do not run), instead of
      waiting in JAX's exit barrier for processes that may be blocked in a
      collective with it. The launcher (or the others' heartbeats) then stops
      the job.

  Returns:
    A `ProcessInfo`.

  Raises:
    ValueError: for a malformed argument or `JAXDP_*` variable.
    RuntimeError: if a job must be joined but the JAX backend already started.
  """
  global _info
  if _info is not None:
    return _info
  coordinator_address = _check_address(coordinator_address, "coordinator_address")
  coordinator_bind_address = _check_address(coordinator_bind_address, "coordinator_bind_address")
  num_processes = _optional_int(num_processes, "num_processes", 1)
  process_id = _optional_int(process_id, "process_id", 0)
  num_cpu_devices = _optional_int(num_cpu_devices, "num_cpu_devices", 1)
  if num_cpu_devices is None:
    num_cpu_devices = _env_int(ENV_DEVICES_PER_PROC, 1)
  if cpu_collectives not in (None, "gloo", "mpi"):
    raise ValueError(f"cpu_collectives must be 'gloo', 'mpi' or None, got {cpu_collectives!r}.")
  timeouts = {
      "initialization_timeout": _timeout(
          initialization_timeout, ENV_INIT_TIMEOUT, _DEFAULT_INIT_TIMEOUT, "initialization_timeout"
      ),
      "heartbeat_timeout_seconds": _timeout(
          heartbeat_timeout_seconds, ENV_HEARTBEAT_TIMEOUT, _DEFAULT_HEARTBEAT_TIMEOUT, "heartbeat_timeout_seconds"
      ),
      "shutdown_timeout_seconds": _timeout(
          shutdown_timeout_seconds, ENV_SHUTDOWN_TIMEOUT, _DEFAULT_SHUTDOWN_TIMEOUT, "shutdown_timeout_seconds"
      ),
  }

  if jax.distributed.is_initialized():
    _info = _current_info(_coordinator_of_running_job(), "external")
    return _info

  explicit = any(x is not None for x in (coordinator_address, num_processes, process_id, cluster_detection_method))
  source = "arguments" if explicit else detect_cluster()
  if source is None:
    _configure_cpu(num_cpu_devices, None)
    _info = _current_info(None, "none")
    return _info

  settings = _launcher_settings()
  coordinator_address = coordinator_address or settings.get("coordinator_address")
  if coordinator_bind_address is None:
    if "coordinator_bind_address" in settings and coordinator_address == settings["coordinator_address"]:
      coordinator_bind_address = settings["coordinator_bind_address"]
    elif coordinator_address is not None and _is_loopback(coordinator_address):
      coordinator_bind_address = coordinator_address
  num_processes = num_processes if num_processes is not None else settings.get("num_processes")
  process_id = process_id if process_id is not None else settings.get("process_id")
  if _backend_started():
    raise RuntimeError(
        "jaxdp.runtime.distributed.initialize() must run before anything touches a JAX device (jax.devices(), "
        "creating an array, jitting); call it first thing in the script, right after the imports."
    )
  _configure_cpu(num_cpu_devices, cpu_collectives)
  jax.distributed.initialize(
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
      local_device_ids=local_device_ids,
      cluster_detection_method=cluster_detection_method,
      coordinator_bind_address=coordinator_bind_address,
      **timeouts,
  )
  _info = _current_info(_coordinator_of_running_job(), source)
  if fail_fast and _info.process_count > 1:
    sys.excepthook = _exiting_at_once(sys.excepthook)
  return _info


def _exiting_at_once(hook):
  """`hook` (an `excepthook`) followed by an immediate exit with code 1."""

  def excepthook(kind, value, traceback):
    try:
      hook(kind, value, traceback)
      sys.stdout.flush()
      sys.stderr.flush()
    finally:
      os._exit(1)

  return excepthook


def _timeout(value: Any, variable: str | None, default: int, name: str) -> int:
  value = _optional_int(value, name, 1)
  if value is None and variable is not None:
    value = _env_int(variable, 1)
  return default if value is None else value


def _coordinator_of_running_job() -> str | None:
  try:
    from jax._src import distributed as jax_distributed
  except ImportError:
    return None
  return getattr(jax_distributed.global_state, "coordinator_address", None)


