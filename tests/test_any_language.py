"""Results in any language: the Go and Node.js examples publish jobs and read their trajectories
back from a real consumer; every stored message names its encoding, and the JSON Schemas
describe both encodings exactly (checked on real wire messages)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import sys
from pathlib import Path

import agentlib
import msgpack
import numpy as np
import pytest
from worker_env import worker_for

from agentarium.broker import collect_status
from agentarium.examples import toy
from agentarium.producers import TaskProducer, TrajectoryReader
from agentarium.schemas import DeadLetter, Job, Trajectory, decode, encode_json

ROOT = Path(__file__).parents[1]
SCHEMAS = ROOT / "schemas" / "json"
GO_EXAMPLE = ROOT / "examples" / "go"
NODE_EXAMPLE = ROOT / "examples" / "node"
PROGRAM_TIMEOUT_S = 120


def _missing(message: str) -> None:
    """Skip, except under CI=true: an example whose test never runs checks nothing."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def go_program(tmp_path_factory) -> Path:
    if shutil.which("go") is None:
        _missing(
            "go not found: apt-get install golang-go golang-github-nats-io-go-nats-dev "
            "(ops/setup.sh --test does)"
        )
    out = tmp_path_factory.mktemp("go") / "agentarium-go"
    import subprocess

    built = subprocess.run(
        ["bash", str(GO_EXAMPLE / "build.sh"), str(out)], capture_output=True, text=True
    )
    assert built.returncode == 0, f"go build failed:\n{built.stdout}\n{built.stderr}"
    return out


@pytest.fixture(scope="module")
def node_program() -> list[str]:
    node = shutil.which("node")
    if node is None:
        _missing("node not found: install Node.js 18+")
    if not (NODE_EXAMPLE / "node_modules" / "@nats-io" / "transport-node").is_dir():
        _missing(
            "the NATS Node client is not installed: npm ci --prefix examples/node "
            "(ops/setup.sh --test does)"
        )
    return [node, str(NODE_EXAMPLE / "agentarium.mjs")]


