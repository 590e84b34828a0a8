"""verl's data format in and out: a verl-style parquet dataset (prompt as chat messages,
data_source, reward_model, extra_info, ability) goes through `agentarium produce` (the agent
per row from data_source) and `agentarium eval run`, and the parquet export loads with the
`datasets` library with `messages` as lists of role/content structs, as TRL's SFT reads them."""

from __future__ import annotations

import argparse
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fake_sglang import FakeSGLang

from agentarium.broker import NatsSettings
from agentarium.commands import produce_cmd
from agentarium.evaluation import EvalConfig, EvalRun, export_run
from agentarium.producers import TaskFileError, read_task_file
from agentarium.schemas import Job, LLMCall, Trajectory, decode, encode


def verl_row(index: int, source: str, question: str, answer: str) -> dict:
    """One row as verl's data preprocessing scripts write it (examples/data_preprocess)."""
    return {
        "data_source": source,
        "prompt": [
            {"role": "system", "content": "Answer with one digit."},
            {"role": "user", "content": question},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": index},
    }


ROWS = [
    verl_row(0, "toy", "repeat 3", "3"),
    verl_row(1, "toy", "repeat 4", "4"),
    verl_row(2, "calc", "2+2", "4"),
    verl_row(3, "openai/gsm8k", "3+4", "7"),  # a dataset name, not an agent name
]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def produce_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    produce_cmd.add_produce_arguments(parser)
    return parser.parse_args(list(argv))


async def stored(js, topology) -> list[tuple[str, Job]]:
    info = await js.stream_info(topology.tasks_stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await js.get_msg(topology.tasks_stream, seq)
        out.append((raw.subject, decode(Job, raw.data)))
    return out


def test_the_task_file_reader_takes_parquet_rows_as_they_are(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", ROWS)
    read = read_task_file(path)
    assert read.tasks == ROWS and read.positions == [1, 2, 3, 4] and read.unit == "row"
    # a column JSON cannot carry is named with its row
    pq.write_table(
        pa.table({"prompt": ["a", "b"], "blob": [b"x", b"\xff"]}), tmp_path / "b.parquet"
    )
    with pytest.raises(TaskFileError, match=r"row 1, column 'blob': a bytes value"):
        read_task_file(tmp_path / "b.parquet")
    (tmp_path / "fake.parquet").write_text('{"not": "parquet"}\n')
    with pytest.raises(TaskFileError, match="is not a parquet file"):
        read_task_file(tmp_path / "fake.parquet")


def test_without_pyarrow_the_error_names_the_package(tmp_path, monkeypatch):
    import builtins

    path = write_parquet(tmp_path / "train.parquet", ROWS)
    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(TaskFileError, match=r"needs pyarrow: pip install 'agentarium\[parquet\]'"):
        read_task_file(path)


async def test_verl_parquet_becomes_jobs_routed_by_data_source(
    js, topology, settings, tmp_path, capsys
):
    path = write_parquet(tmp_path / "train.parquet", ROWS)
    args = produce_args(
        "--file", str(path), "--agent-from", "data_source", "--agent", "toy", "--run", "verl",
        "--group-size", "2",
    )  # fmt: skip
    assert await produce_cmd.run_produce(args, settings) == 0
    captured = capsys.readouterr()
    assert "jobs per agent: calc=2 toy=6" in captured.err
    assert "jobs=8 published=8 duplicates=0" in captured.out

    jobs = await stored(js, topology)
    assert len(jobs) == 8
    for subject, job in jobs:
        assert subject == topology.tasks_subject(job.agent)
        assert job.run == "verl" and job.group_size == 2
    by_task = {job.task_id: job for _, job in jobs}
    # the row is the task, verbatim: chat messages, reward_model and extra_info as objects
    assert [by_task[f"t{i}"].task for i in range(4)] == ROWS
    # data_source names the agent; a dataset name (openai/gsm8k) falls back to --agent
    assert [by_task[f"t{i}"].agent for i in range(4)] == ["toy", "toy", "calc", "toy"]
    assert by_task["t2"].task["reward_model"]["ground_truth"] == "4"


async def test_rows_without_an_agent_are_named_before_anything_is_sent(settings, tmp_path, capsys):
    path = write_parquet(tmp_path / "train.parquet", ROWS)
    args = produce_args("--file", str(path), "--agent-from", "data_source", "--run", "verl")
    assert await produce_cmd.run_produce(args, settings) == 2
    err = capsys.readouterr().err
    assert "row 4: data_source 'openai/gsm8k' is not an agent name" in err
    assert "pass --agent NAME for such rows" in err
    with pytest.raises(ValueError, match="pass --agent NAME, or --agent-from COLUMN"):
        produce_cmd.check_produce(produce_args("--file", str(path)))


async def test_eval_run_reads_a_verl_parquet(nats_url, tmp_path):
    # the toy agent reads verl rows too: messages from prompt, answer from reward_model
    path = write_parquet(tmp_path / "test.parquet", [r for r in ROWS if r["data_source"] == "toy"])
    fake = FakeSGLang(output_ids=[51, 258], text="3")  # always answers "3"
    await fake.start()
    try:
        cfg = EvalConfig.of(
            agent="toy=agentarium.examples.toy:rollout",
            tasks_file=str(path),
            k=2,
            out_dir=str(tmp_path / "eval"),
            run="evalverl",
            llm=(fake.url,),
            model="tiny",
            concurrency=4,
        )
        run = EvalRun(cfg, NatsSettings(url=nats_url), out=io.StringIO(), err=io.StringIO())
        assert await run.run() == 0
    finally:
        await fake.close()
    results = [json.loads(line) for line in (tmp_path / "eval" / "results.jsonl").open()]
    rewards = {(r["task_id"], r["attempt"]): r["reward"] for r in results}
    assert rewards == {("t0", 0): 1.0, ("t0", 1): 1.0, ("t1", 0): 0.0, ("t1", 1): 0.0}


def trajectory(job_id: str, messages: list[dict]) -> Trajectory:
    call = LLMCall(
        prompt_ids=[257, 51, 52],
        response_ids=[53, 258],
        response_logprobs=[-0.5, -0.1],
        finish_reason="stop",
        messages=messages,
    )
    return Trajectory(
        job_id=job_id,
        agent="calc",
        task_id=job_id,
        group_id=job_id,
        run="sft",
        status="ok",
        reward=1.0,
        calls=[call],
    )


TOOL_CHAT = [
    {"role": "user", "content": "2+2?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'},
            }
        ],
    },
    {"role": "tool", "content": "4", "tool_call_id": "call_1", "name": "add"},
    {"role": "assistant", "content": "4"},
]
PLAIN_CHAT = [{"role": "user", "content": "repeat 5"}, {"role": "assistant", "content": "5"}]


async def export_and_load(js, topology, tmp_path, chats: dict[str, list[dict]], name: str):
    datasets = pytest.importorskip("datasets")
    for job_id, messages in chats.items():
        t = trajectory(job_id, messages)
        await js.publish(topology.trajectory_subject(t.run, t.agent, t.job_id), encode(t))
    out = tmp_path / f"{name}.parquet"
    await export_run(js, topology, run="sft", fmt="parquet", out=out)
    loaded = datasets.load_dataset(
        "parquet", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf")
    )
    return {row["job_id"]: row for row in loaded}, loaded.features


def message_keys(features) -> set[str]:
    column = features["messages"]  # datasets >= 4: List(feature); before: [feature]
    return set(column.feature if hasattr(column, "feature") else column[0])


async def test_export_parquet_loads_with_datasets_messages_as_structs(js, topology, tmp_path):
    rows, features = await export_and_load(js, topology, tmp_path, {"plain": PLAIN_CHAT}, "plain")
    # a chat without tools: exactly role and content, nothing null-filled for a template
    assert rows["plain"]["messages"] == PLAIN_CHAT
    assert message_keys(features) == {"role", "content"}
    assert len(rows["plain"]["input_ids"]) == len(rows["plain"]["loss_mask"]) == 5


async def test_export_parquet_keeps_tool_calls_as_structs(js, topology, tmp_path):
    rows, features = await export_and_load(
        js, topology, tmp_path, {"tools": TOOL_CHAT, "plain": PLAIN_CHAT}, "tools"
    )
    assert message_keys(features) == {"role", "content", "tool_calls", "tool_call_id", "name"}
    tools = rows["tools"]["messages"]
    assert [m["role"] for m in tools] == ["user", "assistant", "tool", "assistant"]
    assert tools[1]["tool_calls"] == TOOL_CHAT[1]["tool_calls"]
    assert json.loads(tools[1]["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 2}
    assert (tools[2]["tool_call_id"], tools[2]["name"], tools[2]["content"]) == (
        "call_1",
        "add",
        "4",
    )
    # the other conversation has the same keys, null where it has nothing
    assert rows["plain"]["messages"][1] == {
        "role": "assistant",
        "content": "5",
        "tool_calls": None,
        "tool_call_id": None,
        "name": None,
    }
