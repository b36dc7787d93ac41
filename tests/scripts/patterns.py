"""A small DDP training script whose data and state follow one of the patterns that decide
whether a recovery can be bit-identical (``--pattern``), for the tests.

Right: ``batches`` (a DataLoader drawn through ``session.batches`` at the top of each step),
``batches-prefetch`` (the same, the next batch prefetched into a local at the end of a step),
``generator`` (random batches from a generator, through ``session.batches``, two per step),
``shards`` (each rank's share of a global batch of 10, uneven at world 3, through
``session.shards``).
Broken: ``prefetch-locals`` (the loader's own iterator, prefetched into a local),
``iterator`` (the loader's own iterator, drawn at the top of each step), ``own-generator``
(noise from a generator of the script's own, not reseeded per step), ``scheduler`` (the LR
scheduler not registered), ``unseeded`` (the model's first weights drawn unseeded: no two
runs alike).
"""

import argparse
import time

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import xmig

PATTERNS = ("batches", "batches-prefetch", "generator", "shards", "prefetch-locals", "iterator",
            "own-generator", "scheduler", "unseeded")  # fmt: skip


class Points(Dataset):
    """Fixed points with a random jitter drawn when each is loaded (an augmentation)."""

    def __init__(self, n=40):
        self.x = torch.linspace(-1, 1, n * 16).reshape(n, 16)
        self.y = (torch.arange(n) % 4).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i] + 0.01 * torch.randn(16), self.y[i]


def epochs(loader, sampler):
    """The loader's batches, epoch after epoch: an iterator of the script's own."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def random_batches():
    while True:
        yield torch.randn(4, 16), torch.randint(0, 4, (4,))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pattern", choices=PATTERNS, default="batches")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--slow-backward", action="store_true")
    # RANK:STEP: that rank sleeps a second before that step's update (its collectives done),
    # so that its peers are a step ahead of it when a fault comes
    parser.add_argument("--slow-update", default=None)
    args = parser.parse_args()

    session = xmig.init(seed=11)
    if args.pattern != "unseeded":
        torch.manual_seed(0)
    # small buckets: DDP reduces the last layer's gradients while the backward goes on (so a
    # fault mid-backward finds some of the step's collectives done)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 4))  # fmt: skip
    ddp = DistributedDataParallel(model, process_group=session.process_group, bucket_cap_mb=0.01)
    if args.slow_backward:
        # xmig's "backward" fault point is this parameter's gradient: the collectives issued
        # before it complete before the fault fires, as in a model of real size
        trainable = [p for p in model.parameters() if p.requires_grad]
        trainable[len(trainable) // 2].register_post_accumulate_grad_hook(
            lambda _p: time.sleep(0.05)
        )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    objects = {"model": ddp, "optimizer": optimizer}
    if args.pattern != "scheduler":
        objects["scheduler"] = scheduler
    session.register(**objects)

    dataset = Points()
    sampler = DistributedSampler(dataset, num_replicas=session.world_size, rank=session.rank,
                                 shuffle=True, seed=1)  # fmt: skip
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=args.workers,
                        pin_memory=args.workers > 0)  # fmt: skip
    if args.pattern in ("prefetch-locals", "iterator"):
        data = epochs(loader, sampler)
    elif args.pattern == "generator":
        data = session.batches(random_batches())
    elif args.pattern == "shards":
        data = session.shards(dataset, batch=10)
    else:
        data = session.batches(loader)
    own = torch.Generator().manual_seed(5)
    prefetch = args.pattern in ("batches-prefetch", "prefetch-locals")
    batch = next(data) if prefetch else None

    for _step in session.steps(args.steps):
        if not prefetch:
            batch = next(data)
            if args.pattern == "generator":  # two per step, as gradient accumulation would
                extra = next(data)
                batch = (torch.cat([batch[0], extra[0]]), torch.cat([batch[1], extra[1]]))
        x, y = batch
        out = ddp(x)
        if args.pattern == "own-generator":
            out = out + 0.1 * torch.randn(out.shape, generator=own)
        loss = torch.nn.functional.cross_entropy(out, y)
        if args.pattern == "shards":
            loss = loss * data.weight  # uneven shares: the global batch's mean
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if args.slow_update and args.slow_update == f"{session.rank}:{_step}":
            time.sleep(1.0)
        optimizer.step()
        scheduler.step()
        if prefetch:
            batch = next(data)
        if args.step_sleep:
            time.sleep(args.step_sleep)


if __name__ == "__main__":
    main()
