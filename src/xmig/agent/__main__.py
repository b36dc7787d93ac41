"""``python -m xmig.agent --coord HOST:PORT --node-rank K [--log-level LEVEL]
[--connect-timeout S]`` (started by ``xmig run``; a host's own launch, if it has a launcher of
its own, in ``XMIG_HOST_LAUNCH``)."""

import argparse
import json
import os
import sys

from xmig import logs
from xmig.agent.agent import CONNECT_TIMEOUT_S, Agent
from xmig.jobenv import HOST_LAUNCH, TOKEN
from xmig.jobspec import DEFAULT_LOG_LEVEL, LOG_LEVELS, HostLaunch
from xmig.wire import parse_address


def main() -> int:
    parser = argparse.ArgumentParser(prog="xmig-agent")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--coord", help="coordinator address host:port")
    where.add_argument("--control-plane", help="etcd://... that says which coordinator leads")
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default=DEFAULT_LOG_LEVEL, help="the job's log level"
    )
    parser.add_argument(
        "--connect-timeout", type=float, default=CONNECT_TIMEOUT_S,
        help="seconds to keep trying to reach the coordinator",
    )  # fmt: skip
    args = parser.parse_args()
    logs.setup(args.log_level)
    token = os.environ.get(TOKEN)
    if not token:
        parser.error("the job token is missing from the environment")
    launch = os.environ.get(HOST_LAUNCH)
    host = HostLaunch.from_json(json.loads(launch)) if launch else None
    coord = parse_address(args.coord) if args.coord else None
    agent = Agent(coord, token, args.node_rank, launch=host, connect_timeout=args.connect_timeout,
                  control_plane=args.control_plane)  # fmt: skip
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
