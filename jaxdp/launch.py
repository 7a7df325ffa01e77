"""Local launcher: ``python -m jaxdp.launch --nproc P [--devices-per-proc D] -- script.py [args]``.

Like ``torchrun --standalone``: picks a free port on the loopback interface,
starts ``P`` worker processes with the environment that
:func:`jaxdp.distributed.initialize` reads, streams their output prefixed with
``[rank i]``, and takes the whole job down when one worker fails.

Failure handling, all bounded in time:

* a worker that exits non-zero or is killed by a signal: the others get
  SIGTERM, then SIGKILL after ``--grace-period`` seconds; the launcher exits
  with that worker's code (``128 + signal`` for a signal) and names its rank;
* ``--timeout`` seconds of wall clock (e.g. a worker that hangs): everything
  is stopped the same way, exit code 124;
* SIGINT (Ctrl-C) or SIGTERM to the launcher: everything is stopped, exit
  code ``128 + signal``.

Each worker runs in its own session (process group), so the launcher can
stop a worker together with any children it started; on Linux the workers
are also killed if the launcher itself dies.

A JAX worker that joined the job catches SIGTERM (JAX's preemption notifier:
``multihost_utils.reached_preemption_sync_point`` lets it checkpoint), so
stopping one takes the grace period before SIGKILL.

The launcher starts workers with ``sys.executable``; it does not change
``sys.path``, so the script must be able to import jaxdp (installed, or
``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, NamedTuple, Sequence

from jaxdp import distributed

_POLL_SECONDS = 0.05
_WAIT_SLICE = 0.5  # seconds; short waits keep the main thread responsive to signals
_KILL_WAIT_SECONDS = 10.0
_PR_SET_PDEATHSIG = 1
_TIMEOUT_EXIT = 124
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Failure(NamedTuple):
  """Why the job stopped early: the first worker to fail, a timeout or a signal."""

  rank: int | None
  exit_code: int
  message: str


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that is free on ``host`` right now (the OS picks it)."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def _join_host_port(host: str, port: int) -> str:
  return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _connect_host(host: str) -> str:
  """Where local workers reach a coordinator bound to ``host`` (wildcards mean loopback)."""
  return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def worker_env(
    rank: int,
    nproc: int,
    coordinator: str,
    bind: str,
    *,
    devices_per_proc: int | None = None,
    heartbeat_timeout: int | None = None,
    shutdown_timeout: int | None = None,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
  """The environment of worker ``rank``: ``base`` (default ``os.environ``) plus the ``JAXDP_*`` settings."""
  env = dict(os.environ if base is None else base)
  env.update({
      distributed.ENV_COORDINATOR: coordinator,
      distributed.ENV_COORDINATOR_BIND: bind,
      distributed.ENV_NUM_PROCESSES: str(nproc),
      distributed.ENV_PROCESS_ID: str(rank),
      "JAXDP_LOCAL_RANK": str(rank),
      "PYTHONUNBUFFERED": "1",
  })
  optional = {
      distributed.ENV_DEVICES_PER_PROC: devices_per_proc,
      distributed.ENV_HEARTBEAT_TIMEOUT: heartbeat_timeout,
      distributed.ENV_SHUTDOWN_TIMEOUT: shutdown_timeout,
  }
  for variable, value in optional.items():
    if value is None:
      env.pop(variable, None)
    else:
      env[variable] = str(value)
  return env


def _prepare_child() -> None:
  """In the child, before exec: unblock the launcher's signals; SIGKILL when the launcher dies (Linux)."""
  signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
  if sys.platform.startswith("linux"):
    try:
      ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
      pass


def _pump(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock) -> None:
  """Copies ``stream`` to ``out`` line by line, each line prefixed, until end of file.

  If ``out`` breaks (e.g. the launcher's output was piped into ``head``), the
  rest is read and dropped, so that the worker never blocks on a full pipe.
  """
  for line in iter(stream.readline, b""):
    if out is None:
      continue
    if not line.endswith(b"\n"):
      line += b"\n"
    try:
      with lock:
        out.write(prefix + line)
        out.flush()
    except (OSError, ValueError):
      out = None
  stream.close()


