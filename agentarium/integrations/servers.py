"""The LLM servers a verl agent loop announced for a run: where the consumers' ``--llm`` goes.

    python -m agentarium.integrations.servers RUN      # one URL a line (AGENTARIUM_NATS_URL)

The verl loop (``agentarium.integrations.verl``) records the servers behind verl's load
balancer in the engines KV with status ``announced``; this reads them back, so a script can
start ``agentarium consumer --llm URL ...`` once verl's servers are up.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from agentarium.broker import NatsSettings, Topology
from agentarium.inference import engine_versions

ANNOUNCED = "announced"


async def announced_servers(settings: NatsSettings, run: str) -> list[str]:
    """The URLs announced for ``run``, sorted."""
    nc = await settings.connect(name="agentarium-verl-servers")
    try:
        entries = await engine_versions(nc.jetstream(), Topology(settings.prefix))
    finally:
        await nc.close()
    return sorted(
        {e["engine"] for e in entries if e.get("run") == run and e.get("status") == ANNOUNCED}
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Print the LLM servers a verl agent loop announced for RUN, one URL a line "
        "(exit 1 when none is). The broker is $AGENTARIUM_NATS_URL."
    )
    parser.add_argument("run", metavar="RUN", help="the run id of the agent loop's settings")
    args = parser.parse_args(argv)
    urls = asyncio.run(announced_servers(NatsSettings.from_env(), args.run))
    for url in urls:
        print(url)
    return 0 if urls else 1


if __name__ == "__main__":
    sys.exit(main())
