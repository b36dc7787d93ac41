"""Where a GPU training process's own host memory goes: what CRIU's image of a migrating
rank carries beside the driver's checkpoint (about 1.2 GB at every model size on one H200).

    python bench/host_memory.py [--preset small] [--out FILE.json]

A fresh process per CUDA module loading mode (LAZY, EAGER), each measuring its anonymous
resident memory (``/proc/self/smaps_rollup``) after each stage: torch imported, the CUDA
context made, the model and AdamW built, three steps trained, and PyTorch's and the C
library's free memory given back (as a moving rank does). After the last stage it lists its
largest anonymous mappings, each with the file mapped just before it (a library's own heap
follows the library).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent / "src"))


def anonymous_mb() -> float:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(model_args: list[str]) -> dict:
    stages = {"start": anonymous_mb()}
    import torch
    import train_gpt

    from xmig.worker.memory import largest_anonymous_mappings, trim_host_memory

    stages["torch imported"] = anonymous_mb()
    device = torch.device("cuda", 0)
    torch.ones(1, device=device)
    torch.cuda.synchronize(device)
    stages["CUDA context"] = anonymous_mb()
    args = train_gpt.parse_args(model_args)
    cfg = train_gpt.build_config(args)
    torch.manual_seed(args.seed)
    model = train_gpt.GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    stages["model built"] = anonymous_mb()
    for step in range(3):
        x, y = train_gpt.synthetic_batch(args.seed, step, 0, args.batch_size, cfg.block_size,
                                         cfg.vocab_size, device)  # fmt: skip
        loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize(device)
    stages["3 steps"] = anonymous_mb()
    torch.cuda.empty_cache()
    trim_host_memory()
    stages["trimmed"] = anonymous_mb()
    largest = [{"anon_mb": size / 2**20, "where": where}
               for size, where in largest_anonymous_mappings(12)]  # fmt: skip
    return {"stages_mb": stages, "largest": largest}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    model_args = ["--preset", args.preset, *rest]
    if args.child:
        print(json.dumps(child(model_args)))
        return 0
    results = {}
    for mode in ("LAZY", "EAGER"):
        env = {**os.environ, "CUDA_MODULE_LOADING": mode}
        done = subprocess.run([sys.executable, __file__, "--child", *model_args], env=env,
                              capture_output=True, text=True, timeout=args.timeout)  # fmt: skip
        if done.returncode != 0:
            print(f"{mode}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            return 1
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        stages = results[mode]["stages_mb"]
        print(f"{mode}: " + ", ".join(f"{k} {v:.0f} MB" for k, v in stages.items()))
        for m in results[mode]["largest"]:
            print(f"   {m['anon_mb']:8.1f} MB  {m['where']}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
