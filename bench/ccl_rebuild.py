"""Communicator rebuild costs on 2 GPUs: what a survivor pays to reach a replacement rank.

    python bench/ccl_rebuild.py --out ccl-rebuild.json --markdown ccl-rebuild.md
    python bench/ccl_rebuild.py --backend gloo --repeats 2 --sizes-mb 64   # CPU smoke run

Setting: in a 2-rank data-parallel job rank 1 died and was replaced; the survivor needs a
communicator that includes the replacement. Two processes (rank r on cuda:r) measure, each
``--repeats`` times (median, min, max; a repeat counts the slower rank, i.e. the time until
the result is on both ranks):

* ``new``: a fresh ``ProcessGroupNCCL`` over a fresh store prefix plus its first 4-byte
  all-reduce (lazy init); ``new-eager``: the communicator created at construction;
* ``split``: ``split_group`` from a healthy, eagerly initialized parent (it only helps when
  every member survived: a replacement process is in no parent);
* ``abort``: ``abort()`` of a healthy group, and of a group whose peer died while the survivor
  is blocked in an all-reduce (abort from another thread);
* ``shrink``: rank 1 kills itself, then rank 0 shrinks pre-built 2-rank groups to 1 rank
  (NCCL < 2.29.2 has no ``ncclCommGrow``: the replacement cannot be added back); last;
* bandwidth: NCCL broadcast rank 0 -> rank 1 against in-process peer and same-GPU copies.

The parent starts one process for the copies, then the two ranks; each process is killed by
PID when it overruns ``--timeout``, and dies with the parent. With ``--backend gloo`` it runs
on CPU as a smoke test; what gloo cannot do is reported as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import inspect
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

try:
    import psutil
except ImportError:  # only used to see the dead peer go
    psutil = None

# set before torch is imported; the children inherit them
BENCH_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
}
for _key, _value in BENCH_ENV.items():
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parent.parent
WORLD = 2
PEER = 1  # the rank that dies
MIB = 1 << 20
GIB = 1 << 30
# bytes moved per bandwidth sample (several back-to-back transfers amortize the start skew)
SAMPLE_BYTES = {"nccl": 8 * GIB, "gloo": 256 * MIB}
FAILED_PEER_GRACE_S = 30.0
NO_GROW = "shrink + re-add: not possible with NCCL < 2.29.2 (no ncclCommGrow)"
SPLIT_NOTE = (
    "split only helps for groups whose members all survived: a replacement process is in no "
    "parent communicator, so it cannot take part in a split"
)
NCCL_ONLY = "NCCL only (ncclCommAbort); not measured with gloo"


def _now() -> float:
    return time.perf_counter()


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()


class Fatal(Exception):
    """The ranks cannot stay in step (a store barrier failed): stop the run."""


class Results:
    """One process's measurements, rewritten to JSON after every section."""

    def __init__(self, path: Path, rank: int) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "rank": rank,
            "samples": {},
            "bytes": {},
            "skipped": {},
            "errors": {},
            "notes": {},
            "info": {},
            "done": False,
        }

    def add(self, key: str, seconds: float) -> None:
        self.data["samples"].setdefault(key, []).append(seconds)

    def skip(self, key: str, reason: str) -> None:
        self.data["skipped"][key] = reason

    def error(self, key: str, text: str) -> None:
        self.data["errors"][key] = text

    def note(self, key: str, text: str) -> None:
        self.data["notes"][key] = text

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


@contextlib.contextmanager
def section(res: Results, key: str, refusal_skips: bool = False) -> Iterator[None]:
    """Record an exception under ``key`` (as a skip when ``refusal_skips``) and save."""
    try:
        yield
    except Fatal:
        raise
    except Exception as exc:
        traceback.print_exc()
        if refusal_skips:
            res.skip(key, f"refused by the API: {_err(exc)}")
        else:
            res.error(key, _err(exc))
    finally:
        res.save()


def bounded(fn: Callable[[], Any], limit_s: float, device: torch.device | None) -> tuple:
    """Run ``fn`` in a daemon thread: ("ok"|"error", value or text, seconds) or ("hung", ...)."""
    box: dict[str, Any] = {}

    def run() -> None:
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
        start = _now()
        try:
            box["value"], box["status"] = fn(), "ok"
        except Exception as exc:
            traceback.print_exc()
            box["value"], box["status"] = _err(exc), "error"
        box["seconds"] = _now() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        return "hung", f"did not return within {limit_s:.0f} s", limit_s
    return box["status"], box["value"], box["seconds"]


