"""The record of one collective: enough to check it, re-issue it, or serve it locally."""

from __future__ import annotations

import contextlib
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# positions of the arguments that carry an op's input data; the other tensors are outputs
INPUT_ARGS: dict[str, tuple[int, ...]] = {
    "allreduce": (0,),
    "allreduce_coalesced": (0,),
    "broadcast": (0,),
    "reduce": (0,),
    "allgather": (1,),
    "_allgather_base": (1,),
    "allgather_coalesced": (1,),
    "allgather_into_tensor_coalesced": (1,),
    "gather": (1,),
    "scatter": (1,),
    "reduce_scatter": (1,),
    "_reduce_scatter_base": (1,),
    "reduce_scatter_tensor_coalesced": (1,),
    "alltoall": (1,),
    "alltoall_base": (1,),
    "send": (0,),
    "recv": (),
    "recv_anysource": (),
    "barrier": (),
}
# positions of the arguments the op writes its result into, on every rank (reduce and gather
# leave theirs undefined off the root; a send writes nothing)
OUTPUT_ARGS: dict[str, tuple[int, ...]] = {
    op: () if op in ("reduce", "gather", "send", "recv_anysource", "barrier") else (0,)
    for op in INPUT_ARGS
}
# the arguments that carry tensors (the rest are options, ranks, tags)
TENSOR_ARGS: dict[str, tuple[int, ...]] = {
    op: (0, 1)
    if op
    in (
        "allgather",
        "_allgather_base",
        "allgather_coalesced",
        "allgather_into_tensor_coalesced",
        "gather",
        "scatter",
        "reduce_scatter",
        "_reduce_scatter_base",
        "reduce_scatter_tensor_coalesced",
        "alltoall",
        "alltoall_base",
    )
    else ((0,) if op != "barrier" else ())
    for op in INPUT_ARGS
}


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) list or tuple, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if not isinstance(value, (list, tuple)):
        return []
    found = []
    for item in value:  # (a call per nested list only: each op's issue walks its args)
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            found.extend(tensors_in(item))
    return found


