"""Moving a rank's state to another rank over a communicator, in a few large buffers.

The structure (state dicts with their numbers, strings and nesting) travels as a restricted
pickle in which every tensor is a reference. The tensors land in one flat buffer per (dtype,
device type) on the receiver and travel in buckets of consecutive tensors: a large tensor is
sent as it is (no copy), small ones are packed together, so a pull costs a few hundred
collectives at most whatever the model's size, and the sender needs at most one bucket of
extra memory. Both ends hash what travels (SHA-256 of the structure and of every bucket in
order, on a few threads beside the transfer): the receiver loads the state only once its digest
equals the one the sender announced over the authenticated control channel, since the
communicator itself is reachable by anyone who can reach the job's store.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from xmig.ccl import Communicator

BUCKET_BYTES = 256 * 2**20
HASH_THREADS = max(1, min(8, (os.cpu_count() or 1) - 1))
PIECE_BYTES = 16 * 2**20  # what one hashing thread takes at a time


@dataclass(frozen=True)
class TensorRef:
    """Stands for the tensor with this index in the transfer."""

    index: int


_ALLOWED = {
    ("builtins", name)
    for name in (
        "dict",
        "list",
        "tuple",
        "set",
        "frozenset",
        "int",
        "float",
        "complex",
        "str",
        "bytes",
        "bool",
        "NoneType",
        "slice",
        "range",
    )  # fmt: skip
} | {("collections", "OrderedDict"), (__name__, "TensorRef")}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a peer")
        return super().find_class(module, name)


def _strip(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return TensorRef(len(tensors) - 1)
    if isinstance(value, OrderedDict):
        stripped = OrderedDict((k, _strip(v, tensors)) for k, v in value.items())
        if hasattr(value, "_metadata"):  # module versions that load_state_dict reads
            stripped["__xmig_metadata__"] = value._metadata
        return stripped
    if isinstance(value, dict):
        return {k: _strip(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(_strip(v, tensors) for v in value)
    return value


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, TensorRef):
        return tensors[value.index]
    if isinstance(value, OrderedDict):
        filled = OrderedDict((k, _fill(v, tensors)) for k, v in value.items())
        metadata = filled.pop("__xmig_metadata__", None)
        if metadata is not None:
            filled._metadata = metadata  # type: ignore[attr-defined]
        return filled
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(_fill(v, tensors) for v in value)
    return value


def pack(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """Split ``state`` into a structure (bytes) and the tensors it holds."""
    tensors: list[torch.Tensor] = []
    structure = _strip(state, tensors)
    meta = {
        "structure": structure,
        "tensors": [
            (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.device.type) for t in tensors
        ],  # fmt: skip
    }
    return pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL), tensors


def unpack(meta: bytes, tensors: list[torch.Tensor]) -> Any:
    """The state ``pack`` split, from its structure and its tensors (in order). The structure
    is read with a restricted unpickler: it builds nothing but plain containers."""
    structure = _RestrictedUnpickler(io.BytesIO(meta)).load()
    if len(structure["tensors"]) != len(tensors):
        raise pickle.UnpicklingError(
            f"the structure names {len(structure['tensors'])} tensors, {len(tensors)} given"
        )
    return _fill(structure["structure"], tensors)


def tensor_specs(meta: bytes) -> list[tuple[str, tuple[int, ...], str]]:
    """Each tensor's (dtype name, shape, device type), as ``pack`` recorded them."""
    return list(_RestrictedUnpickler(io.BytesIO(meta)).load()["tensors"])


Spec = tuple[str, tuple[int, ...], str]  # dtype name, shape, device type


def _groups(specs: list[Spec]) -> dict[tuple[str, str], list[int]]:
    groups: dict[tuple[str, str], list[int]] = {}
    for i, (dtype, _shape, device) in enumerate(specs):
        groups.setdefault((dtype, device), []).append(i)
    return groups


def _numel(spec: Spec) -> int:
    return int(torch.Size(spec[1]).numel())


