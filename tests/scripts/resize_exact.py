"""A job whose every number is exact in floating point, so its final weight can be told in
advance whatever the world size: one weight w, SGD with lr 1, the loss w * x averaged over
each step's global batch of the samples 0, 1, 2, ... in order (``session.shards``, no
shuffle). The gradient is the batch's mean, a multiple of 0.5; every partial sum and mean on
the way (a rank's share of 2 or 3, DDP's average over 2 or 3 ranks) is exact. So each step
takes w down by the mean of its samples, and a run that skips, repeats or misweighs a sample,
or averages over the wrong number of ranks after a resize, ends with another weight.

``--out FILE``: rank 0 writes the final weight and the world size it ended at.
``--fail-new-rank R``: the first process started later as rank R (a grow's new rank) exits
before it joins, as one on a node that cannot run the job would.
"""

import argparse
import json
import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel

import xmig

BATCH = 6  # divides evenly over 1, 2, 3 and 6 ranks


class Numbers(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--fail-new-rank", type=int, default=None)
    args = parser.parse_args()
    first_late = os.environ.get("XMIG_ATTEMPT") == "1"
    if first_late and args.fail_new_rank == int(os.environ.get("RANK", "-1")):
        sys.exit(3)

    session = xmig.init(seed=0)
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1.0)
    session.register(model=ddp, optimizer=optimizer)
    data = session.shards(Numbers(BATCH * args.steps), batch=BATCH, shuffle=False)
    for _step in session.steps(args.steps):
        x = next(data)
        loss = (ddp(x).mean()) * data.weight
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if args.step_sleep:
            import time

            time.sleep(args.step_sleep)
    if args.out and session.rank == 0:
        with open(args.out, "w") as out:
            json.dump({"w": model.weight.item(), "world_size": session.world_size}, out)


if __name__ == "__main__":
    main()