def nccl_version() -> tuple[int, ...] | None:
    """The runtime NCCL version, or None without NCCL."""
    try:
        version = torch.cuda.nccl.version()
    except Exception:
        return None
    if isinstance(version, int):  # old style: 2.28.9 -> 22809
        return (version // 10000, version // 100 % 100, version % 100)
    return tuple(version)


def environment() -> dict[str, Any]:
    """Versions and hardware of this machine."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "env": {key: os.environ.get(key) for key in BENCH_ENV},
    }
    version = nccl_version()
    info["nccl"] = ".".join(map(str, version)) if version else None
    if psutil is not None:
        info["memory_gib"] = round(psutil.virtual_memory().total / GIB)
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(count)]
        if count >= 2:
            info["peer_access_0_1"] = torch.cuda.can_device_access_peer(0, 1)
    return info


def api_report() -> dict[str, str]:
    """What this torch offers for rebuilding communicators (signatures, or "missing")."""
    out: dict[str, str] = {}
    c10d = dist.distributed_c10d
    for name in ("new_group", "split_group", "shrink_group", "_abort_process_group"):
        fn = getattr(dist, name, None) or getattr(c10d, name, None)
        try:
            out[f"dist.{name}"] = str(inspect.signature(fn)) if fn else "missing"
        except (TypeError, ValueError):
            out[f"dist.{name}"] = "present"
    for name in ("SHRINK_DEFAULT", "SHRINK_ABORT"):
        out[f"dist.{name}"] = repr(getattr(c10d, name, "missing"))
    out["init_process_group(device_id)"] = str(
        "device_id" in inspect.signature(dist.init_process_group).parameters
    )
    cls = getattr(dist, "ProcessGroupNCCL", None)
    if cls is None:
        out["ProcessGroupNCCL"] = "missing (no NCCL in this build)"
        return out
    for attr in (
        "abort",
        "shrink",
        "shutdown",
        "eager_connect_single_device",
        "supports_shrinking",
        "supports_splitting",
        "_comm_ptr",
        "comm_split_count",
        "grow",
    ):
        out[f"ProcessGroupNCCL.{attr}"] = "present" if hasattr(cls, attr) else "missing"
    with contextlib.suppress(Exception):
        opts = cls.Options()
        out["ProcessGroupNCCL.Options"] = ", ".join(
            a for a in dir(opts) if not a.startswith("__") and not a.startswith("_pybind")
        )
    return out


# ---------------------------------------------------------------- child processes


def guard_child(parent_pid: int, limit_s: float) -> None:
    """Die with the parent (PR_SET_PDEATHSIG, plus a polling thread) and after ``limit_s``."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if parent_pid and os.getppid() != parent_pid:
        os._exit(3)  # the parent went before the death signal was armed
    deadline = _now() + limit_s

    def watch() -> None:
        while True:
            if parent_pid and os.getppid() != parent_pid:
                os._exit(3)
            if _now() > deadline:
                print(f"child overran {limit_s:.0f} s; exiting", file=sys.stderr, flush=True)
                os._exit(124)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="guard").start()


def _iters(nbytes: int, backend: str) -> int:
    return max(1, math.ceil(SAMPLE_BYTES[backend] / nbytes))


def time_copies(
    dst: torch.Tensor, src: torch.Tensor, iters: int, repeats: int, sync: Callable[[], None]
) -> list[float]:
    """Seconds per ``dst.copy_(src)``: a warm-up, then ``iters`` copies per sample, synced."""
    dst.copy_(src)
    sync()
    if int(dst[-1]) != int(src[-1]):
        raise RuntimeError("copy check failed")
    samples = []
    for _ in range(repeats):
        start = _now()
        for _ in range(iters):
            dst.copy_(src)
        sync()
        samples.append((_now() - start) / iters)
    return samples


def child_local(args: argparse.Namespace) -> int:
    """One process: device-to-device copies (the NVLink peer copy and a same-GPU copy)."""
    res = Results(Path(args.workdir) / "local.json", -1)
    res.data["info"].update(environment())
    res.save()
    cuda = args.backend == "nccl"
    if cuda and torch.cuda.device_count() < 2:
        res.error("peer", f"needs 2 GPUs, found {torch.cuda.device_count()}")
    for mb in args.sizes_mb:
        nbytes = mb * MIB
        iters = _iters(nbytes, args.backend)
        if cuda and torch.cuda.device_count() >= 2:
            key = f"peer/{mb}"
            with section(res, key):
                src = torch.full((nbytes,), 3, dtype=torch.uint8, device="cuda:0")
                dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")

                def sync_both() -> None:
                    torch.cuda.synchronize(0)
                    torch.cuda.synchronize(1)

                for s in time_copies(dst, src, iters, args.repeats, sync_both):
                    res.add(key, s)
                res.data["bytes"][key] = nbytes
                del src, dst
                torch.cuda.empty_cache()
        elif not cuda:
            res.skip(f"peer/{mb}", "no GPU (gloo smoke run)")
        key = f"same/{mb}"
        with section(res, key):
            device = torch.device("cuda:0" if cuda else "cpu")
            src = torch.full((nbytes,), 3, dtype=torch.uint8, device=device)
            dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
            sync = functools.partial(torch.cuda.synchronize, 0) if cuda else (lambda: None)
            for s in time_copies(dst, src, iters, args.repeats, sync):
                res.add(key, s)
            res.data["bytes"][key] = nbytes
            res.data["info"]["copy_device"] = str(device)
            del src, dst
            if cuda:
                torch.cuda.empty_cache()
    res.data["done"] = True
    res.save()
    return 0


class Barrier:
    """A barrier over the store (outside NCCL, so it works whatever state NCCL is in)."""

    def __init__(self, store: Any, rank: int) -> None:
        self.store = store
        self.rank = rank

    def __call__(self, name: str) -> None:
        try:
            self.store.set(f"barrier/{name}/{self.rank}", "1")
            self.store.wait([f"barrier/{name}/{r}" for r in range(WORLD)])
        except Exception as exc:
            raise Fatal(f"store barrier {name!r} failed: {_err(exc)}") from exc


