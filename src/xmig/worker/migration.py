"""A migration, as a worker lives it: the rank that moves makes room outside its process for
its tensors while it still trains; every rank pauses at a step boundary; the rank that moves
parks its tensors, is checkpointed and moved, and takes them back; every rank goes on on a new
generation's communicator."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from xmig import jobenv, protocol
from xmig.migrate import cuda
from xmig.procs import die_with_parent, outlive_parent
from xmig.worker.context import WorkerContext
from xmig.worker.errors import exit_now
from xmig.worker.memory import anonymous_bytes, largest_anonymous_mappings, trim_host_memory
from xmig.worker.parking import Parked, Parking, ParkingError, expected_bytes
from xmig.worker.phase import WorkerPhase

logger = logging.getLogger(__name__)

# bytes a thread while a moving rank is checkpointed; the driver grows it for a kernel that
# needs more, so it only has to be below what the job set (PyTorch keeps the default, 1 KiB)
MOVING_STACK_BYTES = 16


@dataclass(frozen=True)
class Continue:
    """Not an order from the wire: a pause superseded by one at a later step."""

    generation: int


@dataclass(frozen=True)
class Ready:
    """A moving rank made ready for its checkpoint: what it parked and what its GPU holds."""

    parking: Parking | None
    parked: Parked | None
    gpu: str | None
    held: int  # what it held at the pause, before parking
    dropped: int = 0  # its replay log's copies of the steps before the pause, dropped

    @property
    def park_s(self) -> float:
        return self.parked.copy_s + self.parked.unregister_s if self.parked else 0.0

    def message(self, gpu_bytes: int) -> protocol.ReadyForDump:
        """The report to the agent; ``gpu_bytes``: what the GPU holds now."""
        files = [[str(self.parking.path), self.parking.size]] if self.parking else []
        return protocol.ReadyForDump(
            gpu=self.gpu, gpu_bytes=gpu_bytes, held_bytes=self.held, t=time.time(),
            host_files=files, parked_bytes=self.parked.parked_bytes if self.parked else 0,
            dropped_bytes=self.dropped,
        )  # fmt: skip


class Migration:
    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._lock = threading.Lock()
        self._pause_at: protocol.Pause | None = None
        self._boundary: int | None = None  # the last step the loop started
        self._paused_at: int | None = None
        self._prepare_order: protocol.Prepare | None = None  # for the next boundary
        self._parking: Parking | None = None  # made for the migration of ``_parking_for``
        self._parking_for: int | None = None
        self._ready: Ready | None = None  # this rank readied for its move at the pause
        self._readying = threading.Lock()  # held while tensors are parked or taken back
        # a pause may end in a change of the world size (``worker/resize.py``): whether this
        # rank's world can, and what carries it out
        self.why_not_resize: Callable[[], str | None] = lambda: "not supported"
        self.on_resize: Callable[[protocol.Resize], None] | None = None

    def on_prepare(self, order: protocol.Prepare) -> None:
        """From the order consumer: if this rank is the one to move, make room for its
        tensors, from its next step boundary on (there its tensors are still: the room they
        need is measured there, on the step loop's thread; the room is made on a thread of
        its own, as it takes seconds and the job trains meanwhile)."""
        if order.rank == self._ctx.rank:
            with self._lock:
                self._prepare_order = order

    def _start_preparing(self, order: protocol.Prepare, step: int) -> None:
        size = expected_bytes(self._parkable())
        threading.Thread(target=self._prepare, args=(order, size, step), name="xmig-prepare",
                         daemon=True).start()  # fmt: skip

    def _prepare(self, order: protocol.Prepare, size: int, step: int) -> None:
        ctx = self._ctx
        started = time.monotonic()
        self._drop_parking()
        try:
            made = Parking.prepare(ctx.env.job_id or "local", ctx.rank, order.generation, size,
                                   torch.device(ctx.device))  # fmt: skip
        except (ParkingError, OSError, RuntimeError) as exc:
            logger.warning("rank %d moves without parking its tensors: %s", ctx.rank, exc)
            ctx.send(protocol.Prepared(generation=order.generation, ok=False, step=step,
                                       error=str(exc), t=time.time()))  # fmt: skip
            return
        with self._lock:
            self._parking, self._parking_for = made, order.generation
        took = time.monotonic() - started
        pages = "huge pages" if made.huge_pages else "4 KiB pages"
        logger.info("rank %d: room for %.2f GB of tensors in %s (%s), made in %.2f s", ctx.rank,
                    size / 1e9, made.path, pages, took)  # fmt: skip
        if not made.huge_pages and made.device.type == "cuda" and size >= 1 << 30:
            logger.warning("rank %d: the parking folder %s has 4 KiB pages: pinning and "
                           "tearing down %.1f GB of them adds seconds to the move; a tmpfs "
                           "mounted with huge=within_size (XMIG_PARK_DIR) avoids that",
                           ctx.rank, made.path.parent, size / 1e9)  # fmt: skip
        ctx.send(protocol.Prepared(generation=order.generation, ok=True, room_bytes=size,
                                   prepare_s=took, step=step, t=time.time()))  # fmt: skip

    def _take_parking(self, generation: int) -> Parking | None:
        with self._lock:
            made, self._parking = self._parking, None
            ready = made is not None and self._parking_for == generation
        if made is not None and not ready:
            made.close()
        return made if ready else None

    def _drop_parking(self) -> None:
        with self._lock:
            made, self._parking = self._parking, None
        if made is not None:
            made.close()

    def on_pause(self, order: protocol.Pause) -> None:
        """From the order consumer: pause at the start of ``order.step``, or say this rank has
        already begun it. Not a pause of the generation this process was started in: a rank
        a grow adds is started while its peers go on to that pause, and joins past it."""
        if order.generation <= self._ctx.env.generation:
            return
        with self._lock:
            started = self._boundary
            if started is not None and started >= order.step:
                self._ctx.send(protocol.PauseRefused(generation=order.generation, step=started,
                                                     t=time.time()))  # fmt: skip
                return
            self._pause_at = order
            if self._paused_at is not None and self._paused_at < order.step:
                # paused at an earlier boundary of a superseded order: go on to this one
                self._ctx.orders.boundary.hand(Continue(order.generation))

    def pause_at(self, order: protocol.Pause) -> None:
        """Pause at the start of ``order.step`` (a step this rank redoes after a rollback:
        no refusal, it has not begun it again yet)."""
        with self._lock:
            self._pause_at = order

    def at_boundary(self, step: int) -> None:
        """The step loop is at the start of ``step``: make room for a move, or pause here,
        if told to."""
        with self._lock:
            self._boundary = step
            prepare, self._prepare_order = self._prepare_order, None
        if prepare is not None:
            self._start_preparing(prepare, step)
        with self._lock:
            order = self._pause_at
            if order is None or order.step != step:
                return
            self._pause_at = None
            self._paused_at = step
        try:
            self._paused(step, order)
        finally:
            with self._lock:
                self._paused_at = None

    def _paused(self, step: int, pause: protocol.Pause) -> None:
        """Wait at this boundary, every collective of the last step complete, until the
        coordinator resumes the job on a new generation's communicator."""
        ctx = self._ctx
        generation = pause.generation
        stopped = time.monotonic()
        ctx.phase.move(WorkerPhase.PAUSED)
        aborts = []
        if ctx.backend == "nccl":
            # the communicator is replaced on resume; closing it now frees the peers' mappings
            # of each other's GPU memory, which a GPU checkpoint of a moving rank needs. Every
            # rank is at this boundary, so the communicator is healthy and shut down (~0.5 s;
            # an abort takes ~1 s): on threads, while the rank that moves parks its tensors
            aborts = [threading.Thread(target=_close_paused, args=(proxy,), name="xmig-close",
                                       daemon=True)
                      for proxy in ctx.groups.proxies()]  # fmt: skip
            for thread in aborts:
                thread.start()
        parking = self._take_parking(generation)
        if parking is not None:  # this rank moves: ready itself now, not once the dump is due
            with self._readying:  # a save that comes meanwhile waits, then takes them back
                self._ready = self._make_ready(parking)
        for thread in aborts:
            thread.join()
        with self._readying:
            park_s = self._ready.park_s if self._ready is not None else 0.0
        ctx.send(protocol.Paused(generation=generation, step=step, t=time.time(),
                                 stop_s=time.monotonic() - stopped, park_s=park_s,
                                 cannot_resize=self.why_not_resize()))  # fmt: skip
        ctx.injector.at_point(step, "pause")
        while True:
            order = ctx.orders.boundary.next(generation, ctx.env.recovery_timeout)
            if order is None:
                ctx.die(f"paused for migration and no order came within "
                        f"{ctx.env.recovery_timeout:.0f} s")  # fmt: skip
            if isinstance(order, Continue):
                # the tensors come back for the steps to the later pause; the room is kept
                self._take_back(keep_for=generation)
                ctx.phase.move(WorkerPhase.TRAINING)
                return
            if isinstance(order, protocol.Dump):
                self._be_moved(order)
            elif isinstance(order, protocol.Resize):
                assert self.on_resize is not None
                self.on_resize(order)  # a rank that leaves ends in it
                break
            elif isinstance(order, protocol.Resume):
                built = order.communicators or generation
                for group in ctx.groups.all():  # the moved rank's connections are closed
                    group.proxy.switch(ctx.comms.communicator(
                        group.name, built, group.proxy.communicator.rank,
                        group.proxy.communicator.size))  # fmt: skip
                ctx.send(protocol.Resumed(generation=generation, t=time.time()))
                break
        self._take_back()  # readied for a move that did not happen
        self._drop_parking()
        ctx.phase.move(WorkerPhase.TRAINING)

    def _be_moved(self, order: protocol.Dump) -> None:
        """This rank is the one moving: close the connections that cannot move, let the
        agent checkpoint this process, and, restored on the target node, reconnect there."""
        ctx = self._ctx
        assert ctx.link is not None
        ctx.phase.move(WorkerPhase.MOVING)
        # before the agent hears of it: its dump may come at once. The restorer becomes the
        # parent for a moment, then exits
        outlive_parent()
        with self._readying:
            ready, self._ready = self._ready, None
        # every rank has paused at this step's start (the order comes only then): the log's
        # copies of the steps before are not needed again, and are not moved
        step = self._paused_at
        dropped = 0 if step is None else sum(proxy.drop_copies_before(step)
                                             for proxy in ctx.groups.proxies())  # fmt: skip
        if ready is None:  # no room to park in (or given back for a save): nothing readied
            ready = self._make_ready(None)  # (it empties the caches, the copies' included)
        elif dropped:
            if ctx.backend == "nccl":
                torch.cuda.empty_cache()  # their blocks are not checkpointed
            if ctx.backend != "nccl" or any(p.log_route == "host" for p in ctx.groups.proxies()):
                # copies in host memory: freed, they stay in the C library's heap or in
                # PyTorch's cache of pinned blocks, which CRIU's image would carry (a gpt100m
                # rank's image on the CPU machine: 383 MB without this, 243 MB with it)
                trim_host_memory()
        if dropped:
            logger.info("rank %d: the replay log's copies of the steps before %d dropped "
                        "(%.2f GB)", ctx.rank, step, dropped / 1e9)  # fmt: skip
            ready = dataclasses.replace(ready, dropped=dropped)
        parking = ready.parking
        stack = self._shrink_local_memory()
        ctx.link.ask(ready.message(self._left_on_gpu()), timeout=10.0)
        ctx.link.close()
        deadline = time.monotonic() + ctx.env.recovery_timeout
        while not os.path.exists(order.rejoin_file):  # the process is frozen and moved meanwhile
            if time.monotonic() > deadline:
                logger.error("rank %d: not moved within %.0f s", ctx.rank,
                             ctx.env.recovery_timeout)  # fmt: skip
                exit_now(1)
            time.sleep(0.01)
        with open(order.rejoin_file) as source:
            where = json.load(source)
        os.unlink(order.rejoin_file)
        # the restorer is still the parent for a moment; then the target node's agent (its
        # child subreaper) adopts this process, and this process must die with that agent.
        # A container's init cannot see its parent (getppid() is 0): it ends when its link
        # to the agent does
        if os.getpid() != 1:
            while os.getppid() != int(where["agent_pid"]):
                if time.monotonic() > deadline:
                    exit_now(1)
                time.sleep(0.002)
            die_with_parent()
        if stack is not None:  # its first CUDA call (the agent wrote the file once the GPU
            self._restore_local_memory(stack)  # was restored and unlocked)
        unpark_s = 0.0
        if parking is not None:  # its CUDA calls wait until the agent has restored the GPU
            unpark_s = parking.unpark()
            # unregistering takes a while and nothing waits for it
            threading.Thread(target=parking.close, name="xmig-unpark", daemon=True).start()
        env = dataclasses.replace(ctx.env, agent_addr=where["agent_addr"],
                                  node_rank=int(where["node"]))  # fmt: skip
        ctx.connect(env)
        # the store's connection came back closed: a new one, from this node's address
        ctx.comms.reconnect(env)
        netns = os.stat("/proc/self/ns/net").st_ino
        ctx.send(protocol.Rejoined(generation=order.generation, netns=netns, t=time.time(),
                                   unpark_s=unpark_s))  # fmt: skip
        ctx.phase.move(WorkerPhase.PAUSED)

    def _make_ready(self, parking: Parking | None) -> Ready:
        """Make this process ready for its checkpoint: its tensors parked (where there is
        room), what the driver's checkpoint and CRIU would carry for nothing given back."""
        ctx = self._ctx
        gpu, held = None, 0
        if ctx.backend == "nccl":
            torch.cuda.synchronize(ctx.device)
            for proxy in ctx.groups.proxies():  # memory kept for the log's next copies
                proxy.drop_spare_buffers()
            # cuBLAS's workspaces (about 70 MB) come back at the next matmul
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            # cached free blocks would be checkpointed, copied and restored for nothing
            torch.cuda.empty_cache()
            gpu = str(torch.cuda.get_device_properties(ctx.device).uuid)
            free, total = torch.cuda.mem_get_info(ctx.device)
            held = total - free  # this GPU's use: this process's, one process per GPU
        parked = self._park(parking) if parking is not None else None
        if parked is None and parking is not None:
            parking.close()
            parking = None
        before = anonymous_bytes()
        trim_host_memory()
        after = anonymous_bytes()
        if before is not None and after is not None:
            logger.info("rank %d: %.2f GB of anonymous host memory for CRIU (%.2f GB before "
                        "trimming)", ctx.rank, after / 1e9, before / 1e9)  # fmt: skip
        if logger.isEnabledFor(logging.DEBUG):  # reading every mapping takes a while
            logger.debug("rank %d: its largest anonymous mappings: %s", ctx.rank,
                         "; ".join(f"{size / 1e6:.0f} MB {where}"
                                   for size, where in largest_anonymous_mappings(12)))  # fmt: skip
        return Ready(parking=parking, parked=parked, gpu=gpu, held=held)

    def _shrink_local_memory(self) -> int | None:
        """Size the context's local memory for the smallest stack before the driver's
        checkpoint: at the default 1 KiB a thread it is about 0.27 GB on an H100, which the
        checkpoint, CRIU's dump and restore and the GPU restore would carry for nothing.
        Returns the stack size to set again after the restore (None: left as it was)."""
        if self._ctx.backend != "nccl":
            return None
        try:
            stack = cuda.stack_size()
            if stack > MOVING_STACK_BYTES:
                cuda.set_stack_size(MOVING_STACK_BYTES)
            return stack
        except cuda.GpuCheckpointError as exc:
            logger.warning("rank %d: the context's local memory is moved whole: %s",
                           self._ctx.rank, exc)  # fmt: skip
            return None

    def _restore_local_memory(self, stack: int) -> None:
        """The stack size from before the move: a kernel whose stack the compiler could not
        bound (recursion, calls through pointers) relies on it."""
        started = time.monotonic()
        try:
            if cuda.stack_size() < stack:
                cuda.set_stack_size(stack)
        except cuda.GpuCheckpointError as exc:
            logger.warning("rank %d: the stack size of %d B is not set again: %s",
                           self._ctx.rank, stack, exc)  # fmt: skip
            return
        logger.info("rank %d: the stack size of %d B set again in %.3f s", self._ctx.rank,
                    stack, time.monotonic() - started)  # fmt: skip

    def _left_on_gpu(self) -> int:
        """What the GPU holds for the driver's checkpoint (the communicators aborted and the
        tensors parked by now): tensors nothing registered holds, blocks kept by them, and
        the CUDA context itself; said in the log, to find what else could be parked."""
        ctx = self._ctx
        if ctx.backend != "nccl":
            return 0
        free, total = torch.cuda.mem_get_info(ctx.device)
        logger.info("rank %d: the GPU holds %.2f GB for the driver's checkpoint: %.2f GB "
                    "in live tensors (the largest: %s), %.2f GB reserved by PyTorch",
                    ctx.rank, (total - free) / 1e9, torch.cuda.memory_allocated(ctx.device) / 1e9,
                    _largest_blocks(ctx.device),
                    torch.cuda.memory_reserved(ctx.device) / 1e9)  # fmt: skip
        return total - free

    def give_back(self) -> None:
        """From the order consumer, before this rank's state is saved (the coordinator was
        lost while the job paused for a move): tensors parked for the move come back first,
        or the save would read emptied storages."""
        self._take_back()

    def _take_back(self, keep_for: int | None = None) -> None:
        """The move this rank was readied for did not happen (or comes at a later pause):
        its parked tensors come back; the room is kept for ``keep_for``'s move, if given."""
        with self._readying:
            ready, self._ready = self._ready, None
            if ready is None or ready.parking is None:
                return
            took = ready.parking.unpark()
        logger.info("rank %d: not moved here; its parked tensors are back in %.3f s",
                    self._ctx.rank, took)  # fmt: skip
        if keep_for is None:
            ready.parking.close()
            return
        with self._lock:
            self._parking, self._parking_for = ready.parking, keep_for

    def _park(self, parking: Parking) -> Parked | None:
        """The registered tensors into the parking file (None: they stay, and the move
        carries them the usual way)."""
        for proxy in self._ctx.groups.proxies():
            proxy.drop_spare_buffers()
        try:
            parked = parking.park(self._parkable())
        except (ParkingError, RuntimeError) as exc:
            logger.warning("rank %d: parking its tensors failed, they move with the process: "
                           "%s", self._ctx.rank, exc)  # fmt: skip
            return None
        logger.info("rank %d: parked %.2f GB (%d storages) in %.3f s, unregistered in %.3f s",
                    self._ctx.rank, parked.parked_bytes / 1e9, parked.storages, parked.copy_s,
                    parked.unregister_s)  # fmt: skip
        return parked

    def _parkable(self) -> list[Any]:
        """What a move parks: the registered objects, and the framework's tensors the
        communication log holds (DDP's gradient buckets; the log's copies are dropped)."""
        ctx = self._ctx
        held = [t for proxy in ctx.groups.proxies() for t in proxy.held_tensors()]
        return [*ctx.registry.objects.values(), *held]


