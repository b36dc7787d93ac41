"""A just-in-time checkpoint on disk: the state of every shard as of the start of one step,
written by the ranks that still hold it when a fault cannot be recovered, and read back by
``xmig run --resume``.

A checkpoint is a folder: one ``shard-K.safetensors`` per set of replicas (the tensors of what
a replacement would have pulled, with the structure around them in the file's metadata) and a
``manifest.json`` naming the job, the world layout, the step, the registered objects and every
file's size and SHA-256. It is written as ``.NAME.partial`` and renamed to ``NAME`` once the
manifest is in it, so a folder without the suffix is always whole.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the launcher reads manifests without loading torch
    import torch

KIND = "xmig-jit-checkpoint"
FORMAT = 1
MANIFEST = "manifest.json"
STRUCTURE_KEY = "xmig_structure"  # the safetensors metadata entry holding the structure
HASH_CHUNK = 16 * 2**20


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or resumed from; the message is one line."""


def shard_file(shard: int) -> str:
    return f"shard-{shard:05d}.safetensors"


def rank_file(rank: int) -> str:
    """Where a rank writes its own state when the coordinator is lost."""
    return f"rank-{rank:05d}.safetensors"


def lost_coordinator_folder(checkpoint_dir: str, job_id: str) -> str:
    """The partial folder the ranks write their own states into when the coordinator is
    lost; the launcher seals it once they are done."""
    return os.path.join(checkpoint_dir, partial_name(f"{job_id}-coordinator-lost"))