def connect_store(workdir: Path, rank: int, timeout: timedelta) -> Any:
    """Rank 0 hosts a TCPStore on a free port (port 0) and publishes it in a file."""
    port_file = workdir / "store.port"
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, WORLD, is_master=True, timeout=timeout, wait_for_workers=False
        )
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        os.replace(tmp, port_file)
        return store
    deadline = _now() + timeout.total_seconds()
    while not port_file.exists():
        if _now() > deadline:
            raise Fatal("rank 0 published no store port")
        time.sleep(0.05)
    port = int(port_file.read_text())
    return dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timeout)


@dataclass
class Rank:
    """One rank's state and helpers."""

    rank: int
    device: torch.device
    nccl: bool
    store: Any
    barrier: Barrier
    res: Results
    timeout: timedelta
    args: argparse.Namespace
    peer_dead: bool = False  # then sync the current stream only: another may hold a stuck kernel

    @property
    def limit_s(self) -> float:
        return self.timeout.total_seconds()

    def sync(self) -> None:
        if self.nccl and self.peer_dead:
            torch.cuda.current_stream(self.device).synchronize()
        elif self.nccl:
            torch.cuda.synchronize(self.device)

    def one(self) -> torch.Tensor:
        """A 4-byte float32 tensor holding 1, ready before any timer starts."""
        x = torch.ones(1, dtype=torch.float32, device=self.device)
        self.sync()
        return x

    def check(self, x: torch.Tensor, expected: float, key: str) -> None:
        got = float(x[0])
        if got != expected:
            self.res.error(f"{key}.check", f"all-reduce gave {got}, expected {expected}")

    def backend(self, prefix: str, eager: bool) -> Any:
        """A new backend object over ``PrefixStore(prefix)``; NCCL eager init if asked."""
        store = dist.PrefixStore(f"{prefix}/", self.store)
        if not self.nccl:  # gloo connects its full mesh in the constructor
            return dist.ProcessGroupGloo(store, self.rank, WORLD, self.timeout)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self.timeout
        opts.is_high_priority_stream = False
        with contextlib.suppress(Exception):
            opts.group_name = prefix
            opts.global_ranks_in_group = list(range(WORLD))
        pg = dist.ProcessGroupNCCL(store, self.rank, WORLD, opts)
        if eager:
            pg.eager_connect_single_device(self.device)
        return pg

    def allreduce(self, pg: Any, x: torch.Tensor, stream_only: bool = False) -> None:
        """All-reduce on a backend object, synchronized (the current stream only if asked)."""
        pg.allreduce([x]).wait()
        if self.nccl:
            if stream_only:  # a stuck kernel of another communicator must not block us
                torch.cuda.current_stream(self.device).synchronize()
            else:
                torch.cuda.synchronize(self.device)

    def dispose(self, pg: Any) -> None:
        """Release a backend object after a store barrier (both ranks are done with it)."""
        if self.nccl:
            with contextlib.suppress(Exception):
                pg.abort()

    def dispose_registered(self, group: Any) -> None:
        """Abort (NCCL) or destroy a registered group; failures only leave it alive."""
        c10d = dist.distributed_c10d
        try:
            if self.nccl and hasattr(c10d, "_abort_process_group"):
                c10d._abort_process_group(group)
            else:
                dist.destroy_process_group(group)
        except Exception as exc:
            print(f"disposing of a split group: {_err(exc)}", file=sys.stderr, flush=True)
            if self.nccl:
                with contextlib.suppress(Exception):
                    group.abort()

    def bounded(self, fn: Callable[[], Any]) -> tuple:
        return bounded(fn, self.limit_s, self.device)


def run_first(c: Rank) -> None:
    """The first communicator of a fresh process: init_process_group + first all-reduce."""
    with section(c.res, "first"):
        c.barrier("first")
        x = c.one()
        kwargs = {"device_id": c.device} if c.nccl else {}
        start = _now()
        dist.init_process_group(
            c.args.backend,
            store=c.store,
            rank=c.rank,
            world_size=WORLD,
            timeout=c.timeout,
            **kwargs,
        )
        dist.all_reduce(x)
        c.sync()
        c.res.add("first", _now() - start)
        c.check(x, WORLD, "first")


def run_new(c: Rank, eager: bool) -> None:
    """A brand-new communicator plus its first all-reduce, ``--repeats`` times."""
    key = "new-eager" if eager else "new"
    with section(c.res, key):
        for i in range(c.args.repeats):
            c.barrier(f"{key}/{i}")
            x = c.one()
            start = _now()
            pg = c.backend(f"{key}/{i}", eager=eager)
            built = _now()
            c.allreduce(pg, x)
            end = _now()
            if eager:
                c.res.add(f"{key}.construct", built - start)
                c.res.add(f"{key}.first_allreduce", end - built)
            c.res.add(key, end - start)
            c.check(x, WORLD, key)
            c.barrier(f"{key}/{i}/done")
            c.dispose(pg)


