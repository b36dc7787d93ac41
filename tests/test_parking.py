"""A moving rank's tensors parked in a shared memory file and taken back (CPU here; the
same code registers the file with CUDA on a GPU, measured in bench/results/gpu-speed.md)."""

import os
from pathlib import Path

import pytest
import torch

from xmig.paths import huge_pages, is_parking_file, parking_files
from xmig.worker import parking as parking_module
from xmig.worker.memory import anonymous_bytes, largest_anonymous_mappings, trim_host_memory
from xmig.worker.parking import (
    MIN_STORAGE_BYTES,
    Parking,
    ParkingError,
    chunks,
    expected_bytes,
    pieces,
    storages,
)


@pytest.fixture
def job_id():
    job = f"test{os.getpid()}"
    yield job
    for path in parking_files(job):
        path.unlink()


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 64))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(8, 128)).square().mean().backward()
        optimizer.step()
    return model, optimizer


def _state(model, optimizer):
    params = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    moments = {k: {n: t.clone() for n, t in s.items()} for k, s in optimizer.state.items()}
    return params, grads, moments


def _same(a, b):
    (pa, ga, oa), (pb, gb, ob) = a, b
    return (all(torch.equal(pa[k], pb[k]) for k in pa)
            and all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))
            and all(torch.equal(oa[k][n], ob[k][n]) for k in oa for n in oa[k]))  # fmt: skip


def test_parked_tensors_come_back_bit_for_bit_and_training_goes_on(job_id):
    model, optimizer = _trained()
    before = _state(model, optimizer)
    parking = Parking.prepare(job_id, 1, 4, expected_bytes([model, optimizer]),
                              torch.device("cpu"))  # fmt: skip
    assert parking_files(job_id) == [parking.path] and is_parking_file(str(parking.path))
    parked = parking.park([model, optimizer])
    # two weights, their gradients and both moments of each (the biases are too small)
    assert parked.storages == 8 and storages([model, optimizer]) == []  # every one freed
    assert model[0].weight.untyped_storage().nbytes() == 0
    assert parked.parked_bytes >= 2 * 128 * 256 * 4
    parking.unpark()
    parking.close()
    assert _same(_state(model, optimizer), before) and not parking.path.exists()
    # the optimizer and the module still hold the same tensors: training goes on
    model(torch.randn(8, 128)).square().mean().backward()
    optimizer.step()
    assert not torch.equal(model[0].weight, before[0]["0.weight"])


def test_a_storage_shared_by_views_is_parked_once():
    base = torch.zeros(1 << 16)
    module = torch.nn.Module()
    module.a = torch.nn.Parameter(base[: 1 << 15])
    module.b = torch.nn.Parameter(base[1 << 15 :])
    assert len(storages([module])) == 1


def test_small_and_fixed_storages_stay():
    module = torch.nn.Linear(4, 4)  # far below MIN_STORAGE_BYTES
    fixed = torch.frombuffer(bytearray(MIN_STORAGE_BYTES * 2), dtype=torch.uint8)
    module.register_buffer("fixed", fixed)  # memory torch did not allocate: cannot be resized
    assert storages([module]) == []


def test_what_does_not_fit_stays_in_place(job_id):
    model, optimizer = _trained()
    before = _state(model, optimizer)
    largest = storages([model])[0].nbytes()
    parking = Parking.prepare(job_id, 0, 1, largest, torch.device("cpu"))
    parked = parking.park([model, optimizer])
    assert parked.storages == 1 and parked.parked_bytes == largest
    parking.unpark()
    parking.close()
    assert _same(_state(model, optimizer), before)


def test_no_room_and_nothing_to_park_are_refused(job_id, tmp_path, monkeypatch):
    with pytest.raises(ParkingError, match="nothing to park"):
        Parking.prepare(job_id, 0, 1, 0, torch.device("cpu"))
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(ParkingError, match="GiB free"):
        Parking.prepare(job_id, 0, 1, free + 1, torch.device("cpu"), folder=tmp_path)
    monkeypatch.setenv("XMIG_PARK", "0")
    with pytest.raises(ParkingError, match="turned off"):
        Parking.prepare(job_id, 0, 1, 4096, torch.device("cpu"))
    assert parking_files(job_id) == [] and list(tmp_path.iterdir()) == []


def test_only_parking_files_are_accepted_from_another_machine():
    assert is_parking_file("/dev/shm/xmig-park-job-rank1-g2-77-ab")
    assert not is_parking_file("/dev/shm/other")
    assert not is_parking_file("/etc/xmig-park-job")
    assert not is_parking_file("/dev/shm/xmig-park-../../etc/passwd")
    assert is_parking_file("/run/park/xmig-park-job-rank1", folder=Path("/run/park"))


def test_the_file_is_pinned_in_chunks_and_copies_are_split_where_a_chunk_ends():
    assert chunks(10, chunk=4) == [(0, 4), (4, 4), (8, 2)]
    assert chunks(8, chunk=4) == [(0, 4), (4, 4)]
    assert chunks(0, chunk=4) == []
    assert pieces(0, 4, chunk=4) == [(0, 4)]
    assert pieces(2, 9, chunk=4) == [(2, 4), (4, 8), (8, 11)]
    assert pieces(5, 2, chunk=4) == [(5, 7)]
    # every byte once, in order, none across an edge
    for offset, size in ((0, 1), (3, 13), (4096, 3 * 4096 + 7)):
        cut = pieces(offset, size, chunk=4096)
        assert cut[0][0] == offset and cut[-1][1] == offset + size
        assert all(a[1] == b[0] for a, b in zip(cut, cut[1:], strict=False))
        assert all(start // 4096 == (end - 1) // 4096 for start, end in cut)


def test_storages_that_cross_a_chunk_edge_are_parked_in_pieces(job_id, monkeypatch):
    monkeypatch.setattr(parking_module, "REGISTER_CHUNK", 3 * 4096)
    torch.manual_seed(0)
    tensors = [torch.randn(n) for n in (5000, 1025, 7000, 3 * 1024)]  # not page multiples
    expected = [t.clone() for t in tensors]
    parking = Parking.prepare(job_id, 0, 1, expected_bytes(tensors), torch.device("cpu"))
    try:
        parked = parking.park(tensors)
        assert parked.storages == len(tensors)
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
        parking.unpark()
    finally:
        parking.close()
    for got, want in zip(tensors, expected, strict=True):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_trimming_gives_freed_heap_back_and_the_count_sees_it():
    # many mid-sized blocks come from the C library's heap, which keeps them once freed
    before = anonymous_bytes()
    assert before is not None and before > 0
    blocks = [torch.ones(64 * 1024) for _ in range(2000)]  # 256 KiB each, 0.5 GB in all
    held = anonymous_bytes()
    assert held is not None and held > before + 400e6
    del blocks
    trim_host_memory()
    after = anonymous_bytes()
    assert after is not None and after < held - 400e6


def test_the_largest_anonymous_mappings_are_found_largest_first():
    block = torch.ones(48 * 1024 * 1024 // 4)  # 48 MiB, touched: a mapping of its own
    found = largest_anonymous_mappings(5)
    sizes = [size for size, _ in found]
    assert sizes == sorted(sizes, reverse=True) and len(found) == 5
    assert sizes[0] >= block.nbytes
    assert all(where for _, where in found)


def test_the_parking_file_asks_for_huge_pages_and_says_whether_it_got_them(job_id):
    parking = Parking.prepare(job_id, 0, 1, 1 << 21, torch.device("cpu"))
    try:
        assert parking.huge_pages == (huge_pages(parking.path.parent) != "never")
    finally:
        parking.close()
