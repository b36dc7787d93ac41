"""A worker script: FSDP2 over a plain process group against FSDP2 through xmig's, steps
alternating in the same process (ABBA), on the same device. Run under ``xmig run``.

    xmig run --nproc-per-node 1 bench/fsdp_overhead.py --steps 40 --warmup 5 --out result.json

``--log-loss`` sums each step's loss over the model's group, as a script logs it (on one rank
FSDP2 issues no collective of its own: this op is then the only one).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import xmig


def build(width: int, depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def shard(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--log-loss", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    session = xmig.init(seed=1)
    device = session.device
    kind = device.type
    backend = "nccl" if kind == "cuda" else "gloo"
    plain_group = dist.new_group(backend=backend)  # the same ranks, no proxy
    plain_mesh = DeviceMesh.from_group(plain_group, kind)
    xmig_mesh = init_device_mesh(kind, (session.world_size,))  # xmig's default backend
    torch.manual_seed(0)
    base = build(args.width, args.depth).to(device)
    models = {"plain": shard(copy.deepcopy(base), plain_mesh),
              "xmig": shard(copy.deepcopy(base), xmig_mesh)}  # fmt: skip
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    groups = {"plain": plain_group, "xmig": dist.group.WORLD}
    # the optimizer's update goes through xmig's gate as in training; the model is left out,
    # since FSDP over every rank (no replica) would be refused before the first step
    session.register(optimizer=optimizers["xmig"])
    times: dict[str, list[float]] = {"plain": [], "xmig": []}
    for step in session.steps(args.steps):
        order = ["plain", "xmig"] if step % 2 == 0 else ["xmig", "plain"]
        g = torch.Generator(device=device).manual_seed(step)
        x = torch.randn(args.batch, args.width, device=device, generator=g)
        for name in order:
            if kind == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            loss = models[name](x).float().square().mean()
            if args.log_loss:
                logged = loss.detach().clone()
                dist.all_reduce(logged, group=groups[name])
            optimizers[name].zero_grad(set_to_none=True)
            loss.backward()
            optimizers[name].step()
            if kind == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - started)
    kept = {k: v[args.warmup :] for k, v in times.items()}
    ratios = sorted(x / p for p, x in zip(kept["plain"], kept["xmig"], strict=True))
    quart = statistics.quantiles(ratios, n=4) if len(ratios) >= 4 else [ratios[0], 0, ratios[-1]]
    params = sum(p.numel() for p in base.parameters())
    result = {"parameters": params, "median_ms": {k: 1e3 * statistics.median(v)
                                                  for k, v in kept.items()},
              "paired_ratio_median": statistics.median(ratios),
              "paired_ratio_iqr": [quart[0], quart[2]], "pairs": len(ratios)}  # fmt: skip
    if session.rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
