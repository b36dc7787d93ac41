"""Stand-ins for Slurm's ``scontrol`` and ``srun`` on simulated hosts (``tests/hosts_harness``).

``fake_slurm.py scontrol show hostnames LIST`` prints LIST's hosts, one a line (a comma-separated
list: the test's nodes are named by their addresses). ``fake_slurm.py srun [OPTIONS] COMMAND
[ARGS...]`` runs COMMAND once per node of ``$FAKE_SLURM`` (a JSON file: ``nodes``, each with its
``netns`` path and ``env``; ``log_dir``), each in its node's network namespace with the
environment srun gives a task (``SLURM_NODEID``, ``SLURM_PROCID``, ...), writes what it was
asked to run in ``srun.json`` and each node's output and exit code in ``node<I>.log`` and
``codes.json``, and exits with the highest exit code, as srun does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from xmig.launch.hosts import enter_netns

# the srun options the batch script may give, each as --name=value or a flag
FLAGS = {"--no-kill"}


def scontrol(args: list[str]) -> int:
    if args[:2] != ["show", "hostnames"] or len(args) != 3:
        print(f"fake scontrol: only `show hostnames LIST`, got {args}", file=sys.stderr)
        return 2
    if "[" in args[2]:
        print("fake scontrol: a comma-separated list only", file=sys.stderr)
        return 2
    # a line at a time, as a long list comes: a reader that stops early (`| head -n 1`)
    # ends this one by SIGPIPE, as it would end scontrol
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    for name in args[2].split(","):
        print(name, flush=True)
        time.sleep(0.05)
    return 0


def srun(args: list[str]) -> int:
    config = json.loads(Path(os.environ["FAKE_SLURM"]).read_text())
    nodes, log_dir = config["nodes"], Path(config["log_dir"])
    options: dict[str, str | None] = {}
    while args and args[0].startswith("-"):
        name, sep, value = args.pop(0).partition("=")
        if not sep and name not in FLAGS:
            print(f"fake srun: give {name} as {name}=VALUE", file=sys.stderr)
            return 2
        options[name] = value if sep else None
    if not args:
        print("fake srun: no command", file=sys.stderr)
        return 2
    if options.get("--nodes", str(len(nodes))) != str(len(nodes)):
        print(f"fake srun: --nodes={options['--nodes']}, the allocation has {len(nodes)}",
              file=sys.stderr)  # fmt: skip
        return 2
    (log_dir / "srun.json").write_text(json.dumps({"options": options, "command": args}))
    procs = []
    for index, node in enumerate(nodes):
        env = {**os.environ, **node["env"], "SLURM_NODEID": str(index),
               "SLURM_PROCID": str(index), "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
               "SLURM_STEP_NUM_NODES": str(len(nodes)),
               "SLURMD_NODENAME": node["name"]}  # fmt: skip
        with open(log_dir / f"node{index}.log", "w") as log:
            procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          preexec_fn=enter_netns(node["netns"])))  # fmt: skip

    def forward(signum: int, _frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, forward)
    codes = [proc.wait() for proc in procs]
    (log_dir / "codes.json").write_text(json.dumps(codes))
    return max(code if code >= 0 else 128 - code for code in codes)


if __name__ == "__main__":
    tool, rest = sys.argv[1], sys.argv[2:]
    sys.exit(scontrol(rest) if tool == "scontrol" else srun(rest))
