"""A host's memory written once before moves land on it (``xmig.migrate.warm``)."""

from __future__ import annotations

import threading
import time

import psutil
import pytest

from xmig.migrate.warm import (
    CHUNK_BYTES,
    WARM_ENV,
    MemoryWarmer,
    cgroup_headroom,
    wanted_bytes,
    warm_memory,
)


def test_the_size_asked_for_is_read_in_gb_and_bad_values_say_what_is_wrong():
    assert wanted_bytes({}) == 0
    assert wanted_bytes({WARM_ENV: " "}) == 0
    assert wanted_bytes({WARM_ENV: "2.5"}) == 2_500_000_000
    assert wanted_bytes({WARM_ENV: "0"}) == 0
    for bad, why in [("8G", "not a number"), ("-1", ">= 0"), ("nan", ">= 0"), ("inf", ">= 0")]:
        with pytest.raises(ValueError, match=why) as caught:
            wanted_bytes({WARM_ENV: bad})
        assert WARM_ENV in str(caught.value)


def test_the_memory_is_written_while_held_and_all_given_back():
    process = psutil.Process()
    seen: list[int] = []

    def available() -> int:  # called before each chunk: what the process holds so far
        seen.append(process.memory_info().rss)
        return 1 << 50

    before = process.memory_info().rss
    done = warm_memory(3 * CHUNK_BYTES, keep_free=0, available=available)
    assert done.bytes == 3 * CHUNK_BYTES and done.stopped is None and done.seconds > 0
    # resident, not only mapped: two chunks were written before the third was asked for
    assert seen[-1] - seen[0] >= 2 * CHUNK_BYTES * 0.9
    assert process.memory_info().rss - before < CHUNK_BYTES / 2  # all given back


def test_it_stops_at_the_floor_of_free_memory():
    free = [10 * CHUNK_BYTES]

    def available() -> int:
        free[0] -= CHUNK_BYTES // 2  # others take memory too
        return free[0]

    done = warm_memory(100 * CHUNK_BYTES, keep_free=6 * CHUNK_BYTES, available=available)
    # (in chunks) available 9.5, 9, ... 7 before the 1st to the 6th: each leaves >= 6 free;
    # before the 7th, 6.5 would leave 5.5
    assert done.bytes == 6 * CHUNK_BYTES
    assert done.stopped is not None and "must stay free" in done.stopped


def test_a_move_stops_it_at_once():
    stop = threading.Event()
    stop.set()
    done = warm_memory(100 * CHUNK_BYTES, keep_free=0, stop=stop)
    assert done.bytes == 0 and done.stopped == "stopped: a move began"

    def slowly() -> int:  # 1 MB each 10 ms: 1,000 MB would take 10 s
        time.sleep(0.01)
        return 1 << 50

    warmer = MemoryWarmer(1000 << 20, "agent 9", keep_free=0, available=slowly, chunk=1 << 20)
    warmer.start()
    time.sleep(0.2)
    halted = time.monotonic()
    warmer.halt(timeout=30)
    assert time.monotonic() - halted < 2  # the next chunk's check, then the memory back
    assert warmer.result is not None and warmer.result.stopped == "stopped: a move began"
    assert 0 < warmer.result.bytes < 500 << 20


def _write(folder, **files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_a_memory_cgroups_limit_bounds_what_may_be_taken(tmp_path):
    """The node's workers share the agent's cgroup: writing past its limit would get one of
    them killed, so the least room left over the cgroup and its parents counts."""
    root = tmp_path / "fs"
    cgroup = tmp_path / "cgroup"
    # cgroup v2: the job's cgroup has no limit of its own, its parent one with 3 GB left
    cgroup.write_text("0::/jobs/job1\n")
    _write(root, memory_max="max", memory_current="1")
    _write(root / "jobs", memory_max=str(8 << 30), memory_current=str(5 << 30))
    _write(root / "jobs" / "job1", memory_max="max", memory_current=str(4 << 30))
    assert cgroup_headroom(cgroup, root) == 3 << 30
    # over its limit already: nothing
    _write(root / "jobs", memory_current=str(9 << 30))
    assert cgroup_headroom(cgroup, root) == 0
    # no limit anywhere
    _write(root / "jobs", memory_max="max")
    assert cgroup_headroom(cgroup, root) is None
    # cgroup v1, its path hidden by a cgroup namespace: the memory controller's root is ours
    cgroup.write_text("4:memory:/not/visible\n3:cpu:/x\n")
    _write(root / "memory", memory_limit_in_bytes=str(2 << 30),
           memory_usage_in_bytes=str(1 << 30))  # fmt: skip
    assert cgroup_headroom(cgroup, root) == 1 << 30
    _write(root / "memory", memory_limit_in_bytes="9223372036854771712")  # v1's "none"
    assert cgroup_headroom(cgroup, root) is None
    assert cgroup_headroom(tmp_path / "missing", root) is None
