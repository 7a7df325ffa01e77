"""The local launcher ``python -m jaxdp.launch``: environment, output, failures, signals, restarts.

The workers here (``tests/mp_workers/plain.py``) do not import JAX, so each
job takes well under a second (the launcher itself imports jaxdp, which takes
seconds); jobs of real JAX workers are in ``test_multiprocess.py`` and
``test_restart.py``. Every job is bounded in time and checked for processes
left behind: workers, their descendants and the launcher's guardian are all
tagged with the test's temporary directory on their command line, and some
workers start descendants that leave the worker's process group and session
(a child in a new session, a double-forked daemon).
"""

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from jaxdp.runtime import distributed
from jaxdp.runtime import launch
from mp_workers import harness

PLAIN = harness.WORKERS / "plain.py"
FAST = ["--grace-period", "1", "--timeout", "60"]
LINUX = sys.platform.startswith("linux")


def _launch(tmp_path, mode, *options, timeout=60):
  result = harness.launch([*options, *FAST], [PLAIN, mode, tmp_path], timeout=timeout)
  harness.assert_no_leftovers(str(tmp_path))
  return result


def _records(stdout: str, rank: int) -> list[str]:
  prefix = f"[rank {rank}] "
  return [line[len(prefix):] for line in stdout.splitlines() if line.startswith(prefix)]


@pytest.fixture(scope="module")
def env_job(tmp_path_factory):
  """One job of 3 ``env`` workers, shared by the tests that only read its output."""
  return _launch(tmp_path_factory.mktemp("env"), "env", "--nproc", "3", "--devices-per-proc", "2", "--heartbeat-timeout", "7")


def test_all_workers_succeeding_is_success(env_job):
  assert env_job.returncode == 0, env_job
  assert "jaxdp.runtime.launch" not in env_job.stderr


def test_workers_get_the_environment_initialize_reads(env_job):
  envs = [json.loads(_records(env_job.stdout, rank)[0]) for rank in range(3)]
  coordinators = {e[distributed.ENV_COORDINATOR] for e in envs}
  assert len(coordinators) == 1
  host, port = coordinators.pop().rsplit(":", 1)
  assert host == "127.0.0.1" and 0 < int(port) < 65536
  for rank, e in enumerate(envs):
    assert e[distributed.ENV_PROCESS_ID] == str(rank)
    assert e[distributed.ENV_NUM_PROCESSES] == "3"
    assert e[distributed.ENV_DEVICES_PER_PROC] == "2"
    assert e[distributed.ENV_HEARTBEAT_TIMEOUT] == "7"
    assert e[distributed.ENV_COORDINATOR_BIND] == e[distributed.ENV_COORDINATOR]  # loopback only
    assert e["PYTHONUNBUFFERED"] == "1"
    assert e[launch.ENV_RESTART_COUNT] == "0"


def test_output_is_prefixed_with_the_rank(env_job):
  for rank in range(3):
    assert _records(env_job.stdout, rank)[1] == "no newline"  # a last line without newline is kept whole
    assert f"[rank {rank}] to stderr from {rank}" in env_job.stderr.splitlines()
  assert not [line for line in env_job.stdout.splitlines() if not line.startswith("[rank ")]


def test_host_binds_where_told_and_workers_connect_locally(tmp_path):
  result = _launch(tmp_path, "env", "--nproc", "1", "--host", "0.0.0.0")
  assert result.returncode == 0, result
  env = json.loads(_records(result.stdout, 0)[0])
  assert env[distributed.ENV_COORDINATOR_BIND].startswith("0.0.0.0:")
  assert env[distributed.ENV_COORDINATOR].startswith("127.0.0.1:")
  assert env[distributed.ENV_COORDINATOR].split(":")[1] == env[distributed.ENV_COORDINATOR_BIND].split(":")[1]
  assert distributed.ENV_DEVICES_PER_PROC not in env


def test_output_is_streamed_while_workers_run(tmp_path):
  job = _Job(tmp_path, "stream", "--nproc", "2")
  try:
    assert sorted(job.stdout_lines(2, seconds=20)) == ["[rank 0] first", "[rank 1] first"]
    assert job.proc.poll() is None, "the lines must arrive before the workers end"
    job.proc.wait(timeout=30)
  finally:
    job.kill()
  assert job.proc.returncode == 0
  assert sorted(job.stdout_lines(2, seconds=5)) == ["[rank 0] second", "[rank 1] second"]
  harness.assert_no_leftovers(str(tmp_path))


