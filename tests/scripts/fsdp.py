"""FSDP2 on CPU for the tests: ``--layout hsdp`` shards a small MLP over the shard dimension of
a (replicate, shard) mesh of 2 × 2 (its replicas along the other), ``--layout fsdp`` over all 4
ranks (no replica of any shard), ``--layout tp-dp`` tensor parallel over tp and data parallel
over dp on a (dp, tp) mesh of 2 × 2; ``--layout hsdp-by-node`` is HSDP with each shard's two
replicas next to each other (ranks 0, 1 and 2, 3: on one node each with 2 ranks a node).
``--log-loss`` sums the loss over the world each step
(as a script logs it): on one rank FSDP2 itself communicates nothing, this op does."""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import xmig


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", default="hsdp",
                        choices=("hsdp", "hsdp-by-node", "fsdp", "tp-dp"))  # fmt: skip
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--log-loss", action="store_true")
    args = parser.parse_args()

    session = xmig.init(seed=3)
    kind = session.device.type  # cuda under NCCL
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    model.to(session.device)
    if args.layout == "tp-dp":
        # tensor parallel over tp, data parallel over dp: FSDP2 with a shard dimension of one
        # replicates over dp (what DDP does) and takes the DTensor parameters
        mesh = init_device_mesh(kind, (2, 1, 2), mesh_dim_names=("dp", "dp_shard", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp", "dp_shard"])
    else:
        if args.layout == "hsdp":
            mesh = init_device_mesh(kind, (2, 2), mesh_dim_names=("replicate", "shard"))
        elif args.layout == "hsdp-by-node":
            mesh = DeviceMesh(kind, [[0, 2], [1, 3]], mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(kind, (session.world_size,), mesh_dim_names=("shard",))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    session.register(model=model, optimizer=optimizer)
    for step in session.steps(args.steps):
        g = torch.Generator().manual_seed(100 * step + session.rank)
        x = torch.randn(8, 16, generator=g).to(session.device)
        loss = model(x).square().mean()
        if args.log_loss:
            logged = loss.detach().clone()
            dist.all_reduce(logged)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
