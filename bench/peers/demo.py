"""The demo's training script as a module, for the peers' loops (they train exactly its model
on exactly its batches)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

DEMO = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


def demo_module() -> ModuleType:
    """``examples/train_gpt.py``, loaded once under the name ``train_gpt``."""
    if "train_gpt" in sys.modules:
        return sys.modules["train_gpt"]
    spec = importlib.util.spec_from_file_location("train_gpt", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module