def run_split(c: Rank) -> None:
    """split_group from the healthy, eagerly initialized default group."""
    if not hasattr(dist, "split_group"):
        c.res.skip("split", "torch.distributed.split_group is missing")
        return
    # the children stay registered until the end: split_group names a child by hashing its
    # ranks with the number of registered groups, so disposing inside the loop reuses names
    children = []
    with section(c.res, "split", refusal_skips=not c.nccl):
        for i in range(c.args.repeats):
            c.barrier(f"split/{i}")
            x = c.one()
            start = _now()
            child = dist.split_group(split_ranks=[list(range(WORLD))])
            built = _now()
            children.append(child)
            dist.all_reduce(x, group=child)
            c.sync()
            end = _now()
            c.res.add("split.call", built - start)
            c.res.add("split.first_allreduce", end - built)
            c.res.add("split", end - start)
            c.check(x, WORLD, "split")
        c.barrier("split/done")
        for child in children:
            c.dispose_registered(child)


def run_abort_healthy(c: Rank) -> None:
    """abort() on a healthy, used 2-rank group, both ranks at once."""
    if not c.nccl:
        c.res.skip("abort-healthy", NCCL_ONLY)
        return
    with section(c.res, "abort-healthy"):
        for i in range(c.args.repeats):
            pg = c.backend(f"abort-healthy/{i}", eager=True)
            c.allreduce(pg, c.one())
            c.barrier(f"abort-healthy/{i}")
            start = _now()
            pg.abort()
            c.res.add("abort-healthy", _now() - start)


def run_bandwidth(c: Rank) -> None:
    """Broadcast rank 0 -> rank 1 of each size; a sample is several transfers, synced."""
    for mb in c.args.sizes_mb:
        key = f"bcast/{mb}"
        with section(c.res, key):
            nbytes = mb * MIB
            iters = _iters(nbytes, c.args.backend)
            fill = 7 if c.rank == 0 else 0
            buf = torch.full((nbytes,), fill, dtype=torch.uint8, device=c.device)
            align = c.one()
            dist.broadcast(buf, src=0)  # warm-up, and a check
            c.sync()
            if int(buf[0]) != 7 or int(buf[-1]) != 7:
                raise RuntimeError("broadcast check failed")
            for i in range(c.args.repeats):
                c.barrier(f"{key}/{i}")
                dist.all_reduce(align)  # line the ranks up on the device as well
                c.sync()
                start = _now()
                for _ in range(iters):
                    dist.broadcast(buf, src=0)
                c.sync()
                c.res.add(key, (_now() - start) / iters)
            c.res.data["bytes"][key] = nbytes
            c.res.note(key, f"{iters} broadcasts per sample")
            del buf
            if c.nccl:
                torch.cuda.empty_cache()


def wait_dead(pid: int, limit_s: float) -> bool:
    """Wait until ``pid`` has exited (a zombie counts as gone)."""
    deadline = _now() + limit_s
    while _now() < deadline:
        if psutil is not None:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                return True
        else:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
        time.sleep(0.01)
    return False


def report_refusal(c: Rank, key: str, value: Any) -> None:
    """An API that failed: an error on NCCL (where it should work), a skip on gloo."""
    if c.nccl:
        c.res.error(key, value)
    else:
        c.res.skip(key, f"refused by the API: {value}")


def _shrink(pg: Any, flags: int) -> Any:
    if not hasattr(pg, "shrink"):
        raise AttributeError(f"{type(pg).__name__} has no shrink()")
    return pg.shrink([PEER], flags)


def run_shrinks(c: Rank, groups: dict[str, list], hung: list[str]) -> None:
    """Rank 0, peer dead: backend shrink of each pre-built group, then a 1-rank all-reduce."""
    c10d = dist.distributed_c10d
    flags = {
        "shrink-default": getattr(c10d, "SHRINK_DEFAULT", 0),
        "shrink-abort": getattr(c10d, "SHRINK_ABORT", 1),
    }
    for key, flag in flags.items():
        if hung:
            c.res.skip(key, f"not run: {hung[0]} did not return")
            continue
        for pg in groups.get(key, []):
            status, value, seconds = c.bounded(functools.partial(_shrink, pg, flag))
            if status == "hung":
                hung.append(key)
            if status != "ok":
                report_refusal(c, key, value)
                break
            c.res.add(key, seconds)
            x = c.one()
            status, text, seconds = c.bounded(
                functools.partial(c.allreduce, value, x, stream_only=True)
            )
            if status != "ok":
                c.res.error(f"{key}.first_allreduce", text)
                if status == "hung":
                    hung.append(f"{key}.first_allreduce")
                break
            c.res.add(f"{key}.first_allreduce", seconds)
            c.check(x, 1, key)
        c.res.save()


