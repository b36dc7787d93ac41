"""The control plane's own faults, measured: a coordinator killed and started again by its
launcher, a leader killed and succeeded by a standby on etcd, and a rank's recovery with and
without etcd, in the same run.

    python bench/control_plane.py [--repeat N] [--out bench/results/multihost.md]

For each mode (``restart``: the default, one coordinator restarted by its launcher; ``etcd``:
``--control-plane`` on a 3-member etcd cluster on loopback, two coordinators), in turn (ABBA):

- failover: the demo GPT on 2 ranks, the coordinator (the leader) SIGKILLed at step 5; the
  time from the kill to a ``status`` request answered by the coordinator that took over, and
  the job's own ``down_s`` (from its agent seeing the coordinator go to the job going on);
  the run must end bit-identical to the fault-free run;
- recovery: a rank SIGKILLed mid-backward (hot spare), its recovery's time by phase.

Every run is bounded in time and its processes end with it; etcd's members are ended by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the etcd cluster the tests start

from xmig.coord.etcd import ControlPlane, ControlPlaneError  # noqa: E402
from xmig.wire import Client, WireError, parse_address  # noqa: E402

from etcd_harness import EtcdCluster  # noqa: E402

DEMO = REPO / "examples" / "train_gpt.py"
JOB = [str(DEMO), "--preset", "tiny", "--steps", "24", "--step-sleep", "0.25"]
FLAGS = ["--nproc-per-node", "2", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2"]
RUN_TIMEOUT_S = 240.0
KILL_AT_STEP = 5


def start(mode: str, cluster: EtcdCluster, folder: Path, extra: list[str]) -> subprocess.Popen:
    plane = ["--control-plane", cluster.url] if mode == "etcd" else []
    folder.mkdir(parents=True)
    return subprocess.Popen(
        [sys.executable, "-m", "xmig", "run", "--summary", str(folder / "summary.json"),
         *FLAGS, *plane, *extra, *JOB],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={**os.environ, "XMIG_JOBS_DIR": str(folder / "jobs")}, start_new_session=True,
    )  # fmt: skip


def read_until(proc: subprocess.Popen, text: str, seen: list[str]) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the run ended before {text!r}:\n{''.join(seen[-20:])}")
        seen.append(line)
        if text in line:
            return
    raise RuntimeError(f"no {text!r} within {RUN_TIMEOUT_S} s")


def finish(proc: subprocess.Popen, folder: Path, seen: list[str]) -> dict:
    try:
        rest, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate()
    seen.append(rest)
    path = folder / "summary.json"
    if not path.exists():
        raise RuntimeError(f"no summary:\n{''.join(seen)[-3000:]}")
    return json.loads(path.read_text())


def job_of(seen: list[str]) -> tuple[str, str, str]:
    """(job id, coordinator address, token) from the run's job file line and folder."""
    line = next(x for x in seen if x.startswith("xmig: job ") and "coordinator" in x)
    job_id = line.split()[2].rstrip(":")
    address = line.split("coordinator ", 1)[1].split(",", 1)[0]
    return job_id, address, ""


def token_of(folder: Path, job_id: str) -> str:
    return json.loads((folder / "jobs" / f"{job_id}.json").read_text())["token"]


def answered(address: str, token: str) -> bool:
    try:
        client = Client(parse_address(address), token, info={"role": "client"},
                        connect_timeout=1.0)  # fmt: skip
    except (WireError, OSError):
        return False
    try:
        return client.call("status", timeout=2.0)["status"]["status"] == "running"
    except Exception:  # refused by a standby, or gone
        return False
    finally:
        client.close()


