"""A replacement's join: receive the state while the script builds its model, check its
digest, load it, match DDP's layout, and start at the survivors' step. A rank of a job resumed
from a just-in-time checkpoint joins the same way, its state read from its shard on disk."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

import torch

from xmig import protocol
from xmig.state import PayloadError, ReplacementPayload
from xmig.state.payload import result_key
from xmig.wire import WireError
from xmig.worker import pull
from xmig.worker.context import WorkerContext
from xmig.worker.errors import RecoveryFailed, exit_now
from xmig.worker.layout import DdpLayout
from xmig.worker.verify import Verifier

logger = logging.getLogger(__name__)

EXIT_REFUSED = 3  # a replacement that refused to replay: its end is expected


class Replacement:
    """``checkpoint``: the folder of the checkpoint this rank resumes from (None: a
    replacement, which pulls its state from a peer)."""

    def __init__(self, ctx: WorkerContext, layout: DdpLayout, verifier: Verifier,
                 checkpoint: Path | None = None) -> None:  # fmt: skip
        self._ctx = ctx
        self._checkpoint = checkpoint
        self._layout = layout
        self._verifier = verifier
        # (what was received, its stats), or (the exception, None)
        self._incoming: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._payload: ReplacementPayload | None = None
        self._stats: Any = None
        self._waited = 0.0

    def start_receiving(self) -> None:
        """Receive the state on a thread of its own while the script still builds its model."""
        threading.Thread(target=self._receive, name="xmig-receive", daemon=True).start()

    def _receive(self) -> None:
        ctx = self._ctx
        try:
            stream = None
            if ctx.backend == "nccl":
                torch.cuda.set_device(ctx.device)  # the current device is per thread
                # a stream of its own, so that the script's kernels on the default stream
                # (building the model) and the transfer do not wait for each other
                stream = torch.cuda.Stream(ctx.device)
            if self._checkpoint is not None:
                self._incoming.put((self._read_checkpoint(self._checkpoint), None))
                return
            self._incoming.put(pull.receive(ctx, ctx.env.generation, stream))
        except BaseException as exc:  # handed to the step loop, which reports it
            self._incoming.put((exc, None))

    def _check_resumed_layout(self, payload: ReplacementPayload) -> None:
        """A checkpoint of DDP's rebuild step taken before its layout went out holds no
        layout: every resumed rank's DDP then builds rank 0's own, which need not be the
        fault-free run's (its gradient order of the first step): said, never silent."""
        ctx = self._ctx
        ddp = payload.ddp
        rebuild_step = (payload.first_step or 0) + 1
        if ctx.registry.ddp is None or ddp.layout is not None or ddp.in_step is not None:
            return
        if payload.step != rebuild_step or ctx.rank != 0:
            return
        why = (f"the checkpoint is of step {payload.step}, in which DDP rebuilds its buckets, "
               "taken before their layout was sent: the resumed run's layout is rank 0's "
               "parameter order, which with 3 ranks or more can change the last bits")  # fmt: skip
        logger.warning("%s", why)
        ctx.send(protocol.NotBitIdentical(generation=ctx.env.generation, why=why, t=time.time()))

    def refuse(self, why: str) -> None:
        """One of this rank's ops is not what its survivors logged (a proxy's
        ``on_mismatch``): the coordinator hears it and rolls the step back instead, with a new
        replacement; this one ends, which also lets go the survivors' replay of the op."""
        ctx = self._ctx
        logger.warning("rank %d: cannot replay: %s", ctx.rank, why)
        if ctx.link is not None:
            with contextlib.suppress(WireError, TimeoutError):
                ctx.link.ask(protocol.ReplayMismatched(generation=ctx.env.generation, why=why,
                                                       t=time.time()), timeout=10.0)  # fmt: skip
        exit_now(EXIT_REFUSED)

    def _read_checkpoint(self, folder: Path) -> Any:
        """This rank's shard of the checkpoint (the launcher checked every file's SHA-256
        before the job started)."""
        from xmig.state.checkpoint import read_manifest, read_shard

        manifest = read_manifest(folder)
        return read_shard(folder / manifest.shard_of(self._ctx.rank).file, self._ctx.device)

    def payload(self) -> ReplacementPayload:
        """The state pulled from a peer, checked (waiting for it the first time): the step
        loop's join takes it, and so may a data stream the script draws from before its loop."""
        with self._lock:
            if self._payload is not None:
                return self._payload
            ctx = self._ctx
            timeout = ctx.env.recovery_timeout
            started = time.monotonic()
            try:
                incoming, stats = self._incoming.get(timeout=timeout)
            except queue.Empty:
                raise RecoveryFailed(f"no state from a peer within {timeout:.0f} s") from None
            if isinstance(incoming, BaseException):
                where = "reading the checkpoint" if self._checkpoint else "receiving the state"
                raise RecoveryFailed(f"{where} failed: {incoming}") from incoming
            if self._checkpoint is None:
                pull.check_digest(ctx, ctx.env.generation, stats.digest)
            self._waited = time.monotonic() - started
            try:
                payload = ReplacementPayload.from_wire(incoming)
            except PayloadError as exc:
                raise RecoveryFailed(f"the peer's state is not a recovery's: {exc}") from None
            self._payload, self._stats = payload, stats
            return payload

    def stream_state(self, name: str) -> tuple[dict[str, Any], int]:
        """The data stream ``name``'s part of the pulled state, and the step it resumes at."""
        payload = self.payload()
        state = payload.state.get(name)
        if not isinstance(state, dict):
            raise RecoveryFailed(f"the peer's state has no data stream {name!r}")
        return state, payload.step

    def _joined(self, payload: ReplacementPayload, stats: Any, started: float) -> int:
        """A rank the world grew by: its peers paused at the start of ``payload.step`` and
        made the new world with it; nothing is replayed. Its checksum is compared with its
        peers' after the first step (``Verify``), as after a recovery."""
        ctx = self._ctx
        ctx.prologue_local = False
        for group in ctx.groups.all():
            group.proxy.resume("normal")
        logger.info("rank %d of %d joins at step %d: state pulled (%.2f MB in %.3f s), "
                    "joined in %.3f s", ctx.rank, ctx.world_size, payload.step,
                    stats.bytes / 1e6, stats.seconds, time.monotonic() - started)  # fmt: skip
        self._verifier.expect(ctx.env.generation, payload.step)
        ctx.send(protocol.Resumed(generation=ctx.env.generation, t=time.time()))
        return payload.step

    def join(self) -> int:
        """Take the state received from a peer, match its DDP, and return the step to
        start at."""
        ctx = self._ctx
        started = time.monotonic()
        payload = self.payload()
        stats, waited = self._stats, self._waited
        ctx.load_state(payload.state)
        ctx.registry.resume_streams(payload.state, payload.step, fresh=True)
        if ctx.backend == "nccl":
            # buffers received on the receiving thread's stream and now copied into the
            # model return to that stream's pool, which nothing allocates from again
            payload.state = {}
            torch.cuda.empty_cache()
        ctx.first_step = payload.first_step
        self._layout.adopt(payload.ddp, payload.step, payload.first_step)
        if self._checkpoint is not None:  # every rank starts here: no peer to catch up with
            self._check_resumed_layout(payload)
            return payload.step
        assert stats is not None
        if payload.mode == "join":
            return self._joined(payload, stats, started)
        groups = ctx.groups.all()
        known = {g.name for g in groups}
        for name, signatures in (payload.signatures or {}).items():
            group = ctx.groups.named(name)
            if group is None:
                raise RecoveryFailed(f"the survivors replay process group {name}, which this "
                                     f"rank has not made (it has {sorted(known)})")  # fmt: skip
            group.proxy.expect_signatures(payload.step, signatures)
        results: dict[str, dict[tuple[int, int], list[torch.Tensor]]] = {}
        for key, outputs in (payload.results or {}).items():
            name, step, index = result_key(key)
            results.setdefault(name, {})[(int(step), int(index))] = outputs
        for name, expected in results.items():
            group = ctx.groups.named(name)
            if group is not None:
                group.proxy.expect_results(expected)
        ctx.prologue_local = False
        for group in groups:
            group.proxy.resume("normal")
        phases = {"pull": stats.seconds, "join": time.monotonic() - started, "waited": waited}
        ctx.send(protocol.Recovered(generation=ctx.env.generation, role="replacement",
                                    phases=phases, pull=pull.pull_report("receiver", stats),
                                    t_resumed=time.time(), t=time.time()))  # fmt: skip
        check_after = payload.check_after if payload.check_after is not None else payload.step
        self._verifier.expect(ctx.env.generation, check_after)
        return payload.step