def test_a_failed_worker_stops_the_others(tmp_path):
  # Rank 1 exits with 3; the others sleep for 2 minutes, rank 0 ignoring SIGTERM and rank 2 with a
  # sleeping child in its process group, a child in a new session and a double-forked daemon: the
  # launcher must end them all (SIGKILL after the 1 s grace period), promptly, and name rank 1.
  result = _launch(tmp_path, "fail", "--nproc", "3")
  assert result.returncode == 3, result
  assert "jaxdp.runtime.launch: rank 1 exited with code 3; stopped all 3 workers." in result.stderr
  assert sorted(line for line in result.stdout.splitlines()) == [f"[rank {r}] ready" for r in range(3)]
  assert result.seconds < 20, f"took {result.seconds:.1f} s"


def test_a_worker_that_lost_a_peer_is_not_named_as_the_cause(tmp_path):
  # Rank 0 says its collective lost a peer and exits first; rank 1 fails half a second later. Under load the
  # one whose death broke the collective can be reaped after the one it broke: the launcher names rank 1.
  result = _launch(tmp_path, "lost-peer", "--nproc", "2")
  assert result.returncode == 3, result
  assert "jaxdp.runtime.launch: rank 1 exited with code 3; stopped all 2 workers." in result.stderr


def test_timeout_stops_everything_and_is_not_restarted(tmp_path):
  options = ["--nproc", "2", "--grace-period", "1", "--timeout", "2", "--max-restarts", "2"]
  result = harness.launch(options, [PLAIN, "sleep", tmp_path], timeout=60)
  harness.assert_no_leftovers(str(tmp_path))
  assert result.returncode == 124, result
  assert "jaxdp.runtime.launch: timed out after 2 s; stopped all 2 workers." in result.stderr
  assert "restart" not in result.stderr
  assert result.seconds < 20


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_everything_and_is_not_restarted(sig, tmp_path):
  job = _Job(tmp_path, "sleep", "--nproc", "2", "--max-restarts", "2")
  try:
    assert sorted(job.stdout_lines(2, seconds=20)) == ["[rank 0] ready", "[rank 1] ready"]
    start = time.monotonic()
    job.proc.send_signal(sig)
    job.proc.wait(timeout=30)
  finally:
    job.kill()
  err = "\n".join(job.stderr_lines())
  assert job.proc.returncode == 128 + sig, err
  assert f"jaxdp.runtime.launch: interrupted by {signal.Signals(sig).name}; stopped all 2 workers." in err
  assert "restart" not in err
  assert time.monotonic() - start < 15
  harness.assert_no_leftovers(str(tmp_path))


@pytest.mark.skipif(not LINUX, reason="the guardian finds descendants through /proc and PR_SET_CHILD_SUBREAPER")
def test_descendants_in_other_sessions_end_with_the_job(tmp_path):
  # Every worker exits 0 at once, leaving a child in a new session and a re-parented daemon asleep.
  result = _launch(tmp_path, "orphans", "--nproc", "2")
  assert result.returncode == 0, result
  assert sorted(line.split(" ready ")[0] for line in result.stdout.splitlines()) == ["[rank 0]", "[rank 1]"], result
  assert result.seconds < 20, f"took {result.seconds:.1f} s"


@pytest.mark.skipif(not LINUX, reason="the guardian finds descendants through /proc and PR_SET_CHILD_SUBREAPER")
@pytest.mark.parametrize("target", ["launcher", "launcher's process group"])
def test_every_descendant_dies_with_the_launcher(target, tmp_path):
  job = _Job(tmp_path, "orphans-sleep", "--nproc", "2")
  try:
    pids = [json.loads(line.split(" ", 3)[3]) for line in job.stdout_lines(2, seconds=30)]
    for p in pids:  # the descendants escaped the worker's session; the daemon was adopted by the guardian
      assert os.getsid(p["child"]) == p["child"] != os.getsid(p["worker"])
      guardian = _parent(p["worker"])
      assert _parent(p["daemon"]) == guardian and _parent(guardian) == job.proc.pid
      assert os.getsid(guardian) == guardian != os.getsid(job.proc.pid)
    if target == "launcher":
      job.proc.kill()  # SIGKILL: the launcher cannot clean up; its guardian must
    else:
      os.killpg(job.proc.pid, signal.SIGKILL)  # the guardian has a session of its own
    job.proc.wait(timeout=10)
  finally:
    job.kill()
  harness.assert_no_leftovers(str(tmp_path))


