"""Local launcher: `python -m jaxdp.launch --nproc P [--devices-per-proc D] -- script.py [args]`.

Like `torchrun --standalone`: picks a free port on the loopback interface,
starts `P` worker processes with the environment that
`jaxdp.runtime.distributed.initialize` reads, streams their output prefixed with
`[rank i]`, and takes the whole job down when one worker fails.

Failure handling, all bounded in time:

* a worker that exits non-zero or is killed by a signal: the others get
  SIGTERM, then SIGKILL after `--grace-period` seconds; the launcher exits
  with that worker's code (`128 + signal` for a signal) and names its rank
  (of the workers failing within a second, one killed by a signal is named
  first, then one whose output does not say it lost a connection to a peer:
  a collective that loses a peer fails at once, and that process can even
  be reaped before the one whose death caused it);
* `--timeout` seconds of wall clock (e.g. a worker that hangs): everything
  is stopped the same way, exit code 124;
* SIGINT (Ctrl-C) or SIGTERM to the launcher: everything is stopped, exit
  code `128 + signal`.

Stopping the job stops every process it started, however deep and in
whatever session or process group (Linux; elsewhere only the workers'
process groups). The workers are children of a small *guardian* process
(this file run with `python -I -S`: standard library only, so it starts in
milliseconds), not of the launcher. The guardian is a child subreaper
(`prctl(PR_SET_CHILD_SUBREAPER)`): a process whose parent exits is
re-parented to it instead of to init, so every live process of the job stays
below it in the `/proc` parent chains, even one that double-forked into a
new session. Stopping walks those chains: SIGTERM and SIGCONT to every
process, SIGKILL after the grace period to every one left, until the
guardian has no child. The guardian runs in its own session and holds the
read end of a pipe from the launcher; when the pipe closes, which the kernel
also does when the launcher is SIGKILLed, it SIGKILLs the whole tree and
exits. `PR_SET_PDEATHSIG` alone cannot do this: it only reaches a process
whose parent dies, not a grandchild whose parent is still alive or already
gone; a cgroup can, but needs a delegated cgroup hierarchy that containers
and CI runners often lack. As a second line, the workers still get SIGKILL
from the kernel if the guardian itself dies (`PR_SET_PDEATHSIG`).

Automatic restart (`--max-restarts K`, like torchrun's): when a worker
fails, the job is stopped as above and started again from scratch, with a
fresh coordinator port (unless `--port` fixes it), up to `K` times. Each
restart is logged to stderr with the failing rank and its exit code, and the
workers read `JAXDP_RESTART_COUNT` (0 for the first attempt). After `K`
restarts the launcher exits with the last failure's code. `--timeout`
bounds each attempt, not the whole run. What is and is not recovered:

* recovered: a worker that exits non-zero or is killed (crash, OOM killer,
  SIGKILL), and so the job it takes down. The new attempt runs the script
  from its start: one that resumes from its latest checkpoint (see
  `jaxdp.CheckpointManager`) redoes only the steps since then, one
  without checkpoints redoes everything;
* not recovered: a timeout (exit 124: a hang would most likely hang again;
  a hang that keeps sending heartbeats is only ended by `--timeout`),
  Ctrl-C or SIGTERM to the launcher (someone wants the job gone), and a
  worker that exits 0, even early: it has not failed, and the launcher
  waits for the others (a JAX worker that leaves early waits in JAX's
  shutdown barrier; if the others never get there JAX aborts them all after
  `--shutdown-timeout`, and that abort is a failure).

`--min-nproc M` (default `--nproc`) lets a restarted job run with fewer
processes. The policy depends only on the attempt number `k`: attempt
`k` runs `max(P - k, M)` processes. With `--devices-per-proc D` the
first attempt's `P * D` devices are re-split over the new count when it
divides them (`2 x 2` restarts as `1 x 4`), so the data axis keeps its
size; otherwise each process keeps `D` devices and the job has fewer in
all (`3 x 1` restarts as `2 x 1`): the script must then cope with a
smaller mesh, e.g. by restoring its checkpoint onto it. Without
`--devices-per-proc` each process uses what the backend gives it.

A JAX worker that joined the job catches SIGTERM (JAX's preemption notifier:
`multihost_utils.reached_preemption_sync_point` lets it checkpoint), so
stopping one takes the grace period before SIGKILL.

The launcher starts workers with `sys.executable`; it does not change
`sys.path`, so the script must be able to import jaxdp (installed, or
`PYTHONPATH`).
"""

