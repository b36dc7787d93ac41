"""Running ``xmig`` as a user would, bounded in time, and checking nothing is left behind."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "examples" / "train_gpt.py"
PATTERNS = REPO / "tests" / "scripts" / "patterns.py"


@dataclass
class Result:
    returncode: int
    output: str
    summary: dict | None
    elapsed: float

    @property
    def last_lines(self) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith("xmig:")][-3:]


def job_processes(job_id: str) -> list[psutil.Process]:
    """Every live process that carries this job's id in its environment."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get("XMIG_JOB_ID") == job_id:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def summary_pids(summary: dict) -> list[int]:
    pids = [summary["coordinator_pid"], *summary["agent_pids"].values()]
    pids += [p for ps in summary["worker_pids"].values() for p in ps]
    return [int(p) for p in pids]


def assert_all_gone(summary: dict, timeout: float = 10.0) -> None:
    """No process of the job is alive (by the PIDs the summary names, and by job id)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [
            p
            for p in summary_pids(summary)
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        alive += [p.pid for p in job_processes(summary["job_id"])]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not alive, f"processes of job {summary['job_id']} still alive: {sorted(set(alive))}"


def xmig(
    *args: str, timeout: float = 120.0, env: dict | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """Run an ``xmig`` command that ends by itself (bad input, inject, status)."""
    return subprocess.run(
        [sys.executable, "-m", "xmig", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        check=False,
    )


# every job a test started, so that a pytest stopped from outside ends them too
_STARTED: list[subprocess.Popen] = []


def kill_started_jobs() -> None:
    """SIGKILL every job the tests started that still runs (its launcher's process group:
    its coordinator, agents and workers die with the launcher)."""
    for proc in _STARTED:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def start_run(args: list[str], tmp_path: Path, env: dict | None = None) -> subprocess.Popen:
    summary = tmp_path / "summary.json"
    _STARTED[:] = [p for p in _STARTED if p.poll() is None]
    proc = subprocess.Popen(
        [sys.executable, "-m", "xmig", "run", "--summary", str(summary), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "XMIG_JOBS_DIR": str(tmp_path / "jobs"), **(env or {})},
        start_new_session=True,
    )
    _STARTED.append(proc)
    return proc


@contextlib.contextmanager
def launched(args: list[str], tmp_path: Path, env: dict | None = None):
    """``xmig run ARGS`` started; killed with its whole job should the test fail before it
    has finished the run itself."""
    proc = start_run(args, tmp_path, env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its job dies with it (parent-death signal)
            proc.communicate(timeout=30)


def finish_run(proc: subprocess.Popen, tmp_path: Path, timeout: float) -> Result:
    started = time.monotonic()
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # the launcher's death takes its coordinator, agents and workers with it
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"xmig run did not finish within {timeout} s:\n{output}") from None
    summary_file = tmp_path / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else None
    result = Result(proc.returncode, output, summary, time.monotonic() - started)
    if summary is not None:
        assert_all_gone(summary)
    return result


def finish_bit_identical(proc: subprocess.Popen, tmp_path: Path, seen: str, expected: str,
                         timeout: float = 180.0) -> Result:  # fmt: skip
    """``finish_run`` of a job that must end well: exit code 0 and the fault-free run's final
    parameters (``seen``: its output read so far, put in front)."""
    result = finish_run(proc, tmp_path, timeout=timeout)
    result.output = seen + result.output
    assert result.returncode == 0, result.output
    assert result.summary["final_params_sha256"] == expected, "not bit-identical"
    return result


def run(args: list[str], tmp_path: Path, timeout: float = 180.0, env: dict | None = None) -> Result:
    """``xmig run --summary … ARGS``, bounded; asserts afterwards that no process remains."""
    return finish_run(start_run(args, tmp_path, env), tmp_path, timeout)


def resume_printed(output: str, tmp_path: Path, timeout: float = 180.0) -> Result:
    """Run the resume command a stopped job printed (``xmig: resume with: …``), in a folder
    of its own under ``tmp_path`` (``resumed``), its summary the test's, not the job's."""
    (line,) = [x for x in output.splitlines() if x.startswith("xmig: resume with: ")]
    command = shlex.split(line.removeprefix("xmig: resume with: "))[2:]
    where = command.index("--summary")
    del command[where : where + 2]
    folder = tmp_path / "resumed"
    folder.mkdir()
    return run(command, folder, timeout)


def write_script(tmp_path: Path, body: str, name: str = "worker.py") -> str:
    """A test's own worker script (dedented) in ``tmp_path``; its path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def wait_for(predicate, timeout: float, what: str):
    """Poll ``predicate`` until it returns something true, at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# quick fault detection for recovery tests, without hot spares (a 4-rank job on 2 cores)
FAST = ["--hot-spares", "0", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2"]
_FAULT_FREE: dict[tuple[str, ...], str] = {}
# options that change how a run is watched or paced, never its numbers: a fault-free
# reference runs with FAST's instead (no hot spare; a quick heartbeat, which also ends a job
# sooner) and without the scripts' sleeps, once for every job that differs only in them
_PACING = {"--hot-spares": 1, "--heartbeat-interval": 1, "--heartbeat-timeout": 1}
_SCRIPT_PACING = {"--step-sleep": 1, "--slow-backward": 0, "--quiet": 0}  # DEMO's, PATTERNS'


def reference_args(args: list[str]) -> list[str]:
    """``args`` of an ``xmig run`` without the options that cannot change its parameters."""
    scripts = {str(DEMO), str(PATTERNS)}
    at = next((i for i, a in enumerate(args) if a.endswith(".py")), len(args))
    kept, i = list(FAST), 0
    while i < len(args):
        pacing = _PACING if i < at else _SCRIPT_PACING if args[at] in scripts else {}
        if args[i] in pacing:
            i += 1 + pacing[args[i]]
            continue
        kept.append(args[i])
        i += 1
    return kept


def fault_free_sha256(args: list[str], tmp_path_factory) -> str:
    """The final parameters of a fault-free ``xmig run ARGS``, run once for all the ARGS that
    differ only in how the run is watched or paced (``reference_args``)."""
    key = tuple(reference_args(args))
    if key not in _FAULT_FREE:
        result = run(list(key), tmp_path_factory.mktemp("reference"))
        assert result.returncode == 0, result.output
        _FAULT_FREE[key] = result.summary["final_params_sha256"]
    return _FAULT_FREE[key]
