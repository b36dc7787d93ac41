"""xmig side by side with what users run today, on the same workload and the same fault.

    pip install -e .[bench]       # the peers: torchft, nvidia-resiliency-ext, matplotlib
    python bench/compare.py [--models gpt mlp] [--preset tiny] [--faults 3] [--out DIR]

Systems, each on 2 ranks (gloo; NCCL where there are GPUs) running the demo's training loop:
``plain`` (torchrun, DDP, no fault tolerance: the yardstick), ``xmig`` (hot spare, replay),
``torchrun`` (``--max-restarts``, a checkpoint to local disk every K steps, reloaded on
restart; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` set, as torchrun's restarts on gloo need
it), ``torchft`` (FT-DDP: one replica group per rank, each under torchrun, a lighthouse on
localhost) and ``nvrx`` (nvidia-resiliency-ext's in-process restart: a spare process per kill
takes the dead rank's place, every rank calls the training function again and reloads the
checkpoint written every K steps). Each system runs fault-free, with one SIGKILL of rank 1
mid-backward, and with ``--faults`` kills at fixed intervals; the runs are interleaved system
by system so that drift hits all alike. Every rank writes a JSON line per finished step;
everything below comes from those lines and each run's final parameters' SHA-256. Results:
``compare-<device>.md`` and ``compare-<device>.png`` in ``--out``. Every run is bounded in
time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch
from recovery_cpu import DEMO, REPO, free_port, kill_tree, machine
from recovery_cpu import bounded as run_bounded

PEER_TORCHFT = REPO / "bench" / "peers" / "torchft_ddp.py"
PEER_NVRX = REPO / "bench" / "peers" / "nvrx_inprocess.py"
SYSTEMS = ("plain", "xmig", "torchrun", "torchft", "nvrx")
WARMUP_STEPS = 3


@dataclass
class Run:
    """One system's run: its step lines, kills and final parameters."""

    system: str
    scenario: str
    launched: float
    ended: float
    exit_code: int
    steps: list[dict] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)
    params: str | None = None
    log: str = ""
    recoveries: list[dict] = field(default_factory=list)  # xmig's, from its summary
    world: int = 2  # ranks (torchft: replica groups)
    killed: int = 1  # the rank every fault kills


def read_events(path: Path) -> tuple[list[dict], list[float]]:
    steps, kills = [], []
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if "kill" in record:
                kills.append(float(record["t"]))
            else:
                steps.append(record)
    steps.sort(key=lambda r: r["t"])
    return steps, sorted(kills)


def bounded(cmd: list[str], log: Path, env: dict[str, str], timeout: float) -> int:
    """One process group, bounded in time (-9 when it had to be killed)."""
    try:
        return run_bounded(cmd, log, timeout, env)
    except RuntimeError as exc:  # the overrun, killed
        print(exc, file=sys.stderr)
        return -9


def start_all(commands: list[tuple[list[str], dict[str, str]]], log: Path) -> list:
    """Start processes that belong together, each in its own process group, output to
    ``log``."""
    procs = []
    for cmd, env in commands:
        with log.open("a") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                          env=env, start_new_session=True))  # fmt: skip
    return procs


def wait_all(procs: list, timeout: float) -> list[int]:
    """Their exit codes (-9 for one still running at the time bound); then every group that
    is left (monitor processes and the like) is killed."""
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(-9)
    finally:
        for proc in procs:
            kill_tree(proc)
    return codes


