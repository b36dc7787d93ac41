"""``python -m xmig.agent --coord HOST:PORT --node-rank K [--log-level LEVEL]`` (started by
``xmig run``)."""

import argparse
import os
import sys

from xmig import logs
from xmig.agent.agent import Agent
from xmig.jobenv import TOKEN
from xmig.jobspec import DEFAULT_LOG_LEVEL, LOG_LEVELS
from xmig.wire import parse_address


def main() -> int:
    parser = argparse.ArgumentParser(prog="xmig-agent")
    parser.add_argument("--coord", required=True, help="coordinator address host:port")
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default=DEFAULT_LOG_LEVEL, help="the job's log level"
    )
    args = parser.parse_args()
    logs.setup(args.log_level)
    token = os.environ.get(TOKEN)
    if not token:
        parser.error("the job token is missing from the environment")
    return Agent(parse_address(args.coord), token, args.node_rank).run()


if __name__ == "__main__":
    sys.exit(main())
