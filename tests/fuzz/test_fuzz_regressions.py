"""One example of each defect the fuzzed corpus found, pinned where it was fixed.

Before the fixes: a job that decoded but could not be written back (an integer beyond 64 bits,
a lone surrogate) failed every delivery as a worker error and lost its reason; JSON nested too
deeply or a msgpack map keyed by an array escaped decoding as RecursionError/TypeError; NaN
deadlines and temperatures were accepted; an agent raising SystemExit, KeyboardInterrupt or
GeneratorExit ended the consumer process; an agent swallowing its cancellation was stored as
``ok`` after its deadline; a trajectory over max_payload was retried to ``max_deliveries``; a
token id outside the vocabulary crashed the trainer (and again after each restart); a
sampling_seed out of a torch.Generator's range and a body nested too deeply were 500s.
"""

from __future__ import annotations

import asyncio
import json
import math

import msgpack
import pytest
from fake_sglang import FakeSGLang
from worker_env import worker_for

from agentarium.consumers.tracing.llm import _sampling_params
from agentarium.inference.engine.errors import InvalidRequest
from agentarium.inference.engine.request import parse_generate
from agentarium.producers import TrajectoryReader
from agentarium.schemas import (
    DecodeError,
    Job,
    LLMCall,
    Sampling,
    SchemaError,
    Trajectory,
    WeightIdentity,
    decode,
    run_version,
)
from agentarium.trainer.rows import refusal

BASE = {"job_id": "a", "agent": "fuzz", "task": {}}


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (json.dumps({**BASE, "group_size": 2**64}).encode(), "job.group_size"),
        (json.dumps({**BASE, "group_size": 1e300}).encode(), "job.group_size"),
        (json.dumps({**BASE, "task": {"n": 10**30}}).encode(), "64 bits"),
        (json.dumps({**BASE, "task": {"d": nested(600)}}).encode(), "nested deeper than 64"),
        (b'{"job_id":"a","agent":"fuzz","task":{"s":"\\udc80"}}', "lone surrogates"),
        (b'{"job_id":"a","agent":"fuzz","task":{},"batch_id":"\\ud800"}', "job.batch_id"),
        (msgpack.packb({**BASE, "task": {"b": b"\x00"}}), "JSON values only"),
        (msgpack.packb({**BASE, "task": {1: "x"}}), "object key"),
        (json.dumps({**BASE, "deadline_s": math.nan}).encode(), "job.deadline_s"),
        (json.dumps({**BASE, "deadline_s": math.inf}).encode(), "job.deadline_s"),
        (json.dumps({**BASE, "deadline_s": 10**400}).encode(), "job.deadline_s"),
        (json.dumps({**BASE, "sampling": {"temperature": math.nan}}).encode(), "temperature"),
        (b'{"job_id":"a","task":' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"}", "nested"),
        (b"\x81\x92\x01\x02\x01", "unhashable"),
        (b"\x83\xa6job_id\xa1x\xa5agent\xa4fuzz\xa4task" + b"\x91" * 2000 + b"\xc0", "nested"),
        (b"\xc1", "FormatError"),  # an empty message no longer
    ],
)
def test_a_job_that_could_not_be_stored_again_is_refused_when_decoded(payload, says):
    with pytest.raises(SchemaError) as refused:
        decode(Job, payload)
    assert says in str(refused.value)
    if isinstance(refused.value, DecodeError):
        assert refused.value.raw == payload


def test_sampling_and_versions_that_mean_nothing_are_refused():
    with pytest.raises(SchemaError, match="finite"):
        Sampling(temperature=math.inf)
    # what int() would take is no identity: "r@-3:…", "r@+3:…", "r@ 7:…", "r@1_000:…", "r@²:…"
    for version in ("-3", "+3", " 7", "1_000", "²", "012"):
        assert WeightIdentity.parse(f"r@{version}:{'ab' * 8}") is None, version
        assert run_version(f"r@{version}:{'ab' * 8}", "r") is None
    assert run_version(f"r@12:{'ab' * 8}", "r") == 12 and run_version("default", "r") == 0