def partial_name(name: str) -> str:
    """Where a checkpoint called ``name`` is written until it is whole."""
    return f".{name}.partial"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _saveable(tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as safetensors takes them: on the CPU, contiguous, no two sharing memory."""
    named: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for i, tensor in enumerate(tensors):
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")  # a copy of its own
        elif not t.is_contiguous() or (t.numel() and t.untyped_storage().data_ptr() in storages):
            t = t.contiguous().clone()
        if t.numel():
            storages.add(t.untyped_storage().data_ptr())
        named[str(i)] = t
    return named


def write_shard(folder: Path, shard: int, payload: dict[str, Any], name: str | None = None,
                extra: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Write one shard's payload (``ReplacementPayload.to_wire()``) into ``folder`` (as
    ``name``, by default the shard's file), under a temporary name first, ``extra`` beside
    its structure in the file's metadata; its file name, size, SHA-256 and seconds taken."""
    from safetensors.torch import save_file

    from xmig.state.transfer import pack

    started = time.monotonic()
    folder.mkdir(parents=True, exist_ok=True)
    meta, tensors = pack(payload)
    name = name or shard_file(shard)
    temporary = folder / f".{name}.writing"
    metadata = {**(extra or {}), STRUCTURE_KEY: base64.b64encode(meta).decode()}
    save_file(_saveable(tensors), str(temporary), metadata=metadata)
    with temporary.open("rb+") as f:
        os.fsync(f.fileno())
    os.replace(temporary, folder / name)
    _fsync_dir(folder)
    path = folder / name
    return {"file": name, "bytes": path.stat().st_size, "sha256": file_sha256(path),
            "seconds": time.monotonic() - started}  # fmt: skip


def read_metadata(path: Path) -> dict[str, str]:
    """A safetensors file's metadata, read from its header (no torch needed)."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size <= 100 * 2**20:
            raise CheckpointError(f"{path} is not a safetensors file")
        header = json.loads(f.read(size))
    metadata = header.get("__metadata__") or {}
    return {str(k): str(v) for k, v in metadata.items()}


def read_shard(path: Path, device: torch.device) -> dict[str, Any]:
    """The payload ``write_shard`` wrote (tensors that were on a GPU come back on ``device``)."""
    from safetensors import safe_open

    from xmig.state.transfer import tensor_specs, unpack

    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = base64.b64decode((f.metadata() or {})[STRUCTURE_KEY])
        specs = tensor_specs(meta)
        tensors = []
        for i, (_dtype, _shape, device_type) in enumerate(specs):
            tensor = f.get_tensor(str(i))
            tensors.append(tensor.to(device) if device_type != "cpu" else tensor)
    return unpack(meta, tensors)


@dataclass(frozen=True)
class Shard:
    """One set of replicas' state: the ranks whose state it is, and its file."""

    shard: int
    ranks: list[int]
    file: str
    bytes: int
    sha256: str
    writer: int


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint holds and which job it comes from."""

    job_id: str
    step: int
    first_step: int | None
    world_size: int
    nnodes: int
    nproc_per_node: int
    script: str  # the script's absolute path
    args: list[str]
    shards: list[Shard]
    missing: list[dict[str, Any]] = field(default_factory=list)  # {shard, ranks}: not saved
    objects: list[str] = field(default_factory=list)  # the registered objects' names
    reason: str = ""  # why the job stopped
    created: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)  # the job spec, for the record

    @property
    def complete(self) -> bool:
        return not self.missing

    def shard_of(self, rank: int) -> Shard:
        for shard in self.shards:
            if rank in shard.ranks:
                return shard
        raise CheckpointError(f"the checkpoint holds no state of rank {rank}")

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        return {"kind": KIND, "format": FORMAT, "complete": self.complete, **data}

    @classmethod
    def from_json(cls, data: Any, where: str) -> Manifest:
        if not isinstance(data, dict) or data.get("kind") != KIND:
            raise CheckpointError(f"{where} is not an xmig checkpoint's manifest")
        if data.get("format") != FORMAT:
            raise CheckpointError(f"{where} has format {data.get('format')!r}; this xmig reads "
                                  f"format {FORMAT}")  # fmt: skip
        fields = {f.name for f in dataclasses.fields(cls)}
        try:
            body = {k: v for k, v in data.items() if k in fields}
            body["shards"] = [Shard(**s) for s in body["shards"]]
            manifest = cls(**body)
        except (TypeError, KeyError) as exc:
            raise CheckpointError(f"{where} is damaged: {exc}") from None
        covered = sorted(r for s in manifest.shards for r in s.ranks)
        covered += sorted(r for m in manifest.missing for r in m.get("ranks", []))
        if sorted(covered) != list(range(manifest.world_size)):
            raise CheckpointError(f"{where} is damaged: its shards do not cover ranks "
                                  f"0..{manifest.world_size - 1} once each")  # fmt: skip
        return manifest


def write_manifest(folder: Path, manifest: Manifest) -> None:
    temporary = folder / f".{MANIFEST}.writing"
    with temporary.open("w") as out:
        json.dump(manifest.to_json(), out, indent=1)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, folder / MANIFEST)
    _fsync_dir(folder)


def seal(partial: Path, final: Path, manifest: Manifest) -> None:
    """Put the manifest into the partial folder and rename it into place: a checkpoint that
    exists under its own name is whole."""
    if final.exists():
        raise CheckpointError(f"{final} exists already: a checkpoint is never written over")
    write_manifest(partial, manifest)
    os.rename(partial, final)
    _fsync_dir(final.parent)


def read_manifest(folder: Path) -> Manifest:
    """The manifest of the checkpoint in ``folder``; CheckpointError when there is none."""
    if not folder.is_dir():
        if folder.with_name(partial_name(folder.name)).is_dir():
            raise CheckpointError(f"{folder} was never completed (only its partial folder "
                                  "exists)")  # fmt: skip
        raise CheckpointError(f"{folder} is not a folder")
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{folder} has no {MANIFEST}: it is not a finished checkpoint")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} cannot be read: {exc}") from None
    return Manifest.from_json(data, str(path))


def check_resumable(
    folder: Path,
    world_size: int,
    nnodes: int,
    nproc_per_node: int,
    script: str,
    args: list[str],
    progress: Callable[[str], None] | None = None,
) -> Manifest:
    """The manifest of a checkpoint this run can resume from; CheckpointError (one line)
    for one that is incomplete, damaged, altered, or from another layout or script."""
    manifest = read_manifest(folder)
    if not manifest.complete:
        lost = "; ".join(f"shard {m['shard']} (ranks {m['ranks']})" for m in manifest.missing)
        raise CheckpointError(f"{folder} is incomplete: no live copy of {lost} was left to save")
    ours = (world_size, nnodes, nproc_per_node)
    theirs = (manifest.world_size, manifest.nnodes, manifest.nproc_per_node)
    if ours != theirs:
        raise CheckpointError(
            f"{folder} is from another world layout: {theirs[0]} ranks ({theirs[1]} node(s) × "
            f"{theirs[2]}), this run has {ours[0]} ({ours[1]} × {ours[2]})"
        )
    if (script, list(args)) != (manifest.script, list(manifest.args)):
        raise CheckpointError(
            f"{folder} is from another script or other script arguments: it ran "
            f"{' '.join([manifest.script, *manifest.args])}, this run is "
            f"{' '.join([script, *args])}"
        )
    total = sum(s.bytes for s in manifest.shards)
    done = 0
    for shard in manifest.shards:
        path = folder / shard.file
        if not path.is_file():
            raise CheckpointError(f"{folder}: shard {shard.shard}'s file {shard.file} is missing")
        size = path.stat().st_size
        if size != shard.bytes:
            raise CheckpointError(f"{folder}: shard {shard.shard} is truncated or altered: "
                                  f"{size} bytes, the manifest says {shard.bytes}")  # fmt: skip
        if progress is not None and total > 1 << 30:
            progress(f"checking {shard.file} ({done / 2**30:.1f} of {total / 2**30:.1f} GiB)")
        if file_sha256(path) != shard.sha256:
            raise CheckpointError(f"{folder}: shard {shard.shard}'s checksum differs from the "
                                  "manifest's: the file was altered or corrupted")  # fmt: skip
        done += size
    return manifest
