"""verl 0.9.1 runs its own agent-loop worker with the ``agentarium`` loop, in verl's virtualenv.

Here: a nats-server, the local engine (it speaks the SGLang API that verl's SGLang servers
serve, so it stands in for verl's rollout server on a machine without a GPU) and a consumer
running the rollouts. In verl's venv, ``tests/verl_agent_loop_check.py`` drives verl's own
``AgentLoopWorker.generate_sequences`` through ``examples/verl_agent_loop.yaml`` and compares
the resulting DataProto field by field with what verl's own single-turn loop builds from the
same tokens (see that script). What needs a GPU (verl's SGLang servers and weight sync) is
``ops/verl_gpu_recipe.sh``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from pathlib import Path

from verlenv import ensure_venv
from worker_env import worker_for

from agentarium.examples.toy import messages_of
from agentarium.integrations.servers import announced_servers

ROOT = Path(__file__).resolve().parent.parent
_FLAKY = itertools.count()


async def agent(task: dict, llm) -> dict:
    """A reward from the reply's first token (varied, so advantages are not all 0); every
    other rollout of a ``flaky`` task raises."""
    if task.get("flaky") and next(_FLAKY) % 2:
        raise RuntimeError("this rollout fails on purpose")
    result = await llm.chat(messages_of(task), max_new_tokens=4)
    return float(result.call.response_ids[0] % 7)


async def test_verl_agent_loop_builds_verls_own_batch(js, settings, tiny_dir, engine_url, tmp_path):
    python = ensure_venv()
    out = tmp_path / "report.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "AGENTARIUM_NATS_URL": settings.url,
        "OMP_NUM_THREADS": "1",
    }
    async with worker_for(js, "toy", agent, [engine_url], burst=False, attempts=1) as worker:
        running = asyncio.create_task(worker.run())
        try:
            proc = await asyncio.create_subprocess_exec(
                str(python),
                str(ROOT / "tests" / "verl_agent_loop_check.py"),
                str(tiny_dir),
                str(out),
                engine_url.removeprefix("http://"),  # verl's balancer lists host:port
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            output, _ = await asyncio.wait_for(proc.communicate(), 240)
        finally:
            worker.stop()
            await asyncio.wait_for(running, 30)
    assert proc.returncode == 0, output.decode(errors="replace")[-4000:]
    report = json.loads(out.read_text())
    # 3 groups of 4: two whole, one with two failed rollouts (the agent raised: status error)
    assert report["status"][:8] == ["ok"] * 8
    assert sorted(report["status"][8:]) == ["error", "error", "ok", "ok"]
    fields = report["fields"]
    assert set(fields) == {
        "prompts",
        "responses",
        "response_mask",
        "input_ids",
        "attention_mask",
        "position_ids",
        "rollout_log_probs",
    }
    assert all(count == 10 for count in fields.values()), fields
    # the loop announced verl's server, where a consumer's --llm goes
    assert await announced_servers(settings, "verl") == [engine_url]
