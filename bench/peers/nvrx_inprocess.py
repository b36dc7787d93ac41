"""The demo under NVIDIA's in-process restart (nvidia-resiliency-ext's ``inprocess.Wrapper``).

    RANK=r WORLD_SIZE=N+S MASTER_ADDR=… MASTER_PORT=… python bench/peers/nvrx_inprocess.py \\
        --active N --store-port P …       (one process per rank, S of them spares)

The usual pattern with it: the training function is wrapped; when a rank fails (here: its
process is SIGKILLed mid-backward), every live rank abandons the call, a spare process takes
the dead rank's place (``FillGaps``, then ``MaxActiveWorldSize(N)``), and the function is
called again in the same processes: it builds a new process group under a new store prefix and
reloads the last checkpoint, which rank 0 writes to local disk every K steps. Step lines as the
demo writes them (``--events-file``) and, at the end, the parameters' SHA-256.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from demo import demo_module
from torch.nn.parallel import DistributedDataParallel

_STORE: list[Any] = []  # the function's own store, made once per process


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--active", type=int, required=True, help="ranks that train")
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--model", choices=["gpt", "mlp"], default="gpt")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--events-file")
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--checkpoint-every", type=int, default=1)
    parser.add_argument("--die-at", metavar="RANK:STEP", action="append", default=[],
                        help="that active rank dies mid-backward, in restart i")  # fmt: skip
    return parser.parse_args()


def train(args: argparse.Namespace, demo: Any, call_wrapper: Any = None) -> None:
    from xmig.state import params_sha256, reseed

    iteration = call_wrapper.iteration if call_wrapper is not None else 0
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not _STORE:
        initial = int(os.environ.get("XMIG_PEER_INITIAL_RANK", "-1"))
        _STORE.append(dist.TCPStore(os.environ["MASTER_ADDR"], args.store_port,
                                    is_master=initial == 0, multi_tenant=True,
                                    timeout=datetime.timedelta(seconds=60)))  # fmt: skip
    store = dist.PrefixStore(f"iteration{iteration}", _STORE[0])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))  # fmt: skip
    torch.manual_seed(args.seed)
    model, batch = demo.build_model(args.model, args.preset, args.seed, args.batch_size)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    checkpoint = demo.Checkpoint(args.checkpoint_dir, args.checkpoint_every)
    start = checkpoint.load(model, optimizer, torch.device("cpu"))
    dies = None
    if iteration < len(args.die_at):
        die_rank, die_step = (int(x) for x in args.die_at[iteration].split(":"))
        dies = die_step if die_rank == rank else None
    events = open(args.events_file, "a", buffering=1) if args.events_file else None  # noqa: SIM115
    current = [start]

    def hook(_param: torch.Tensor) -> None:
        if dies is not None and current[0] == dies:
            if events is not None:
                events.write(json.dumps({"rank": rank, "kill": dies, "t": time.time()}) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)

    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable[len(trainable) // 2].register_post_accumulate_grad_hook(hook)
    for step in range(start, args.steps):
        current[0] = step
        reseed(args.seed, rank, step)
        demo.train_step(ddp, optimizer, *batch(step, rank), args.step_sleep)
        checkpoint.after_step(step, model, optimizer, rank)
        if events is not None:
            events.write(json.dumps({"rank": rank, "step": step, "t": time.time(),
                                     "attempt": iteration}) + "\n")  # fmt: skip
    if rank == 0:
        print(f"final params sha256 {params_sha256(model)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    args = parse_args()
    from nvidia_resiliency_ext import inprocess
    from nvidia_resiliency_ext.inprocess import rank_assignment

    os.environ["XMIG_PEER_INITIAL_RANK"] = os.environ["RANK"]
    demo = demo_module()
    wrapper = inprocess.Wrapper(
        # a spare fills the dead rank's place; ranks past ``--active`` wait as spares
        rank_assignment=inprocess.Compose(
            rank_assignment.MaxActiveWorldSize(args.active), rank_assignment.FillGaps()
        ),
        monitor_thread_interval=datetime.timedelta(seconds=0.1),
        monitor_process_interval=datetime.timedelta(seconds=0.1),
        heartbeat_interval=datetime.timedelta(seconds=0.2),
        heartbeat_timeout=datetime.timedelta(seconds=2),
        progress_watchdog_interval=datetime.timedelta(seconds=0.1),
        last_call_wait=datetime.timedelta(seconds=0.1),
        termination_grace_time=datetime.timedelta(seconds=1),
        soft_timeout=datetime.timedelta(seconds=30),
        hard_timeout=datetime.timedelta(seconds=45),
        barrier_timeout=datetime.timedelta(seconds=60),
        completion_timeout=datetime.timedelta(seconds=60),
    )

    def wrapped(call_wrapper=None) -> None:  # noqa: ANN001
        train(args, demo, call_wrapper)

    # the wrapper hands itself to the parameter annotated with its class: a real class here,
    # where this module's annotations are strings
    wrapped.__annotations__["call_wrapper"] = inprocess.CallWrapper
    wrapper(wrapped)()
    return 0


if __name__ == "__main__":
    sys.exit(main())
