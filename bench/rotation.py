"""Training copies of one model in turn, step by step, for paired comparisons (ABBA): the
order rotates every step and is reversed every other step, so that none always goes first
and a shared machine's drift hits all alike."""

from __future__ import annotations

import time
from typing import Any

import torch


def train_in_rotation(variants: dict[str, tuple[Any, Any]], steps: int, gpt_args: Any,
                      cfg: Any, device: torch.device) -> dict[str, list[float]]:  # fmt: skip
    """Each step, every variant's (DDP, optimizer) trains the demo GPT on the same batch and
    dropout; returns each variant's step wall times (the GPU's work included)."""
    import train_gpt

    on_gpu = device.type == "cuda"
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for step in range(steps):
        order = names[step % len(names) :] + names[: step % len(names)]
        if step % 2:
            order.reverse()
        for name in order:
            ddp, opt = variants[name]
            if on_gpu:
                torch.cuda.synchronize(device)
            torch.manual_seed(gpt_args.seed + step)  # the same dropout in every variant
            started = time.perf_counter()
            x, y = train_gpt.synthetic_batch(gpt_args.seed, step, 0, gpt_args.batch_size,
                                             cfg.block_size, cfg.vocab_size, device)  # fmt: skip
            loss = ddp(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if on_gpu:
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - started)
    return times
