"""Op records: signatures every rank can compare, scratch copies for a re-issue, restoring
clobbered inputs, serving an op without the network, and the pool the log's copies reuse."""

import time

import torch
import torch.distributed as dist

from xmig.proxy.oplog import BufferPool, OpRecord, signature_of


def _allreduce_opts(op=dist.ReduceOp.SUM):
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return opts


def _record(op, args, inputs=None):
    return OpRecord(
        step=3,
        index=0,
        op=op,
        args=args,
        signature=signature_of(op, args),
        future=torch.futures.Future(),
        inputs=inputs,
    )


# ---- signatures ----------------------------------------------------------------------------


def test_equal_ops_have_equal_signatures():
    """Different tensors and option objects with the same content give the same signature."""
    a = signature_of("allreduce", ([torch.zeros(10)], _allreduce_opts()))
    b = signature_of("allreduce", ([torch.ones(10)], _allreduce_opts()))
    assert a == b
    assert a == "allreduce|(10,):torch.float32|reduceOp=RedOpType.SUM"


def test_signatures_follow_the_options_values_each_time():
    """(the options' texts are kept per field and value: a later op with other values of the
    same options type must not take an earlier op's text)"""
    t = torch.zeros(3)
    texts = []
    for root in (0, 1, 0, 2):
        options = dist.BroadcastOptions()
        options.rootRank = root
        texts.append(signature_of("broadcast", ([t], options)))
    expected = "broadcast|(3,):torch.float32|rootRank={},rootTensor=0"
    assert texts == [expected.format(r) for r in (0, 1, 0, 2)]
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.SUM):
        name = str(_allreduce_opts(op).reduceOp.op)
        assert signature_of("allreduce", ([t], _allreduce_opts(op))).endswith(f"reduceOp={name}")


def test_signatures_hold_no_memory_addresses():
    t = torch.zeros(4)
    sigs = [
        signature_of("allreduce", ([t], _allreduce_opts(dist.ReduceOp.MAX))),
        signature_of("broadcast", ([t], dist.BroadcastOptions())),
        signature_of("allgather", ([[torch.empty(4), torch.empty(4)]], [t], object())),
        signature_of("barrier", (dist.BarrierOptions(),)),
    ]
    for sig in sigs:
        assert "0x" not in sig, sig
        assert " at " not in sig, sig


def test_signatures_differ_by_shape_dtype_kind_and_reduce_op():
    base = signature_of("allreduce", ([torch.zeros(10)], _allreduce_opts()))
    others = {
        "shape": signature_of("allreduce", ([torch.zeros(11)], _allreduce_opts())),
        "rank-2 shape": signature_of("allreduce", ([torch.zeros(2, 5)], _allreduce_opts())),
        "dtype": signature_of(
            "allreduce", ([torch.zeros(10, dtype=torch.bfloat16)], _allreduce_opts())
        ),
        "kind": signature_of("broadcast", ([torch.zeros(10)], dist.BroadcastOptions())),
        "reduce op": signature_of(
            "allreduce", ([torch.zeros(10)], _allreduce_opts(dist.ReduceOp.MAX))
        ),
        "tensor count": signature_of(
            "allreduce", ([torch.zeros(10), torch.zeros(10)], _allreduce_opts())
        ),
    }
    for what, sig in others.items():
        assert sig != base, what
    assert len(set(others.values())) == len(others)


def test_signature_of_allgather_covers_outputs_and_input():
    inp = torch.zeros(4)
    two = signature_of("allgather", ([[torch.empty(4), torch.empty(4)]], [inp], object()))
    three = signature_of(
        "allgather", ([[torch.empty(4), torch.empty(4), torch.empty(4)]], [inp], object())
    )
    assert two.startswith("allgather|")
    assert two != three


def test_signature_of_broadcast_includes_the_root():
    t = torch.zeros(3)
    root0, root1 = dist.BroadcastOptions(), dist.BroadcastOptions()
    root1.rootRank = 1
    assert signature_of("broadcast", ([t], root0)) != signature_of("broadcast", ([t], root1))


# ---- scratch arguments and restoring inputs ------------------------------------------------