def test_a_failed_worker_restarts_the_job_on_fewer_processes(tmp_path):
  # The last rank fails on attempts 0 and 1; 3 x 2 devices restart as 2 x 3, then 1 x 6, which succeeds.
  options = ["--nproc", "3", "--devices-per-proc", "2", "--min-nproc", "1", "--max-restarts", "2"]
  result = _launch(tmp_path, "flaky", *options)
  assert result.returncode == 0, result
  restarts = [line for line in result.stderr.splitlines() if line.startswith("jaxdp.runtime.launch:")]
  assert restarts == [
      "jaxdp.runtime.launch: worker rank 2 failed with exit code 3; restart 1 of 2 with --nproc 2 --devices-per-proc 3",
      "jaxdp.runtime.launch: worker rank 1 failed with exit code 3; restart 2 of 2 with --nproc 1 --devices-per-proc 6",
  ], result.stderr
  envs = [json.loads(line.split(" ", 2)[2]) for line in result.stdout.splitlines()]
  layouts = {(e[launch.ENV_RESTART_COUNT], e[distributed.ENV_NUM_PROCESSES], e[distributed.ENV_DEVICES_PER_PROC])
             for e in envs}
  assert layouts == {("0", "3", "2"), ("1", "2", "3"), ("2", "1", "6")}, layouts
  coordinators = {e[launch.ENV_RESTART_COUNT]: e[distributed.ENV_COORDINATOR] for e in envs}
  assert len(set(coordinators.values())) == 3, "each attempt has its own coordinator port"


def test_restarts_run_out(tmp_path):
  result = _launch(tmp_path, "flaky", "--nproc", "2", "--max-restarts", "1")
  assert result.returncode == 3, result
  messages = [line for line in result.stderr.splitlines() if line.startswith("jaxdp.runtime.launch:")]
  assert messages == ["jaxdp.runtime.launch: worker rank 1 failed with exit code 3; restart 1 of 1",
                      "jaxdp.runtime.launch: rank 1 exited with code 3; stopped all 2 workers."], result.stderr


def test_restart_layouts():
  def layouts(*args, **kwargs):
    return [tuple(launch.restart_layout(k, *args, **kwargs)) for k in range(4)]

  assert layouts(2, 1) == [(2, 1)] * 4  # --min-nproc defaults to --nproc
  assert layouts(2, 2, min_nproc=1) == [(2, 2), (1, 4), (1, 4), (1, 4)]
  assert layouts(3, 2, min_nproc=1) == [(3, 2), (2, 3), (1, 6), (1, 6)]
  assert layouts(3, 1, min_nproc=1) == [(3, 1), (2, 1), (1, 3), (1, 3)]  # 3 devices do not split over 2
  assert layouts(4, None, min_nproc=2) == [(4, None), (3, None), (2, None), (2, None)]
  assert launch.restart_layout(1, 2, 2, min_nproc=1) == launch.ProcessLayout(nproc=1, devices_per_proc=4)


def test_the_launcher_imports_no_jax(tmp_path):
  # -X importtime reaches only the launcher (the guardian and the workers are started without it), and
  # covers its whole life, from before its signal handlers to after its workers have run.
  result = harness.run([sys.executable, "-X", "importtime", "-m", "jaxdp.runtime.launch", "--nproc", "1", *FAST, "--",
                        PLAIN, "env", tmp_path], timeout=60)
  harness.assert_no_leftovers(str(tmp_path))
  assert result.returncode == 0, result
  assert _records(result.stdout, 0), "the worker ran"
  imported = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines()
              if line.startswith("import time:")}
  assert "jaxdp" in imported
  assert not imported & {"jax", "jaxlib", "flax", "orbax", "optax", "numpy"}, sorted(imported)


def test_a_signal_before_the_first_start_starts_no_worker():
  job = launch.Job([sys.executable, "-c", "pass"], 1)
  with launch._Signals() as signals:
    signals.received = signal.SIGTERM
    assert launch.supervise(lambda restart: job, signals=signals) == 128 + signal.SIGTERM
  assert job.pids == [None]


