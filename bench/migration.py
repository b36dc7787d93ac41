"""Live migration on CPU: downtime by phase against the size of the moved process.

    python bench/migration.py [--out bench/results/migration.md]   (root: CRIU, namespaces)

Runs the demo GPT on 2 simulated hosts plus a spare one (``--simulate-hosts``), moves rank 1
to the spare node at step 3 (``--inject migrate:rank=1:step=3``) at several model sizes, and
compares each run's final parameters with the fault-free run's. Every run is bounded in time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from recovery_cpu import REPO, machine, write_report, xmig_summary

from xmig.migrate import criu_status

SIZES = {  # name: model flags (small batches: the point is the process's size, not speed)
    "tiny": ["--preset", "tiny"],
    "small": ["--preset", "small"],
    "gpt100m": ["--preset", "gpt100m", "--batch-size", "1", "--block-size", "64"],
}
STEPS = 5
LAYOUT = ["--nnodes", "2", "--nproc-per-node", "1", "--spare-nodes", "1", "--simulate-hosts",
          "--hot-spares", "0"]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "migration.md")
    args = parser.parse_args()
    usable, detail = criu_status()
    if not usable:
        print(f"CRIU is not usable here: {detail}", file=sys.stderr)
        return 2
    command = "python bench/migration.py " + " ".join(sys.argv[1:])
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    work = Path(tempfile.mkdtemp(prefix="xmig-migration-"))
    rows = []
    for name, model in SIZES.items():
        reference = xmig_summary(work, f"{name}-reference", STEPS, LAYOUT, [], model=model)
        flags = [*LAYOUT, "--inject", "migrate:rank=1:step=3"]
        moved = xmig_summary(work, f"{name}-moved", STEPS, flags, [], model=model)
        expected = reference["final_params_sha256"]
        same = expected is not None and moved["final_params_sha256"] == expected
        record = moved["migrations"][0] if moved["migrations"] else None
        rows.append((name, moved, record, same))
        print(name, record["downtime_s"] if record else moved["message"], same, flush=True)
    lines = [
        "# Live migration: downtime by phase",
        "",
        f"## CPU (measured {started})",
        "",
        f"`{command}` as root; {machine()}; {detail}.",
        "",
        "The demo GPT on 2 simulated hosts (a network namespace each) plus a spare one; rank 1 "
        "moves to the spare node at the start of step 3: every rank pauses at that boundary, "
        "rank 1 closes its agent connection, its agent checkpoints it with `criu dump "
        "--tcp-close`, the spare node's agent fetches the images and restores it (same PID, "
        "its own network namespace) and adopts it, it reconnects, and every rank resumes on a "
        "new "
        "communicator. No state pull and no replay. Seconds; downtime is from every rank "
        "paused to every rank resumed.",
        "",
        "| model | image | quiesce | dump | transfer | restore | rejoin | downtime | same PID | "
        "bit-identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, moved, record, same in rows:
        if record is None:
            lines.append(f"| {name} | not migrated: {moved['message']} |||||||||")
            continue
        p = record["phases"]
        lines.append(
            f"| {name} | {record['image_bytes'] / 1e6:.0f} MB | {p['quiesce']:.3f} | "
            f"{p['dump']:.3f} | {p['transfer']:.3f} | {p['restore']:.3f} | {p['rejoin']:.3f} | "
            f"**{record['downtime_s']:.2f}** | {'yes' if record['pid_kept'] else 'NO'} | "
            f"{'yes' if same else 'NO'} |"
        )
    lines += [
        "",
        "Transfer: the target node's agent fetches the images from the source node's agent "
        "over TCP (the job's token, `sendfile`), between the two network namespaces; with "
        "`XMIG_MIGRATE_DIR` set (a directory both read) it is 0.",
        "",
    ]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