def buckets(specs: list[Spec], indices: list[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive runs of ``indices`` of at most ``bucket_bytes`` each (a larger tensor is a
    bucket of its own); sender and receiver compute the same runs from the same specs."""
    runs: list[list[int]] = []
    size = 0
    for i in indices:
        nbytes = _numel(specs[i]) * getattr(torch, specs[i][0]).itemsize
        if runs and size + nbytes <= bucket_bytes:
            runs[-1].append(i)
            size += nbytes
        else:
            runs.append([i])
            size = nbytes
    return runs


def _broadcast(comm: Communicator, tensor: torch.Tensor, device: torch.device) -> None:
    """Broadcast from the pair's rank 0; NCCL carries only GPU tensors, so CPU ones (an
    optimizer's step counters) travel through ``device`` and come back."""
    staged = tensor
    if comm.kind == "nccl" and not tensor.is_cuda:
        staged = tensor.to(device)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    comm.backend.broadcast([staged], opts).wait()
    if staged is not tensor:
        tensor.copy_(staged)


@dataclass
class TransferStats:
    """``seconds`` covers the tensors' bytes only; ``setup_seconds`` the communicator's
    creation, the wait for the peer and the structure."""

    bytes: int = 0
    seconds: float = 0.0
    setup_seconds: float = 0.0
    digest: str = ""  # SHA-256 of what travelled (the structure, then each bucket)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _sha256(data: Any) -> bytes:
    return hashlib.sha256(data).digest()  # releases the GIL: the hashing threads run at once


# pinned host buffers a GPU process stages pieces in for hashing (a copy into pageable memory
# runs at ~1 GB/s on a first touch, into pinned memory at ~55 GB/s: measured on an H200)
_STAGING: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
_staged = 0
_staging_lock = threading.Lock()


def _staging_buffer() -> torch.Tensor:
    global _staged
    with _staging_lock:
        if _staged < HASH_THREADS and _STAGING.empty():
            _staged += 1
            return torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True)
    return _STAGING.get()


class _Digest:
    """The digest of one transfer: SHA-256 over the structure's digest and then every piece's
    (PIECE_BYTES of each bucket, in order), the pieces hashed on threads of their own as the
    transfer goes (at most HASH_THREADS at a time; a GPU's pieces through pinned buffers).
    Plain threads, not an executor: a rank that has finished its steps serves peers from its
    exit handlers, when executors refuse new work."""

    def __init__(self, meta: bytes) -> None:
        self._parts: list[bytes | None] = []
        self._slots = threading.BoundedSemaphore(HASH_THREADS)
        self._threads: list[threading.Thread] = []
        self._hash(meta)

    def add(self, payload: torch.Tensor) -> None:
        flat = payload.detach().reshape(-1).contiguous().view(torch.uint8)
        for start in range(0, flat.numel(), PIECE_BYTES):
            piece = flat[start : start + PIECE_BYTES]
            if piece.device.type == "cpu":
                self._hash(piece.numpy())
                continue
            buffer = _staging_buffer()
            staged = buffer[: piece.numel()]
            # on this thread's stream: after the op that filled the piece
            staged.copy_(piece, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            self._hash(staged.numpy(), copied, buffer)

    def _hash(self, data: Any, ready: Any = None, buffer: torch.Tensor | None = None) -> None:
        index = len(self._parts)
        self._parts.append(None)
        self._slots.acquire()

        def work() -> None:
            try:
                if ready is not None:
                    ready.synchronize()
                self._parts[index] = _sha256(data)
            finally:
                if buffer is not None:
                    _STAGING.put(buffer)
                self._slots.release()

        thread = threading.Thread(target=work, name="xmig-hash", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no new threads at this point of the interpreter's life
            work()
            return
        self._threads.append(thread)

    def hexdigest(self) -> str:
        for thread in self._threads:
            thread.join()
        digest = hashlib.sha256()
        for part in self._parts:
            assert part is not None
            digest.update(part)
        return digest.hexdigest()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        # the transfer is complete, and its time is true; only this thread's stream, which
        # waited for every broadcast (the model may be building beside it, on another)
        torch.cuda.current_stream(device).synchronize()


def send_state(
    comm: Communicator, state: Any, control_device: torch.device, bucket_bytes: int = BUCKET_BYTES
) -> TransferStats:
    """Send ``state`` to the other member of the two-rank ``comm`` (this rank is its rank 0)."""
    started = time.monotonic()
    meta, tensors = pack(state)
    _broadcast(comm, torch.tensor([len(meta)], dtype=torch.int64), control_device)
    _broadcast(comm, torch.frombuffer(bytearray(meta), dtype=torch.uint8), control_device)
    _synchronize(control_device)
    sending = time.monotonic()
    total = 0
    digest = _Digest(meta)
    specs = pickle.loads(meta)["tensors"]
    for indices in _groups(specs).values():
        for run in buckets(specs, indices, bucket_bytes):
            parts = [tensors[i].reshape(-1) for i in run]
            payload = parts[0] if len(parts) == 1 and parts[0].is_contiguous() else torch.cat(parts)
            _broadcast(comm, payload, control_device)
            digest.add(payload)
            total += payload.numel() * payload.element_size()
    _synchronize(control_device)
    done = time.monotonic()
    return TransferStats(total, done - sending, sending - started, digest.hexdigest())


def recv_state(
    comm: Communicator,
    control_device: torch.device,
    tensor_device: torch.device,
    bucket_bytes: int = BUCKET_BYTES,
) -> tuple[Any, TransferStats]:
    """Receive what ``send_state`` sent; tensors land on ``tensor_device`` (CPU ones stay CPU)."""
    started = time.monotonic()
    size = torch.zeros(1, dtype=torch.int64)
    _broadcast(comm, size, control_device)
    raw = torch.empty(int(size.item()), dtype=torch.uint8)
    _broadcast(comm, raw, control_device)
    meta_bytes = raw.cpu().numpy().tobytes()
    meta = _RestrictedUnpickler(io.BytesIO(meta_bytes)).load()
    digest = _Digest(meta_bytes)
    receiving = time.monotonic()
    specs = meta["tensors"]
    tensors: list[torch.Tensor | None] = [None] * len(specs)
    total = 0
    for (dtype_name, device_type), indices in _groups(specs).items():
        dtype = getattr(torch, dtype_name)
        device = tensor_device if device_type != "cpu" else torch.device("cpu")
        numels = [_numel(specs[i]) for i in indices]
        flat = torch.empty(sum(numels), dtype=dtype, device=device)
        parts = dict(zip(indices, flat.split(numels), strict=True))
        offset = 0
        for run in buckets(specs, indices, bucket_bytes):
            length = sum(parts[i].numel() for i in run)
            _broadcast(comm, flat[offset : offset + length], control_device)  # in place
            digest.add(flat[offset : offset + length])
            offset += length
        total += flat.numel() * flat.element_size()
        for i in indices:
            tensors[i] = parts[i].view(specs[i][1])
    state = _fill(meta["structure"], tensors)  # type: ignore[arg-type]
    _synchronize(tensor_device)
    done = time.monotonic()
    return state, TransferStats(total, done - receiving, receiving - started, digest.hexdigest())