def test_the_package_exports_every_public_name_lazily():
  import jaxdp
  from jaxdp.adapters import batchnorm
  from jaxdp.sharding import layout

  assert set(jaxdp.__all__) <= set(dir(jaxdp))
  for name in jaxdp.__all__:
    assert getattr(jaxdp, name) is not None
  assert jaxdp.sharding.layout is layout and jaxdp.gather_state is layout.gather_state
  assert jaxdp.masked_moments is batchnorm.masked_moments
  assert jaxdp.runtime.distributed.ENV_COORDINATOR == launch.ENV_COORDINATOR
  with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
    jaxdp.no_such_name  # noqa: B018


def test_module_workers(tmp_path):
  result = harness.launch(["--nproc", "2", *FAST], ["-m", "json.tool", "--help"], timeout=60)
  assert result.returncode == 0, result
  assert any(line.startswith("[rank 1] usage:") for line in result.stdout.splitlines())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc", "2"], "no command"),
        (["--nproc", "0", "--", "x.py"], "--nproc: must be >= 1"),
        (["--", "x.py"], "the following arguments are required: --nproc"),
        (["--nproc", "1", "--grace-period", "0", "--", "x.py"], "--grace-period: must be > 0"),
        (["--nproc", "1", "--max-restarts", "-1", "--", "x.py"], "--max-restarts: must be >= 0"),
        (["--nproc", "2", "--min-nproc", "3", "--", "x.py"], "--min-nproc 3 is more than --nproc 2"),
        (["--nproc", "1", "--port", "70000", "--", "x.py"], "--port: must be a TCP port"),
        (["--nproc", "1", "--port", "-1", "--", "x.py"], "--port: must be a TCP port"),
    ],
)
def test_bad_arguments(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    launch.main(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_free_port_is_bindable():
  port = launch.free_port()
  with socket.socket() as s:
    s.bind(("127.0.0.1", port))


def test_failures_are_named():
  assert launch._failure(1, 3) == launch.Failure(1, 3, "rank 1 exited with code 3", 3)
  assert launch._failure(2, -9) == launch.Failure(2, 137, "rank 2 was killed by signal SIGKILL", -9)


def test_worker_env_overrides_and_removes():
  base = {"JAXDP_DEVICES_PER_PROC": "8", "KEEP": "1"}
  env = launch.worker_env(1, 2, "127.0.0.1:5", "127.0.0.1:5", base=base)
  assert env["KEEP"] == "1" and env["JAXDP_PROCESS_ID"] == "1" and env["JAXDP_NUM_PROCESSES"] == "2"
  assert "JAXDP_DEVICES_PER_PROC" not in env  # not inherited from an enclosing job


# --- helpers ----------------------------------------------------------------------------------


def _parent(pid: int) -> int:
  with open(f"/proc/{pid}/stat") as f:
    return int(f.read().rsplit(")", 1)[1].split()[1])


class _Job:
  """A launcher run in the background; its output lines are collected by threads as they come."""

  def __init__(self, tmp_path, mode, *options):
    args = [sys.executable, "-m", "jaxdp.runtime.launch", *options, *FAST, "--", str(PLAIN), mode, str(tmp_path)]
    self.proc = subprocess.Popen(args, cwd=harness.ROOT, env=harness.env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
    self._out, self._err = queue.Queue(), queue.Queue()
    for stream, lines in ((self.proc.stdout, self._out), (self.proc.stderr, self._err)):
      threading.Thread(target=lambda s=stream, q=lines: [q.put(line.rstrip("\n")) for line in s], daemon=True).start()

  def stdout_lines(self, count: int, seconds: float) -> list[str]:
    """The next ``count`` lines of stdout, failing after ``seconds``."""
    deadline, lines = time.monotonic() + seconds, []
    while len(lines) < count:
      try:
        lines.append(self._out.get(timeout=max(deadline - time.monotonic(), 0.01)))
      except queue.Empty:
        raise AssertionError(f"only {lines} within {seconds} s") from None
    return lines

  def stderr_lines(self) -> list[str]:
    time.sleep(0.2)  # the reader thread drains what the launcher wrote before it exited
    return [self._err.get() for _ in range(self._err.qsize())]

  def kill(self) -> None:
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait()