def run_abort_dead(c: Rank, groups: list, hung: list[str]) -> None:
    """Rank 0, peer dead: abort() while another thread is blocked in an all-reduce."""
    key = "abort-dead"
    if not c.nccl:
        c.res.skip(key, NCCL_ONLY)
        return
    if hung:
        c.res.skip(key, f"not run: {hung[0]} did not return")
        return
    outcomes = []
    for pg in groups:
        x = c.one()
        state: dict[str, Any] = {}
        issued = threading.Event()

        def blocked(
            pg: Any = pg, x: torch.Tensor = x, state: dict = state, issued: threading.Event = issued
        ) -> None:
            torch.cuda.set_device(c.device)
            stream = torch.cuda.Stream(device=c.device)
            try:
                with torch.cuda.stream(stream):
                    work = pg.allreduce([x])
                    issued.set()
                    work.wait()
                    stream.synchronize()
                state["outcome"] = "returned without raising"
            except Exception as exc:
                state["outcome"] = f"raised {_err(exc)}"
            finally:
                issued.set()
                state["unblocked"] = _now()

        thread = threading.Thread(target=blocked, daemon=True)
        thread.start()
        issued.wait(c.limit_s)
        time.sleep(c.args.block_s)
        was_blocked = thread.is_alive()

        def do_abort(pg: Any = pg, state: dict = state) -> None:
            state["abort_start"] = _now()
            pg.abort()

        status, value, seconds = c.bounded(do_abort)
        if status != "ok":
            c.res.error(key, value)
            if status == "hung":
                hung.append(key)
            break
        c.res.add(key, seconds)
        thread.join(c.limit_s)
        if thread.is_alive():
            c.res.error(f"{key}.unblocked", f"survivor still blocked {c.limit_s:.0f} s after abort")
            hung.append(f"{key}.unblocked")
            break
        if was_blocked:
            c.res.add(f"{key}.unblocked", state["unblocked"] - state["abort_start"])
        outcomes.append(f"{'blocked' if was_blocked else 'NOT blocked'}; {state['outcome']}")
        c.res.save()
    if outcomes:
        distinct = sorted(set(outcomes))
        c.res.note(key, "the aborted all-reduce's wait(): " + " | ".join(distinct))


def run_shrink_group(c: Rank, hung: list[str]) -> None:
    """Rank 0, peer dead: torch's dist.shrink_group on the default group (last: it tears down)."""
    key = "shrink_group"
    if not hasattr(dist, "shrink_group"):
        c.res.skip(key, "torch.distributed.shrink_group is missing")
        return
    if hung:
        c.res.skip(key, f"not run: {hung[0]} did not return")
        return
    status, value, seconds = c.bounded(functools.partial(dist.shrink_group, [PEER]))
    if status != "ok":
        report_refusal(c, key, value)
        return
    c.res.add(key, seconds)
    x = c.one()

    def first(group: Any = value) -> None:
        dist.all_reduce(x, group=group)
        if c.nccl:
            torch.cuda.current_stream(c.device).synchronize()

    status, text, seconds = c.bounded(first)
    if status == "ok":
        c.res.add(f"{key}.first_allreduce", seconds)
        c.check(x, 1, key)
    else:
        c.res.error(f"{key}.first_allreduce", text)


def run_death(c: Rank) -> None:
    """Pre-build groups, let rank 1 die (SIGKILL), then shrink and abort on rank 0."""
    kinds = ["shrink-default", "shrink-abort"] + (["abort-dead"] if c.nccl else [])
    groups: dict[str, list] = {kind: [] for kind in kinds}
    with section(c.res, "prebuild"):
        for kind in kinds:
            for i in range(c.args.repeats):
                pg = c.backend(f"{kind}/{i}", eager=True)
                c.allreduce(pg, c.one())
                groups[kind].append(pg)
    c.barrier("predeath")
    if c.rank == PEER:
        c.res.data["info"]["died_on_purpose"] = True
        c.res.data["done"] = True
        c.res.save()
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    pid = int(c.store.get(f"pid/{PEER}"))
    start = _now()
    if not wait_dead(pid, c.limit_s):
        raise Fatal(f"rank {PEER} (pid {pid}) did not exit")
    c.res.data["info"]["peer_exit_wait_s"] = _now() - start
    c.peer_dead = True
    hung: list[str] = []
    run_shrinks(c, groups, hung)
    run_abort_dead(c, groups.get("abort-dead", []), hung)
    run_shrink_group(c, hung)


def child_rank(args: argparse.Namespace) -> int:
    """One of the two ranks; ends with os._exit (no communicator teardown at exit)."""
    workdir = Path(args.workdir)
    res = Results(workdir / f"rank{args.rank}.json", args.rank)
    timeout = timedelta(seconds=args.op_timeout)
    nccl = args.backend == "nccl"
    rc = 0
    try:
        if nccl:
            if torch.cuda.device_count() < WORLD:
                raise Fatal(f"needs {WORLD} GPUs, found {torch.cuda.device_count()}")
            device = torch.device("cuda", args.rank)
            torch.cuda.set_device(device)
            torch.ones(1, device=device)  # the CUDA context, outside every timer
            torch.cuda.synchronize(device)
        else:
            device = torch.device("cpu")
        store = connect_store(workdir, args.rank, timeout)
        store.set(f"pid/{args.rank}", str(os.getpid()))
        if args.rank == 0:
            res.data["info"]["api"] = api_report()
        res.save()
        c = Rank(args.rank, device, nccl, store, Barrier(store, args.rank), res, timeout, args)
        run_first(c)
        run_new(c, eager=False)
        run_new(c, eager=True)
        run_split(c)
        run_abort_healthy(c)
        run_bandwidth(c)
        run_death(c)  # rank 1 does not come back from here
        res.data["done"] = True
    except Fatal as exc:
        res.error("fatal", str(exc))
        rc = 2
    except Exception as exc:
        traceback.print_exc()
        res.error("fatal", _err(exc))
        rc = 1
    res.save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