# Only the standard library at module level: the guardian runs this file without jaxdp on its path.
from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Callable, NamedTuple, Sequence

# The environment written for each worker, read by :func:`jaxdp.runtime.distributed.initialize` (which re-exports
# these names). They live here because the launcher imports no jax.
ENV_COORDINATOR = "JAXDP_COORDINATOR"
"""`host:port` the workers connect to."""
ENV_COORDINATOR_BIND = "JAXDP_COORDINATOR_BIND"
"""`host:port` the coordinator (process 0) listens on; default: `JAXDP_COORDINATOR`."""
ENV_NUM_PROCESSES = "JAXDP_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXDP_PROCESS_ID"
ENV_DEVICES_PER_PROC = "JAXDP_DEVICES_PER_PROC"
"""Simulated CPU devices per process (`jax_num_cpu_devices`); unset: JAX's default."""
ENV_HEARTBEAT_TIMEOUT = "JAXDP_HEARTBEAT_TIMEOUT"
ENV_INIT_TIMEOUT = "JAXDP_INIT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "JAXDP_SHUTDOWN_TIMEOUT"
ENV_RESTART_COUNT = "JAXDP_RESTART_COUNT"
"""How many times the launcher has restarted the job (0 for the first attempt)."""

_POLL_SECONDS = 0.05
_SETTLE_SECONDS = 1.0  # after a worker exits non-zero, how long to look for a peer killed by a signal
_WAIT_SLICE = 0.1  # seconds; how soon the main thread notices a signal
_KILL_WAIT_SECONDS = 10.0
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_TIMEOUT_EXIT = 124
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_GUARDIAN_FLAG = "--guardian"
_GUARDIAN_FAILED = -1  # "exit code" of a rank the guardian stopped reporting on (it died)


class Failure(NamedTuple):
  """Why the job stopped early: the first worker to fail, a timeout or a signal.

  `worker_code` is the failed worker's status as `subprocess` reports it
  (negative: killed by that signal), `None` when no worker failed: only a
  worker's failure restarts the job.
  """

  rank: int | None
  exit_code: int
  message: str
  worker_code: int | None = None


class ProcessLayout(NamedTuple):
  """The processes of one attempt, and simulated devices per process (`None`: the backend's default)."""

  nproc: int
  devices_per_proc: int | None = None


