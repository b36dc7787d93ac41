"""State transfer: a peer's structure is unpickled with a whitelist, a real state dict
crosses a two-rank gloo communicator intact, and so does a replacement's whole payload."""

import io
import os
import pickle
import threading
from collections import OrderedDict
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from xmig.ccl import Communicator
from xmig.state import DdpPayload, PayloadError, ReplacementPayload, transfer
from xmig.state.transfer import (
    BUCKET_BYTES,
    TensorRef,
    _RestrictedUnpickler,
    buckets,
    pack,
    recv_state,
    send_state,
)

CPU = torch.device("cpu")


class _Exploit:
    """Unpickles into a call of ``os.system``: what a hostile peer would send."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_restricted_unpickler_refuses_a_callable():
    data = pickle.dumps({"structure": _Exploit(), "tensors": []})
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        _RestrictedUnpickler(io.BytesIO(data)).load()


def test_restricted_unpickler_refuses_an_arbitrary_class():
    data = pickle.dumps({"structure": threading.Event, "tensors": []})
    with pytest.raises(pickle.UnpicklingError, match="threading"):
        _RestrictedUnpickler(io.BytesIO(data)).load()


def test_restricted_unpickler_refuses_a_raw_tensor():
    """Tensors travel as buffers, never inside the pickle."""
    data = pickle.dumps({"structure": torch.zeros(2), "tensors": []})
    with pytest.raises(pickle.UnpicklingError):
        _RestrictedUnpickler(io.BytesIO(data)).load()


def test_pack_structure_loads_through_the_restricted_unpickler():
    """What ``pack`` produces uses only whitelisted classes, tensors replaced by references."""
    t0, t1 = torch.arange(6.0).view(2, 3), torch.tensor([1, 2], dtype=torch.int64)
    state = OrderedDict(a=t0, b=[t1, (1, "x", None)], c={3: 2.5, "s": {1, 2}})
    meta, tensors = pack(state)
    assert len(tensors) == 2
    assert tensors[0] is not t0 and torch.equal(tensors[0], t0)
    loaded = _RestrictedUnpickler(io.BytesIO(meta)).load()
    assert loaded["tensors"] == [("float32", (2, 3), "cpu"), ("int64", (2,), "cpu")]
    structure = loaded["structure"]
    assert type(structure) is OrderedDict
    assert structure["a"] == TensorRef(0)
    assert structure["b"] == [TensorRef(1), (1, "x", None)]
    assert structure["c"] == {3: 2.5, "s": {1, 2}}


# ---- a real transfer -----------------------------------------------------------------------


def _sample_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "extra": OrderedDict(
            [
                ("half", torch.randn(3, 2).to(torch.bfloat16)),
                ("ids", torch.arange(10, dtype=torch.int64).view(2, 5)),
                ("transposed", torch.arange(12.0).view(3, 4).t()),  # not contiguous
                ("nested", [1, (2.5, torch.ones(2)), [torch.zeros(0), "text"], (None, True)]),
            ]
        ),
        "step": 11,
        "name": "run-a",
    }


def _tensor_bytes(value):
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _assert_same(got, want, path="state"):
    assert type(got) is type(want), f"{path}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, path
        assert got.shape == want.shape, path
        assert got.device == want.device, path
        assert torch.equal(got, want), path
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        for key in want:
            _assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


def _transfer(state, bucket_bytes, alter=None):
    """``state`` from rank 0 to rank 1 of a gloo pair (two threads); ``alter(tensor)`` changes
    what rank 1 receives, as a machine in the middle would."""
    store = dist.HashStore()
    results: dict[str, object] = {}
    errors: list[BaseException] = []
    real = transfer._broadcast

    def broadcast(comm, tensor, device):
        real(comm, tensor, device)
        if alter is not None and comm.rank == 1 and tensor.dtype == torch.float32:
            alter(tensor)

    def run(rank):
        try:
            comm = Communicator("gloo", "pairtest", 0, store, rank, 2, timedelta(seconds=30))
            if rank == 0:
                results["sent"] = send_state(comm, state, CPU, bucket_bytes)
            else:
                results["received"] = recv_state(comm, CPU, CPU, bucket_bytes)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    transfer._broadcast = broadcast
    try:
        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        transfer._broadcast = real
    assert not any(t.is_alive() for t in threads), "transfer did not finish within 30 s"
    assert not errors, errors
    return results["sent"], *results["received"]


@pytest.mark.parametrize("bucket_bytes", [BUCKET_BYTES, 64], ids=["one-bucket", "many-buckets"])
def test_a_state_altered_in_transit_does_not_match_its_digest(bucket_bytes):
    """One bit of one parameter changed between the peers: the receiver's digest differs from
    the one the sender announces, so the replacement refuses the state."""
    state = _sample_state()

    def flip(tensor):
        tensor.view(torch.int32).reshape(-1)[0] ^= 1

    sent, got, received = _transfer(state, bucket_bytes, alter=flip)
    pairs = zip(got["model"].values(), state["model"].values(), strict=True)
    assert not all(torch.equal(a, b) for a, b in pairs)
    assert received.digest != sent.digest
    sent, _got, received = _transfer(state, bucket_bytes)
    assert received.digest == sent.digest


def test_buckets_are_consecutive_runs_within_the_limit():
    specs = [("float32", (4,), "cpu"), ("float32", (2,), "cpu"), ("float32", (100,), "cpu"),
             ("float32", (1,), "cpu"), ("float32", (3,), "cpu")]  # fmt: skip
    # 16 + 8 bytes fit in 32; the 400-byte tensor is a bucket of its own; 4 + 12 fit
    assert buckets(specs, [0, 1, 2, 3, 4], 32) == [[0, 1], [2], [3, 4]]
    assert buckets(specs, [0, 1, 2, 3, 4], 10**6) == [[0, 1, 2, 3, 4]]
    assert buckets(specs, [0, 2, 4], 1) == [[0], [2], [4]]
    assert buckets(specs, [], 32) == []


@pytest.mark.parametrize("bucket_bytes", [BUCKET_BYTES, 64], ids=["one-bucket", "many-buckets"])
def test_send_and_recv_state_over_gloo(bucket_bytes):
    state = _sample_state()
    # the optimizer state is keyed by parameter index and holds tensors
    assert all(isinstance(k, int) for k in state["optimizer"]["state"])
    assert isinstance(state["optimizer"]["state"][0]["exp_avg"], torch.Tensor)

    send_stats, got, recv_stats = _transfer(state, bucket_bytes)
    _assert_same(got, state)
    # the received tensors are new memory, not the sender's
    assert got["model"]["0.weight"].data_ptr() != state["model"]["0.weight"].data_ptr()

    tensor_bytes = _tensor_bytes(state)
    assert tensor_bytes > 0
    assert send_stats.bytes >= tensor_bytes
    assert recv_stats.bytes >= tensor_bytes
    assert send_stats.bytes == recv_stats.bytes
    assert send_stats.seconds >= 0 and recv_stats.seconds >= 0
    # both ends hashed the same bytes: the receiver's check against the announced digest
    assert len(send_stats.digest) == 64 and recv_stats.digest == send_stats.digest


# ---- a replacement's payload -----------------------------------------------------------------


def _payload():
    layout = [
        torch.tensor([2, 0, 1, 2], dtype=torch.int32),
        torch.tensor([1, 2], dtype=torch.int32),
    ]
    return ReplacementPayload(
        step=5,
        mode="replay",
        first_step=0,
        state=_sample_state(),
        ddp=DdpPayload(layout=layout, ready_order=[2, 0, 1], verify_ready_order=True),
        signatures={"world": ["allreduce|(10,):torch.float32|reduceOp=RedOpType.SUM"]},
        results={"pg3:5:0": [torch.arange(3.0)]},
        check_after=6,
    )


def test_a_replacement_payload_crosses_a_pair_intact():
    """What the serving survivor sends travels as plain containers (the receiver's unpickler
    builds nothing else) and comes back as the same payload."""
    payload = _payload()
    sent, got, received = _transfer(payload.to_wire(), BUCKET_BYTES)
    assert received.digest == sent.digest
    back = ReplacementPayload.from_wire(got)
    assert (back.step, back.mode, back.first_step) == (5, "replay", 0)
    assert back.signatures == payload.signatures and back.check_after == 6
    assert list(back.results) == ["pg3:5:0"] and torch.equal(
        back.results["pg3:5:0"][0], torch.arange(3.0)
    )
    _assert_same(back.state, payload.state)
    _assert_same(back.ddp.layout, payload.ddp.layout)
    assert back.ddp.in_step is None and back.ddp.in_step_index == 0
    assert back.ddp.ready_order == [2, 0, 1] and back.ddp.verify_ready_order is True


@pytest.mark.parametrize("change, why", [
    (lambda w: w.pop("signatures"), "does not have the fields"),
    (lambda w: w.update(mode="redo"), "unknown mode"),
    (lambda w: w.update(step="5"), "step is not an integer"),
    (lambda w: w.update(state=[1]), "state is not a mapping"),
    (lambda w: w["ddp"].update(layout=[1, 2]), "ddp.layout is not a list of tensors"),
    (lambda w: w["ddp"].update(ready_order=[0, "1"]), "ddp.ready_order"),
    (lambda w: w["ddp"].update(verify_ready_order=1), "ddp.verify_ready_order"),
    (lambda w: w.update(signatures=["x"]), "signatures is not a mapping of groups"),
    (lambda w: w.update(signatures={"world": [3]}), r"signatures\[world\] is not a list"),
    (lambda w: w.update(results={"5:0": []}), "is not group:step:index"),
])  # fmt: skip
def test_a_payload_that_is_not_one_is_refused(change, why):
    wire = _payload().to_wire()
    change(wire)
    with pytest.raises(PayloadError, match=why):
        ReplacementPayload.from_wire(wire)
