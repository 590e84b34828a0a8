"""``agentarium eval``: killed halfway and resumed (no pair evaluated twice, none missing), a
finished eval rerun does nothing, cross-sampling records both models, and the SFT export."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fake_sglang import FakeSGLang

from agentarium.broker import NatsSettings
from agentarium.evaluation import EvalConfig, EvalRun, export_run, print_summary
from agentarium.producers import TrajectoryReader

ROOT = Path(__file__).resolve().parents[1]


class SlowFake(FakeSGLang):
    """Answers after ``delay`` seconds, so an eval is still running when the test kills it."""

    def __init__(self, delay: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.delay = delay

    async def _generate(self, request):
        await asyncio.sleep(self.delay)
        return await super()._generate(request)


def write_tasks(path: Path, n: int) -> Path:
    lines = [
        json.dumps({"task_id": f"t{i}", "prompt": f"repeat {i % 10}", "answer": str(i % 10)})
        for i in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def eval_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "agentarium", "eval", "run", *args]


async def wait_lines(
    path: Path, n: int, proc: asyncio.subprocess.Process, timeout: float = 60
) -> None:
    async with asyncio.timeout(timeout):
        while not (path.exists() and len(path.read_text().splitlines()) >= n):
            assert proc.returncode is None, "eval exited before the test could kill it"
            await asyncio.sleep(0.05)


async def test_resume_after_kill_runs_every_pair_exactly_once(js, topology, nats_url, tmp_path):
    fake = SlowFake(0.15, output_ids=[51, 258], text="3")
    await fake.start()
    tasks = write_tasks(tmp_path / "tasks.jsonl", 12)
    out = tmp_path / "eval-out"
    args = [
        "--agent",
        "toy=agentarium.examples.toy:rollout",
        "--file",
        str(tasks),
        "--k",
        "2",
        "--llm",
        fake.url,
        "--out",
        str(out),
        "--run",
        "evalkill",
        "--concurrency",
        "2",
        "--ack-wait",
        "3",
        "--nats-url",
        nats_url,
    ]
    env = {**os.environ, "AGENTARIUM_LOG_LEVEL": "warning"}
    try:
        first = await asyncio.create_subprocess_exec(
            *eval_cmd(*args),
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        await wait_lines(out / "results.jsonl", 4, first)
        first.send_signal(signal.SIGKILL)
        await first.wait()
        done_before = len((out / "results.jsonl").read_text().splitlines())
        assert 4 <= done_before < 24

        # without --resume an unfinished eval is refused, saying what to do
        # in a thread: the eval asks the fake (served on this loop) what it serves
        refused = await asyncio.to_thread(
            subprocess.run,
            eval_cmd(*args),
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 2 and "--resume" in refused.stderr

        resumed = await asyncio.create_subprocess_exec(
            *eval_cmd(*args, "--resume"),
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(resumed.communicate(), 120)
        assert resumed.returncode == 0, stderr.decode()[-3000:]
        assert "pass@2" in stdout.decode() and "best-of-2" in stdout.decode()

        stored = await TrajectoryReader(js, topology).read("evalkill")
        pairs = [(t.task_id, t.sample_index) for t in stored]
        assert len(pairs) == 24 and len(set(pairs)) == 24  # none twice, none missing
        assert all(t.status == "ok" and t.is_train is False for t in stored)
        results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        assert sorted((r["task_id"], r["attempt"]) for r in results) == sorted(pairs)
        # only rollouts in flight at the kill ran a second LLM call
        assert fake.count <= 24 + 2

        again = await asyncio.create_subprocess_exec(
            *eval_cmd(*args),
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(again.communicate(), 60)
        assert again.returncode == 0 and "nothing to do" in stderr.decode()
        assert len(await TrajectoryReader(js, topology).read("evalkill")) == 24
        summary = json.loads((out / "summary.json").read_text())
        assert summary["ok"] == 24 and summary["missing"] == 0 and summary["pass@1"] is not None
    finally:
        await fake.close()


async def test_cross_sampling_records_both_models_and_export(js, topology, nats_url, tmp_path):
    primary = FakeSGLang(output_ids=[49, 258], text="1")
    second = FakeSGLang(output_ids=[50, 258], text="2")
    for server in (primary, second):
        await server.start()
    tasks = write_tasks(tmp_path / "tasks.jsonl", 6)
    out = tmp_path / "cross"
    cfg = EvalConfig.of(
        agent="calc=agentarium.examples.calculator:rollout",
        tasks_file=str(tasks),
        k=2,
        out_dir=str(out),
        run="evalcross",
        llm=(primary.url,),
        model="tiny",
        cross_model=(second.url,),
        cross_model_name="big",
        cross_ratio=0.5,
        seed=3,
        concurrency=4,
    )
    try:
        stdout = io.StringIO()
        code = await EvalRun(cfg, NatsSettings(url=nats_url), out=stdout, err=io.StringIO()).run()
        assert code == 0
        assert "calls by model" in stdout.getvalue()
    finally:
        for server in (primary, second):
            await server.close()
    assert primary.count and second.count
    stored = await TrajectoryReader(js, topology).read("evalcross")
    assert len(stored) == 12
    served = {}
    for traj in stored:
        for call in traj.calls:
            served[call.model] = call.backend
            assert call.policy == (call.model == "tiny")
            assert call.response_ids == ([49, 258] if call.policy else [50, 258])
    assert served == {"tiny": primary.url, "big": second.url}
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {m for r in results for m in r["models"]} == {"tiny", "big"}

    table = io.StringIO()
    assert print_summary(out, out=table) == 0
    assert "best-of-2" in table.getvalue() and "big" in table.getvalue()

    # the same run as an SFT dataset: messages plus token arrays with a loss mask
    n = await export_run(js, topology, run="evalcross", fmt="jsonl", out=tmp_path / "sft.jsonl")
    records = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert n == len(records) == 12
    for record in records:
        assert record["messages"][0]["role"] in ("system", "user")
        assert len(record["input_ids"]) == len(record["loss_mask"]) == len(record["logprobs"])
        assert record["loss_mask"][: record["prompt_length"]] == [0] * record["prompt_length"]
    # the loss mask marks the policy's tokens: the other model's replies are context
    policy_calls = sum(c.policy for t in stored for c in t.calls)
    assert sorted(sum(r["loss_mask"]) for r in records) == sorted(
        2 if c.policy else 0 for t in stored for c in t.calls
    )
    assert 0 < policy_calls < 12
    pq = pytest.importorskip("pyarrow.parquet")
    n = await export_run(js, topology, run="evalcross", fmt="parquet", out=tmp_path / "sft.parquet")
    table = pq.read_table(tmp_path / "sft.parquet")
    assert table.num_rows == n == 12
    assert table.column("input_ids").to_pylist() == [r["input_ids"] for r in records]


async def test_new_weights_behind_the_same_url_and_name_are_a_new_eval(nats_url, tmp_path):
    # The run id holds what the server serves (here SGLang's model_info: model path and
    # weight_version), so the same command after the weights changed runs again instead of
    # printing "nothing to do" with the other weights' results.
    fake = FakeSGLang(output_ids=[51, 258], text="3", weight_version="default")
    await fake.start()
    tasks = write_tasks(tmp_path / "tasks.jsonl", 2)

    async def evaluate(**sampling) -> tuple[EvalRun, str]:
        cfg = EvalConfig.of(
            agent="toy=agentarium.examples.toy:rollout",
            tasks_file=str(tasks),
            llm=(fake.url,),
            model="tiny",
            out_dir=str(tmp_path / f"out-{fake.weight_version}-{len(sampling)}"),
            **sampling,
        )
        err = io.StringIO()
        run = EvalRun(cfg, NatsSettings(url=nats_url), out=io.StringIO(), err=err)
        assert await run.run() == 0
        return run, err.getvalue()

    try:
        base, _ = await evaluate()
        again, said = await evaluate()
        assert again.run_id == base.run_id and "nothing to do" in said
        fake.weight_version = "12"  # the syncer loaded the trained weights
        trained, said = await evaluate()
        # the same weights at another temperature are another eval too, sampled at it
        cooler, said_cooler = await evaluate(temperature=0.5)
    finally:
        await fake.close()
    assert trained.run_id != base.run_id and "nothing to do" not in said
    assert trained.served == ["/models/fake@12"] and base.served == ["/models/fake@default"]
    manifest = json.loads((tmp_path / "out-12-0" / "eval.json").read_text())
    assert manifest["served"] == ["/models/fake@12"]
    assert cooler.run_id not in (trained.run_id, base.run_id)
    assert "nothing to do" not in said_cooler
    temperatures = [r["sampling_params"]["temperature"] for r in fake.requests]
    assert temperatures == [1.0] * 4 + [0.5] * 2  # 2 tasks, once per weights, then cooler