def restart_layout(restart: int, nproc: int, devices_per_proc: int | None = None,
                   min_nproc: int | None = None) -> ProcessLayout:
  """The layout of attempt `restart` (0 is the first) of a `nproc x devices_per_proc` job.

  `max(nproc - restart, min_nproc)` processes; the first attempt's device
  total re-split over them when it divides evenly, else `devices_per_proc`
  each (see the module docstring).
  """
  count = max(nproc - restart, nproc if min_nproc is None else min_nproc)
  if devices_per_proc is None or (nproc * devices_per_proc) % count:
    return ProcessLayout(count, devices_per_proc)
  return ProcessLayout(count, nproc * devices_per_proc // count)


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that is free on `host` right now (the OS picks it)."""
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def _join_host_port(host: str, port: int) -> str:
  return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _connect_host(host: str) -> str:
  """Where local workers reach a coordinator bound to `host` (wildcards mean loopback)."""
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
    restart_count: int = 0,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
  """The environment of worker `rank`: `base` (default `os.environ`) plus the `JAXDP_*` settings."""
  env = dict(os.environ if base is None else base)
  env.update({
      ENV_COORDINATOR: coordinator,
      ENV_COORDINATOR_BIND: bind,
      ENV_NUM_PROCESSES: str(nproc),
      ENV_PROCESS_ID: str(rank),
      "JAXDP_LOCAL_RANK": str(rank),
      ENV_RESTART_COUNT: str(restart_count),
      "PYTHONUNBUFFERED": "1",
  })
  optional = {
      ENV_DEVICES_PER_PROC: devices_per_proc,
      ENV_HEARTBEAT_TIMEOUT: heartbeat_timeout,
      ENV_SHUTDOWN_TIMEOUT: shutdown_timeout,
  }
  for variable, value in optional.items():
    if value is None:
      env.pop(variable, None)
    else:
      env[variable] = str(value)
  return env


def _prctl(option: int, value: int) -> bool:
  """`prctl(option, value)` on Linux; False where it is not available or fails."""
  if not sys.platform.startswith("linux"):
    return False
  try:
    return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
  except (OSError, AttributeError):
    return False


def _prepare_child() -> None:
  """In the child, before exec: unblock the stop signals; SIGKILL when the parent dies (Linux)."""
  signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
  _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


# What a worker prints when one of its collectives lost the connection to a peer (gloo: "Connection closed by
# peer"; sockets: "reset by peer", "Broken pipe"): a consequence of the peer's failure, not a cause.
_LOST_PEER = (b"closed by peer", b"reset by peer", b"Broken pipe")


def _pump(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock,
          on_lost_peer: Callable[[], None] = lambda: None) -> None:
  """Copies `stream` to `out` line by line, each line prefixed, until end of file.

  If `out` breaks (e.g. the launcher's output was piped into `head`), the
  rest is read and dropped, so that the worker never blocks on a full pipe.
  `on_lost_peer()` is called for each line that says a connection to a peer was lost.
  """
  for line in iter(stream.readline, b""):
    if any(phrase in line for phrase in _LOST_PEER):
      on_lost_peer()
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
  """`nproc` workers running one command, stopped together with every process they start.

  Args:
    command: the worker command line (`[python, script, ...]`).
    nproc: the number of workers.
    host: the address the coordinator binds to.
    port: the coordinator port; `0` picks a free one.
    devices_per_proc: simulated CPU devices per worker, or `None`.
    heartbeat_timeout: `JAXDP_HEARTBEAT_TIMEOUT` for the workers, or `None`.
    shutdown_timeout: `JAXDP_SHUTDOWN_TIMEOUT` for the workers, or `None`.
    grace_period: seconds between SIGTERM and SIGKILL when stopping.
    restart_count: `JAXDP_RESTART_COUNT` for the workers.

  Attributes:
    pids: each worker's pid once the guardian has started it, else `None`.
    exits: `(rank, code)` of each worker as it exits (a negative code is
      a signal); `(None, -1)` if the guardian ended before every worker.
    lost_peer: the ranks whose output said a connection to a peer was lost.
  """

  def __init__(self, command: Sequence[str], nproc: int, *, host: str = "127.0.0.1", port: int = 0,
               devices_per_proc: int | None = None, heartbeat_timeout: int | None = None,
               shutdown_timeout: int | None = None, grace_period: float = 5.0, restart_count: int = 0):
    self.command, self.nproc, self.grace_period = list(command), nproc, grace_period
    self.devices_per_proc = devices_per_proc
    port = port or free_port(host)
    self.bind = _join_host_port(host, port)
    self.coordinator = _join_host_port(_connect_host(host), port)
    self.env_settings = {
        "devices_per_proc": devices_per_proc,
        "heartbeat_timeout": heartbeat_timeout,
        "shutdown_timeout": shutdown_timeout,
        "restart_count": restart_count,
    }
    self.pids: list[int | None] = [None] * nproc
    self._guardian: subprocess.Popen | None = None
    self._threads: list[threading.Thread] = []
    self._lock = threading.Lock()
    self._exited: set[int] = set()
    self.exits: queue.Queue[tuple[int | None, int]] = queue.Queue()
    self.lost_peer: set[int] = set()

  def start(self) -> None:
    """Starts the guardian, which starts every worker, and the threads that stream their output.

    SIGINT and SIGTERM are held back meanwhile (the launcher notes them
    after): the guardian inherits that mask and lifts it once its own
    handlers are in place, so no signal can end it before it can clean up.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
      outputs = self._start_guardian()
    finally:
      signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    self._thread(self._read_reports)
    for rank, streams in enumerate(outputs):
      prefix = f"[rank {rank}] ".encode()
      for stream, out in zip(streams, (sys.stdout.buffer, sys.stderr.buffer)):
        self._thread(_pump, stream, prefix, out, self._lock, functools.partial(self.lost_peer.add, rank))

  def _start_guardian(self) -> list[tuple[IO[bytes], IO[bytes]]]:
    """Starts the guardian and sends it the workers to start; returns their (stdout, stderr) read ends."""
    pipes = [(os.pipe(), os.pipe()) for _ in range(self.nproc)]  # per rank: ((read, write), (read, write))
    read_ends = [r for pair in pipes for r, _ in pair]
    write_ends = [w for pair in pipes for _, w in pair]
    try:
      workers = [{"env": worker_env(rank, self.nproc, self.coordinator, self.bind, **self.env_settings),
                  "stdout": out_w, "stderr": err_w}
                 for rank, ((_, out_w), (_, err_w)) in enumerate(pipes)]
      self._guardian = subprocess.Popen(
          [sys.executable, "-I", "-S", os.path.abspath(__file__), _GUARDIAN_FLAG, "--", *self.command],
          stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=write_ends, start_new_session=True,
      )
    except BaseException:
      for fd in read_ends:
        os.close(fd)
      raise
    finally:
      for fd in write_ends:  # the guardian and the workers hold their own; EOF comes when they are all gone
        os.close(fd)
    self._send(json.dumps({"workers": workers}) + "\n")
    return [(os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb")) for (out_r, _), (err_r, _) in pipes]

  def _thread(self, target, *args) -> None:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    self._threads.append(thread)

  def _send(self, text: str) -> None:
    try:
      self._guardian.stdin.write(text.encode())
      self._guardian.stdin.flush()
    except (OSError, ValueError):  # the guardian is gone; its reports say so
      pass

  def _read_reports(self) -> None:
    """Turns the guardian's `pid RANK PID` and `exit RANK CODE` lines into `pids` and `exits`."""
    for line in self._guardian.stdout:
      kind, rank, value = line.decode().split()
      if kind == "pid":
        self.pids[int(rank)] = int(value)
      else:
        self._exited.add(int(rank))
        self.exits.put((int(rank), int(value)))
    if len(self._exited) < self.nproc:
      self.exits.put((None, _GUARDIAN_FAILED))

  def done(self) -> bool:
    """Whether every worker has exited."""
    return len(self._exited) == self.nproc

  def stop(self) -> None:
    """SIGTERM and SIGCONT to every process of the job, SIGKILL to what is left after the grace period.

    SIGCONT lets a stopped (`SIGSTOP`) process act on SIGTERM. Returns when
    the guardian has reaped every process of the job (or after a bounded wait
    if one survives SIGKILL, e.g. stuck in the kernel).
    """
    if self._guardian is None:
      return
    self._send("term\n")
    with contextlib.suppress(subprocess.TimeoutExpired):
      self._guardian.wait(timeout=self.grace_period)
    with contextlib.suppress(OSError):
      self._guardian.stdin.close()  # the guardian now SIGKILLs whatever is left
    try:
      self._guardian.wait(timeout=2 * _KILL_WAIT_SECONDS)
    except subprocess.TimeoutExpired:  # it reports survivors itself after _KILL_WAIT_SECONDS
      print(f"jaxdp.runtime.launch: guardian pid {self._guardian.pid} did not finish; killing it", file=sys.stderr, flush=True)
      self._guardian.kill()
      self._guardian.wait()

  def close(self) -> None:
    """Waits (briefly) for the output threads to drain."""
    for thread in self._threads:
      thread.join(timeout=2.0)
    if self._guardian is not None:
      self._guardian.stdout.close()


def _signal_name(signum: int) -> str:
  try:
    return signal.Signals(signum).name
  except ValueError:
    return str(signum)


def _failure(rank: int, code: int) -> Failure:
  if code < 0:
    return Failure(rank, 128 - code, f"rank {rank} was killed by signal {_signal_name(-code)}", code)
  return Failure(rank, code, f"rank {rank} exited with code {code}", code)


def _interrupted(signum: int) -> Failure:
  return Failure(None, 128 + signum, f"interrupted by {_signal_name(signum)}")


class _Signals:
  """Notes the first SIGINT or SIGTERM to the launcher; the main loop polls `received`.

  The handler never raises, so no signal can cut a start or a clean-up
  short, and a second Ctrl-C changes nothing.
  """

  def __init__(self):
    self.received: int | None = None
    self._previous = {}

  def __enter__(self) -> _Signals:
    self._previous = {s: signal.signal(s, self._note) for s in _STOP_SIGNALS}
    return self

  def __exit__(self, *exc_info) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)

  def _note(self, signum, frame) -> None:
    if self.received is None:
      self.received = signum


def run(job: Job, timeout: float | None = None) -> int:
  """Runs `job` once to the end and returns the launcher's exit code.

  Returns 0 when every worker exits 0. Otherwise stops every process of the
  job and returns the first failed worker's code (`128 + signal` if it was
  killed), 124 on `timeout` or `128 + signal` when the launcher is
  interrupted, after printing the reason to stderr.
  """
  return supervise(lambda restart: job, timeout=timeout)


def supervise(new_job: Callable[[int], Job], *, timeout: float | None = None, max_restarts: int = 0,
              signals: _Signals | None = None) -> int:
  """Runs a job, and starts it again after a worker fails, up to `max_restarts` times.

  Args:
    new_job: `new_job(restart)` builds attempt `restart` (0 is the first), unstarted.
    timeout: seconds each attempt may run.
    max_restarts: how many times a worker's failure restarts the job.
    signals: the launcher's handlers of SIGINT and SIGTERM, already installed
      (as `main` does first); by default they are installed here.

  Returns:
    The launcher's exit code, as `run`: that of the last attempt.
  """
  with contextlib.nullcontext(signals) if signals is not None else _Signals() as signals:
    job, restart = new_job(0), 0
    while (failure := _attempt(job, timeout, signals)) is not None:
      if failure.worker_code is None or restart == max_restarts or signals.received is not None:
        break
      restart += 1
      previous, job = job, new_job(restart)
      print(f"jaxdp.runtime.launch: {_restart_message(failure, restart, max_restarts, previous, job)}",
            file=sys.stderr, flush=True)
  if failure is None:
    return 0
  print(f"jaxdp.runtime.launch: {failure.message}; stopped all {job.nproc} workers.", file=sys.stderr, flush=True)
  return failure.exit_code


def _restart_message(failure: Failure, restart: int, max_restarts: int, previous: Job, job: Job) -> str:
  code = failure.worker_code
  text = f"worker rank {failure.rank} failed with exit code {code}"
  text += f" ({_signal_name(-code)})" if code < 0 else ""
  text += f"; restart {restart} of {max_restarts}"
  if (job.nproc, job.devices_per_proc) != (previous.nproc, previous.devices_per_proc):
    text += f" with --nproc {job.nproc}"
    text += "" if job.devices_per_proc is None else f" --devices-per-proc {job.devices_per_proc}"
  return text


def _attempt(job: Job, timeout: float | None, signals: _Signals) -> Failure | None:
  """Runs `job` to the end or to its first failure, then stops all of it."""
  if signals.received is not None:  # came before any worker started: start none
    return _interrupted(signals.received)
  try:
    job.start()
    return _watch(job, timeout, signals)
  finally:
    job.stop()
    job.close()


def _watch(job: Job, timeout: float | None, signals: _Signals) -> Failure | None:
  """Waits for every worker to exit 0 (`None`), for the first to fail, for `timeout` or for a signal."""
  deadline = None if timeout is None else time.monotonic() + timeout
  running = job.nproc
  while running:
    if signals.received is not None:
      return _interrupted(signals.received)
    wait = None if deadline is None else deadline - time.monotonic()
    if wait is not None and wait <= 0:
      return Failure(None, _TIMEOUT_EXIT, f"timed out after {timeout:g} s")
    try:
      rank, code = job.exits.get(timeout=_WAIT_SLICE if wait is None else min(wait, _WAIT_SLICE))
    except queue.Empty:
      continue
    if rank is None:
      return Failure(None, 1, "the launcher's guardian process ended unexpectedly")
    if code != 0:
      return _failure(*_root_cause(job, rank, code))
    running -= 1
  return None


def _root_cause(job: Job, rank: int, code: int) -> tuple[int, int]:
  """The failure to report among those within `_SETTLE_SECONDS`: one killed by a signal, else one that lost no peer.

  When one worker dies, its peers often fail a moment later on their own (a collective's connection
  closes) and can even be reaped first (on a loaded machine both exits can come in one pass); the
  worker whose death caused it is the one worth naming. Else the first reported.
  """
  failures, settle = [(rank, code)], time.monotonic() + _SETTLE_SECONDS
  while code >= 0 and time.monotonic() < settle:
    try:
      other, other_code = job.exits.get(timeout=max(0.0, settle - time.monotonic()))
    except queue.Empty:
      break
    if other is not None and other_code != 0:
      failures.append((other, other_code))
  return min(failures, key=lambda f: (f[1] >= 0, f[0] in job.lost_peer))  # stable: else the first reported


# --- The guardian: ``python -I -S launch.py --guardian -- COMMAND``, the parent of every worker ---------------
#
# Protocol. stdin (from the launcher): one JSON line {"workers": [{"env", "stdout", "stderr"}, ...]} (the
# output fds are inherited from the launcher), then optionally "term"; end of file means "kill everything
# now". stdout (to the launcher): "pid RANK PID" per started worker, "exit RANK CODE" per reaped worker.


def _descendants(root: int) -> list[int]:
  """Pids of every process below `root` in the parent chains of `/proc` (empty without `/proc`)."""
  children: dict[int, list[int]] = {}
  try:
    names = os.listdir("/proc")
  except OSError:
    return []
  for name in names:
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat", "rb") as f:
        ppid = int(f.read().rsplit(b")", 1)[1].split()[1])  # the command name may hold spaces and ')'
    except (OSError, IndexError, ValueError):
      continue  # exited meanwhile
    children.setdefault(ppid, []).append(int(name))
  found, todo = [], [root]
  while todo:
    below = children.get(todo.pop(), [])
    found += below
    todo += below
  return found


def _last_ran(pid: int) -> float:
  """When `pid` (a zombie: not yet reaped) last ran, in the scheduler's clock; `inf` where Linux does not say."""
  try:
    with open(f"/proc/{pid}/sched") as f:
      for line in f:
        if line.startswith("se.exec_start"):
          return float(line.split(":")[1])
  except (OSError, ValueError, IndexError):
    pass
  return float("inf")


def _report(line: str) -> None:
  try:
    os.write(1, (line + "\n").encode())
  except OSError:  # the launcher is gone; the guardian still cleans up
    pass


class _LineReader:
  """Lines from a pipe, waiting at most `timeout` for each (the guardian also watches its children)."""

  def __init__(self, fd: int, wake: int | None = None):
    self.fd, self.wake, self.buffer, self.closed = fd, wake, b"", False

  def read(self, timeout: float | None) -> str | None:
    """The next line, or `None` if none came within `timeout`, a byte came on `wake`, or the pipe closed."""
    while b"\n" not in self.buffer and not self.closed:
      ready = select.select([self.fd] + ([self.wake] if self.wake is not None else []), [], [], timeout)[0]
      if self.wake in ready:
        with contextlib.suppress(BlockingIOError):
          os.read(self.wake, 1 << 10)
      if self.fd not in ready:
        return None
      chunk = os.read(self.fd, 1 << 16)
      self.closed = not chunk
      self.buffer += chunk
    if b"\n" not in self.buffer:
      return None
    line, self.buffer = self.buffer.split(b"\n", 1)
    return line.decode()


class _Guardian:
  """Starts the workers, reports their exits, and stops every process below it."""

  def __init__(self, command: list[str]):
    self.command = command
    self.workers: dict[int, tuple[int, subprocess.Popen]] = {}  # pid -> (rank, process), until reaped

  def spawn(self, workers: list[dict]) -> None:
    """Starts each worker in its own session; a worker that cannot start is reported with code 127."""
    try:
      for rank, worker in enumerate(workers):
        try:
          proc = subprocess.Popen(self.command, env=worker["env"], stdin=subprocess.DEVNULL, stdout=worker["stdout"],
                                  stderr=worker["stderr"], start_new_session=True, preexec_fn=_prepare_child)
        except OSError as e:
          print(f"jaxdp.runtime.launch: cannot start rank {rank}: {e}", file=sys.stderr, flush=True)
          _report(f"exit {rank} 127")
          return
        self.workers[proc.pid] = (rank, proc)
        _report(f"pid {rank} {proc.pid}")
    finally:
      for worker in workers:  # the workers hold their own copies; EOF must come when they are gone
        os.close(worker["stdout"])
        os.close(worker["stderr"])

  def reap(self) -> bool:
    """Reaps every exited child, reporting the workers in the order they exited; False once no child is left.

    The order matters: the first worker to fail is the one the launcher names, and its peers usually fail
    a moment later when their collectives lose it. Children that exited since the last pass are ordered
    by when they last ran (`/proc/PID/sched`, read before reaping) where Linux shows it, else as found.
    """
    exited = []
    while True:
      try:
        found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
      except ChildProcessError:
        found, alive = None, False
      else:
        alive = True
      if found is None:
        break
      last_ran = _last_ran(found.si_pid)
      pid, status = os.waitpid(found.si_pid, 0)
      exited.append((last_ran, len(exited), pid, status))
    for _, _, pid, status in sorted(exited):
      rank, proc = self.workers.pop(pid, (None, None))
      if proc is not None:
        proc.returncode = os.waitstatus_to_exitcode(status)  # so that Popen never waits for it again
        _report(f"exit {rank} {proc.returncode}")
    return alive

  def signal_all(self, sig: int) -> None:
    """`sig` to the live workers' process groups and to every process below the guardian."""
    for pid in list(self.workers):  # without /proc (not Linux) the groups are all it can find
      with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    for pid in _descendants(os.getpid()):
      with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)

  def kill_all(self) -> None:
    """SIGKILL to every process below, again and again, until none is left (or for `_KILL_WAIT_SECONDS`).

    Repeated because a process may fork between the walk and the kill; its
    child is then re-parented to the guardian and found by the next walk.
    """
    deadline = time.monotonic() + _KILL_WAIT_SECONDS
    while self.reap():
      if time.monotonic() > deadline:
        print(f"jaxdp.runtime.launch: pids {_descendants(os.getpid())} survived SIGKILL", file=sys.stderr, flush=True)
        return
      self.signal_all(signal.SIGKILL)
      time.sleep(0.01)


def _guardian_main(command: list[str]) -> int:
  """Runs the guardian (see the module docstring); its exit code is of no interest."""
  stop = []  # a signal to the guardian itself means: clean up now
  for s in (*_STOP_SIGNALS, signal.SIGHUP):
    signal.signal(s, lambda signum, frame: stop.append(signum))
  signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # the launcher held them back while starting it
  _prctl(_PR_SET_CHILD_SUBREAPER, 1)
  # A worker's exit wakes the loop at once (not at the next poll), so exits are reported in the order they came.
  wake_read, wake_write = os.pipe()
  for fd in (wake_read, wake_write):
    os.set_blocking(fd, False)
  signal.signal(signal.SIGCHLD, lambda signum, frame: None)
  signal.set_wakeup_fd(wake_write)
  control = _LineReader(0, wake=wake_read)
  spec = None
  while spec is None and not control.closed and not stop:
    spec = control.read(timeout=None)
  if spec is None:  # the launcher went away (or stopped it) before sending the job
    return 0
  guardian = _Guardian(command)
  guardian.spawn(json.loads(spec)["workers"])
  terminating = False
  while not stop and not control.closed:
    if control.read(timeout=_POLL_SECONDS) == "term" and not terminating:
      terminating = True  # the launcher's grace period has begun
      guardian.signal_all(signal.SIGTERM)
      guardian.signal_all(signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
    if not guardian.reap() and terminating:
      return 0
  guardian.kill_all()  # the launcher closed the pipe (grace period over, or it died) or the guardian was signalled
  return 0


def _positive_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def _non_negative_int(text: str) -> int:
  value = int(text)
  if value < 0:
    raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
  return value


def _port(text: str) -> int:
  value = int(text)
  if not 0 <= value <= 65535:
    raise argparse.ArgumentTypeError(f"must be a TCP port, 0 (a free one) to 65535, got {value}")
  return value


def _positive_float(text: str) -> float:
  value = float(text)
  if not value > 0:
    raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
  return value


def parser() -> argparse.ArgumentParser:
  """The command line of `python -m jaxdp.launch`."""
  p = argparse.ArgumentParser(
      prog="python -m jaxdp.launch",
      description="Start NPROC local worker processes of one JAX job (call jaxdp.runtime.distributed.initialize() in the script).",
      usage="%(prog)s --nproc P [options] -- script.py [args] | -m module [args]",
  )
  p.add_argument("--nproc", type=_positive_int, required=True, help="number of worker processes")
  p.add_argument("--devices-per-proc", type=_positive_int, default=None,
                 help="simulated CPU devices per worker (sets jax_num_cpu_devices)")
  p.add_argument("--host", default="127.0.0.1", help="address the coordinator binds to (default: loopback only)")
  p.add_argument("--port", type=_port, default=0, help="coordinator port (default: a free one, new at each restart)")
  p.add_argument("--grace-period", type=_positive_float, default=5.0,
                 help="seconds between SIGTERM and SIGKILL when stopping workers (default 5)")
  p.add_argument("--timeout", type=_positive_float, default=None,
                 help="stop everything after this many seconds of wall clock, per attempt (default: none)")
  p.add_argument("--max-restarts", type=_non_negative_int, default=0,
                 help="restart the job this many times after a worker fails (default 0)")
  p.add_argument("--min-nproc", type=_positive_int, default=None,
                 help="a restart may run down to this many processes, one fewer per restart (default: --nproc)")
  p.add_argument("--heartbeat-timeout", type=_positive_int, default=None,
                 help="seconds without a heartbeat before jax.distributed declares a worker dead")
  p.add_argument("--shutdown-timeout", type=_positive_int, default=None,
                 help="seconds a finished worker waits for the others at exit before JAX aborts the job")
  p.add_argument("command", nargs=argparse.REMAINDER, help="script.py [args], or -m module [args], after --")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  """Runs `python -m jaxdp.launch` with `argv` (default `sys.argv[1:]`); returns the exit code."""
  # The handlers come first: a signal from here on stops the job cleanly, even before a worker exists.
  with _Signals() as signals:
    return _main(argv, signals)


def _main(argv: Sequence[str] | None, signals: _Signals) -> int:
  args = parser().parse_args(argv)
  command = list(args.command)
  if command[:1] == ["--"]:
    command = command[1:]
  if not command:
    parser().error("no command: pass the worker script after --, e.g. -- train.py --lr 0.1")
  if args.min_nproc is not None and args.min_nproc > args.nproc:
    parser().error(f"--min-nproc {args.min_nproc} is more than --nproc {args.nproc}")

  def new_job(restart: int) -> Job:
    layout = restart_layout(restart, args.nproc, args.devices_per_proc, args.min_nproc)
    return Job([sys.executable, *command], layout.nproc, host=args.host, port=args.port,
               devices_per_proc=layout.devices_per_proc, heartbeat_timeout=args.heartbeat_timeout,
               shutdown_timeout=args.shutdown_timeout, grace_period=args.grace_period, restart_count=restart)

  return supervise(new_job, timeout=args.timeout, max_restarts=args.max_restarts, signals=signals)


if __name__ == "__main__":
  if sys.argv[1:3] == [_GUARDIAN_FLAG, "--"]:
    sys.exit(_guardian_main(sys.argv[3:]))
  sys.exit(main())
