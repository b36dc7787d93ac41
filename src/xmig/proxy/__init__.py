"""The process group the framework talks to (fault interception lives here)."""

from xmig.proxy.process_group import FORWARDED_OPS, ProxyProcessGroup

__all__ = ["FORWARDED_OPS", "ProxyProcessGroup"]