def one_call(**fields) -> Trajectory:
    call = {"prompt_ids": [1, 2], "response_ids": [3], "response_logprobs": [-1.0]}
    call.update(fields)
    return Trajectory(
        job_id="j",
        agent="a",
        task_id="t",
        group_id="g",
        status="ok",
        reward=1.0,
        calls=[LLMCall(finish_reason="stop", **call)],
    )


def test_the_trainer_refuses_what_would_crash_a_step_or_make_its_loss_nan():
    assert refusal(one_call(), vocab_size=263) is None
    assert "vocabulary" in refusal(one_call(response_ids=[263]), vocab_size=263)
    assert "vocabulary" in refusal(one_call(prompt_ids=[-1, 2]))
    assert "log-prob" in refusal(one_call(response_logprobs=[math.nan]))
    assert "not finite" in refusal(one_call(temperature=math.inf))
    assert "top_p" in refusal(one_call(top_p=math.nan))


def test_the_engine_and_the_tracing_client_name_a_bad_sampling_option():
    def parse(sampling: dict) -> None:
        body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1, **sampling}}
        parse_generate(body, encode=list, vocab_size=10, context_len=100)

    parse({"sampling_seed": 2**64 - 1})
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(InvalidRequest, match="sampling_seed"):
            parse({"sampling_seed": seed})
    for option, value in (("temperature", "hot"), ("top_k", 1.5), ("stop", {}), ("seed", "x")):
        with pytest.raises(ValueError, match=option if option != "seed" else "sampling_seed"):
            _sampling_params(Sampling(), [], {option: value})


release, gave_in = asyncio.Event(), asyncio.Event()


async def swallows_cancellation(task: dict, llm) -> float:
    """Ignores every cancellation until the test lets it go."""
    while not release.is_set():
        try:
            await release.wait()
        except asyncio.CancelledError:
            continue
    gave_in.set()
    return 1.0


async def exits(task: dict, llm) -> float:
    raise {"exit": SystemExit(3), "interrupt": KeyboardInterrupt(), "gen": GeneratorExit()}[
        task["how"]
    ]


async def huge_metrics(task: dict, llm) -> dict:
    return {"reward": 1.0, "metrics": {f"m{i}": float(i) for i in range(100_000)}}


async def publish(js, topology, agent: str, tasks: list[dict], deadline_s: float = 60.0) -> None:
    for i, task in enumerate(tasks):
        job = {"job_id": f"{agent}-{i}", "agent": agent, "task": task, "deadline_s": deadline_s}
        await js.publish(topology.tasks_subject(agent), msgpack.packb(job))


async def test_an_agent_can_neither_stop_its_worker_nor_hold_it_past_a_deadline(js, topology):
    release.clear()
    gave_in.clear()
    fake = FakeSGLang()
    await fake.start()
    try:
        await publish(js, topology, "exits", [{"how": h} for h in ("exit", "interrupt", "gen")])
        await publish(js, topology, "swallows", [{}], deadline_s=0.3)
        await publish(js, topology, "big", [{}])
        for agent, fn in (
            ("exits", exits),
            ("swallows", swallows_cancellation),
            ("big", huge_metrics),
        ):
            async with worker_for(js, agent, fn, [fake.url], attempts=1) as worker:
                started = asyncio.get_running_loop().time()
                await worker.run()
                elapsed = asyncio.get_running_loop().time() - started
            if agent == "swallows":
                assert elapsed < 10  # the deadline (0.3 s) and the grace (1 s), not forever
    finally:
        await fake.close()
    stored = {t.job_id: t for t in await TrajectoryReader(js, topology).read("default")}
    for i, name in enumerate(("SystemExit", "KeyboardInterrupt", "GeneratorExit")):
        assert stored[f"exits-{i}"].status == "error" and name in stored[f"exits-{i}"].error
    assert stored["swallows-0"].status == "timeout"
    assert stored["big-0"].status == "error" and "max_payload" in stored["big-0"].error
    release.set()  # the abandoned agent, still running, may end now
    await gave_in.wait()
