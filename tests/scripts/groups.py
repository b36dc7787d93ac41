"""DDP over a sub-group, for the tests: 4 ranks on a (stage, dp) DeviceMesh of 2 × 2. Each
stage has a model of its own, trained by DDP over its dp group ({0, 1} and {2, 3}); every step
also averages the loss over the world and sums a tensor over the stage group ({0, 2} and
{1, 3}), so ops of every kind of group are in flight when a rank fails.

``--groups new_group`` makes the same groups with ``dist.new_group`` instead of a mesh,
``--groups split`` with ``dist.split_group`` (the world split into rows, then into columns);
``--groups solo`` trains each rank's DDP over a group of its own (no replica anywhere).
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import xmig


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--groups", choices=("mesh", "new_group", "split", "solo"), default="mesh")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()

    session = xmig.init(seed=7)
    if session.world_size != 4:
        raise SystemExit("groups.py runs on 4 ranks")
    if args.groups == "mesh":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("stage", "dp"))
        dp, across = mesh.get_group("dp"), mesh.get_group("stage")
    elif args.groups == "solo":  # DDP over a group of one: no rank has a replica
        alone = [dist.new_group([r]) for r in range(4)]
        dp, across = alone[session.rank], dist.group.WORLD
    elif args.groups == "split":
        dp = dist.split_group(split_ranks=[[0, 1], [2, 3]])
        across = dist.split_group(split_ranks=[[0, 2], [1, 3]])
    else:
        rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        dp, across = rows[session.rank // 2], cols[session.rank % 2]
    stage = session.rank // 2

    torch.manual_seed(100 + stage)  # each stage's model is its own; its dp replicas alike
    model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 4))  # fmt: skip
    ddp = DistributedDataParallel(model, process_group=dp, bucket_cap_mb=0.01)
    trainable = list(model.parameters())
    # the backward's fault point: collectives issued before it complete before it fires
    trainable[len(trainable) // 2].register_post_accumulate_grad_hook(lambda _p: time.sleep(0.05))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    session.register(model=ddp, optimizer=optimizer)

    for step in session.steps(args.steps):
        g = torch.Generator().manual_seed(1000 * step + session.rank)  # the batch: (step, rank)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the world's
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        mark = torch.full((2,), float(step + session.rank))
        dist.all_reduce(mark, group=across)
        optimizer.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)


if __name__ == "__main__":
    main()
