"""DDP with communication that depends on a process's history, which xmig does not model: a
module syncs a buffer from rank 0 once, at the ``--sync-at``-th forward of its process (as DDP
rebuilds its buckets at its second), and keeps in its state that it did. A replacement, a new
process that pulls the synced state, does not issue that broadcast where its survivors logged
it, so the step cannot be replayed; rolled back, every rank redoes the step without it.
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import xmig


class LazySync(torch.nn.Module):
    def __init__(self, sync_at: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 4)
        self.register_buffer("offset", torch.linspace(0, 1, 4))
        self.register_buffer("synced", torch.zeros((), dtype=torch.int64))  # part of the state
        self.sync_at = sync_at
        self.forwards = 0  # of this process: part of no state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        if self.forwards >= self.sync_at and not int(self.synced):
            dist.broadcast(self.offset, src=0)
            self.synced.fill_(1)
        return self.linear(x) + self.offset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sync-at", type=int, default=3)
    args = parser.parse_args()

    session = xmig.init(seed=5)
    torch.manual_seed(0)
    model = LazySync(args.sync_at)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    session.register(model=ddp, optimizer=optimizer)
    for step in session.steps(args.steps):
        g = torch.Generator().manual_seed(100 * step + session.rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