def _largest_blocks(device: torch.device, count: int = 5) -> str:
    """The sizes of the largest live blocks of PyTorch's allocator on ``device``, and the
    segments live blocks keep (what a move left on the GPU: to find what else could be
    parked)."""
    sizes, kept, kept_bytes = [], 0, 0
    try:
        for segment in torch.cuda.memory_snapshot():
            if segment.get("device") != device.index:
                continue
            live = [b["size"] for b in segment.get("blocks", [])
                    if b.get("state") == "active_allocated"]  # fmt: skip
            sizes += live
            if live:
                kept += 1
                kept_bytes += segment.get("total_size", 0)
    except (RuntimeError, KeyError, TypeError):  # a diagnostic: it never stops a move
        return "unknown"
    largest = sorted(sizes, reverse=True)[:count]
    blocks = ", ".join(f"{size / 1e6:.0f} MB" for size in largest) or "none"
    return f"{blocks}; {len(sizes)} live blocks keep {kept} segments of {kept_bytes / 1e9:.2f} GB"


def _close_paused(proxy: Any) -> None:
    """Close a paused group's communicator: shut down, or aborted when the job asks for the
    old way (``XMIG_PAUSE_CLOSE=abort``, to measure one against the other)."""
    if os.environ.get(jobenv.PAUSE_CLOSE) == "abort":
        proxy.abort_communicator(wait=True)
    else:
        proxy.release_communicator()
