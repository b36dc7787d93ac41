"""xmig's demo workload: a small GPT trained with DDP on synthetic data.

Run it with ``xmig run --nproc-per-node 2 examples/train_gpt.py --steps 20``; it also runs
under torchrun or alone (``--plain`` skips xmig entirely, for baselines). The token stream is a
pure function of (seed, step, rank), and RNGs are reseeded at every step boundary, so two runs
with the same flags end with the same parameters, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# deterministic cuBLAS on GPU; must be set before CUDA starts
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.nn.parallel import DistributedDataParallel

PRESETS = {
    # name: (n_layer, n_head, n_embd, block_size, vocab_size)
    "tiny": (2, 4, 64, 32, 256),
    "small": (4, 4, 256, 64, 1024),
    "gpt100m": (12, 12, 768, 512, 16384),
    "gpt350m": (24, 16, 1024, 512, 32768),
}


@dataclass
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer(
            "mask", mask.view(1, 1, cfg.block_size, cfg.block_size), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def synthetic_batch(
    seed: int, step: int, rank: int, batch: int, block: int, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic token sequences mod vocab, a pure function of (seed, step, rank)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + rank)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 8, (batch, 1), generator=gen)
    seq = (start + stride * torch.arange(block + 1)) % vocab
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


class MLP(nn.Module):
    """The small workload: an MLP regressing a fixed function of its input."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, width))

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), targets)


def synthetic_regression(
    seed: int, step: int, rank: int, batch: int, width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP's batch for (seed, step, rank): inputs and a fixed function of them."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + rank)
    x = torch.randn(batch, width, generator=gen)
    return x.to(device), torch.tanh(x.roll(1, dims=1) * 0.5).to(device)


def make_workload(args: argparse.Namespace, device: torch.device):
    """The model (built on ``device``, weights from the current seed) and ``batch(step,
    rank)``."""
    if args.model == "mlp":
        width, depth = args.n_embd or 1024, args.n_layer or 4
        with device:
            model = MLP(width, depth)
        return model, lambda step, rank: synthetic_regression(
            args.seed, step, rank, args.batch_size, width, device
        )
    cfg = build_config(args)
    with device:  # built where it trains: no copy, and a GPU initializes it far faster
        model = GPT(cfg)
    return model, lambda step, rank: synthetic_batch(
        args.seed, step, rank, args.batch_size, cfg.block_size, cfg.vocab_size, device
    )


def build_model(kind: str, preset: str, seed: int, batch_size: int, device: str = "cpu"):
    """The workload for other training loops (the baselines'): model and ``batch(step,
    rank)``, as this script builds them."""
    args = parse_args(["--model", kind, "--preset", preset, "--seed", str(seed),
                       "--batch-size", str(batch_size)])  # fmt: skip
    torch.manual_seed(seed)
    return make_workload(args, torch.device(device))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--model", choices=["gpt", "mlp"], default="gpt",
                        help="the GPT (sized by --preset) or a small MLP")  # fmt: skip
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--n-layer", type=int)
    parser.add_argument("--n-head", type=int)
    parser.add_argument("--n-embd", type=int)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--vocab-size", type=int)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument(
        "--step-sleep",
        type=float,
        default=0.0,
        help="sleep this long in every step (to make faults easy to aim)",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="plain torch.distributed + DDP, without xmig (a baseline)",
    )
    parser.add_argument(
        "--parallel",
        choices=["ddp", "fsdp", "hsdp", "tp-dp"],
        default="ddp",
        help="ddp; fsdp (FSDP2 over every rank: no replica, refused by xmig); hsdp (FSDP2 on a "
        "(replicate, shard) mesh); tp-dp (tensor parallel MLPs on a (dp, tp) mesh, data "
        "parallel over dp)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=2,
        help="hsdp and tp-dp: the mesh's data-parallel dimension; the other one is the rest",
    )
    parser.add_argument("--quiet", action="store_true", help="print only the last step")
    parser.add_argument(
        "--register-module",
        action="store_true",
        help="hand xmig the bare module instead of its DDP (xmig finds the DDP that wraps it)",
    )
    parser.add_argument("--timing-file", help="rank 0 writes each step's wall time (JSON) here")
    parser.add_argument(
        "--mean-loss",
        action="store_true",
        help="average the loss over the ranks after each update (a collective after the "
        "optimizer, as scripts that log the mean loss have)",
    )
    parser.add_argument(
        "--events-file",
        help="every rank appends one JSON line per finished step (wall clock) to this file",
    )
    baseline = parser.add_argument_group("the usual checkpoint-and-restart pattern (--plain only)")
    baseline.add_argument(
        "--checkpoint-dir", help="save model and optimizer here; a restarted job resumes from it"
    )
    baseline.add_argument(
        "--checkpoint-every", type=int, default=0, help="save after every K-th step (0: never)"
    )
    baseline.add_argument(
        "--die-at",
        metavar="RANK:STEP",
        action="append",
        default=[],
        help="that rank SIGKILLs itself mid-backward in that step; the i-th --die-at happens "
        "in the i-th attempt (torchrun's restart count)",
    )
    args = parser.parse_args(argv)
    if args.steps < 0:
        parser.error("--steps must not be negative")
    if args.checkpoint_every < 0:
        parser.error("--checkpoint-every must not be negative")
    if (args.checkpoint_dir or args.die_at) and not args.plain:
        parser.error("--checkpoint-dir and --die-at belong to the --plain baseline")
    if args.checkpoint_every and not args.checkpoint_dir:
        parser.error("--checkpoint-every needs --checkpoint-dir")
    deaths = []
    for text in args.die_at:
        try:
            rank, step = (int(x) for x in text.split(":"))
        except ValueError:
            parser.error(f"--die-at wants RANK:STEP, got {text!r}")
        deaths.append((rank, step))
    args.die_at = deaths
    return args