# ---------------------------------------------------------------- parent


def run_children(
    workdir: Path, names: list[str], forwarded: list[str], timeout_s: float
) -> dict[str, dict[str, Any]]:
    """Start the named children, wait at most ``timeout_s``, kill by PID what overruns."""
    env = dict(os.environ)
    env.update({key: os.environ[key] for key in BENCH_ENV})
    env["PYTHONUNBUFFERED"] = "1"
    procs: dict[str, subprocess.Popen] = {}
    logs = []
    status: dict[str, dict[str, Any]] = {}
    try:
        start = _now()
        for name in names:
            extra = ["--child", "local"] if name == "local" else ["--child", "rank"]
            if name.startswith("rank"):
                extra += ["--rank", name[4:]]
            cmd = [sys.executable, str(SCRIPT), *extra, *forwarded]
            cmd += ["--workdir", str(workdir), "--parent-pid", str(os.getpid())]
            log = (workdir / f"{name}.log").open("w")
            logs.append(log)
            procs[name] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO
            )
            status[name] = {"pid": procs[name].pid, "rc": None, "outcome": "running"}
        failed_at = None
        while True:
            running = [n for n, p in procs.items() if p.poll() is None]
            for name, proc in procs.items():
                if proc.returncode is not None and status[name]["rc"] is None:
                    status[name]["rc"] = proc.returncode
                    status[name]["seconds"] = round(_now() - start, 1)
                    ok = proc.returncode == 0 or _died_on_purpose(workdir, name, proc.returncode)
                    status[name]["outcome"] = "ok" if ok else "failed"
                    if not ok and failed_at is None:
                        failed_at = _now()
            if not running:
                break
            overran = _now() - start > timeout_s
            orphaned = failed_at is not None and _now() - failed_at > FAILED_PEER_GRACE_S
            if overran or orphaned:
                for name in running:
                    procs[name].kill()
                    procs[name].wait()
                    status[name]["rc"] = procs[name].returncode
                    status[name]["outcome"] = (
                        f"killed after {timeout_s:g} s (--timeout)"
                        if overran
                        else f"killed {FAILED_PEER_GRACE_S:.0f} s after a peer failed"
                    )
                break
            time.sleep(0.1)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    return status


def _died_on_purpose(workdir: Path, name: str, rc: int) -> bool:
    if rc != -signal.SIGKILL or name != f"rank{PEER}":
        return False
    data = _load(workdir / f"{name}.json")
    return bool(data.get("info", {}).get("died_on_purpose"))


