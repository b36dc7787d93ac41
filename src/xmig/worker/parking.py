"""A moving rank's large tensors parked in a shared memory file while its process is moved.

Before the agent checkpoints a moving worker, the worker copies the storages of its registered
state (the model's parameters, gradients and buffers, the optimizer's state) into a file in
``/dev/shm`` (``XMIG_PARK_DIR``) that it maps shared, and frees them. CRIU keeps a shared file
mapping by reference (it does not copy its pages), and the CUDA driver's checkpoint no longer
has that GPU memory to move: both images hold only what is left. After the restore the storages
are allocated again and copied back, at the same tensors (every view and every reference the
optimizer or DDP holds stays valid; only the storage's address changes).

On a GPU the file is registered with CUDA (pinned, so the copies run at the link's speed), in
chunks of 1 GiB pinned and unpinned on several threads; a copy is split where one chunk ends
(measured: CUDA refuses a copy that spans two registrations). Making the file and registering
it cost seconds (the first touch of the memory and the pinning of its pages):
``Parking.prepare`` does it ahead, while the job still trains. The registration is dropped
before the checkpoint (measured: the driver's checkpoint and restore, and CRIU's dump, grow
with registered host memory) and made again after the restore, each chunk's copies queued as
soon as it is pinned. On a tmpfs with huge pages all of this is several times faster
(``xmig.paths.huge_pages``).
The file's name says its job, so whatever a crash leaves is removed with the job's other
leftovers (``xmig.paths.parking_files``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from xmig.paths import PARK_PREFIX, huge_pages, park_dir
from xmig.worker.memory import libc

logger = logging.getLogger(__name__)

MIN_STORAGE_BYTES = 1 << 12  # smaller storages stay: parking them saves nothing worth a call
ALIGN = 4096  # each storage's place in the file starts on a page
ROOM_MARGIN = 1 << 28  # free room the file leaves in its filesystem
REGISTER_THREADS = 4
REGISTER_CHUNK = 1 << 30  # bytes one registration of the file covers (the last: fewer)
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
MADV_HUGEPAGE = 14


class ParkingError(RuntimeError):
    """The parking file could not be made, registered or read back."""


def _tensors_of(objects: Iterable[Any]) -> Iterator[torch.Tensor]:
    for obj in objects:
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, torch.nn.Module):
            for param in obj.parameters():
                yield param
                if param.grad is not None:
                    yield param.grad
            yield from obj.buffers()
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def storages(objects: Iterable[Any]) -> list[torch.UntypedStorage]:
    """Each distinct storage of ``objects``' tensors (tensors; modules: their parameters,
    gradients, buffers; optimizers: their state) worth parking: large enough, resizable, not
    already freed. Largest first."""
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in _tensors_of(objects):
        data = getattr(tensor, "_local_tensor", tensor)  # a DTensor's own shard
        if not isinstance(data, torch.Tensor) or data.is_meta or data.is_sparse:
            continue
        storage = data.untyped_storage()
        if storage.nbytes() < MIN_STORAGE_BYTES or not storage.resizable():
            continue
        found.setdefault(storage.data_ptr(), storage)
    return sorted(found.values(), key=lambda s: -s.nbytes())


def expected_bytes(objects: Iterable[Any]) -> int:
    """The room parking ``objects`` may need: their storages now, and a gradient for every
    parameter that has none yet (a step may make them before the pause)."""
    objects = list(objects)
    total = sum(_aligned(s.nbytes()) for s in storages(objects))
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for param in obj.parameters():
                local = getattr(param, "_local_tensor", param)  # a DTensor's gradient: its shard
                size = local.numel() * local.element_size()
                if param.requires_grad and param.grad is None and size >= MIN_STORAGE_BYTES:
                    total += _aligned(size)
    return total


def _advise_huge_pages(host: torch.Tensor) -> None:
    """Ask for huge pages for the file's mapping (heeded on a tmpfs mounted ``huge=advise``;
    ``always`` and ``within_size`` need no asking, ``never`` ignores it)."""
    if host.numel() == 0:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc().madvise(ctypes.c_void_p(host.data_ptr()), ctypes.c_size_t(host.numel()),
                       MADV_HUGEPAGE)  # fmt: skip


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def chunks(size: int, chunk: int | None = None) -> list[tuple[int, int]]:
    """The file's registrations: ``(start, length)`` pieces of ``chunk`` bytes (default
    ``REGISTER_CHUNK``) covering ``size`` bytes, each pinned (and unpinned) on a thread of
    its own."""
    chunk = chunk or REGISTER_CHUNK
    return [(start, min(chunk, size - start)) for start in range(0, size, chunk)]


def pieces(offset: int, size: int, chunk: int | None = None) -> list[tuple[int, int]]:
    """``(start, end)`` in the file of the copies that move a storage parked at ``offset``:
    split where one registration ends and the next begins (measured: CUDA refuses a copy
    that spans two)."""
    chunk = chunk or REGISTER_CHUNK
    cuts = []
    start, end = offset, offset + size
    while start < end:
        stop = min(end, (start // chunk + 1) * chunk)
        cuts.append((start, stop))
        start = stop
    return cuts


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass(frozen=True)
class Parked:
    """What ``Parking.park`` moved out and what it took (seconds)."""

    parked_bytes: int
    storages: int
    copy_s: float
    unregister_s: float


class Parking:
    """One shared memory file, made ahead for one migration, and what is parked in it."""

    def __init__(self, path: Path, size: int, device: torch.device) -> None:
        self.path = path
        self.size = size
        self.device = device
        self._host: torch.Tensor | None = None
        self._registered: list[int] = []  # the host addresses registered, one per chunk
        self._parked: list[tuple[torch.UntypedStorage, int, int]] = []  # storage, offset, bytes

    @classmethod
    def prepare(cls, job_id: str, rank: int, generation: int, size: int,
                device: torch.device, folder: Path | None = None) -> Parking:  # fmt: skip
        """Make, touch and (on a GPU) register a file of ``size`` bytes for rank ``rank``'s
        migration at ``generation``."""
        folder = folder or park_dir()
        if os.environ.get("XMIG_PARK") == "0":
            # a parked tensor comes back at another address: code that keeps raw device
            # pointers across steps (captured CUDA graphs) needs the driver's way, which keeps them
            raise ParkingError("parking is turned off (XMIG_PARK=0)")
        if size <= 0:
            raise ParkingError("nothing to park")
        if not folder.is_dir():
            raise ParkingError(f"{folder} does not exist")
        room = os.statvfs(folder)
        free = room.f_bavail * room.f_frsize
        if free < size + ROOM_MARGIN:
            raise ParkingError(f"{folder} has {free / 2**30:.1f} GiB free, parking needs "
                               f"{(size + ROOM_MARGIN) / 2**30:.1f} GiB")  # fmt: skip
        unique = f"{os.getpid()}-{secrets.token_hex(4)}"
        name = f"{PARK_PREFIX}{job_id}-rank{rank}-g{generation}-{unique}"
        parking = cls(folder / name, size, device)
        try:
            # shared: the mapping is the file's, which CRIU keeps by reference
            host = torch.from_file(str(parking.path), shared=True, size=size, dtype=torch.uint8)
            _advise_huge_pages(host)
            host.zero_()  # the first touch of every page, now rather than during the move
            parking._host = host
            if device.type == "cuda":
                parking._register_all()
        except BaseException:
            parking.close()
            raise
        return parking

    @property
    def huge_pages(self) -> bool:
        """Whether the file is on a tmpfs that gives it huge pages."""
        return huge_pages(self.path.parent) in ("always", "within_size", "advise")

    @property
    def parked_bytes(self) -> int:
        return sum(n for _, _, n in self._parked)

    def _cudart(self) -> Any:
        return torch.cuda.cudart()

    def _register(self, start: int, length: int) -> int:
        """Pin ``length`` bytes of the file from ``start``; returns their address (the
        caller records it: this runs on several threads)."""
        assert self._host is not None
        address = self._host.data_ptr() + start
        # portable: pinned for every context, whichever device the calling thread is on
        err = self._cudart().cudaHostRegister(address, length, HOST_REGISTER_PORTABLE)
        if int(err) != 0:
            raise ParkingError(f"cudaHostRegister of {length} bytes failed: error {int(err)}")
        return address

    def _pool(self) -> ThreadPoolExecutor:
        # pinning and unpinning pages is the slow part of a registration: it runs on
        # several threads, each on this file's device
        return ThreadPoolExecutor(REGISTER_THREADS, thread_name_prefix="xmig-pin",
                                  initializer=torch.cuda.set_device,
                                  initargs=(self.device,))  # fmt: skip

    def _register_all(self) -> None:
        """Pin the whole file, a chunk per registration; on failure none stays pinned."""
        with self._pool() as pool:
            pinned = [pool.submit(self._register, start, length)
                      for start, length in chunks(self.size)]  # fmt: skip
            errors = []
            for future in pinned:
                try:
                    self._registered.append(future.result())
                except ParkingError as exc:
                    errors.append(exc)
        if errors:
            self._unregister_all()
            raise errors[0]

    def _unregister(self, address: int) -> None:
        err = self._cudart().cudaHostUnregister(address)
        if int(err) != 0:
            logger.warning("cudaHostUnregister failed: error %d", int(err))

    def _unregister_all(self) -> None:
        if not self._registered:
            return
        registered, self._registered = self._registered, []
        if len(registered) == 1:
            self._unregister(registered[0])
            return
        with self._pool() as pool:
            list(pool.map(self._unregister, registered))

    def park(self, objects: Iterable[Any]) -> Parked:
        """Copy ``objects``' storages into the file and free them; what does not fit stays.
        The caller has synchronized the device: nothing writes these tensors now."""
        assert self._host is not None and not self._parked
        started = time.monotonic()
        offset, chosen = 0, []
        for storage in storages(objects):
            size = storage.nbytes()
            if offset + size > self.size:
                continue  # larger than was foreseen: it stays where it is
            chosen.append((storage, offset, size))
            offset += _aligned(size)
        try:
            for storage, offset, size in chosen:
                view = _byte_view(storage)
                for start, end in pieces(offset, size):
                    self._host[start:end].copy_(view[start - offset : end - offset],
                                                non_blocking=True)  # fmt: skip
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except RuntimeError as exc:  # nothing freed yet: every tensor is still where it was
            raise ParkingError(f"copying into the parking file failed: {exc}") from exc
        self._parked = chosen
        for storage, _, _ in self._parked:
            storage.resize_(0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the freed blocks go back to the driver
        copied = time.monotonic()
        self._unregister_all()
        return Parked(parked_bytes=self.parked_bytes, storages=len(self._parked),
                      copy_s=copied - started, unregister_s=time.monotonic() - copied)  # fmt: skip

    def unpark(self) -> float:
        """Allocate every parked storage again and copy it back (on a GPU: the file pinned
        again a chunk at a time on several threads, each chunk's copies queued once it is
        pinned). Returns the seconds it took."""
        assert self._host is not None
        started = time.monotonic()
        for storage, _, size in self._parked:
            storage.resize_(size)
        if self.device.type != "cuda":
            for storage, offset, size in self._parked:
                _byte_view(storage).copy_(self._host[offset : offset + size])
            self._parked.clear()
            return time.monotonic() - started
        # the copies of each chunk: (storage's byte view, start in it, start, end in the file)
        by_chunk: dict[int, list[tuple[torch.Tensor, int, int, int]]] = {}
        for storage, offset, size in self._parked:
            view = _byte_view(storage)
            for start, end in pieces(offset, size):
                by_chunk.setdefault(start // REGISTER_CHUNK, []).append(
                    (view, start - offset, start, end)
                )
        with self._pool() as pool:
            pinned = [pool.submit(self._register, start, length)
                      for start, length in chunks(self.size)]  # fmt: skip
            for index, registered in enumerate(pinned):
                try:
                    self._registered.append(registered.result())
                except ParkingError as exc:  # copied from pageable memory: slower, as exact
                    logger.warning("parking file: %s", exc)
                for view, at, start, end in by_chunk.get(index, []):
                    view[at : at + end - start].copy_(self._host[start:end], non_blocking=True)
        torch.cuda.synchronize(self.device)
        self._parked.clear()
        return time.monotonic() - started

    def close(self) -> None:
        """Unregister, unmap and remove the file (what is parked in it is lost: unpark
        first)."""
        if self._parked:
            logger.warning("closing the parking file %s with %d storages still in it",
                           self.path, len(self._parked))  # fmt: skip
        with contextlib.suppress(Exception):
            if self._registered:
                torch.cuda.set_device(self.device)  # a thread of its own may call this
            self._unregister_all()
        self._host = None  # the mapping goes with its last tensor
        self.path.unlink(missing_ok=True)
