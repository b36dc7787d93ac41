"""Live migration: downtime by phase against the size of the moved process (CPU or GPU).

    python bench/migration.py [--out bench/results/migration.md]          (root: CRIU, netns)
    python bench/migration.py --container ROOTFS     (each size bare, then in containers)
    NCCL_NVLS_ENABLE=0 XMIG_CRIU=… python bench/migration.py --gpu [--nnodes 4 --rank 3]

Runs the demo GPT on ``--nnodes`` simulated hosts of one rank each plus a spare one
(``--simulate-hosts``), moves ``--rank`` to the spare node at step 3 (``--inject
migrate:rank=R:step=3``) at several model sizes, and compares each run's final parameters with
the fault-free run's. On a GPU machine (``--gpu``) every node has a GPU of its own (the spare
node's is another GPU where the machine has one more than the job's nodes, else the first):
the moved process's GPU memory goes through the CUDA driver's checkpoint API. The results
file keeps its other sections: each label (``CPU``, ``GPU …``) rewrites only its own. With
``--container ROOTFS`` every size moves twice, a bare process and then a container of that
rootfs (``xmig run --container``), both against the same fault-free bare run. Every run is
bounded in time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from recovery_cpu import REPO, machine, xmig_summary

from xmig.launch.doctor import check_pipe_size, check_transparent_huge_pages
from xmig.migrate import criu_status

SIZES = {  # name: model flags (small batches: the point is the process's size, not speed)
    "tiny": ["--preset", "tiny"],
    "small": ["--preset", "small"],
    "gpt100m": ["--preset", "gpt100m", "--batch-size", "1", "--block-size", "64"],
}
GPU_SIZES = {
    "small": ["--preset", "small"],
    "gpt100m": ["--preset", "gpt100m", "--batch-size", "4"],
    "gpt350m": ["--preset", "gpt350m", "--batch-size", "4"],
    "gpt350m, batch 16": ["--preset", "gpt350m", "--batch-size", "16"],
    # 671 M parameters: its parameters, gradients, AdamW's state, DDP's buckets and the
    # replay log's copies (which a move drops) are ~16 GB of live tensors at a step
    # boundary (18 GB held)
    "gpt700m": ["--preset", "gpt350m", "--n-layer", "48", "--batch-size", "8"],
}
STEPS = 10
# a tiny model's steps take milliseconds: without a pause between them the job ends before
# the moving rank has made its room and every rank has paused
CPU_STEP_SLEEP_S = 0.1
GPU_STEPS = 20  # room for the moving rank to prepare (seconds at 18 GB) before the job ends
MOVE_AT = 3
RUN_TIMEOUT_S = 300


def replace_section(path: Path, label: str, section: list[str], title: str) -> None:
    """Write ``section`` (starting with its ``## label …`` heading) into the results file,
    in place of the old section of that label; other sections stay."""
    head, sections = [f"# {title}", ""], {}
    if path.exists():
        text = path.read_text()
        first, *rest = text.split("\n## ")
        head = first.rstrip("\n").splitlines() + [""]
        for chunk in rest:
            name = chunk.split("\n", 1)[0]
            sections[name.split(" (")[0]] = ["## " + chunk.rstrip("\n"), ""]
    sections[label] = [*section, ""]
    lines = head + [line for name in sections for line in sections[name]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip("\n") + "\n")
    print(f"wrote {path} (section {label!r})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "migration.md")
    parser.add_argument("--gpu", action="store_true", help="NCCL, one GPU per simulated host")
    parser.add_argument("--nnodes", type=int, default=2, help="nodes of one rank each")
    parser.add_argument("--rank", type=int, default=1, help="the rank that moves")
    parser.add_argument("--sizes", nargs="+", help="a subset of the model sizes, by name")
    parser.add_argument("--label", help="the results file's section (default: CPU or GPU)")
    parser.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S, help="per run, seconds")
    parser.add_argument(
        "--log-level",
        default="INFO",
        help="xmig's (DEBUG: the moving rank lists its largest mappings)",
    )
    parser.add_argument("--container", type=Path, metavar="ROOTFS",
                        help="move each size bare and as a container of ROOTFS")  # fmt: skip
    args = parser.parse_args()
    usable, detail = criu_status()
    if not usable:
        print(f"CRIU is not usable here: {detail}", file=sys.stderr)
        return 2
    # the machine's settings that a move's time depends on
    detail += "; huge pages " + check_transparent_huge_pages()[2].split(":")[0]
    detail += "; " + check_pipe_size()[2].split(":")[0]
    if args.gpu and not torch.cuda.is_available():
        print("--gpu: no CUDA device here", file=sys.stderr)
        return 2
    if not 0 <= args.rank < args.nnodes:
        print(f"--rank {args.rank}: the job has ranks 0..{args.nnodes - 1}", file=sys.stderr)
        return 2
    sizes = GPU_SIZES if args.gpu else SIZES
    unknown = sorted(set(args.sizes or []) - set(sizes))
    if unknown:
        print(f"unknown sizes {unknown}; known: {sorted(sizes)}", file=sys.stderr)
        return 2
    chosen = {name: sizes[name] for name in (args.sizes or sizes)}
    label = args.label or ("GPU" if args.gpu else "CPU")
    if args.container and not args.label:
        label += ", containers"
    command = "python bench/migration.py " + " ".join(sys.argv[1:])
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    work = Path(tempfile.mkdtemp(prefix="xmig-migration-"))
    layout = ["--nnodes", str(args.nnodes), "--nproc-per-node", "1", "--spare-nodes", "1",
              "--simulate-hosts", "--hot-spares", "0", "--log-level", args.log_level]  # fmt: skip
    rows = []
    steps = GPU_STEPS if args.gpu else STEPS
    script = [] if args.gpu else ["--step-sleep", str(CPU_STEP_SLEEP_S)]
    for name, model in chosen.items():
        slug = name.replace(", ", "-").replace(" ", "")
        try:
            reference = xmig_summary(work, f"{slug}-reference", steps, layout, script, model=model,
                                     nproc=1, timeout=args.timeout)  # fmt: skip
        except RuntimeError as exc:  # an overrun: said in the table
            rows.append((name, {"message": str(exc)}, None, False))
            print(name, exc, flush=True)
            break
        expected = reference["final_params_sha256"]
        kinds = [("bare", []), ("container", ["--container", str(args.container)])]
        failed = False
        for kind, extra in kinds if args.container else kinds[:1]:
            row = f"{name} ({kind})" if args.container else name
            flags = [*layout, *extra, "--inject", f"migrate:rank={args.rank}:step={MOVE_AT}"]
            try:
                moved = xmig_summary(work, f"{slug}-moved-{kind}", steps, flags, script,
                                     model=model, nproc=1, timeout=args.timeout)  # fmt: skip
            except RuntimeError as exc:
                rows.append((row, {"message": str(exc)}, None, False))
                failed = True
                break
            same = expected is not None and moved["final_params_sha256"] == expected
            record = moved["migrations"][0] if moved.get("migrations") else None
            rows.append((row, moved, record, same))
            print(row, record if record else moved["message"], same, flush=True)
            failed = failed or record is None or not same
        if failed:
            break  # the larger sizes would fail alike, and slower
    ok = all(r[2] is not None and r[3] for r in rows)
    done = {r[0].split(" (")[0] for r in rows}
    for name in chosen:
        if name not in done:
            rows.append((name, {"message": "not run: a smaller size failed"}, None, False))
    section = report(args, label, command, started, detail, rows)
    replace_section(args.out, label, section, "Live migration: downtime by phase")
    print(f"logs in {work}")
    return 0 if ok else 1


def report(args: argparse.Namespace, label: str, command: str, started: str, detail: str,
           rows: list) -> list[str]:  # fmt: skip
    where = machine()
    if args.gpu:
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        where += f"; {torch.cuda.device_count()} × {', '.join(names)}, NCCL {nccl}"
    lines = [
        f"## {label} (measured {started})",
        "",
        f"`{command}` as root; {where}; {detail}.",
        "",
        f"The demo GPT on {args.nnodes} simulated hosts (a network namespace each, one rank "
        f"each) plus a spare one; rank {args.rank} moves to the spare node at the start of step "
        f"{MOVE_AT}: every rank pauses at that boundary, the moving rank closes its agent "
        "connection, its agent checkpoints it with `criu dump --tcp-close`, the spare node's "
        "agent fetches the images and restores it (same PID, its own network namespace) and "
        "adopts it, it reconnects, and every rank resumes on a new communicator. No state pull "
        "and no replay. Seconds; downtime is from the pause boundary (of the rank that took "
        "longest to stop: `stop`, its communicator shut down and, on the moving rank, its tensors "
        "parked meanwhile, `park`) to every rank resumed; `quiesce`, the job training on to that "
        "boundary, is not downtime.",
        "",
    ]
    if args.container:
        lines += [
            f"Each size moves twice: a bare process, then a container of `{args.container}` "
            "(`xmig run --container`: every worker the init of a runc container of its own, "
            "in its node's network namespace). A container's agent checkpoints it whole with "
            "`runc checkpoint` (xmig's CRIU, connections closed, no network lock) and the "
            "target's restores it under the same ID with `runc restore`; the worker keeps its "
            "PID inside (1), the host's PID of it changes. Both moves end with the fault-free "
            "bare run's parameters.",
            "",
        ]
    lines += [
        "The moving rank first makes room outside its process for its tensors while the job "
        "still trains (`prepare`: a file in `/dev/shm`, mapped shared; on a GPU registered "
        "with CUDA). At the pause it copies its registered state and the tensors its "
        "communication log holds (DDP's gradient buckets; the log's copies of the steps "
        "before the pause it drops once every rank has paused) into it and frees them (`park`); "
        "CRIU keeps the file's mapping by reference, so neither the images nor the GPU "
        "checkpoint carry those bytes. Restored, it allocates them again and copies them back "
        "(`unpark`; on a GPU the file is registered again chunk by chunk, the copies of one "
        "chunk running while the next is registered). A target on another machine gets the "
        "file streamed beside the images.",
        "",
    ]
    if args.gpu:
        lines += [
            "On GPU, every rank shuts its NCCL communicator down at the pause; the moving rank "
            "empties PyTorch's cache of free GPU blocks; its agent locks its CUDA calls and "
            "checkpoints what is left of its GPU memory into its host memory through the "
            "driver's API (`cuCheckpointProcessLock`, `cuCheckpointProcessCheckpoint`) before "
            "the CRIU dump; the spare node's agent restores it onto the spare node's GPU "
            "(`cuCheckpointProcessRestore` with the old/new GPU UUID pairs where the GPU "
            "changes, then `Unlock`). NCCL keeps the address of the interface it found at its "
            "first use, so every rank has an interface of its own (`xr<rank>`, "
            "NCCL_SOCKET_IFNAME), which moves into the target node's namespace with the rank. "
            "Held: the GPU memory the rank held at the pause; parked: what went through the "
            "file (and the replay log's copies dropped instead); driver: what the driver's "
            "checkpoint moved (NVML). Goals: ≤ 1.5 s of "
            "downtime at about 1.3 GB held, ≤ 5 s at about 18 GB.",
            "",
            "| model | held | parked | driver | image | prepare | quiesce | stop (park) | "
            "GPU checkpoint | dump | transfer | restore | GPU restore | unpark | rejoin | "
            "downtime | goal | same PID | bit-identical |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    else:
        lines += [
            "| model | parked | image | prepare | quiesce | stop (park) | dump | transfer | "
            "restore | unpark | rejoin | downtime | same PID | bit-identical |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for name, moved, record, same in rows:
        if record is None:
            blanks = "|" * (18 if args.gpu else 13)
            lines.append(f"| {name} | not migrated: {moved['message']} {blanks}")
            continue
        p = record["phases"]
        kept, identical = ("yes" if record["pid_kept"] else "NO"), ("yes" if same else "NO")
        parked = f"{record.get('parked_bytes', 0) / 1e9:.2f} GB"
        if record.get("prepare_error"):
            parked = f"none ({record['prepare_error']})"
        if record.get("dropped_bytes"):  # the replay log's copies, not moved at all
            parked += f" ({record['dropped_bytes'] / 1e9:.2f} GB of log copies dropped)"
        if args.gpu:
            held = record.get("held_bytes") or record.get("gpu_bytes", 0)
            goal = "—"
            if held <= 2e9 or held >= 15e9:
                limit = 1.5 if held <= 2e9 else 5.0
                met = "met" if record["downtime_s"] <= limit else "not met"
                goal = f"{limit:.1f} ({met})"
            lines.append(
                f"| {name} | {held / 1e9:.2f} GB | {parked} | "
                f"{record.get('gpu_bytes', 0) / 1e9:.2f} GB | "
                f"{record['image_bytes'] / 1e9:.2f} GB | {p['prepare']:.3f} | "
                f"{p['quiesce']:.3f} | {p['stop']:.3f} ({p['park']:.3f}) | "
                f"{p['gpu_checkpoint']:.3f} | "
                f"{p['dump']:.3f} | {p['transfer']:.3f} | {p['restore']:.3f} | "
                f"{p['gpu_restore']:.3f} | {p['unpark']:.3f} | {p['rejoin']:.3f} | "
                f"**{record['downtime_s']:.2f}** | {goal} | {kept} | {identical} |"
            )
        else:
            lines.append(
                f"| {name} | {parked} | {record['image_bytes'] / 1e6:.0f} MB | "
                f"{p['prepare']:.3f} | {p['quiesce']:.3f} | {p['stop']:.3f} ({p['park']:.3f}) | "
                f"{p['dump']:.3f} | {p['transfer']:.3f} | {p['restore']:.3f} | "
                f"{p['unpark']:.3f} | {p['rejoin']:.3f} | **{record['downtime_s']:.2f}** | "
                f"{kept} | {identical} |"
            )
    accounts = [(name, record) for name, _, record, _ in rows if record is not None]
    if accounts:
        lines += ["", "CRIU's own account of each move (its `stats-dump` and `stats-restore` "
                  "images): the dump's frozen time, of which collecting and writing the memory, "
                  "and the restore's time to the tree's resumption:", ""]  # fmt: skip
    for name, record in accounts:
        dump, restore = record.get("criu_dump_stats", {}), record.get("criu_restore_stats", {})
        lines.append(
            f"- {name}: dump frozen {dump.get('frozen_s', 0):.3f} s (memory "
            f"{dump.get('memdump_s', 0):.3f} s, writing {dump.get('memwrite_s', 0):.3f} s, "
            f"{dump.get('pages_written', 0):.0f} pages); restore "
            f"{restore.get('restore_s', 0):.3f} s ({restore.get('pages_restored', 0):.0f} pages)"
        )
        steps = [(side, record.get(f"{side}_steps") or {}) for side in ("dump", "restore")]
        if any(done for _, done in steps):
            lines.append("  - the agents' steps: " + "; ".join(
                f"{side}: " + ", ".join(f"{k} {v:.3f}" for k, v in done.items())
                for side, done in steps if done))  # fmt: skip
    lines += [
        "",
        "Transfer: the target node's agent fetches the images from the source node's agent "
        "over TCP (the job's token, `sendfile`), between the two network namespaces; with "
        "`XMIG_MIGRATE_DIR` set (a directory both read) it is 0.",
    ]
    return lines


def short(uuid: str | None) -> str:
    return uuid[:12] if uuid else "?"


if __name__ == "__main__":
    sys.exit(main())
