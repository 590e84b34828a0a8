"""Real agent harnesses, unchanged, as program agents (``--agent NAME=exec:...``) through the
rollout's gateway: Codex CLI, Claude Code, mini-swe-agent and the OpenAI Agents SDK, each on
``examples/repo_tasks.jsonl`` (a tiny repository whose tests fail; reward 1 when they pass).

    ops/harnesses.sh                                       # installs them (npm, PyPI)
    PYTHONPATH=. .venv/bin/python bench/harnesses.py       # every installed one, one task each
    PYTHONPATH=. .venv/bin/python bench/harnesses.py --harness mini --tasks 3

One nats-server, one local engine and, per harness, one `agentarium consumer --burst` process.
The model is the built-in tiny one with its context raised to 131,072 tokens (a copy whose
config says so: rotary positions need no new weights), since the harnesses' own prompts are
3,000 to 80,000 tokens long; its replies are random bytes, so rewards are 0 and the point is
the plumbing. Checked per harness: one trajectory per job and no dead letter; every LLM call
recorded with its token ids; the reply text the harness reports having received (its own
output, kept in ``metadata["program"]``) equal to the recorded reply of the call that produced
it; and, where the harness counts its model calls (mini-swe-agent, the Agents SDK), that count
equal to the trajectory's. Prints one line per harness and writes ``harnesses.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fake_sglang import local_engine  # noqa: E402

from agentarium.broker import NatsServer, NatsSettings, Topology, provision  # noqa: E402
from agentarium.producers import TaskProducer, TrajectoryReader  # noqa: E402
from agentarium.schemas import Sampling  # noqa: E402
from agentarium.tiny import ensure_tiny_model  # noqa: E402

HARNESS_DIR = Path(os.environ.get("AGENTARIUM_HARNESSES", "~/.cache/agentarium/harnesses"))
CONTEXT = 131072


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def codex_replies(stdout: str) -> tuple[list[str], int | None]:
    items = [e.get("item", {}) for e in _json_lines(stdout) if e.get("type") == "item.completed"]
    return [i["text"] for i in items if i.get("type") == "agent_message"], None


def claude_replies(stdout: str) -> tuple[list[str], int | None]:
    results = [e for e in _json_lines(stdout) if e.get("type") == "result"]
    return ([results[-1].get("result", "")] if results else []), None


def mini_replies(stdout: str) -> tuple[list[str], int | None]:
    """Each model response mini-swe-agent saw: an assistant message, or the response kept with
    the format error it caused (such replies are not sent back to the model)."""
    trajectories = [e["mini_trajectory"] for e in _json_lines(stdout) if "mini_trajectory" in e]
    if not trajectories:
        return [], None
    said = []
    for message in trajectories[-1].get("messages", []):
        response = (message.get("extra") or {}).get("response")
        if message.get("role") == "assistant":
            said.append(message.get("content") or "")
        elif isinstance(response, dict) and response.get("choices"):
            said.append(response["choices"][0]["message"].get("content") or "")
    return said, len(said)


def sdk_replies(stdout: str) -> tuple[list[str], int | None]:
    ends = [e for e in _json_lines(stdout) if "final_output" in e]
    return ([ends[-1]["final_output"]], ends[-1]["responses"]) if ends else ([], None)


@dataclass(frozen=True)
class Harness:
    spec: str  # the agent spec after NAME=
    needs: str  # the binary it runs, under HARNESS_DIR
    replies: Callable[[str], tuple[list[str], int | None]]  # stdout -> (texts, model calls)


def harnesses(base: Path) -> dict[str, Harness]:
    node, venv = base / "node/node_modules/.bin", base / "venv/bin"
    sdk = f"exec:{venv / 'python'} examples/harnesses/openai_agents.py"
    return {
        "codex": Harness("exec:examples/harnesses/codex.sh", str(node / "codex"), codex_replies),
        "claude": Harness(
            "exec:examples/harnesses/claude.sh", str(node / "claude"), claude_replies
        ),
        "mini": Harness("exec:examples/harnesses/mini_swe.sh", str(venv / "mini"), mini_replies),
        "sdk": Harness(sdk, str(venv / "python"), sdk_replies),
    }


def long_tiny(out: Path) -> Path:
    """The tiny model with a context of ``CONTEXT`` tokens (its config and tokenizer say so)."""
    target = out / "tiny-long"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(ensure_tiny_model(), target)
    for name, key in (
        ("config.json", "max_position_embeddings"),
        ("tokenizer_config.json", "model_max_length"),
    ):
        data = json.loads((target / name).read_text())
        data[key] = CONTEXT
        (target / name).write_text(json.dumps(data, indent=2))
    return target


def check(name: str, harness: Harness, trajectories: list, dead: int, jobs: int) -> dict:
    """What the harness's run came to, and whether the plumbing held (``ok``)."""
    row: dict = {"harness": name, "jobs": jobs, "stored": len(trajectories), "dead": dead}
    row["statuses"] = sorted(t.status for t in trajectories)
    row["calls"] = [len(t.calls) for t in trajectories]
    row["prompt_tokens"] = [[len(c.prompt_ids) for c in t.calls] for t in trajectories]
    row["call_seconds"] = [[round(c.latency_s, 1) for c in t.calls] for t in trajectories]
    row["rewards"] = [t.reward for t in trajectories]
    problems = []
    if len(trajectories) != jobs or dead:
        problems.append(f"{len(trajectories)} trajectories and {dead} dead letters for {jobs} jobs")
    for traj in trajectories:
        if traj.status != "ok":
            problems.append(f"{traj.status}: {(traj.error or '')[-600:]}")
            continue
        if not traj.calls or not all(c.prompt_ids and c.response_ids for c in traj.calls):
            problems.append("a call without its token ids, or no call at all")
        said, counted = harness.replies(traj.metadata.get("program", {}).get("stdout", ""))
        recorded = [(c.messages or [{}])[-1].get("content") or "" for c in traj.calls]
        if not said or recorded[-len(said) :] != said:
            problems.append(f"the harness's replies {said!r:.300} are not the recorded ones")
        if counted is not None and counted != len(traj.calls):
            problems.append(
                f"the harness counts {counted} model calls, the trajectory {len(traj.calls)}"
            )
    row["ok"], row["problems"] = not problems, problems
    return row