def _sha(log: Path) -> str | None:
    found = re.findall(r"final params sha256 ([0-9a-f]{64})", log.read_text(errors="replace"))
    return found[-1] if found else None


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.workload = ["--model", args.model, "--preset", args.preset, "--batch-size",
                         str(args.batch_size), "--steps", str(args.steps), "--quiet",
                         "--step-sleep", str(args.step_sleep)]  # fmt: skip
        self.env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                        PYTHONPATH=os.pathsep.join([str(REPO / "src"),
                                                    os.environ.get("PYTHONPATH", "")]))  # fmt: skip

    def fault_steps(self, scenario: str) -> list[int]:
        if scenario == "fault-free":
            return []
        if scenario == "one fault":
            return [self.args.steps // 2]
        every = self.args.steps // (self.args.faults + 1)
        return [every * (i + 1) for i in range(self.args.faults)]

    def run(self, system: str, scenario: str) -> Run:
        slug = f"{self.args.model}-{system}-{scenario.replace(' ', '-')}"
        events, log = self.work / f"{slug}.jsonl", self.work / f"{slug}.log"
        for path in (events, log):
            path.unlink(missing_ok=True)
        faults = self.fault_steps(scenario)
        launched = time.time()
        code = getattr(self, f"_{system}")(slug, events, log, faults)
        steps, kills = read_events(events)
        summary = self.work / f"{slug}.summary.json"
        recoveries = []
        if summary.exists():  # xmig's faults are injected from outside the script
            record = json.loads(summary.read_text())
            faults_seen, recoveries = record.get("faults", []), record.get("recoveries", [])
            kills = sorted(float(f["t_fault"]) for f in faults_seen if not f.get("secondary"))
        run = Run(system, scenario, launched, time.time(), code, steps, kills, _sha(log), str(log),
                  recoveries, self.args.nproc, self.args.kill_rank)  # fmt: skip
        print(f"{system:9s} {scenario:10s} exit {code} in {run.ended - launched:6.1f} s, "
              f"{len(kills)} kill(s), params {str(run.params)[:12]}", flush=True)  # fmt: skip
        return run

    def _deaths(self, faults: list[int]) -> list[str]:
        """The scripts' own kills: one per attempt, of the killed rank at each fault step."""
        return [x for step in faults for x in ("--die-at", f"{self.args.kill_rank}:{step}")]

    def _torchrun_cmd(self, restarts: int, script: Path, nproc: int | None = None) -> list[str]:
        nproc = self.args.nproc if nproc is None else nproc
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                "--max-restarts", str(restarts), "--monitor-interval", "0.1",
                "--master-port", str(free_port()), str(script)]  # fmt: skip

    def _plain(self, slug: str, events: Path, log: Path, faults: list[int]) -> int:
        cmd = [*self._torchrun_cmd(0, DEMO), "--plain", *self.workload, "--events-file",
               str(events)]  # fmt: skip
        return bounded(cmd, log, self.env, self.args.run_timeout)

    def _torchrun(self, slug: str, events: Path, log: Path, faults: list[int]) -> int:
        directory = self.work / f"{slug}-checkpoints"
        shutil.rmtree(directory, ignore_errors=True)
        deaths = self._deaths(faults)
        cmd = [*self._torchrun_cmd(len(faults), DEMO), "--plain", *self.workload,
               "--checkpoint-dir", str(directory), "--checkpoint-every",
               str(self.args.checkpoint_every), *deaths, "--events-file", str(events)]  # fmt: skip
        code = bounded(cmd, log, self.env, self.args.run_timeout)
        with contextlib.suppress(FileNotFoundError):  # what each save cost, kept
            os.replace(directory / "saves.jsonl", self.work / f"{slug}.saves.jsonl")
        shutil.rmtree(directory, ignore_errors=True)
        return code

    def _xmig(self, slug: str, events: Path, log: Path, faults: list[int]) -> int:
        kills = [f"kill:rank={self.args.kill_rank}:step={step}:at=backward" for step in faults]
        injects = [x for kill in kills for x in ("--inject", kill)]
        summary = self.work / f"{slug}.summary.json"
        summary.unlink(missing_ok=True)
        # as many warm spares as nvrx gets spare processes: one per kill
        spares = ["--hot-spares", str(max(1, len(faults)))]
        cmd = [sys.executable, "-m", "xmig", "run", "--nproc-per-node", str(self.args.nproc),
               *spares,
               *injects,
               "--summary", str(summary), str(DEMO), *self.workload, "--events-file",
               str(events)]  # fmt: skip
        return bounded(cmd, log, self.env, self.args.run_timeout)

    def _torchft(self, slug: str, events: Path, log: Path, faults: list[int]) -> int:
        lighthouse_port = free_port()
        # beside this interpreter (a venv) or on PATH (packages installed with --target)
        search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        lighthouse = shutil.which("torchft_lighthouse", path=search)
        if lighthouse is None:
            raise SystemExit("torchft is not installed: pip install -e .[bench]")
        with (self.work / f"{slug}-lighthouse.log").open("w") as out:
            beacon = subprocess.Popen(
                [lighthouse, "--min_replicas", "1", "--quorum_tick_ms", "100",
                 "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "1000",
                 "--bind", f"127.0.0.1:{lighthouse_port}"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deaths = self._deaths(faults)
        barrier = self.work / f"{slug}-barrier"
        shutil.rmtree(barrier, ignore_errors=True)
        commands = []
        for group in range(self.args.nproc):
            env = dict(self.env, REPLICA_GROUP_ID=str(group),
                       NUM_REPLICA_GROUPS=str(self.args.nproc),
                       TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{lighthouse_port}")  # fmt: skip
            if torch.cuda.is_available():  # a GPU per replica group, as a rank has one
                env["CUDA_VISIBLE_DEVICES"] = str(group)
            cmd = [*self._torchrun_cmd(len(faults), PEER_TORCHFT, nproc=1), *self.workload,
                   *deaths, "--events-file", str(events),
                   "--start-barrier", str(barrier)]  # fmt: skip
            cmd.remove("--quiet")
            commands.append((cmd, env))
        try:
            return max(wait_all(start_all(commands, log), self.args.run_timeout), key=abs)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(beacon.pid, signal.SIGKILL)
            beacon.wait()

    def _nvrx(self, slug: str, events: Path, log: Path, faults: list[int]) -> int:
        spares = max(1, len(faults))  # one spare process for each kill
        total = self.args.nproc + spares
        port, store_port = free_port(), free_port()
        directory = self.work / f"{slug}-checkpoints"
        shutil.rmtree(directory, ignore_errors=True)
        deaths = self._deaths(faults)
        commands = []
        for rank in range(total):
            # one thread per process, as torchrun and xmig give every worker
            env = dict(self.env, RANK=str(rank), WORLD_SIZE=str(total), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port),
                       OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))  # fmt: skip
            cmd = [sys.executable, str(PEER_NVRX), "--active", str(self.args.nproc),
                   "--store-port",
                   str(store_port), *self.workload, "--checkpoint-dir", str(directory),
                   "--checkpoint-every", str(self.args.checkpoint_every), *deaths,
                   "--events-file", str(events)]  # fmt: skip
            commands.append((cmd, env))
        try:
            codes = wait_all(start_all(commands, log), self.args.run_timeout)
            return codes[0]  # the first rank is never killed
        finally:
            shutil.rmtree(directory, ignore_errors=True)


# ---- metrics -----------------------------------------------------------------------------------
def finished(run: Run, rank: int) -> list[tuple[int, float]]:
    """(step, wall clock) of every step line of ``rank``, in time order."""
    return [(int(r["step"]), float(r["t"])) for r in run.steps if r["rank"] == rank]


def step_time(run: Run) -> float | None:
    """Median seconds per step on rank 0, after the warm-up, before any fault."""
    first_kill = run.kills[0] if run.kills else float("inf")
    times = [t for s, t in finished(run, 0) if s >= WARMUP_STEPS and t < first_kill]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def full_world_steps(run: Run) -> list[tuple[float, float]]:
    """(first rank's, last rank's) finishing time of each step that every rank finished with
    every rank's batch in it (a step trained again counts by its last lines), by time."""
    done: dict[int, dict[int, float]] = {}
    for r in run.steps:
        if r.get("participants", run.world) < run.world or r.get("committed") is False:
            continue
        done.setdefault(int(r["step"]), {})[int(r["rank"])] = float(r["t"])
    spans = [(min(ranks.values()), max(ranks.values())) for ranks in done.values()
             if len(ranks) == run.world]  # fmt: skip
    return sorted(spans, key=lambda span: span[1])


def full_world_times(run: Run) -> list[float]:
    """When each step was finished by every rank with every rank's batch in it."""
    return [last for _first, last in full_world_steps(run)]


def back_to_full(run: Run, kill: float) -> float | None:
    """Until a step that every rank finished after the kill, with every rank's batch in it
    (a step the killed rank had finished before it died does not count)."""
    later = [last for first, last in full_world_steps(run) if first > kill]
    return min(later) - kill if later else None


def survivor_stall(run: Run, kill: float) -> float | None:
    """The longest gap between two steps of a surviving rank around the kill."""
    survivor = 0 if run.killed != 0 else 1
    times = [t for _s, t in finished(run, survivor)]
    before = [t for t in times if t <= kill]
    after = [t for t in times if t > kill]
    if not before or not after:
        return None
    window = [before[-1], *after]
    return max(b - a for a, b in zip(window, window[1:], strict=False))


def steps_lost(run: Run) -> int:
    """Steps trained again after a rollback (as the first surviving rank saw them: every rank
    redoes the same steps), plus steps trained without some rank's batch."""
    survivor = 0 if run.killed != 0 else 1
    seen: set[int] = set()
    redone, partial = 0, set()
    for r in run.steps:
        step, rank = int(r["step"]), int(r["rank"])
        if r.get("committed") is False:
            continue
        if r.get("participants", run.world) < run.world:
            partial.add(step)
        if rank == survivor:
            redone += step in seen
            seen.add(step)
    return redone + len(partial)


def goodput(run: Run) -> float:
    """Useful steps per second of wall clock (a step counts by the share of the ranks'
    batches it trained, once)."""
    useful: dict[int, float] = {}
    for r in run.steps:
        if r.get("committed") is False:
            continue
        share = r.get("participants", run.world) / run.world
        useful[int(r["step"])] = max(useful.get(int(r["step"]), 0.0), share)
    return sum(useful.values()) / max(run.ended - run.launched, 1e-9)


# ---- report ------------------------------------------------------------------------------------
def versions() -> str:
    names = ["torchft-nightly", "torchft", "nvidia-resiliency-ext", "matplotlib"]
    found = []
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found.append(f"{name} {metadata.version(name)}")
    return ", ".join(found)


def plot(panels: list[tuple[str, list[Run]]], path: Path) -> bool:
    """Steps completed against wall clock, one panel per workload, kills dotted."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e .[bench])", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for ax, (title, runs) in zip(axes[0], panels, strict=True):
        for run in runs:
            # torchft's steps count on rank 0 even without the other replica's batch
            times = ([t for _s, t in finished(run, 0)] if run.system == "torchft"
                     else full_world_times(run))  # fmt: skip
            xs = [t - run.launched for t in times]
            line = ax.step(xs, range(1, len(xs) + 1), where="post", label=run.system)[0]
            for kill in run.kills:
                ax.axvline(kill - run.launched, color=line.get_color(), linestyle=":", alpha=0.7)
        ax.set_xlabel("wall clock since launch (s); dotted: kills")
        ax.set_ylabel("steps completed")
        ax.set_title(title)
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=["gpt", "mlp"], default=["gpt", "mlp"])
    parser.add_argument("--preset", default="tiny", help="the GPT's size (examples/train_gpt.py)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-sleep", type=float, default=0.2,
                        help="seconds of sleep per step (the same in every system)")  # fmt: skip
    parser.add_argument("--faults", type=int, default=3, help="kills in the goodput run")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="torchrun's checkpoint interval (0: ~2 %% of step time)")  # fmt: skip
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument(
        "--nproc",
        type=int,
        default=2,
        help="ranks (torchft: replica groups; on a GPU machine, one GPU each)",
    )
    parser.add_argument("--kill-rank", type=int, default=1, help="the rank every fault kills")
    parser.add_argument("--run-timeout", type=float, default=900.0,
                        help="seconds one system's run may take before it is killed")  # fmt: skip
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    if args.run_timeout <= 0:
        parser.error("--run-timeout must be positive")
    if args.nproc < 2:
        parser.error("--nproc must be at least 2: a fault needs a survivor")
    if not 0 <= args.kill_rank < args.nproc:
        parser.error(f"--kill-rank must be a rank of 0..{args.nproc - 1}")
    if torch.cuda.is_available() and args.nproc > torch.cuda.device_count():
        parser.error(f"--nproc {args.nproc}: this machine has {torch.cuda.device_count()} GPUs, "
                     "one per rank")  # fmt: skip
    if args.faults < 1 or args.steps < 4 * (args.faults + 1):
        parser.error("--steps must leave at least 4 steps between faults")
    if "plain" not in args.systems:
        args.systems.insert(0, "plain")
    if torch.cuda.is_available() and "nvrx" in args.systems:
        if "--systems" in sys.argv:
            parser.error("nvrx runs here on CPU only (gloo); leave it out on a GPU machine")
        args.systems.remove("nvrx")
    if args.nproc > 2 and "nvrx" in args.systems and "--systems" not in sys.argv:
        # its fault-free result at 4 ranks left plain DDP's at the second step (cause unknown)
        print("nvrx is left out: its peer is checked against plain DDP at 2 ranks only "
              "(name it in --systems to run it anyway)", file=sys.stderr)  # fmt: skip
        args.systems.remove("nvrx")
    device = "h200x" + str(torch.cuda.device_count()) if torch.cuda.is_available() else "cpu"
    if device == "cpu" and args.nproc != 2:
        device = f"cpu-{args.nproc}ranks"
    work = Path(tempfile.mkdtemp(prefix="xmig-compare-"))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results: list[tuple[argparse.Namespace, dict[tuple[str, str], Run]]] = []
    interrupted = None
    signal.signal(signal.SIGTERM, _interrupt)  # a time limit's SIGTERM: report what ran
    try:
        for model in args.models:
            workload = argparse.Namespace(**{**vars(args), "model": model})
            results.append((workload, {}))
            measure(workload, work, results[-1][1])
    except KeyboardInterrupt as exc:
        interrupted = str(exc) or "SIGINT"
        print(f"interrupted ({interrupted}): reporting the runs that finished", file=sys.stderr)
    lines = report(args, results, started, device, work)
    if interrupted:
        lines += ["", f"**Interrupted by {interrupted}**: rows with `-` were not run."]
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / f"compare-{device}.png"
    panels = [(f"{w.model}{' ' + w.preset if w.model == 'gpt' else ''}, {args.nproc} ranks, "
               f"{args.faults} kills",
               [runs[(s, f"{args.faults} faults")] for s in args.systems
                if (s, f"{args.faults} faults") in runs])
              for w, runs in results]  # fmt: skip
    if plot(panels, png):
        lines += ["", f"![steps completed against wall clock]({png.name})"]
    path = args.out / f"compare-{device}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}; runs in {work}")
    return 1 if interrupted else 0


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def measure(args: argparse.Namespace, work: Path, runs: dict[tuple[str, str], Run]) -> None:
    """Every system fault-free, with one kill and with ``args.faults`` kills, interleaved,
    into ``runs`` as they finish."""
    bench = Bench(args, work)
    runs[("plain", "fault-free")] = bench.run("plain", "fault-free")
    checkpointing = {"torchrun", "nvrx"} & set(args.systems)
    if args.checkpoint_every == 0 and checkpointing:  # the interval: saves cost ~2 % of a step
        plain = runs[("plain", "fault-free")]
        per_step = step_time(plain)
        if per_step is None:
            raise SystemExit(f"plain DDP gave no step time (exit {plain.exit_code}; see "
                             f"{plain.log}): no checkpoint interval can be chosen")  # fmt: skip
        # a few steps, each saving: a save of a large model takes seconds
        short = {"checkpoint_every": 1, "steps": min(args.steps, WARMUP_STEPS)}
        probe = Bench(argparse.Namespace(**{**vars(args), **short}), work)
        saving = probe.run("torchrun", "fault-free")
        cost = _save_seconds(work / f"{args.model}-torchrun-fault-free.saves.jsonl")
        if cost is None:
            raise SystemExit(f"the checkpoint probe recorded no save (exit {saving.exit_code}; "
                             f"see {saving.log}): pass --checkpoint-every")  # fmt: skip
        args.checkpoint_every = max(1, round(cost / (0.02 * per_step)))
        print(f"{args.model}: a checkpoint costs {cost * 1e3:.1f} ms, a step "
              f"{per_step * 1e3:.1f} ms: torchrun checkpoints every {args.checkpoint_every} "
              "steps", flush=True)  # fmt: skip
        bench = Bench(args, work)
    for scenario in ("fault-free", "one fault", f"{args.faults} faults"):
        for system in args.systems:  # interleaved: each scenario runs every system in turn
            if system == "plain" and scenario != "fault-free":
                continue  # nothing recovers it
            if (system, scenario) not in runs:
                runs[(system, scenario)] = bench.run(system, scenario)


def _save_seconds(saves: Path) -> float | None:
    if not saves.exists():
        return None
    seconds = [json.loads(line)["seconds"] for line in saves.read_text().splitlines() if line]
    return statistics.median(seconds) if seconds else None


def report(args: argparse.Namespace, results: list, started: str, device: str,
           work: Path) -> list[str]:  # fmt: skip
    described = {
        "xmig": "xmig: warm spares (`--hot-spares`, one per kill, as nvrx gets spare "
        "processes), replay.",
        "torchrun": "torchrun: `--max-restarts`, a checkpoint to local disk every K steps (K "
        "chosen so that saving costs about 2 % of step time, unless `--checkpoint-every` is "
        "given), reloaded on restart, `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`.",
        "torchft": "torchft: FT-DDP, one replica group per rank (`min_replica_size=1`), each "
        "under torchrun with `--max-restarts`, its lighthouse on localhost.",
        "nvrx": "nvrx: nvidia-resiliency-ext's `inprocess.Wrapper`, one spare process per "
        "kill (`FillGaps`, `MaxActiveWorldSize`), the training function called again in the "
        "same processes, reloading the checkpoint written every K steps (the same K as "
        "torchrun's).",
    }
    models = " and ".join(
        f"the demo GPT (`--preset {args.preset}`)" if m == "gpt" else "the demo's MLP"
        for m in args.models
    )
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        where = (f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}, one GPU per "
                 f"rank, NCCL {nccl}; {machine()}")  # fmt: skip
    else:
        where = f"{machine()}, gloo"
    lines = [
        f"# Side by side ({device})",
        "",
        f"Measured {started}: `python bench/compare.py {' '.join(sys.argv[1:])}` on {where}; "
        f"{versions()}. Workloads: {models}, `--batch-size {args.batch_size}`, "
        f"{args.nproc} ranks, {args.steps} steps, `--step-sleep {args.step_sleep}` in every "
        f"system; every fault is a SIGKILL of rank {args.kill_rank} mid-backward (one at step "
        f"{args.steps // 2}; for goodput, {args.faults} at fixed intervals). "
        + " ".join(described[s] for s in args.systems if s in described)
        + " The systems run in turn, scenario by scenario.",
        "",
        "| workload | system | step (ms) | vs plain DDP | survivor stall (s) | "
        "kill → full world (s) | steps lost (1 kill) | bit-identical | "
        f"goodput, {args.faults} kills (steps/s) | steps lost ({args.faults} kills) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, runs in results:
        lines += [_row(args, workload, runs, system) for system in args.systems]
    lines += [
        "",
        "How each column is read from the step lines every rank writes: step = median interval "
        "between rank 0's steps after the warm-up, fault-free run; survivor stall = the longest "
        "gap between two steps of the first surviving rank from its last step before the kill "
        "on; kill → full "
        "world = until a step has been finished by every rank with every rank's batch in it; "
        "steps lost = steps trained again after a rollback (torchrun, nvrx) plus steps trained "
        "without the killed rank's batch (torchft); bit-identical = the final parameters of "
        "both faulty runs equal to the fault-free run's (xmig, torchrun and nvrx against plain "
        "DDP's, torchft against its own); goodput = useful steps (one without a rank's batch "
        "counts by the share it trained) per second from launch to exit, start-up included.",
        "",
        "Exit codes: "
        + "; ".join(
            f"{w.model} " + ", ".join(f"{s}/{n}: {r.exit_code}" for (s, n), r in runs.items())
            for w, runs in results
        )
        + ".",  # fmt: skip
    ]
    spared = [
        f"{w.model} {n}: " + ", ".join(_recovery(r) for r in run.recoveries)
        for w, runs in results for (s, n), run in runs.items() if s == "xmig" and run.recoveries
    ]  # fmt: skip
    if spared:
        lines += ["", "xmig's recoveries (its own record, fault to the step trained again): "
                  + "; ".join(spared) + "."]  # fmt: skip
    return lines


def _recovery(record: dict) -> str:
    spare = all(record.get("from_spare") or [False])
    return f"{record['total_s']:.2f} s ({'hot spare' if spare else 'cold start'})"


def _row(args: argparse.Namespace, workload: argparse.Namespace,
         runs: dict[tuple[str, str], Run], system: str) -> str:  # fmt: skip
    """One system's line of the table; `-` where a run is missing (an interrupted
    comparison)."""
    name = f"{workload.model} {workload.preset}" if workload.model == "gpt" else "mlp"
    plain, free = runs.get(("plain", "fault-free")), runs.get((system, "fault-free"))
    base, ms = (step_time(plain) if plain else None), (step_time(free) if free else None)
    if system == "plain":
        return (
            f"| {name} | plain DDP (no fault tolerance) | {fmt(ms and ms * 1e3, 1)} | "
            f"1.000 | - | - | - | - | {fmt(free and goodput(free))} (no kills) | - |"
        )
    one = runs.get((system, "one fault"))
    many = runs.get((system, f"{args.faults} faults"))
    ratio = ms / base if ms and base else None
    kill = one.kills[0] if one and one.kills else None
    # the demo's own loop (plain, xmig, torchrun, nvrx) must end where plain DDP ends
    expected = plain if system != "torchft" else free
    faulty = [r for r in (one, many) if r is not None]
    if expected is None or expected.params is None or not faulty:
        same = "-"
    else:
        same = "yes" if all(r.params == expected.params for r in faulty) else "NO"
    label = (f"{system} (K={workload.checkpoint_every})" if system in ("torchrun", "nvrx")
             else system)  # fmt: skip
    return (
        f"| {name} | {label} | {fmt(ms and ms * 1e3, 1)} | {fmt(ratio, 3)} | "
        f"{fmt(survivor_stall(one, kill) if one and kill else None)} | "
        f"{fmt(back_to_full(one, kill) if one and kill else None)} | "
        f"{steps_lost(one) if one else '-'} | {same} | "
        f"{fmt(many and goodput(many))} ({len(many.kills) if many else '-'} kills) | "
        f"{steps_lost(many) if many else '-'} |"
    )


if __name__ == "__main__":
    sys.exit(main())