class Job:
  """``nproc`` workers running one command, stopped together.

  Args:
    command: the worker command line (``[python, script, ...]``).
    nproc: the number of workers.
    host: the address the coordinator binds to.
    port: the coordinator port; ``0`` picks a free one.
    devices_per_proc: simulated CPU devices per worker, or ``None``.
    heartbeat_timeout: ``JAXDP_HEARTBEAT_TIMEOUT`` for the workers, or ``None``.
    shutdown_timeout: ``JAXDP_SHUTDOWN_TIMEOUT`` for the workers, or ``None``.
    grace_period: seconds between SIGTERM and SIGKILL when stopping.
  """

  def __init__(self, command: Sequence[str], nproc: int, *, host: str = "127.0.0.1", port: int = 0,
               devices_per_proc: int | None = None, heartbeat_timeout: int | None = None,
               shutdown_timeout: int | None = None, grace_period: float = 5.0):
    self.command, self.nproc, self.grace_period = list(command), nproc, grace_period
    port = port or free_port(host)
    self.bind = _join_host_port(host, port)
    self.coordinator = _join_host_port(_connect_host(host), port)
    self.env_settings = {
        "devices_per_proc": devices_per_proc,
        "heartbeat_timeout": heartbeat_timeout,
        "shutdown_timeout": shutdown_timeout,
    }
    self.procs: list[subprocess.Popen] = []
    self._threads: list[threading.Thread] = []
    self._lock = threading.Lock()
    # (rank, exit code) of each worker in the order they exit; a negative code is a signal.
    self.exits: queue.Queue[tuple[int, int]] = queue.Queue()

  def start(self) -> None:
    """Starts every worker and the threads that stream their output.

    SIGINT and SIGTERM are held back while the workers start, so an interrupt
    never leaves a worker that the job does not know about.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
      self._spawn()
    finally:
      signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    for rank, proc in enumerate(self.procs):
      waiter = threading.Thread(target=lambda r=rank, p=proc: self.exits.put((r, p.wait())), daemon=True)
      waiter.start()
      prefix = f"[rank {rank}] ".encode()
      for stream, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
        thread = threading.Thread(target=_pump, args=(stream, prefix, out, self._lock), daemon=True)
        thread.start()
        self._threads.append(thread)

  def _spawn(self) -> None:
    for rank in range(self.nproc):
      env = worker_env(rank, self.nproc, self.coordinator, self.bind, **self.env_settings)
      self.procs.append(subprocess.Popen(
          self.command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          start_new_session=True, preexec_fn=_prepare_child,
      ))

  def done(self) -> bool:
    return all(proc.poll() is not None for proc in self.procs)

  def stop(self) -> None:
    """SIGTERM to every worker's process group, SIGKILL to what is left after the grace period.

    SIGCONT follows SIGTERM so that a stopped (``SIGSTOP``) worker can act on it.
    """
    self._signal_all(signal.SIGTERM)
    self._signal_all(signal.SIGCONT)
    deadline = time.monotonic() + self.grace_period
    while time.monotonic() < deadline and not self.done():
      time.sleep(_POLL_SECONDS)
    self._signal_all(signal.SIGKILL)
    for proc in self.procs:
      try:
        proc.wait(timeout=_KILL_WAIT_SECONDS)
      except subprocess.TimeoutExpired:  # e.g. stuck in the kernel; nothing more a launcher can do
        print(f"jaxdp.launch: worker pid {proc.pid} survived SIGKILL", file=sys.stderr, flush=True)

  def _signal_all(self, sig: int) -> None:
    for proc in self.procs:
      try:
        os.killpg(proc.pid, sig)  # the worker's group: its children too, even if it has exited
      except (ProcessLookupError, PermissionError):
        pass

  def close(self) -> None:
    """Waits (briefly) for the output threads to drain."""
    for thread in self._threads:
      thread.join(timeout=2.0)


def _failure(rank: int, code: int) -> Failure:
  if code < 0:
    try:
      name = signal.Signals(-code).name
    except ValueError:
      name = str(-code)
    return Failure(rank, 128 - code, f"rank {rank} was killed by signal {name}")
  return Failure(rank, code, f"rank {rank} exited with code {code}")


class _Interrupted(Exception):
  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


def _raise_interrupted(signum, frame) -> None:
  raise _Interrupted(signum)


def run(job: Job, timeout: float | None = None) -> int:
  """Runs ``job`` to the end and returns the launcher's exit code.

  Returns 0 when every worker exits 0. Otherwise stops every worker and
  returns the first failed worker's code (``128 + signal`` if it was killed),
  124 on ``timeout`` or ``128 + signal`` when the launcher is interrupted,
  after printing the reason to stderr.
  """
  previous = {s: signal.signal(s, _raise_interrupted) for s in _STOP_SIGNALS}
  failure = None
  try:
    job.start()
    failure = _watch(job, timeout)
  except _Interrupted as e:
    failure = Failure(None, 128 + e.signum, f"interrupted by {signal.Signals(e.signum).name}")
  finally:
    for s in previous:
      signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
    job.stop()
    for s, handler in previous.items():
      signal.signal(s, handler)
    job.close()
  if failure is None:
    return 0
  print(f"jaxdp.launch: {failure.message}; stopped all {job.nproc} workers.", file=sys.stderr, flush=True)
  return failure.exit_code


def _watch(job: Job, timeout: float | None) -> Failure | None:
  """Waits for every worker to exit 0 (``None``), for the first to fail, or for ``timeout``."""
  deadline = None if timeout is None else time.monotonic() + timeout
  running = job.nproc
  while running:
    wait = None if deadline is None else deadline - time.monotonic()
    if wait is not None and wait <= 0:
      return Failure(None, _TIMEOUT_EXIT, f"timed out after {timeout:g} s")
    try:
      rank, code = job.exits.get(timeout=_WAIT_SLICE if wait is None else min(wait, _WAIT_SLICE))
    except queue.Empty:
      continue
    if code != 0:
      return _failure(rank, code)
    running -= 1
  return None


def _positive_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def _positive_float(text: str) -> float:
  value = float(text)
  if not value > 0:
    raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
  return value


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m jaxdp.launch",
      description="Start NPROC local worker processes of one JAX job (call jaxdp.distributed.initialize() in the script).",
      usage="%(prog)s --nproc P [options] -- script.py [args] | -m module [args]",
  )
  p.add_argument("--nproc", type=_positive_int, required=True, help="number of worker processes")
  p.add_argument("--devices-per-proc", type=_positive_int, default=None,
                 help="simulated CPU devices per worker (sets jax_num_cpu_devices)")
  p.add_argument("--host", default="127.0.0.1", help="address the coordinator binds to (default: loopback only)")
  p.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
  p.add_argument("--grace-period", type=_positive_float, default=5.0,
                 help="seconds between SIGTERM and SIGKILL when stopping workers (default 5)")
  p.add_argument("--timeout", type=_positive_float, default=None,
                 help="stop everything after this many seconds of wall clock (default: none)")
  p.add_argument("--heartbeat-timeout", type=_positive_int, default=None,
                 help="seconds without a heartbeat before jax.distributed declares a worker dead")
  p.add_argument("--shutdown-timeout", type=_positive_int, default=None,
                 help="seconds a finished worker waits for the others at exit before JAX aborts the job")
  p.add_argument("command", nargs=argparse.REMAINDER, help="script.py [args], or -m module [args], after --")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  args = parser().parse_args(argv)
  command = list(args.command)
  if command[:1] == ["--"]:
    command = command[1:]
  if not command:
    parser().error("no command: pass the worker script after --, e.g. -- train.py --lr 0.1")
  job = Job([sys.executable, *command], args.nproc, host=args.host, port=args.port,
            devices_per_proc=args.devices_per_proc, heartbeat_timeout=args.heartbeat_timeout,
            shutdown_timeout=args.shutdown_timeout, grace_period=args.grace_period)
  return run(job, args.timeout)


if __name__ == "__main__":
  sys.exit(main())