def build_config(args: argparse.Namespace) -> GPTConfig:
    n_layer, n_head, n_embd, block, vocab = PRESETS[args.preset]
    cfg = GPTConfig(
        n_layer=args.n_layer or n_layer,
        n_head=args.n_head or n_head,
        n_embd=args.n_embd or n_embd,
        block_size=args.block_size or block,
        vocab_size=args.vocab_size or vocab,
        dropout=args.dropout,
    )
    if cfg.n_embd % cfg.n_head:
        sys.exit(f"--n-embd ({cfg.n_embd}) must be a multiple of --n-head ({cfg.n_head})")
    return cfg


class PlainSession:
    """The same loop without xmig: plain process group, plain reseeding; under torchrun's
    restarts, the usual pattern of saving a checkpoint every K steps and resuming from it."""

    def __init__(self, seed: int) -> None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:
            # under torchrun: a prefix per attempt keeps a dead attempt's keys (its peers'
            # addresses) from being read by the next one
            rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size,
                rank == 0 and not agent_store, multi_tenant=True,
            )  # fmt: skip
            prefixed = dist.PrefixStore(f"attempt{self.attempt}", store)
            dist.init_process_group(backend, store=prefixed, rank=rank, world_size=size)
        else:
            dist.init_process_group(backend)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = (
            torch.device("cuda", self.local_rank) if backend == "nccl" else torch.device("cpu")
        )
        if backend == "nccl":
            torch.cuda.set_device(self.device)
        self.seed = seed
        self.process_group = None
        self.objects: dict = {}

    def register(self, **objects) -> None:
        self.objects.update(objects)

    def steps(self, total: int, start: int = 0):
        from xmig.state import params_sha256, reseed

        for step in range(start, total):
            reseed(self.seed, self.rank, step)
            yield step
        if self.rank == 0:
            model = self.objects["model"]
            print(f"final params sha256 {params_sha256(model.module)}", flush=True)
        # a clean end: torchrun counts a rank that aborts at exit (gloo's threads torn down
        # by the interpreter) as failed
        dist.barrier()
        dist.destroy_process_group()


class Checkpoint:
    """Model and optimizer saved to local disk after every K-th step (rank 0 writes, all
    wait), and loaded when a restarted job begins: what torchrun users do today."""

    def __init__(self, directory: str | None, every: int) -> None:
        self.path = Path(directory) / "checkpoint.pt" if directory else None
        self.every = every

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
        """The step to start at: after the saved one, or 0 without a checkpoint."""
        if self.path is None or not self.path.exists():
            return 0
        saved = torch.load(self.path, map_location=device, weights_only=True)
        for state in saved["optimizer"]["state"].values():
            if "step" in state:  # the optimizer keeps its step counters on the CPU
                state["step"] = state["step"].cpu()
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        return int(saved["next_step"])

    def after_step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                   rank: int) -> None:  # fmt: skip
        if self.path is None or not self.every or (step + 1) % self.every:
            return
        started = time.perf_counter()
        if rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(".partial")
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "next_step": step + 1}  # fmt: skip
            torch.save(state, partial)
            os.replace(partial, self.path)  # a checkpoint is whole or absent
        dist.barrier()
        if rank == 0:  # the cost, kept beside the checkpoint across restarts
            with (self.path.parent / "saves.jsonl").open("a") as out:
                record = {"step": step, "seconds": time.perf_counter() - started}
                out.write(json.dumps(record) + "\n")


