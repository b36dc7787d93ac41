"""What xmig's integrity checks cost, on this machine's device (a GPU when there is one).

    python bench/integrity_cost.py [--sizes-gib 0.25 1 4] [--out FILE.md]

Two checks were added against silently different results: the SHA-256 of a pulled state (the
sender's, announced over the control channel, against the receiver's; each bucket copied to
the host and hashed on threads beside the transfer) and the replicas' parameter checksum after
every recovery and at the end (on a GPU computed there, no copy to the host; on the host a
SHA-256). For each size this measures both, the digest's agreement between the device and a
host copy of the same parameters, and a plain device-to-host copy of the same bytes as the
yardstick.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from recovery_cpu import machine, write_report

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from xmig.state.fingerprint import params_checksum  # noqa: E402
from xmig.state.transfer import BUCKET_BYTES, _Digest  # noqa: E402

REPEATS = 3


def model_of(gib: float, device: torch.device) -> torch.nn.Module:
    """Parameters of ``gib`` GiB in float32, as 64 MiB tensors (an LLM's are of that order)."""
    model = torch.nn.Module()
    elements = int(gib * 2**30 / 4)
    chunk = 16 * 2**20
    for i in range(0, elements, chunk):
        size = min(chunk, elements - i)
        model.register_parameter(f"p{i // chunk}", torch.nn.Parameter(
            torch.randn(size, device=device)))  # fmt: skip
    return model


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    synchronize(device)
    started = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - started


def digest_of(model: torch.nn.Module) -> str:
    """The transfer's digest over the parameters, in BUCKET_BYTES buckets as a pull sends them."""
    digest = _Digest(b"structure")
    flat = [p.detach().reshape(-1) for p in model.parameters()]
    bucket, size = [], 0
    for tensor in flat:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > BUCKET_BYTES:
            digest.add(torch.cat(bucket))
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
    if bucket:
        digest.add(torch.cat(bucket))
    return digest.hexdigest()


def measure(gib: float, device: torch.device) -> dict[str, float | bool]:
    model = model_of(gib, device)
    host = model_of(0.0, torch.device("cpu"))
    for name, param in model.named_parameters():
        host.register_parameter(name, torch.nn.Parameter(param.detach().cpu()))
    params_checksum(model)  # warm (kernels, allocator)
    checksum_s = [timed(lambda: params_checksum(model), device) for _ in range(REPEATS)]
    digest_s = [timed(lambda: digest_of(model), device) for _ in range(REPEATS)]
    copy_s = [timed(lambda: [p.detach().cpu() for p in model.parameters()], device)
              for _ in range(REPEATS)]  # fmt: skip
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "gb": nbytes / 1e9,
        "checksum_s": statistics.median(checksum_s),
        "digest_s": statistics.median(digest_s),
        "copy_s": statistics.median(copy_s),
        "digest_same_on_host": digest_of(model) == digest_of(host),
        "detects_flip": detects_flip(model),
    }


def detects_flip(model: torch.nn.Module) -> bool:
    """Whether the replica checksum changes when one bit of one element changes, and only
    then (a copy of the same parameters gives the same checksum)."""
    before = params_checksum(model)
    param = next(iter(model.parameters()))
    with torch.no_grad():
        bits = param.data.view(-1).view(torch.int32)
        bits[12345] ^= 1
        flipped = params_checksum(model)
        bits[12345] ^= 1
    return flipped != before and params_checksum(model) == before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gib", type=float, nargs="+", default=[0.25, 1.0, 4.0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for gib in args.sizes_gib:
        r = measure(gib, device)
        print(r, flush=True)
        rows.append(
            f"| {r['gb']:.2f} GB | {r['checksum_s'] * 1e3:.1f} ms | {r['gb'] / r['digest_s']:.2f} "
            f"GB/s ({r['digest_s']:.2f} s) | {r['gb'] / r['copy_s']:.1f} GB/s | "
            f"{'yes' if r['digest_same_on_host'] else 'NO'} | "
            f"{'yes' if r['detects_flip'] else 'NO'} |"
        )
    name = "h200x1" if device.type == "cuda" else "cpu"
    out = args.out or Path(__file__).parent / "results" / f"integrity-{name}.md"
    gpu = f"; {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    write_report(out, [
        "# What the integrity checks cost",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with "
        f"`python bench/integrity_cost.py {' '.join(sys.argv[1:])}` on {machine()}{gpu}.",
        "",
        f"Parameters on `{device}`, float32 tensors of 64 MiB; median of {REPEATS} runs.",
        "",
        "| state | replica checksum (on the device) | pull digest (pinned host copies + "
        "SHA-256 on threads) | device→host copy alone (pageable) | digest equal on the host | "
        "checksum sees one flipped bit |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ], echo=True)  # fmt: skip


if __name__ == "__main__":
    main()
