"""A moving rank's large tensors parked in a shared memory file while its process is moved.

Before the agent checkpoints a moving worker, the worker copies the storages of its registered
state (the model's parameters, gradients and buffers, the optimizer's state) into a file in
``/dev/shm`` (``XMIG_PARK_DIR``) that it maps shared, and frees them. CRIU keeps a shared file
mapping by reference (it does not copy its pages), and the CUDA driver's checkpoint no longer
has that GPU memory to move: both images hold only what is left. After the restore the storages
are allocated again and copied back, at the same tensors (every view and every reference the
optimizer or DDP holds stays valid; only the storage's address changes).

On a GPU the file is registered with CUDA (pinned, so the copies run at the link's speed).
Making the file and registering it cost seconds (the first touch of the memory and the pinning
of its pages): ``Parking.prepare`` does it ahead, while the job still trains. The registration
is dropped before the checkpoint (the driver's restore grows with registered host memory) and
made again after the restore a group of storages at a time, each group's copies running while
later groups are registered (a copy may not span two registrations: measured, CUDA refuses it).
The file's name says its job, so whatever a crash leaves is removed with the job's other
leftovers (``xmig.paths.parking_files``).
"""

from __future__ import annotations

import contextlib
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

from xmig.paths import PARK_PREFIX, park_dir

logger = logging.getLogger(__name__)

MIN_STORAGE_BYTES = 1 << 12  # smaller storages stay: parking them saves nothing worth a call
ALIGN = 4096  # each storage's place in the file starts on a page
ROOM_MARGIN = 1 << 28  # free room the file leaves in its filesystem
REGISTER_THREADS = 4
REGISTER_CHUNK = 1 << 30  # bytes a registration of the copies back covers, about
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


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


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def register_groups(
    places: list[tuple[int, int]], chunk: int = REGISTER_CHUNK
) -> list[tuple[int, int, list[int]]]:
    """Consecutive parked storages (``(offset, bytes)`` each, in the file's order) grouped
    into registrations of about ``chunk`` bytes: ``(start, length, indices)`` each. A copy may
    not span two registrations, so a group ends only between storages (one larger than
    ``chunk`` is a group of its own)."""
    groups: list[tuple[int, int, list[int]]] = []
    for index, (offset, size) in enumerate(places):
        end = offset + _aligned(size)
        if groups and end - groups[-1][0] <= chunk and offset == sum(groups[-1][:2]):
            start, _, members = groups[-1]
            groups[-1] = (start, end - start, [*members, index])
        else:
            groups.append((offset, end - offset, [index]))
    return groups


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
            host.zero_()  # the first touch of every page, now rather than during the move
            parking._host = host
            if device.type == "cuda":
                torch.cuda.set_device(device)  # this thread's, not another GPU's context
                # one registration: a copy may start anywhere
                parking._registered.append(parking._register(0, size))
        except BaseException:
            parking.close()
            raise
        return parking

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

    def _unregister_all(self) -> None:
        if not self._registered:
            return
        cudart = self._cudart()
        for address in self._registered:
            err = cudart.cudaHostUnregister(address)
            if int(err) != 0:
                logger.warning("cudaHostUnregister failed: error %d", int(err))
        self._registered.clear()

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
            for storage, start, size in chosen:
                self._host[start : start + size].copy_(_byte_view(storage), non_blocking=True)
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
        """Allocate every parked storage again and copy it back (on a GPU: the file
        registered again a group of storages at a time, each group's copies queued while
        later groups are registered). Returns the seconds it took."""
        assert self._host is not None
        started = time.monotonic()
        if self.device.type != "cuda":
            for storage, offset, size in self._parked:
                storage.resize_(size)
                _byte_view(storage).copy_(self._host[offset : offset + size])
            self._parked.clear()
            return time.monotonic() - started
        # pinning pages is the slow part: several threads pin while this one queues copies;
        # few large registrations pin faster than many small ones
        groups = register_groups([(offset, size) for _, offset, size in self._parked])
        with ThreadPoolExecutor(REGISTER_THREADS, thread_name_prefix="xmig-pin",
                                initializer=torch.cuda.set_device,
                                initargs=(self.device,)) as pool:  # fmt: skip
            pinned = [pool.submit(self._register, start, length) for start, length, _ in groups]
            for (_, _, members), registered in zip(groups, pinned, strict=True):
                try:
                    self._registered.append(registered.result())
                except ParkingError as exc:  # copied from pageable memory: slower, as exact
                    logger.warning("parking file: %s", exc)
                for index in members:
                    storage, offset, size = self._parked[index]
                    storage.resize_(size)
                    view = _byte_view(storage)
                    view.copy_(self._host[offset : offset + size], non_blocking=True)
        if self.device.type == "cuda":
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
