"""An agent on the OpenAI Agents SDK (PyPI openai-agents) as a program agent: the SDK's default
client reads OPENAI_BASE_URL / OPENAI_API_KEY (the rollout's gateway, set by the consumer), and
the agent runs streamed on the Responses API with one tool, ``bash``, in the working directory.
Run it with the interpreter that has the SDK (ops/harnesses.sh):

    agentarium consumer --agent sdk=exec:"$VENV/bin/python examples/harnesses/openai_agents.py" \
        --llm URL --program-setup agentarium.examples.repo_task:setup --program-scorer agentarium.examples.repo_task:score

It prints, last, one JSON line: the final output and how many model responses the run took.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from agents import Agent, Runner, function_tool, set_tracing_disabled

MAX_TURNS = int(os.environ.get("AGENTS_MAX_TURNS", "4"))


@function_tool
def bash(command: str) -> str:
    """Run a bash command in the repository and return its output (stdout and stderr)."""
    done = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=60, check=False
    )
    return f"exit status {done.returncode}\n{done.stdout}{done.stderr}"[-8000:]


async def main() -> int:
    set_tracing_disabled(True)  # traces would go to OpenAI's servers; the gateway traces calls
    task = json.load(sys.stdin)
    agent = Agent(
        name="fixer",
        instructions="You fix repositories. Use the bash tool to inspect, edit and test.",
        tools=[bash],
        model=os.environ["AGENTARIUM_MODEL"],
    )
    run = Runner.run_streamed(agent, task["prompt"], max_turns=MAX_TURNS)
    async for _ in run.stream_events():
        pass
    print(json.dumps({"final_output": str(run.final_output), "responses": len(run.raw_responses)}))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