async def run_one(
    name: str, harness: Harness, *, nats: str, llm: str, model: Path, tasks: list, args
) -> dict:
    settings = NatsSettings(url=nats)
    nc = await settings.connect(name="bench-harnesses")
    js, topology, run = nc.jetstream(), Topology(), f"harness-{name}-{int(time.time())}"
    # room for the tiny model's random reply to reach its end token (1 in 263 a step): at 256
    # tokens a third of replies are cut, which the Agents SDK fails on (response.incomplete)
    sampling = Sampling(max_new_tokens=4096)
    await TaskProducer(js, topology).submit(
        name, tasks, run=run, deadline_s=args.deadline, sampling=sampling
    )
    path = f"{HARNESS_DIR.expanduser() / 'node/node_modules/.bin'}:{HARNESS_DIR.expanduser() / 'venv/bin'}:{os.environ['PATH']}"
    argv = [
        sys.executable, "-m", "agentarium", "consumer", "--nats-url", nats, "--llm", llm,
        "--agent", f"{name}={harness.spec}", "--model", str(model), "--burst", "--attempts", "1",
        "--program-env", f"PATH={path}", "--program-user", args.user,
        "--program-setup", "agentarium.examples.repo_task:setup", "--program-scorer", "agentarium.examples.repo_task:score",
        "--program-output-bytes", str(4 * 1024 * 1024),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    with open(args.out / f"consumer-{name}.log", "w") as log:
        subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    seconds = time.monotonic() - started
    trajectories = await TrajectoryReader(js, topology).read(run, name)
    dead = (await js.stream_info(topology.dead_stream)).state.messages
    await nc.close()
    row = check(name, harness, trajectories, dead - args.dead_before, len(tasks))
    args.dead_before = dead
    row["seconds"] = round(seconds, 1)
    return row


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--harness", action="append", choices=["codex", "claude", "mini", "sdk"])
    parser.add_argument("--tasks", type=int, default=1, help="tasks of examples/repo_tasks.jsonl")
    parser.add_argument("--deadline", type=float, default=1800.0, help="per rollout, seconds")
    # self: the harnesses live under the installing user's home, which nobody may not enter
    parser.add_argument("--user", default="self", help="--program-user for the consumers")
    parser.add_argument("--out", type=Path, default=Path("/tmp/agentarium-bench-harnesses"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    known = harnesses(HARNESS_DIR.expanduser())
    chosen = args.harness or list(known)
    missing = [n for n in chosen if not Path(known[n].needs).exists()]
    if missing:
        print(f"not installed: {', '.join(missing)} (run ops/harnesses.sh)", file=sys.stderr)
        chosen = [n for n in chosen if n not in missing]
    lines = (ROOT / "examples/repo_tasks.jsonl").read_text().splitlines()
    tasks = [json.loads(line) for line in lines[: args.tasks]]
    model = long_tiny(args.out)
    server = NatsServer(store_dir=args.out / "nats").start()
    rows = []
    try:
        nc = await NatsSettings(url=server.url).connect(name="bench-provision")
        await provision(nc.jetstream(), Topology())
        await nc.close()
        args.dead_before = 0
        with local_engine(model) as llm:
            for name in chosen:
                row = await run_one(
                    name, known[name], nats=server.url, llm=llm, model=model, tasks=tasks, args=args
                )
                rows.append(row)
                print(
                    json.dumps(
                        {
                            k: row[k]
                            for k in (
                                "harness",
                                "ok",
                                "statuses",
                                "calls",
                                "prompt_tokens",
                                "seconds",
                                "problems",
                            )
                        }
                    ),
                    flush=True,
                )
    finally:
        server.stop()
    (args.out / "harnesses.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if rows and all(r["ok"] for r in rows) and not missing else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
