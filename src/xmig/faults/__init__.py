"""Fault injection for tests, demos and chaos runs (``--inject`` and ``xmig inject``)."""

from xmig.faults.injector import InjectedCollectiveError, Injector
from xmig.faults.spec import KINDS, POINTS, FaultSpec, FaultSpecError, parse_fault, parse_faults

__all__ = [
    "KINDS",
    "POINTS",
    "FaultSpec",
    "FaultSpecError",
    "InjectedCollectiveError",
    "Injector",
    "parse_fault",
    "parse_faults",
]