async def _run_example(js, topology, fake, argv: list[str], run: str) -> list[dict]:
    """Start the example, let it publish, run a JSON-encoding toy consumer until the queue is
    empty, and return the trajectories the example printed."""
    proc = await asyncio.create_subprocess_exec(
        *argv, "--agent", "toy", "--run", run, "--jobs", "3",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        first = await asyncio.wait_for(proc.stdout.readline(), PROGRAM_TIMEOUT_S)
        assert json.loads(first) == {"published": 3}, first
        async with worker_for(js, "toy", toy.rollout, [fake.url], encoding="json") as worker:
            counters = await worker.run()
        assert counters.ok == 3
        out, err = await asyncio.wait_for(proc.communicate(), PROGRAM_TIMEOUT_S)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    return [json.loads(line) for line in out.decode().splitlines()]


async def _check_against_python_reader(js, topology, printed: list[dict], run: str) -> None:
    assert len(printed) == 3 and all(t["status"] == "ok" for t in printed)
    stored = {t.job_id: t for t in await TrajectoryReader(js, topology).read(run, "toy")}
    assert sorted(stored) == sorted(t["job_id"] for t in printed)
    for t in printed:
        mine = stored[t["job_id"]]
        assert t["reward"] == mine.reward and (t["agent"], t["run"]) == ("toy", run)
        assert len(t["calls"]) == len(mine.calls) == 1
        for theirs, ours in zip(t["calls"], mine.calls, strict=True):
            assert theirs["prompt_ids"] == ours.prompt_ids and ours.prompt_ids
            assert theirs["response_ids"] == ours.response_ids and ours.response_ids
            assert theirs["response_logprobs"] == pytest.approx(ours.response_logprobs)


async def test_go_example_publishes_jobs_and_reads_their_trajectories(
    js, topology, fake, go_program, nats_url
):
    printed = await _run_example(js, topology, fake, [str(go_program), "-nats", nats_url], "go")
    await _check_against_python_reader(js, topology, printed, "go")


async def test_node_example_publishes_jobs_and_reads_their_trajectories(
    js, topology, fake, node_program, nats_url
):
    printed = await _run_example(js, topology, fake, [*node_program, "--nats", nats_url], "node")
    await _check_against_python_reader(js, topology, printed, "node")


async def test_example_refuses_msgpack_trajectories_with_a_fix(
    js, topology, fake, node_program, nats_url
):
    proc = await asyncio.create_subprocess_exec(
        *node_program, "--nats", nats_url, "--agent", "echo", "--run", "mp", "--jobs", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    await asyncio.wait_for(proc.stdout.readline(), PROGRAM_TIMEOUT_S)
    async with worker_for(js, "echo", agentlib.echo, [fake.url]) as worker:  # msgpack
        await worker.run()
    _, err = await asyncio.wait_for(proc.communicate(), PROGRAM_TIMEOUT_S)
    assert proc.returncode == 1
    assert '"application/msgpack", not application/json' in err.decode()
    assert "--encoding json" in err.decode()


# ---- the wire, against the schemas ---------------------------------------------------------


async def _stored(js, stream: str) -> list:
    """Every message of ``stream`` as stored, headers included (by sequence: the work-queue
    stream takes no second consumer)."""
    state = (await js.stream_info(stream)).state
    if not state.messages:
        return []
    return [await js.get_msg(stream, seq) for seq in range(state.first_seq, state.last_seq + 1)]


def _resolve(schema: dict, root: dict) -> dict:
    ref = schema.get("$ref")
    return root["$defs"][ref.rsplit("/", 1)[-1]] if ref else schema


def _as_json_model(value, schema: dict, root: dict):
    """A decoded msgpack message as the JSON encoding would hold it, by the schema's own
    ``x-msgpack`` annotations (bytes of that dtype and byte order, in place of an array)."""
    schema = _resolve(schema, root)
    packed = schema.get("x-msgpack")
    if packed is not None:
        assert isinstance(value, bytes), f"expected a msgpack bin, got {type(value).__name__}"
        assert packed["type"] == "bin" and len(value) % packed["itemsize"] == 0
        order = {"little": "<", "big": ">"}[packed["byteorder"]]
        dtype = {"int32": "i4", "float32": "f4"}[packed["dtype"]]
        items = np.frombuffer(value, dtype=order + dtype).tolist()
        return [x if not isinstance(x, float) or math.isfinite(x) else None for x in items]
    if isinstance(value, dict) and "properties" in schema:
        props = schema["properties"]
        return {k: _as_json_model(v, props.get(k, {}), root) for k, v in value.items()}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_as_json_model(v, schema["items"], root) for v in value]
    return value


def _validate(msg, schema_name: str) -> str:
    """Validate one stored message against its schema, in the encoding its header names."""
    jsonschema = pytest.importorskip("jsonschema", reason="pip install jsonschema")
    schema = json.loads((SCHEMAS / f"{schema_name}.schema.json").read_text())
    content_type = (msg.headers or {}).get("Content-Type")
    if content_type == "application/json":
        instance = json.loads(msg.data)
    else:
        assert content_type == "application/msgpack", f"{msg.subject}: {content_type!r}"
        raw = msgpack.unpackb(msg.data, raw=False)
        instance = _as_json_model(raw, schema, schema)
    jsonschema.Draft202012Validator(schema).validate(instance)
    return content_type


@pytest.mark.parametrize("encoding", ["msgpack", "json"])
async def test_stored_messages_name_their_encoding_and_match_the_schemas(
    js, topology, fake, encoding
):
    await TaskProducer(js, topology).submit("echo", [{"prompt": "hi"}, {"prompt": "yo"}], run="w")
    wrong = Job(job_id="elsewhere", agent="other", task={})  # on echo's subject: wrong_subject
    await js.publish(
        topology.tasks_subject("echo"),
        encode_json(wrong),
        headers={"Content-Type": "application/json"},
    )
    jobs = await _stored(js, topology.tasks_stream)
    assert [_validate(m, "job") for m in jobs] == ["application/msgpack"] * 2 + ["application/json"]

    async with worker_for(js, "echo", agentlib.echo, [fake.url], encoding=encoding) as worker:
        counters = await worker.run()
    assert counters.ok == 2 and counters.dead_lettered == 1
    wanted = f"application/{encoding}"
    trajectories = await _stored(js, topology.trajectories_stream)
    assert [_validate(m, "trajectory") for m in trajectories] == [wanted] * 2
    for m in trajectories:  # and Agentarium's own reader takes either
        t = decode(Trajectory, m.data, m.headers["Content-Type"])
        assert t.calls[0].response_ids == fake.output_ids
    letters = await _stored(js, topology.dead_stream)
    assert [_validate(m, "dead_letter") for m in letters] == [wanted]


async def test_a_job_for_another_agent_is_dead_lettered_under_its_subjects_agent(
    js, topology, fake
):
    job = Job(job_id="stray", agent="other", task={"prompt": "repeat 1", "answer": "1"})
    await js.publish(topology.tasks_subject("toy"), json.dumps(job.to_wire(binary=False)).encode())
    async with worker_for(js, "toy", toy.rollout, [fake.url]) as worker:
        await worker.run()
    letters = await _stored(js, topology.dead_stream)
    assert [m.subject for m in letters] == [topology.dead_subject("toy")]
    letter = decode(DeadLetter, letters[0].data, letters[0].headers["Content-Type"])
    assert (letter.reason, letter.job_id, letter.subject) == (
        "wrong_subject",
        "stray",
        topology.tasks_subject("toy"),
    )
    status = await collect_status(js, topology, environments=False)
    rows = {row.agent: row for row in status.agents}
    assert "other" not in rows, "a phantom agent row for the job's own agent name"
    assert rows["toy"].dead_lettered == 1


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
