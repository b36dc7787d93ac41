"""What a rank issues, written down for ``xmig check`` (``--trace-dir``, never by default).

One JSON-lines file per process, ``rank<R>-attempt<A>-pid<P>.jsonl``: a header, then in order
each forward of the registered model (a digest of its tensor inputs: the batch) and each
collective the framework issues in a step (its signature and a digest of its inputs), and at
the end the digest of the parameters. Two runs of the same script compare line by line.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import IO, Any

import torch

from xmig.proxy import OpRecord
from xmig.proxy.oplog import tensors_in
from xmig.state import params_sha256, tensors_sha256
from xmig.traces import trace_name


class Tracer:
    def __init__(self, folder: str, rank: int, attempt: int, generation: int) -> None:
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = open(path / trace_name(rank, attempt, os.getpid()), "a")  # noqa: SIM115
        self._lock = threading.Lock()
        self._forwards: dict[int, int] = {}  # step -> forwards so far
        self._write({"kind": "header", "rank": rank, "attempt": attempt,
                     "generation": generation, "pid": os.getpid()})  # fmt: skip

    def _write(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()

    def op(self, record: OpRecord) -> None:
        """A collective the framework issued (before it is launched: its inputs as given)."""
        if record.step is None:
            return  # the prologue: a replacement serves it locally
        self._write({"kind": "op", "step": record.step, "index": record.index, "op": record.op,
                     "sig": record.signature,
                     "in": tensors_sha256(record.input_tensors)})  # fmt: skip

    def forward(self, step: int | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if step is None:
            return
        tensors = [t for t in tensors_in(list(args) + list(kwargs.values()))
                   if isinstance(t, torch.Tensor)]  # fmt: skip
        number = self._forwards.get(step, 0)
        self._forwards[step] = number + 1
        self._write({"kind": "forward", "step": step, "n": number,
                     "in": tensors_sha256(tensors)})  # fmt: skip

    def final(self, model: torch.nn.Module | None) -> None:
        self._write({"kind": "final",
                     "params": params_sha256(model) if model is not None else None})  # fmt: skip
