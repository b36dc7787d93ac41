"""What loading every CUDA module at start costs (``CUDA_MODULE_LOADING=EAGER``, which the
workers of a ``--gpu-gate`` job get) against CUDA's lazy loading, on one GPU.

    python bench/cuda_module_loading.py --out FILE.md [--preset gpt350m --batch-size 8]

Each run is a fresh process that imports torch, makes its CUDA context, builds the demo GPT
with AdamW and trains a few steps; runs alternate LAZY, EAGER, EAGER, LAZY per round. Per
run: the time to the CUDA context, to the first step's end and a later step's time, and the
GPU memory the process holds outside PyTorch's allocator (the context, the loaded kernels,
libraries' workspaces): what the driver's checkpoint of a moving rank carries beside the
tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent / "src"))


def child(model_args: list[str], steps: int) -> dict:
    started = time.perf_counter()
    import torch
    import train_gpt

    imported = time.perf_counter()
    device = torch.device("cuda", 0)
    torch.ones(1, device=device)
    torch.cuda.synchronize(device)
    context = time.perf_counter()
    args = train_gpt.parse_args(model_args)
    cfg = train_gpt.build_config(args)
    torch.manual_seed(args.seed)
    model = train_gpt.GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    built = time.perf_counter()
    step_times = []
    for step in range(steps):
        begun = time.perf_counter()
        x, y = train_gpt.synthetic_batch(args.seed, step, 0, args.batch_size, cfg.block_size,
                                         cfg.vocab_size, device)  # fmt: skip
        loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize(device)
        step_times.append(time.perf_counter() - begun)
    free, total = torch.cuda.mem_get_info(device)
    return {
        "import_s": imported - started,
        "context_s": context - imported,
        "build_s": built - context,
        "first_step_s": step_times[0],
        "later_step_ms": statistics.median(step_times[2:]) * 1000 if steps > 2 else None,
        "to_first_step_end_s": built - started + step_times[0],
        "device_used_gb": (total - free) / 1e9,
        "reserved_gb": torch.cuda.memory_reserved(device) / 1e9,
        "outside_allocator_gb": (total - free - torch.cuda.memory_reserved(device)) / 1e9,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, model_args = parser.parse_known_args()
    model_args = model_args or ["--preset", "gpt350m", "--batch-size", "8"]
    if args.child:
        print(json.dumps(child(model_args, args.steps)), flush=True)
        return 0
    if args.out is None:
        parser.error("--out is required")
    rows = []
    by_mode: dict[str, list[dict]] = {"LAZY": [], "EAGER": []}
    for mode in ["LAZY", "EAGER", "EAGER", "LAZY"] * args.rounds:
        env = {**os.environ, "CUDA_MODULE_LOADING": mode}
        cmd = [sys.executable, __file__, "--child", "--steps", str(args.steps), *model_args]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout)  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"{mode} run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        by_mode[mode].append(result)
        rows.append(
            f"| {mode} | {result['context_s']:.2f} | {result['build_s']:.2f} | "
            f"{result['first_step_s']:.2f} | {result['to_first_step_end_s']:.2f} | "
            f"{result['later_step_ms']:.1f} | {result['device_used_gb']:.2f} | "
            f"{result['outside_allocator_gb']:.2f} |"
        )
        print(rows[-1], flush=True)
    lines = [
        "## CUDA's module loading: lazy against eager (one session)",
        "",
        f"`python bench/cuda_module_loading.py --rounds {args.rounds} --steps {args.steps} "
        f"{' '.join(model_args)}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        "seconds unless said:",
        "",
        "| loading | CUDA context | model built | first step | start to first step's end | "
        "later step ms | GPU used GB | outside PyTorch's allocator GB |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    for mode, results in by_mode.items():
        if results:
            lines.append(
                f"- {mode}: start to first step's end "
                f"{statistics.median(r['to_first_step_end_s'] for r in results):.2f} s, "
                "outside the allocator "
                f"{statistics.median(r['outside_allocator_gb'] for r in results):.2f} GB."
            )
    lines.append("")
    args.out.write_text("\n".join(lines))
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