def _load(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def merge_samples(parts: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per key, per repeat: the slower process (max); keys of one process are kept as is."""
    keys: list[str] = []
    for part in parts:
        keys += [k for k in part.get("samples", {}) if k not in keys]
    out = {}
    for key in keys:
        lists = [p["samples"][key] for p in parts if key in p.get("samples", {})]
        out[key] = [max(vals) for vals in zip(*lists, strict=False)]  # shortest wins
    return out


def row_specs(sizes: list[int], nccl: bool, copy_device: str) -> list[tuple[str, str, str]]:
    """(key, label, unit) of every row, in the order printed."""
    comm = "NCCL" if nccl else "gloo"
    eager = " (eager)" if nccl else ""
    rows = [
        ("first", f"first comm of a process: init_process_group{eager} + all-reduce", "s"),
        ("new", f"new (lazy): new {comm} group + first 4-byte all-reduce", "s"),
        ("new-eager.construct", "new-eager: construct, eager init", "s"),
        ("new-eager.first_allreduce", "new-eager: first all-reduce", "s"),
        ("new-eager", "new-eager: total", "s"),
        ("split.call", "split: split_group of the healthy parent", "s"),
        ("split.first_allreduce", "split: first all-reduce", "s"),
        ("split", "split: total", "s"),
        ("abort-healthy", "abort(): healthy 2-rank group (both ranks)", "s"),
        ("shrink-default", "shrink, peer dead (SHRINK_DEFAULT): backend shrink", "s"),
        ("shrink-default.first_allreduce", "  then first all-reduce, 1 rank", "s"),
        ("shrink-abort", "shrink, peer dead (SHRINK_ABORT): backend shrink", "s"),
        ("shrink-abort.first_allreduce", "  then first all-reduce, 1 rank", "s"),
        ("shrink_group", "dist.shrink_group of the default group, peer dead", "s"),
        ("shrink_group.first_allreduce", "  then first all-reduce, 1 rank", "s"),
        ("shrink+new", "shrink then a new 2-rank comm (shrink + new medians)", "s"),
        ("abort-dead", "abort(): peer dead, survivor blocked (other thread)", "s"),
        ("abort-dead.unblocked", "  survivor unblocked, from abort start", "s"),
    ]
    for mb in sizes:
        rows.append((f"bcast/{mb}", f"{comm} broadcast rank 0 -> rank 1, {mb} MiB", "GB/s"))
    for mb in sizes:
        rows.append((f"peer/{mb}", f"peer copy cuda:0 -> cuda:1 (1 process), {mb} MiB", "GB/s"))
    for mb in sizes:
        rows.append((f"same/{mb}", f"same-device copy on {copy_device}, {mb} MiB", "GB/s"))
    return rows


def build_report(args: argparse.Namespace, workdir: Path, status: dict) -> dict[str, Any]:
    """Merge the children's results into rows, notes and environment."""
    local = _load(workdir / "local.json")
    ranks = [_load(workdir / f"rank{r}.json") for r in range(WORLD)]
    parts = [p for p in (local, *ranks) if p]
    samples = merge_samples([p for p in ranks if p])
    samples.update(local.get("samples", {}))
    nbytes: dict[str, int] = {}
    skipped: dict[str, str] = {}
    errors: dict[str, str] = {}
    notes: dict[str, str] = {}
    for part in parts:
        nbytes.update(part.get("bytes", {}))
        skipped.update(part.get("skipped", {}))
        notes.update(part.get("notes", {}))
        who = "local" if part.get("rank") == -1 else f"rank {part.get('rank')}"
        for key, text in part.get("errors", {}).items():
            errors[key] = f"{who}: {text}"
    info = dict(local.get("info", {}))
    api = ranks[0].get("info", {}).get("api", {}) if ranks[0] else {}
    nccl = args.backend == "nccl"
    rows = []
    for key, label, unit in row_specs(args.sizes_mb, nccl, info.get("copy_device", "cuda:0")):
        values = samples.get(key, [])
        if unit == "GB/s" and key in nbytes:
            values = [nbytes[key] / s / 1e9 for s in values if s > 0]
        row: dict[str, Any] = {"key": key, "label": label, "unit": unit, "n": len(values)}
        if values:
            row.update(median=statistics.median(values), min=min(values), max=max(values))
        if key == "shrink+new" and samples.get("shrink-default") and samples.get("new"):
            row.update(
                median=statistics.median(samples["shrink-default"])
                + statistics.median(samples["new"]),
                n=None,
            )
        base = key.split(".")[0]
        for name in (key, f"{key}.check", base):
            if name in errors:
                row["note"] = f"failed: {errors[name]}"
                break
            if name in skipped:
                row["note"] = f"skipped: {skipped[name]}"
                break
        if "note" not in row and "median" not in row:
            row["note"] = "not measured"
        rows.append(row)
    messages = [
        "each repeat counts the slower rank: the time until the result is on both ranks",
        SPLIT_NOTE,
    ]
    version = info.get("nccl")
    if not nccl:
        messages.append("gloo smoke run on CPU: the numbers say nothing about NCCL")
    elif version and tuple(int(v) for v in version.split(".")) >= (2, 29, 2):
        messages.append(f"NCCL {version} has ncclCommGrow: shrink + re-add was not measured")
    else:
        messages.append(NO_GROW)
    if "abort-dead" in notes:
        messages.append(f"abort with the peer dead: {notes['abort-dead']}")
    waited = ranks[0].get("info", {}).get("peer_exit_wait_s") if ranks[0] else None
    if waited is not None:
        messages.append(
            f"rank {PEER} killed itself (SIGKILL) after building the groups; rank 0 saw it gone "
            f"{waited:.3f} s after the barrier, then ran shrink, abort and shrink_group"
        )
    messages.append(
        "bandwidth: GB/s = bytes / seconds / 1e9; a sample is back-to-back transfers of "
        f"{SAMPLE_BYTES[args.backend] // MIB} MiB or more in total, synchronized, divided by "
        "their count; a same-device copy reads and writes the bytes (2x the memory traffic)"
    )
    for key in ("fatal", "prebuild", "setup"):
        if key in errors:
            messages.append(f"{key} error: {errors[key]}")
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python " + shlex.join(sys.argv),
        "backend": args.backend,
        "repeats": args.repeats,
        "sizes_mb": args.sizes_mb,
        "env": {key: os.environ.get(key) for key in BENCH_ENV},
        "info": info,
        "api": api,
        "children": status,
        "rows": rows,
        "notes": messages,
        "skipped": skipped,
        "errors": errors,
        "samples": samples,
        "bytes": nbytes,
    }


def _fmt(row: dict[str, Any], field: str) -> str:
    value = row.get(field)
    if value is None:
        return "-"
    return f"{value:.1f}" if row["unit"] == "GB/s" else f"{value:.4f}"


def table_lines(report: dict[str, Any], markdown: bool) -> list[str]:
    head = ["measurement", "unit", "median", "min", "max", "n", "note"]
    body = []
    previous = ""
    for row in report["rows"]:
        note = row.get("note", "")
        if note and note == previous:
            note = "(as above)"
        else:
            previous = note
        if len(note) > 160:
            note = note[:157] + "..."
        n = "-" if row.get("n") is None else str(row["n"])
        cells = [row["label"], row["unit"], _fmt(row, "median"), _fmt(row, "min")]
        body.append([*cells, _fmt(row, "max"), n, note])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for cells in body:
            cells = [c.replace("|", "\\|") for c in cells]
            cells[2] = f"**{cells[2]}**" if cells[2] != "-" else "-"
            out.append("| " + " | ".join(cells) + " |")
        return out
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head) - 1)]

    def line(cells: list[str]) -> str:
        left = cells[0].ljust(widths[0]) + "  " + cells[1].ljust(widths[1])
        nums = "  ".join(c.rjust(w) for c, w in zip(cells[2:6], widths[2:6], strict=True))
        return f"{left}  {nums}  {cells[6]}".rstrip()

    return [line(head), "-" * (sum(widths) + 12), *(line(c) for c in body)]