def map_tensors(value: Any, fn: Any) -> Any:
    """The same nesting with every tensor replaced by ``fn(tensor)``."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(map_tensors(v, fn) for v in value)
    return value


_OPTION_FIELDS = ("reduceOp", "rootRank", "rootTensor")
# an options type -> those of ``_OPTION_FIELDS`` it has; (field, value) -> its text: an op's
# signature is made at each issue (c10d's option objects answer slowly: 13 µs an op under
# cProfile)
_fields_by_type: dict[type, tuple[str, ...]] = {}
_field_texts: dict[tuple[str, Any], str] = {}


def _options_key(value: Any) -> str:
    kind = type(value)
    names = _fields_by_type.get(kind)
    if names is None:
        names = _fields_by_type[kind] = tuple(n for n in _OPTION_FIELDS if hasattr(value, n))
    parts = []
    for name in names:
        field_value = getattr(value, name)
        if name == "reduceOp":
            field_value = getattr(field_value, "op", field_value)  # ReduceOp → its kind
        try:
            text = _field_texts.get((name, field_value))
        except TypeError:  # not hashable
            text = None
        if text is None:
            text = f"{name}={field_value}"
            with contextlib.suppress(TypeError):
                if len(_field_texts) < 4096:
                    _field_texts[(name, field_value)] = text
        parts.append(text)
    return ",".join(parts)


def signature_of(op: str, args: tuple[Any, ...]) -> str:
    """Kind, shapes, dtypes and options of an op: what every rank must agree on."""
    shapes = []
    for i in TENSOR_ARGS[op]:
        if i < len(args):
            shapes.append(";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors_in(args[i])))
    options = [
        str(a) if isinstance(a, int) else _options_key(a)
        for a in args
        if not isinstance(a, (list, tuple, torch.Tensor))
    ]
    return f"{op}|{'|'.join(shapes)}|{','.join(o for o in options if o)}"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    flat_a, flat_b = a.detach().reshape(-1), b.detach().reshape(-1)
    if flat_a.dtype.is_floating_point or flat_a.dtype.is_complex:
        # bits, not values: NaN equals itself, -0.0 differs from 0.0
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        size = flat_a.element_size()
        if size in width:
            flat_a, flat_b = flat_a.view(width[size]), flat_b.view(width[size])
        else:  # complex128: two int64 per element
            flat_a, flat_b = flat_a.view(torch.uint8), flat_b.view(torch.uint8)
    return bool(torch.equal(flat_a, flat_b))


def signature_digest(signatures: list[str]) -> str:
    digest = hashlib.sha256()
    for sig in signatures:
        digest.update(sig.encode() + b"\n")
    return digest.hexdigest()[:16]


class BufferPool:
    """Reuses the memory of dropped log copies: a copy into warm memory costs a third of a
    fresh allocation (no page faults), which is most of the log's steady-state cost.

    It keeps, per shape, as many spare buffers as the last step asked for copies of: the
    buckets of identical layers share a shape (at gpt350m, 600 of 950 copies found no spare
    when 4 a shape were kept). A shape no copy asked for during a step has its spares dropped
    (a bucket layout rebuilt): a shape's spares are never more than the step before's copies
    of it, or 4."""

    KEPT_AT_LEAST = 4

    def __init__(self) -> None:
        self._free: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self._asked: dict[tuple[Any, ...], int] = {}  # copies per shape since ``new_step``
        self._wanted: dict[tuple[Any, ...], int] = {}  # the same, in the step before
        self._lock = threading.Lock()

    def copy_of(self, tensor: torch.Tensor, host: bool = False) -> torch.Tensor:
        """A copy of ``tensor``; with ``host``, of a GPU tensor into pinned host memory, queued
        on the current stream (the caller waits for it before reading it)."""
        device = torch.device("cpu") if host else tensor.device
        key = (tuple(tensor.shape), tensor.dtype, device)
        with self._lock:
            self._asked[key] = self._asked.get(key, 0) + 1
            free = self._free.get(key)
            buffer = free.pop() if free else None
        if buffer is None:
            if not host:
                return tensor.detach().clone()
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        buffer.copy_(tensor.detach(), non_blocking=host)
        return buffer

    def new_step(self) -> None:
        """A step's copies have been asked for (a boundary's trim): spares are kept for as
        many as it asked for, shape by shape."""
        with self._lock:
            self._wanted, self._asked = self._asked, {}
            for key in [k for k in self._free if k not in self._wanted]:
                del self._free[key]

    def clear(self) -> None:
        """Drop every spare buffer (their memory goes back to the allocator)."""
        with self._lock:
            self._free.clear()

    def give_back(self, tensors: list[torch.Tensor] | None) -> None:
        if not tensors:
            return
        with self._lock:
            for tensor in tensors:
                key = (tuple(tensor.shape), tensor.dtype, tensor.device)
                free = self._free.setdefault(key, [])
                if len(free) < max(self.KEPT_AT_LEAST, self._wanted.get(key, 0)):
                    free.append(tensor)


@dataclass(eq=False)
class IntBroadcast:
    """A broadcast of one int32 tensor (how DDP sends its bucket layout from rank 0): what
    this rank put in before the op, and what the op left in the tensor once complete."""

    step: int | None
    index: int
    sent: torch.Tensor
    received: torch.Tensor | None = None
    local: bool = False  # completed without the network


def int_broadcast_payload(op: str, args: tuple[Any, ...]) -> torch.Tensor | None:
    """The tensor of a broadcast of exactly one int32 tensor, else None."""
    if op != "broadcast":
        return None
    tensors = tensors_in(args[0])
    if len(tensors) == 1 and tensors[0].dtype == torch.int32:
        return tensors[0]
    return None


@dataclass(eq=False)  # records are compared by identity
class OpRecord:
    """One op issued by the framework through the proxy."""

    step: int | None
    index: int
    op: str
    args: tuple[Any, ...]
    signature: str
    future: torch.futures.Future
    inputs: list[torch.Tensor] | None = None  # copies taken before launch; None: not logged
    work: dist.Work | None = None
    state: str = "queued"  # queued, launched, done, failed
    error: str | None = None
    done_event: threading.Event = field(default_factory=threading.Event)
    device: Any = None  # the CUDA device of its tensors (None on CPU)
    int_broadcast: IntBroadcast | None = None
    # the version counters of its outputs once complete: unchanged at a replay, the outputs
    # still hold its result, which the replay's must equal
    output_versions: list[int] | None = None
    group: str = "world"  # the process group it was issued on
    seq: int = 0  # its place in the order ops are issued in across every group of the process
    in_sequence: int = 0  # its number among its step's ops across the groups (collective=K)
    # its future completed at issue behind a gate on the GPU (``xmig.proxy.gate``): the
    # gate, and the number that opens it once the op has ended well
    gate: Any = None
    gate_number: int | None = None
    # (GPU, gates on) an event on the issuing stream after its inputs were logged: a
    # recovery on a stream of its own waits on it, never on the framework's whole stream
    logged_event: Any = None
    # (GPU, the "host" log route) the stream its inputs were copied on, and launched from
    log_stream: Any = None
    # an injected error it reports once it has ended (``raise`` at ``completion=K``)
    late_error: str | None = None
    launched_on: int | None = None  # the backend (its id) it was launched on

    @property
    def input_tensors(self) -> list[torch.Tensor]:
        return [
            t for i in INPUT_ARGS[self.op] if i < len(self.args) for t in tensors_in(self.args[i])
        ]

    def outputs_of(self, args: tuple[Any, ...]) -> list[torch.Tensor]:
        return [t for i in OUTPUT_ARGS[self.op] if i < len(args) for t in tensors_in(args[i])]

    def note_outputs(self) -> None:
        """The op is complete: remember where its outputs' versions stand."""
        self.output_versions = [t._version for t in self.outputs_of(self.args)]

    def outputs_intact(self) -> bool:
        """Whether its outputs still hold its result (nothing wrote into them since)."""
        outputs = self.outputs_of(self.args)
        return bool(outputs) and self.output_versions == [t._version for t in outputs]

    def compare_replay(self, scratch: tuple[Any, ...]) -> bool | None:
        """Whether the replay's result (in ``scratch``, the re-issued op's arguments) is bit
        for bit the result this op had: None when that cannot be told (no outputs, or the
        framework has written into them since)."""
        if not self.outputs_intact():
            return None
        outputs = self.outputs_of(self.args)
        replayed = self.outputs_of(scratch)
        return len(replayed) == len(outputs) and all(
            _same_bits(a, b) for a, b in zip(outputs, replayed, strict=True)
        )

    def take_result(self, expected: list[torch.Tensor]) -> bool:
        """End with ``expected`` as the result (what the op had on the survivors before the
        fault); whether this rank's own result differed from it."""
        outputs = self.outputs_of(self.args)
        if len(outputs) != len(expected):
            return False
        differed = not all(_same_bits(a, b) for a, b in zip(outputs, expected, strict=True))
        if differed:
            with torch.no_grad():
                for out, value in zip(outputs, expected, strict=True):
                    out.copy_(value)
        return differed

    def restore_inputs(self) -> None:
        """Put the logged inputs back (a failed in-place op may have clobbered them)."""
        if self.inputs is not None:
            with torch.no_grad():
                for tensor, saved in zip(self.input_tensors, self.inputs, strict=True):
                    tensor.copy_(saved)

    def scratch_args(self) -> tuple[Any, ...]:
        """The op's arguments with logged inputs copied and fresh outputs: for a re-issue whose
        result is thrown away."""
        assert self.inputs is not None
        saved = iter(self.inputs)
        inputs = set(INPUT_ARGS[self.op])
        args = []
        for i, arg in enumerate(self.args):
            if i in inputs:
                # where the op's own tensor is (a log copy may be in host memory)
                args.append(map_tensors(arg, lambda t: next(saved).to(t.device, copy=True)))
            elif i in TENSOR_ARGS[self.op]:
                args.append(map_tensors(arg, torch.empty_like))
            else:
                args.append(arg)
        return tuple(args)

    def serve_locally(self, world_size: int) -> Any:
        """Complete the op without the network, as if every rank had this rank's data."""
        inputs = [
            t for i in INPUT_ARGS[self.op] if i < len(self.args) for t in tensors_in(self.args[i])
        ]
        outputs: list[torch.Tensor] = []
        if self.op in ("allgather", "gather") and len(self.args) > 1:
            out_lists = self.args[0]
            with torch.no_grad():
                for out_list, source in zip(out_lists, self.args[1], strict=False):
                    for out in out_list:
                        out.copy_(source)
            outputs = [t for lst in out_lists for t in lst]
        elif self.op in ("_allgather_base", "allgather_into_tensor_coalesced"):
            outs, ins = tensors_in(self.args[0]), tensors_in(self.args[1])
            with torch.no_grad():
                for out, source in zip(outs, ins, strict=False):
                    out.view(world_size, -1).copy_(source.reshape(1, -1).expand(world_size, -1))
            outputs = outs
        else:
            outputs = inputs
        return outputs
