"""The demo GPT under torchft's fault-tolerant DDP: one process per replica group.

    torchrun --nproc-per-node 1 --max-restarts 1 … bench/peers/torchft_ddp.py --preset tiny …
      (env: REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE)

Each replica group trains the demo's model on the demo's synthetic batches for its index (the
batches rank ``REPLICA_GROUP_ID`` gets in the demo), with torchft's ``Manager`` (a quorum per
step through the lighthouse), its ``DistributedDataParallel`` and ``Optimizer`` wrappers over
a gloo process group. When a replica group dies, the others go on without it (its batches are
not trained); torchrun restarts it, and it fetches the weights from a live replica. One JSON
line per step (``--events-file``: rank, step, wall clock, participants, whether the step was
committed) and, at the end, the parameters' SHA-256 (``final params sha256 …``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from demo import demo_module


def start_together(directory: Path, group: int, groups: int, limit_s: float = 300.0) -> None:
    """Wait until every replica group has reached this point (a file each in ``directory``).
    Without it, a group whose start-up is seconds faster forms a quorum of one
    (``min_replica_size=1``) and trains alone before the other joins."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"ready-{group}").touch()
    deadline = time.monotonic() + limit_s
    while len(list(directory.glob("ready-*"))) < groups:
        if time.monotonic() > deadline:
            raise SystemExit(f"replica group {group}: the other groups were not ready in "
                             f"{limit_s:.0f} s")  # fmt: skip
        time.sleep(0.01)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--model", choices=["gpt", "mlp"], default="gpt")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--events-file")
    parser.add_argument("--start-barrier", metavar="DIR",
                        help="the replica groups' first attempts start training together: "
                             "each waits here until every group has its model")  # fmt: skip
    parser.add_argument("--die-at", metavar="GROUP:STEP", action="append", default=[],
                        help="SIGKILL mid-backward; the i-th in the i-th attempt")  # fmt: skip
    args = parser.parse_args()

    from torchft import (
        DistributedDataParallel,
        Manager,
        Optimizer,
        ProcessGroupGloo,
        ProcessGroupNCCL,
    )

    from xmig.state import reseed

    demo = demo_module()  # before CUDA starts: it sets cuBLAS's deterministic workspace
    group = int(os.environ["REPLICA_GROUP_ID"])
    groups = int(os.environ["NUM_REPLICA_GROUPS"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    gpu = torch.cuda.is_available()  # one GPU per replica group (CUDA_VISIBLE_DEVICES)
    if gpu:
        torch.cuda.set_device(0)
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    model, batch = demo.build_model(args.model, args.preset, args.seed, args.batch_size,
                                    "cuda:0" if gpu else "cpu")  # fmt: skip

    if args.start_barrier and attempt == 0:
        start_together(Path(args.start_barrier), group, groups)
    timeout = timedelta(seconds=10)
    pg = ProcessGroupNCCL(timeout=timeout) if gpu else ProcessGroupGloo(timeout=timeout)
    optimizer_holder: list[torch.optim.Optimizer] = []

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer_holder[0].load_state_dict(state["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer_holder[0].state_dict()}

    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica{group}",
        timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=60),
    )
    ddp = DistributedDataParallel(manager, model)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    optimizer_holder.append(inner)
    optimizer = Optimizer(manager, inner)

    die = None
    if attempt < len(args.die_at):
        die_group, die_step = (int(x) for x in args.die_at[attempt].split(":"))
        die = die_step if die_group == group else None
    events = open(args.events_file, "a", buffering=1) if args.events_file else None  # noqa: SIM115
    trainable = [p for p in model.parameters() if p.requires_grad]

    def hook(_param: torch.Tensor) -> None:
        if die is not None and manager.current_step() == die:
            if events is not None:
                events.write(json.dumps({"rank": group, "kill": die, "t": time.time()}) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)

    trainable[len(trainable) // 2].register_post_accumulate_grad_hook(hook)
    while manager.current_step() < args.steps:
        step = manager.current_step()
        reseed(args.seed, group, step)  # dropout draws as in the demo
        optimizer.zero_grad(set_to_none=True)
        x, y = batch(step, group)
        loss = ddp(x, y)
        loss.backward()
        optimizer.step()  # skipped when the quorum did not commit: the step is tried again
        committed = manager.current_step() > step
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if events is not None:
            record = {
                "rank": group,
                "step": step,
                "t": time.time(),
                "attempt": attempt,
                "participants": manager.num_participants(),
                "committed": bool(committed),
            }
            events.write(json.dumps(record) + "\n")
    from xmig.state.fingerprint import params_sha256

    print(f"[replica{group}] {args.steps} steps, loss {loss.item():.4f}; final params sha256 "
          f"{params_sha256(model)}", flush=True)  # fmt: skip
    manager.shutdown(wait=False)
    return 0 if groups > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