def _hardware(info: dict[str, Any]) -> str:
    gpus = info.get("gpus") or []
    return f"{len(gpus)} x {gpus[0]}" if gpus else "no GPU"


def machine_line(report: dict[str, Any]) -> str:
    info = report["info"]
    hw = _hardware(info)
    return (
        f"torch {info.get('torch')}, NCCL {info.get('nccl') or '-'}, CUDA {info.get('cuda')}, "
        f"{hw}, Python {info.get('python')}, {info.get('cpus')} CPUs"
    )


def print_report(report: dict[str, Any]) -> None:
    print()
    print(f"ccl_rebuild ({report['backend']}, {report['repeats']} repeats) {report['date']}")
    print(machine_line(report))
    print()
    print("\n".join(table_lines(report, markdown=False)))
    print()
    for message in report["notes"]:
        print(f"* {message}")
    if report["api"]:
        print()
        print("API on this machine:")
        for name, value in report["api"].items():
            print(f"  {name}: {value}")
    print()
    for name, child in report["children"].items():
        print(f"process {name}: {child['outcome']} (rc {child['rc']})")


def markdown(report: dict[str, Any]) -> str:
    info = report["info"]
    comm = f"NCCL {info.get('nccl')}" if report["backend"] == "nccl" else "gloo"
    lines = [
        f"## Communicator rebuild costs ({_hardware(info)}, {comm})",
        "",
        f"Measured {report['date']} with `{report['command']}` (the script sets "
        + " ".join(f"{k}={v}" for k, v in BENCH_ENV.items())
        + f"); {machine_line(report)}. Seconds or GB/s; median, min and max of "
        f"{report['repeats']} repeats; a repeat counts the slower rank.",
        "",
        *table_lines(report, markdown=True),
        "",
        *(f"- {message}" for message in report["notes"][1:]),
        "",
    ]
    return "\n".join(lines)


def parent(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="ccl-rebuild-"))
    forwarded = [
        "--backend",
        args.backend,
        "--repeats",
        str(args.repeats),
        "--sizes-mb",
        ",".join(map(str, args.sizes_mb)),
        "--op-timeout",
        str(args.op_timeout),
        "--block-s",
        str(args.block_s),
        "--timeout",
        str(args.timeout),
    ]
    sizes = ", ".join(map(str, args.sizes_mb))
    print(f"ccl_rebuild: {args.backend}, {args.repeats} repeats, sizes {sizes} MiB; {workdir}")

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    status: dict[str, dict[str, Any]] = {}
    print("copies in one process ...", flush=True)
    status.update(run_children(workdir, ["local"], forwarded, args.timeout))
    print(f"  {status['local']['outcome']}; two ranks ...", flush=True)
    status.update(run_children(workdir, ["rank0", "rank1"], forwarded, args.timeout))
    report = build_report(args, workdir, status)
    print_report(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"JSON: {args.out}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(report))
        print(f"Markdown: {args.markdown}")
    ok = all(child["outcome"] == "ok" for child in status.values())
    ok = ok and not any(k in report["errors"] for k in ("fatal", "prebuild", "setup"))
    if ok:
        shutil.rmtree(workdir, ignore_errors=True)
        return 0
    for name, child in status.items():
        if child["outcome"] != "ok" or "fatal" in _load(workdir / f"{name}.json").get("errors", {}):
            log = workdir / f"{name}.log"
            tail = log.read_text(errors="replace").splitlines()[-30:] if log.exists() else []
            print(f"--- last lines of {log}", file=sys.stderr)
            print("\n".join(tail), file=sys.stderr)
    print(f"FAILED; logs kept in {workdir}", file=sys.stderr)
    return 1


def _sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--sizes-mb",
        type=_sizes,
        default=None,
        help="bandwidth sizes in MiB, comma-separated (default 1024,4096; 64 with gloo)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per process")
    parser.add_argument(
        "--op-timeout",
        type=float,
        default=60.0,
        help="seconds for one store wait or one operation after the peer's death",
    )
    parser.add_argument(
        "--block-s",
        type=float,
        default=0.5,
        help="how long the survivor is blocked before abort()",
    )
    parser.add_argument("--out", type=Path, default=None, help="write JSON here")
    parser.add_argument("--markdown", type=Path, default=None, help="write a Markdown section")
    parser.add_argument("--child", choices=["local", "rank"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.sizes_mb is None:
        args.sizes_mb = [64] if args.backend == "gloo" else [1024, 4096]
    if args.child:
        guard_child(args.parent_pid, args.timeout + 10)
        return child_local(args) if args.child == "local" else child_rank(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