def test_scratch_args_for_allgather():
    inp = torch.arange(4.0)
    out0, out1 = torch.full((4,), 7.0), torch.full((4,), 8.0)
    opts = object()
    rec = _record("allgather", ([[out0, out1]], [inp], opts), inputs=[inp.clone()])
    assert [t is inp for t in rec.input_tensors] == [True]

    outs, ins, got_opts = rec.scratch_args()
    assert got_opts is opts
    assert isinstance(outs, list) and isinstance(outs[0], list) and len(outs[0]) == 2
    for fresh, orig in zip(outs[0], [out0, out1], strict=True):
        assert fresh.shape == orig.shape and fresh.dtype == orig.dtype
        assert fresh.data_ptr() != orig.data_ptr()
    assert isinstance(ins, list) and len(ins) == 1
    assert torch.equal(ins[0], inp)
    assert ins[0].data_ptr() not in (inp.data_ptr(), rec.inputs[0].data_ptr())

    # writing into the scratch tensors leaves the framework's tensors and the log alone
    ins[0].fill_(-1.0)
    outs[0][0].fill_(-2.0)
    assert torch.equal(inp, torch.arange(4.0))
    assert torch.equal(rec.inputs[0], torch.arange(4.0))
    assert torch.equal(out0, torch.full((4,), 7.0))