def shard(model: nn.Module, layout: str, replicas: int, world: int,
          device: torch.device) -> nn.Module:  # fmt: skip
    """``model`` laid out by FSDP2 (and tensor parallel) on a mesh of every rank; returns it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if layout != "fsdp" and (replicas < 1 or world % replicas):
        raise SystemExit(f"--replicas {replicas} does not divide the {world} ranks")
    parts = [m for m in model.modules() if isinstance(m, (Block, MLP))] or [model]
    if layout == "tp-dp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh(device.type, (replicas, 1, world // replicas),
                                mesh_dim_names=("dp", "dp_shard", "tp"))  # fmt: skip
        for block in (m for m in model.modules() if isinstance(m, Block)):
            # the MLP's two layers, split column-wise then row-wise (its output all-reduced)
            parallelize_module(block.mlp, mesh["tp"], {"0": ColwiseParallel(),
                                                       "2": RowwiseParallel()})  # fmt: skip
        fully_shard(model, mesh=mesh["dp", "dp_shard"])
        return model
    if layout == "hsdp":
        mesh = init_device_mesh(device.type, (replicas, world // replicas),
                                mesh_dim_names=("replicate", "shard"))  # fmt: skip
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    for part in parts:
        if part is not model:
            fully_shard(part, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_step(ddp: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor, sleep: float = 0.0) -> torch.Tensor:  # fmt: skip
    """One step of the demo's loop (other loops built on it take it too); its loss."""
    loss = ddp(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if sleep:
        time.sleep(sleep)  # changes no number: makes faults easy to aim
    return loss


def die_mid_backward(model: nn.Module, current_step, step: int, events_file: str | None,
                     rank: int) -> None:  # fmt: skip
    """SIGKILL this process in the middle of ``step``'s backward (the baseline's fault)."""
    trainable = [p for p in model.parameters() if p.requires_grad]

    def hook(_param: torch.Tensor) -> None:
        if current_step() != step:
            return
        if events_file:
            with open(events_file, "a") as out:
                out.write(json.dumps({"rank": rank, "kill": step, "t": time.time()}) + "\n")
        os.kill(os.getpid(), signal.SIGKILL)

    trainable[len(trainable) // 2].register_post_accumulate_grad_hook(hook)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = build_config(args)
    if args.plain:
        session = PlainSession(args.seed)
    else:
        import xmig

        session = xmig.init(seed=args.seed)
    rank, device = session.rank, session.device
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model, batch = make_workload(args, device)
    if args.parallel == "ddp":
        ddp = DistributedDataParallel(
            model,
            process_group=session.process_group,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=args.bucket_cap_mb,
        )
    else:
        ddp = shard(model, args.parallel, args.replicas, session.world_size, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # the DDP module: its bucket layout is part of a rank's state (given the bare module,
    # xmig looks for the DDP that wraps it)
    session.register(model=model if args.register_module else ddp, optimizer=optimizer)
    start = 0
    checkpoint = Checkpoint(args.checkpoint_dir, args.checkpoint_every) if args.plain else None
    if checkpoint is not None:
        start = checkpoint.load(model, optimizer, device)
    attempt = getattr(session, "attempt", 0)
    if attempt < len(args.die_at) and args.die_at[attempt][0] == rank:
        die_mid_backward(model, lambda: current_step, args.die_at[attempt][1], args.events_file,
                         rank)  # fmt: skip
    events = open(args.events_file, "a", buffering=1) if args.events_file else None  # noqa: SIM115
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        shape = f"GPT {cfg.n_layer}x{cfg.n_embd}" if args.model == "gpt" else "MLP"
        print(
            f"[rank0] {shape}, {n_params / 1e6:.2f} M parameters, "
            f"{session.world_size} ranks, {args.steps} steps",
            flush=True,
        )
    started = time.perf_counter()
    step_times: list[float] = []
    last = time.perf_counter()
    current_step = start
    for step in session.steps(args.steps, start):
        current_step = step
        loss = train_step(ddp, optimizer, *batch(step, rank), args.step_sleep)
        if args.mean_loss:
            loss = loss.detach()
            dist.all_reduce(loss, group=session.process_group)
            loss /= session.world_size
        if not args.quiet or step == args.steps - 1:
            print(f"[rank{rank}] step {step} loss {loss.item():.4f}", flush=True)
        if checkpoint is not None:
            checkpoint.after_step(step, model, optimizer, rank)
        now = time.perf_counter()
        step_times.append(now - last)
        last = now
        if events is not None:
            attempt = getattr(session, "attempt", int(os.environ.get("XMIG_ATTEMPT", "0")))
            record = {"rank": rank, "step": step, "t": time.time(), "attempt": attempt}
            events.write(json.dumps(record) + "\n")
    if rank == 0:
        elapsed = time.perf_counter() - started
        print(f"[rank0] {args.steps} steps in {elapsed:.2f} s", flush=True)
        if args.timing_file:
            with open(args.timing_file, "w") as out:
                json.dump({"step_times": step_times, "parameters": n_params}, out)


if __name__ == "__main__":
    main()
