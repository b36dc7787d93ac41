"""The coordinator: membership, generations, fault records, and the decisions on them."""

from xmig.coord.job import JobSpec, describe_fault

__all__ = ["JobSpec", "describe_fault"]
