"""``python -m xmig.agent --coord HOST:PORT --node-rank K`` (started by ``xmig run``)."""

import argparse
import os
import sys

from xmig.agent.agent import Agent
from xmig.jobenv import TOKEN
from xmig.wire import parse_address


def main() -> int:
    parser = argparse.ArgumentParser(prog="xmig-agent")
    parser.add_argument("--coord", required=True, help="coordinator address host:port")
    parser.add_argument("--node-rank", type=int, required=True)
    args = parser.parse_args()
    token = os.environ.get(TOKEN)
    if not token:
        print("xmig-agent: error: the job token is missing from the environment", file=sys.stderr)
        return 2
    return Agent(parse_address(args.coord), token, args.node_rank).run()


if __name__ == "__main__":
    sys.exit(main())
