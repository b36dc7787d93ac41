"""Moves of one rank under several variants (code trees, environment, kernel settings), in
ABBA order, each against the first variant's move beside it (CPU or GPU).

    python bench/move_pairs.py --variant now \\
        --variant before src=/tmp/old/src remove=/run/criu.kdat \\
        --variant unwoken env:XMIG_NCCL_WAKE=0 \\
        --variant pipes sysctl:fs.pipe-max-size=4194304 \\
        [--gpu] [--size small] [--rounds 2] [--budget 480] [--out F.md] [--jsonl F]

A variant is a name, then any of: ``src=PATH`` (the ``src`` folder of another xmig, through
``PYTHONPATH``), ``env:KEY=VALUE`` (the job's environment), ``sysctl:KEY=VALUE`` (set
before each of its moves, put back after), ``remove=PATH`` (a file removed before each of
its moves: a cache that an older tree would not have made). One fault-free run of the
first variant gives the final parameters every move must end with. The moves run in the
order A B C … C B A, ``--rounds`` times, and no move starts after ``--budget`` seconds. Each
move is a job of one rank on a simulated host moving to a spare one at step 3, as in
``bench/migration.py`` (root: CRIU and network namespaces). The table gives each variant's
downtime and phases (medians, and the range), and its paired ratio: each of its moves
against the first variant's nearest move in the order.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from migration import CPU_STEP_SLEEP_S, GPU_SIZES, GPU_STEPS, MOVE_AT, SIZES, STEPS
from recovery_cpu import machine, xmig_summary

from xmig.launch.doctor import check_pipe_size, check_transparent_huge_pages
from xmig.migrate import criu_status


@dataclass(frozen=True)
class Variant:
    name: str
    src: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    sysctl: dict[str, str] = field(default_factory=dict)
    remove: tuple[str, ...] = ()


def parse_variant(tokens: list[str]) -> Variant:
    """``NAME [src=PATH] [env:K=V] [sysctl:K=V] [remove=PATH] …`` as a variant."""
    if not tokens or "=" in tokens[0] or ":" in tokens[0]:
        raise ValueError(f"a variant starts with its name: {' '.join(tokens)!r}")
    src, env, sysctl, remove = None, {}, {}, []
    for token in tokens[1:]:
        kind, sep, rest = token.partition(":") if token.startswith(("env:", "sysctl:")) \
            else token.partition("=")  # fmt: skip
        if kind in ("env", "sysctl"):
            key, eq, value = rest.partition("=")
            if not key or not eq:
                raise ValueError(f"{token!r}: expected {kind}:KEY=VALUE")
            (env if kind == "env" else sysctl)[key] = value
        elif kind == "src" and sep and rest:
            src = rest
        elif kind == "remove" and sep and rest:
            remove.append(rest)
        else:
            raise ValueError(f"{token!r}: expected src=, env:, sysctl: or remove=")
    return Variant(tokens[0], src, env, sysctl, tuple(remove))


def abba_order(names: list[str], rounds: int) -> list[str]:
    """The variants in the order A B … B A, ``rounds`` times."""
    return [name for _ in range(rounds) for name in (*names, *reversed(names))]


def paired_ratios(moves: list[dict], baseline: str, key: str = "downtime_s") -> dict[str, list]:
    """For each variant but ``baseline``: each of its moves' ``key`` against the baseline's
    move nearest to it in the order (the earlier one on a tie)."""
    base = [(i, m[key]) for i, m in enumerate(moves) if m["variant"] == baseline and key in m]
    ratios: dict[str, list[float]] = {}
    if not base:
        return ratios
    for i, move in enumerate(moves):
        if move["variant"] == baseline or key not in move:
            continue
        _, nearest = min(base, key=lambda b: (abs(b[0] - i), b[0]))
        ratios.setdefault(move["variant"], []).append(move[key] / nearest)
    return ratios


def sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


LAYOUT = ["--nnodes", "1", "--nproc-per-node", "1", "--spare-nodes", "1", "--simulate-hosts",
          "--hot-spares", "0"]  # fmt: skip


def run_job(work: Path, name: str, variant: Variant, model: list[str], gpu: bool,
            timeout: float, extra: list[str]) -> dict:  # fmt: skip
    """One job of one rank on a simulated host and a spare one, with ``variant``'s code and
    environment; its summary."""
    env = dict(os.environ)
    if variant.src:
        env["PYTHONPATH"] = variant.src
    env.update(variant.env)
    script = [] if gpu else ["--step-sleep", str(CPU_STEP_SLEEP_S)]
    return xmig_summary(work, name, GPU_STEPS if gpu else STEPS, [*LAYOUT, *extra], script,
                        model=model, nproc=1, timeout=timeout, env=env)  # fmt: skip


def one_move(work: Path, variant: Variant, index: int, model: list[str], gpu: bool,
             timeout: float) -> dict:  # fmt: skip
    """Move the rank once under ``variant`` (its files removed and its kernel settings made
    first, those put back after); what the migration's record says."""
    for path in variant.remove:
        Path(path).unlink(missing_ok=True)
    saved = {key: sysctl_path(key).read_text().strip() for key in variant.sysctl}
    try:
        for key, value in variant.sysctl.items():
            sysctl_path(key).write_text(value)
        summary = run_job(work, f"move{index}-{variant.name}", variant, model, gpu, timeout,
                          ["--inject", f"migrate:rank=0:step={MOVE_AT}"])  # fmt: skip
    finally:
        for key, value in saved.items():
            sysctl_path(key).write_text(value)
    record = (summary.get("migrations") or [None])[0]
    return {"record": record, "final_params_sha256": summary.get("final_params_sha256")}