def test_scratch_args_for_allreduce_use_the_logged_copy():
    """The re-issue uses the input as it was before launch, not as it is now."""
    t = torch.tensor([1.0, 2.0, 3.0])
    opts = _allreduce_opts()
    rec = _record("allreduce", ([t], opts), inputs=[t.clone()])
    t.mul_(10)  # the failed in-place op clobbered it
    scratch, got_opts = rec.scratch_args()
    assert got_opts is opts
    assert len(scratch) == 1
    assert torch.equal(scratch[0], torch.tensor([1.0, 2.0, 3.0]))
    assert scratch[0].data_ptr() not in (t.data_ptr(), rec.inputs[0].data_ptr())
    scratch[0].zero_()
    assert torch.equal(rec.inputs[0], torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(t, torch.tensor([10.0, 20.0, 30.0]))


def test_restore_inputs_writes_the_logged_copy_back():
    t = torch.tensor([1.0, 2.0, 3.0])
    ptr = t.data_ptr()
    rec = _record("allreduce", ([t], _allreduce_opts()), inputs=[t.clone()])
    t.fill_(99.0)
    rec.restore_inputs()
    assert torch.equal(t, torch.tensor([1.0, 2.0, 3.0]))
    assert t.data_ptr() == ptr  # in place


def test_restore_inputs_of_allgather_touches_only_the_input():
    inp, out = torch.ones(2), torch.zeros(2)
    rec = _record("allgather", ([[out, out.clone()]], [inp], object()), inputs=[inp.clone()])
    inp.fill_(5.0)
    out.fill_(6.0)
    rec.restore_inputs()
    assert torch.equal(inp, torch.ones(2))
    assert torch.equal(out, torch.full((2,), 6.0))


def test_restore_inputs_without_a_log_does_nothing():
    t = torch.tensor([4.0])
    rec = _record("allreduce", ([t], _allreduce_opts()))
    t.fill_(5.0)
    rec.restore_inputs()
    assert torch.equal(t, torch.tensor([5.0]))


# ---- serving locally -----------------------------------------------------------------------


def test_serve_locally_allgather_fills_every_output():
    inp = torch.tensor([1.0, 2.0])
    outs = [torch.zeros(2) for _ in range(3)]
    rec = _record("allgather", ([outs], [inp], object()))
    result = rec.serve_locally(world_size=3)
    for out in outs:
        assert torch.equal(out, inp)
    assert len(result) == 3
    assert all(r is o for r, o in zip(result, outs, strict=True))


def test_serve_locally_allgather_base_fills_every_chunk():
    inp = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = torch.zeros(8, 2)
    rec = _record("_allgather_base", (out, inp, object()))
    result = rec.serve_locally(world_size=4)
    for chunk in out.chunk(4):
        assert torch.equal(chunk, inp)
    assert len(result) == 1 and result[0] is out


def test_serve_locally_allreduce_returns_the_inputs_unchanged():
    t = torch.tensor([1.0, -2.0, 3.0])
    rec = _record("allreduce", ([t], _allreduce_opts()))
    result = rec.serve_locally(world_size=4)
    assert len(result) == 1 and result[0] is t
    assert torch.equal(t, torch.tensor([1.0, -2.0, 3.0]))


# ---- a replay's check of what it re-reduces --------------------------------------------------


def _done_allreduce(result):
    """An allreduce that completed with ``result`` in its tensor, as the proxy keeps it."""
    tensor = result.clone()
    record = _record("allreduce", ([tensor], _allreduce_opts()), inputs=[torch.zeros(3)])
    record.note_outputs()
    return record, tensor


def test_a_replay_that_reduces_the_same_is_equal_bit_for_bit():
    record, _ = _done_allreduce(torch.tensor([1.0, float("nan"), -2.5]))
    assert record.compare_replay(([torch.tensor([1.0, float("nan"), -2.5])], None)) is True
    assert record.compare_replay(([torch.tensor([1.0, float("nan"), -2.4])], None)) is False
    zero, _ = _done_allreduce(torch.tensor([0.0, 1.0, 2.0]))
    assert zero.compare_replay(([torch.tensor([-0.0, 1.0, 2.0])], None)) is False  # bits


def test_a_result_the_framework_wrote_into_since_cannot_be_compared():
    record, tensor = _done_allreduce(torch.tensor([1.0, 2.0, 3.0]))
    tensor.div_(2)  # e.g. a communication hook dividing the result afterwards
    assert record.compare_replay(([torch.tensor([0.5, 1.0, 1.5])], None)) is None
    barrier = _record("barrier", ())
    barrier.note_outputs()
    assert barrier.compare_replay(()) is None  # nothing to compare


def test_a_replay_check_counts_and_names_what_differs():
    from xmig.proxy import ReplayCheck

    check = ReplayCheck()
    same, _ = _done_allreduce(torch.ones(3))
    check.add(same, True)
    check.add(same, None)
    same.step, same.index, same.group = 5, 2, "pg3"
    check.add(same, False)
    assert check.to_json() == {"compared": 2, "unverifiable": 1,
                               "differ": [{"step": 5, "index": 2, "op": "allreduce",
                                           "group": "pg3"}]}  # fmt: skip


def test_the_verdict_of_a_recovery():
    from xmig.bitwise import UNVERIFIABLE, combine_replays, describe_verdict, verdict

    replay = combine_replays([{"compared": 2, "unverifiable": 1, "differ": []}, None,
                              {"compared": 1, "unverifiable": 0, "differ": []}])  # fmt: skip
    assert replay == {"compared": 3, "unverifiable": 1, "differ": []}
    assert verdict(replay, True, None) is True
    assert verdict(replay, None, "the data stream is elsewhere") is False
    assert verdict(replay, False, None) is False
    assert verdict({"compared": 0, "unverifiable": 2, "differ": []}, True, None) == UNVERIFIABLE
    assert verdict(None, True, None) == UNVERIFIABLE
    differ = {"compared": 1, "unverifiable": 0, "differ": [{"step": 1, "index": 0, "op": "x"}]}
    assert verdict(differ, True, None) is False
    assert describe_verdict(differ, "respawn") == "NOT bit-identical"
    assert describe_verdict(replay, "rollback").startswith("unverifiable: the step was rolled")
    assert describe_verdict(replay, "respawn").startswith("verified: 3 replayed")


def test_a_replacement_ends_an_op_with_the_result_it_was_sent():
    record, tensor = _done_allreduce(torch.tensor([1.0, 2.0, 4.0]))
    assert record.take_result([torch.tensor([1.0, 2.0, 3.0])]) is True  # its own differed
    assert torch.equal(tensor, torch.tensor([1.0, 2.0, 3.0]))
    assert record.take_result([torch.tensor([1.0, 2.0, 3.0])]) is False
    assert record.outputs_intact() is False  # written into since it completed


def test_records_handed_off_at_a_boundary_are_let_go_before_the_process_exits():
    """The session waits for them at exit: a thread killed there while it destroys a work
    ends the process with std::terminate."""
    from xmig.proxy.process_group import _let_go_later, wait_let_go

    class Slow:
        def __del__(self):
            time.sleep(0.2)

    _let_go_later([Slow(), Slow()])
    assert wait_let_go(10.0)


# ---- the log's buffer pool -----------------------------------------------------------------


def _a_step(pool, tensors, given_back=None):
    """A boundary's trim (the step before's copies given back), then a step's copies."""
    pool.new_step()
    pool.give_back(given_back)
    return [pool.copy_of(t) for t in tensors]


def test_the_pool_keeps_a_spare_for_every_copy_of_one_shape_a_step_asked_for():
    # identical layers' buckets share a shape: more of them than the pool's least
    grads = [torch.full((8,), float(i)) for i in range(3 * BufferPool.KEPT_AT_LEAST)]
    pool = BufferPool()
    first = _a_step(pool, grads)
    second = _a_step(pool, grads)
    third = _a_step(pool, grads, given_back=first)
    assert {t.data_ptr() for t in third} == {t.data_ptr() for t in first}
    assert all(torch.equal(copy, grad) for copy, grad in zip(third, grads, strict=True))
    assert not {t.data_ptr() for t in second} & {t.data_ptr() for t in first}


def test_the_pool_drops_the_spares_of_a_shape_no_step_asks_for_any_more():
    pool = BufferPool()
    old = _a_step(pool, [torch.ones(8)])  # a layout DDP then rebuilds
    _a_step(pool, [torch.ones(4)])
    _a_step(pool, [torch.ones(4)], given_back=old)  # kept for now: a few of any shape are
    pool.new_step()  # a step that asked for no copy of shape (8,)
    assert pool.copy_of(torch.ones(8)).data_ptr() != old[0].data_ptr()
