"""reasoning-gym task families (examples/reasoning_gym_*.py): generated tasks, one agent name per
family, each rollout scored by its family's own ``score_answer``; and the same through the real
pipeline (nats-server, the local engine with the tiny model, one `agentarium consumer` per
family, `agentarium produce --agent-from data_source`). No chance failures: the tasks are
generated with fixed seeds, and the pipeline test asserts what every rollout must be (status,
agent, reply length), never a reward the tiny model's sampling would decide."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import reasoning_gym
from reasoning_gym.utils import extract_answer

from agentarium.demo.processes import child_env, start_child
from agentarium.examples import reasoning_gym_agent as agent
from agentarium.examples.reasoning_gym_tasks import main as make_tasks
from agentarium.producers import TrajectoryReader

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("basic_arithmetic", "leg_counting")


def write_tasks(path: Path, *families: str, n: int = 2, seed: int = 3) -> list[dict]:
    args = [a for f in families for a in ("--family", f)]
    assert make_tasks([*args, "--n", str(n), "--seed", str(seed), "--out", str(path)]) == 0
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tasks_are_seeded_and_name_one_agent_per_family(tmp_path):
    tasks = write_tasks(tmp_path / "a.jsonl", *FAMILIES, n=3)
    again = write_tasks(tmp_path / "b.jsonl", *FAMILIES, n=3)
    assert tasks == again
    assert [t["task_id"] for t in tasks] == [f"{f}-3-{i}" for f in FAMILIES for i in range(3)]
    for task in tasks:
        assert task["agent_name"] == task["data_source"] == task["family"]
        reference = reasoning_gym.create_dataset(task["family"], size=3, seed=3)
        assert task["question"] == reference[int(task["task_id"].rsplit("-", 1)[1])]["question"]


def test_unknown_or_unscorable_families_are_refused(tmp_path, capsys):
    assert make_tasks(["--family", "no_such_family", "--n", "1"]) == 2
    assert "unknown family no_such_family" in capsys.readouterr().err
    # arc_agi's scorer needs tuples that JSON turns into lists: refused before any row is written
    assert make_tasks(["--family", "arc_agi", "--n", "1", "--out", str(tmp_path / "x")]) == 2
    assert "does not accept the reference answer" in capsys.readouterr().err


class ScriptedLLM:
    """The outermost boundary faked: ``chat`` returns a fixed reply."""

    def __init__(self, reply: str) -> None:
        self.reply = reply
        self.messages: list[dict] = []

    async def chat(self, messages, **_):
        self.messages = messages

        class Result:
            text = self.reply

        return Result()


async def test_the_reward_is_the_family_scorer(tmp_path):
    task = write_tasks(tmp_path / "t.jsonl", "basic_arithmetic", n=1)[0]
    entry = {"question": task["question"], "answer": task["answer"], "metadata": task["metadata"]}
    scorer = reasoning_gym.get_score_answer_fn("basic_arithmetic")
    for reply, tagged in (
        (f"thinking... <answer>{task['answer']}</answer>", True),
        ("<answer>12345678</answer>", True),
        (task["answer"], False),  # no answer block: scored as reasoning-gym scores None
    ):
        llm = ScriptedLLM(reply)
        result = await agent.rollout(task, llm)
        assert result["reward"] == scorer(extract_answer(reply), entry)
        assert result["metrics"]["answered"] == float(tagged)
        assert llm.messages[-1] == {"role": "user", "content": task["question"]}
    assert (await agent.rollout(task, ScriptedLLM(f"<answer>{task['answer']}</answer>")))[
        "reward"
    ] == 1.0


async def test_families_run_through_the_pipeline_with_scorer_rewards(
    js, topology, nats_url, tiny_dir, engine_url, tmp_path
):
    tasks = write_tasks(tmp_path / "tasks.jsonl", *FAMILIES, n=2)
    produced = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentarium",
            "produce",
            "--file",
            str(tmp_path / "tasks.jsonl"),
            "--agent-from",
            "data_source",
            "--group-size",
            "2",
            "--max-new-tokens",
            "8",
            "--run",
            "rg",
            "--nats-url",
            nats_url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert produced.returncode == 0, produced.stderr[-2000:]
    env = child_env(PYTHONPATH=str(ROOT))
    consumers = [
        start_child(
            f"consumer-{family}",
            [
                "consumer",
                "--agent",
                f"{family}=agentarium.examples.reasoning_gym_agent:rollout",
                "--llm",
                engine_url,
                "--model",
                str(tiny_dir),
                "--nats-url",
                nats_url,
                "--burst",
            ],
            tmp_path,
            env=env,
        )
        for family in FAMILIES
    ]
    codes = [await asyncio.wait_for(asyncio.to_thread(c.proc.wait), 180) for c in consumers]
    assert codes == [0, 0], [c.log_path.read_text()[-2000:] for c in consumers]

    by_id = {t["task_id"]: t for t in tasks}
    trajectories = await TrajectoryReader(js, topology).read("rg")
    assert len(trajectories) == len(tasks) * 2
    for traj in trajectories:
        assert traj.status == "ok", traj.error
        task = by_id[traj.task_id]
        assert traj.agent == task["family"]
        [call] = traj.calls
        assert 0 < len(call.response_ids) <= 8
        assert call.messages and call.messages[-1]["role"] == "assistant"
        reply = call.messages[-1]["content"]
        assert traj.reward == agent.score(task, extract_answer(reply))
        assert set(traj.metrics) >= {"answered", "reply_chars"}