def flatten(record: dict) -> dict[str, float]:
    """The numbers of a migration's record worth comparing, by name."""
    row = {"downtime_s": record["downtime_s"], "image_gb": record["image_bytes"] / 1e9}
    row.update({k: v for k, v in record["phases"].items() if isinstance(v, float | int)})
    for side in ("dump_steps", "restore_steps"):
        for key, value in (record.get(side) or {}).items():
            row[f"{side.split('_')[0]}.{key}"] = value
    for side in ("criu_dump_stats", "criu_restore_stats"):
        for key, value in (record.get(side) or {}).items():
            row[f"{side.removeprefix('criu_').split('_')[0]}.{key}"] = value
    return row


def spread(values: list[float], digits: int = 3) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def report(variants: list[Variant], moves: list[dict], header: str) -> list[str]:
    names = [v.name for v in variants]
    keys = ["downtime_s", "stop", "gpu_checkpoint", "dump", "restore", "gpu_restore",
            "dump.frozen_s", "dump.memdump_s", "dump.memwrite_s", "restore.restore_s",
            "image_gb"]  # fmt: skip
    present = [k for k in keys if any(k in m for m in moves)]
    lines = [header, "", "| variant | moves | same PID, bit-identical | " +
             " | ".join(present) + " |", "|---" * (len(present) + 3) + "|"]  # fmt: skip
    for name in names:
        mine = [m for m in moves if m["variant"] == name]
        ok = sum(1 for m in mine if m["pid_kept"] and m["identical"])
        cells = [spread([m[k] for m in mine if k in m]) for k in present]
        lines.append(f"| {name} | {len(mine)} | {ok} of {len(mine)} | " + " | ".join(cells) + " |")
    lines += ["", f"Paired against `{names[0]}` (each move over its nearest `{names[0]}` move; "
              "median, range):", ""]  # fmt: skip
    for key in ("downtime_s", "dump", "restore", "stop"):
        ratios = paired_ratios(moves, names[0], key)
        text = ", ".join(f"`{n}` {spread(r)}" for n, r in ratios.items())
        if text:
            lines.append(f"- {key}: {text}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variant",
        nargs="+",
        action="append",
        required=True,
        metavar="NAME [SETTING]",
        help="see above; the first is the baseline",
    )
    parser.add_argument("--gpu", action="store_true", help="NCCL, the rank on the GPU")
    parser.add_argument("--size", default="small", help="the model, as bench/migration.py's")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget", type=float, default=480.0,
                        help="seconds after which no move starts")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=120.0, help="per job, seconds")
    parser.add_argument("--out", type=Path, help="a Markdown file for the table")
    parser.add_argument("--jsonl", type=Path, help="every move's record, one line each")
    args = parser.parse_args()
    try:
        variants = [parse_variant(tokens) for tokens in args.variant]
    except ValueError as exc:
        parser.error(str(exc))
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        parser.error(f"variant names repeat: {names}")
    sizes = GPU_SIZES if args.gpu else SIZES
    if args.size not in sizes:
        parser.error(f"unknown size {args.size!r}; known: {sorted(sizes)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    usable, detail = criu_status()
    if not usable:
        print(f"CRIU is not usable here: {detail}", file=sys.stderr)
        return 2
    model = sizes[args.size]
    work = Path(tempfile.mkdtemp(prefix="xmig-move-pairs-"))
    started = time.monotonic()
    by_name = {v.name: v for v in variants}
    try:
        fault_free = run_job(work, "reference", variants[0], model, args.gpu, args.timeout, [])
    except (RuntimeError, OSError, json.JSONDecodeError) as exc:
        print(f"the fault-free run failed: {exc} (logs in {work})", file=sys.stderr)
        return 1
    expected = fault_free.get("final_params_sha256")
    print(f"reference: {expected}", flush=True)
    moves: list[dict] = []
    for index, name in enumerate(abba_order(names, args.rounds)):
        if time.monotonic() - started > args.budget:
            print(f"budget of {args.budget:.0f} s spent: {len(moves)} moves", flush=True)
            break
        try:
            done = one_move(work, by_name[name], index, model, args.gpu, args.timeout)
        except (RuntimeError, OSError, json.JSONDecodeError) as exc:
            print(f"{index} {name}: failed: {exc}", flush=True)
            moves.append({"variant": name, "pid_kept": False, "identical": False})
            continue
        record = done["record"]
        if record is None:
            print(f"{index} {name}: no migration in the summary", flush=True)
            moves.append({"variant": name, "pid_kept": False, "identical": False})
            continue
        row = {"variant": name, "pid_kept": bool(record["pid_kept"]),
               "identical": expected is not None and done["final_params_sha256"] == expected,
               **flatten(record)}  # fmt: skip
        moves.append(row)
        print(f"{index} {name}: downtime {row['downtime_s']:.3f} s, same PID "
              f"{row['pid_kept']}, bit-identical {row['identical']}", flush=True)  # fmt: skip
        if args.jsonl:
            with args.jsonl.open("a") as out:
                out.write(json.dumps({"variant": name, "record": record}) + "\n")
    settings = (f"huge pages {check_transparent_huge_pages()[2].split(':')[0]}; "
                f"{check_pipe_size()[2].split(':')[0]}")  # fmt: skip
    header = (f"`python bench/move_pairs.py {' '.join(sys.argv[1:])}` on {machine()}; "
              f"{detail}; {settings}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
              f"Variants: " + "; ".join(
                  f"`{v.name}`" + (f" src {v.src}" if v.src else "")
                  + "".join(f" {k}={x}" for k, x in {**v.env, **v.sysctl}.items())
                  for v in variants) + ". Seconds.")  # fmt: skip
    lines = report(variants, moves, header)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    print(f"logs in {work}")
    good = [m for m in moves if m["pid_kept"] and m["identical"]]
    return 0 if moves and len(good) == len(moves) else 1


if __name__ == "__main__":
    sys.exit(main())