def ended(proc: subprocess.Popen) -> None:
    """The run and every process of its job gone (they die with its launcher)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def failover(mode: str, cluster: EtcdCluster, folder: Path) -> dict:
    """Kill the coordinator (the leader) at step 5; the time to the next answer."""
    proc = start(mode, cluster, folder, ["--hot-spares", "0"])
    try:
        return _failover(mode, cluster, folder, proc)
    finally:
        ended(proc)


def _failover(mode: str, cluster: EtcdCluster, folder: Path, proc: subprocess.Popen) -> dict:
    seen: list[str] = []
    read_until(proc, f"step {KILL_AT_STEP} loss", seen)
    job_id, address, _ = job_of(seen)
    token = token_of(folder, job_id)
    plane = ControlPlane(cluster.url, job_id) if mode == "etcd" else None
    if plane is not None:
        leader = plane.leader()
        assert leader is not None
        pid, old = leader.pid, leader.revision
    else:
        import psutil

        (coord,) = [p for p in psutil.Process(proc.pid).children()
                    if "xmig.coord" in " ".join(p.cmdline())]  # fmt: skip
        pid, old = coord.pid, None
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    answer_s = None
    while time.monotonic() - killed < 60:
        where = address
        if plane is not None:
            try:
                new = plane.leader()
            except ControlPlaneError:
                new = None
            if new is None or new.revision == old:
                time.sleep(0.01)
                continue
            where = new.address
        if answered(where, token):
            answer_s = time.monotonic() - killed
            break
        time.sleep(0.01)
    if plane is not None:
        plane.close()
    summary = finish(proc, folder, seen)
    (restart,) = summary["coordinator_restarts"]
    return {"answer_s": answer_s, "down_s": restart["down_s"], "how": restart["how"],
            "sha": summary["final_params_sha256"], "status": summary["status"]}  # fmt: skip


def recovery(mode: str, cluster: EtcdCluster, folder: Path) -> dict:
    proc = start(mode, cluster, folder, ["--inject", "kill:rank=1:step=8:at=backward"])
    try:
        summary = finish(proc, folder, [])
    finally:
        ended(proc)
    (record,) = summary["recoveries"]
    return {"total_s": record["total_s"], "phases": record["phases"],
            "sha": summary["final_params_sha256"], "status": summary["status"]}  # fmt: skip


def reference(folder: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "xmig", "run", "--summary", str(folder / "summary.json"), *FLAGS,
         *JOB], capture_output=True, text=True, cwd=REPO, timeout=RUN_TIMEOUT_S,
        env={**os.environ, "XMIG_JOBS_DIR": str(folder / "jobs")}, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stdout + done.stderr)
    return json.loads((folder / "summary.json").read_text())["final_params_sha256"]


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "multihost.md")
    args = parser.parse_args()
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="xmig-control-plane-"))
    started, wall = time.monotonic(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cluster = EtcdCluster(3).start()
    results: dict[str, dict[str, list[dict]]] = {m: {"failover": [], "recovery": []}
                                                 for m in ("restart", "etcd")}  # fmt: skip
    try:
        expected = reference(work / "reference")
        order = ["restart", "etcd", "etcd", "restart"]
        for i in range(args.repeat):
            for j, mode in enumerate(order):
                for what, measure in (("failover", failover), ("recovery", recovery)):
                    result = measure(mode, cluster, work / f"{what}-{mode}-{i}-{j}")
                    result["identical"] = result["sha"] == expected
                    results[mode][what].append(result)
                    print(f"[{i}] {mode} {what}: {json.dumps(result)}", flush=True)
    finally:
        cluster.stop()
    machine = platform.processor() or platform.machine()
    lines = [
        "# The control plane's own faults",
        "",
        f"Measured {wall} with `python bench/control_plane.py --repeat {args.repeat}` "
        f"({(time.monotonic() - started) / 60:.0f} min); machine: {machine}, "
        f"{os.cpu_count()} cores, Linux {platform.release()}, Python "
        f"{platform.python_version()}.",
        "",
        "The demo GPT (`--preset tiny`) on 2 ranks (gloo), one launcher. `restart`: one "
        "coordinator, started again by its launcher when it dies (the default); `etcd`: "
        "`--control-plane` on a 3-member etcd 3.4 cluster on loopback (elections in 0.25 s), "
        "two coordinators, a lease of 2 s. The modes alternate (ABBA), "
        f"{2 * args.repeat} runs of each.",
        "",
        "## A coordinator (the leader) SIGKILLed at step 5",
        "",
        "| mode | kill → a status request answered by its successor (s) | the job's `down_s` "
        "(s) | bit-identical |",
        "|---|---|---|---|",
    ]
    for mode in ("restart", "etcd"):
        runs = results[mode]["failover"]
        lines.append(f"| {mode} | {spread([r['answer_s'] for r in runs if r['answer_s']])} | "
                     f"{spread([r['down_s'] for r in runs if r['down_s']])} | "
                     f"{sum(r['identical'] for r in runs)}/{len(runs)} |")  # fmt: skip
    lines += ["", "## A rank SIGKILLed mid-backward, hot spare: the recovery with and without etcd",
              "", "| mode | recovery total (s) | bit-identical |", "|---|---|---|"]  # fmt: skip
    for mode in ("restart", "etcd"):
        runs = results[mode]["recovery"]
        lines.append(f"| {mode} | {spread([r['total_s'] for r in runs])} | "
                     f"{sum(r['identical'] for r in runs)}/{len(runs)} |")  # fmt: skip
    lines += ["", "Median (range). `down_s` runs from the first agent that saw the coordinator "
              "go to the job going on under its successor; with etcd it is mostly the "
              "leader's lease running out (2 s).", ""]  # fmt: skip
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
