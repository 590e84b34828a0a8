"""The fuzzed job corpus against one real nats-server and two `agentarium consumer` processes.

About a thousand malformed jobs and messages (wrong types, missing fields, bad names, absurd
groups, deadlines and sampling, invalid UTF-8, deep nesting, msgpack that is not a map, wrong
content types and subjects, megabyte payloads) and misbehaving agents (non-rewards, NaN,
exceptions down to SystemExit and KeyboardInterrupt, hangs, swallowed cancellation, 100 MB of
output) are published in bulk, shuffled among valid jobs. Every malformed one must end as a dead
letter or an error/timeout trajectory whose text says what was wrong, every valid one as an ok
trajectory, and each consumer's peak RSS must stay under ``RSS_BOUND_MIB``.
"""

from __future__ import annotations

import asyncio
import base64
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import corpus
import msgpack
import pytest
from corpus import ASYNC_AGENT, RUN, SYNC_AGENT, Case, draw
from fake_sglang import FakeSGLang
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from agentarium.demo.processes import child_env, consumer_argv
from agentarium.producers import TrajectoryReader
from agentarium.schemas import DeadLetter, decode
from agentarium.tiny import ensure_tiny_model

FUZZ = Path(__file__).resolve().parent
ROOT = FUZZ.parents[1]
RSS_BOUND_MIB = 500
MAX_PAYLOAD = 1024 * 1024  # nats-server's default
ATTEMPTS = 2

FIELD_CASES = 36  # per kind of field defect (15 kinds)
MESSAGE_CASES = 30  # per kind of whole-message defect (12 kinds), but for
MORE_MESSAGE_CASES = {"garbage": 80, "json_non_object": 60, "msgpack_non_dict": 50}  # (repeats)
WRONG_SUBJECT_CASES = 30
AGENT_CASES = {"return": 40, "raise": 40, "hang": 12, "ignore_cancel": 12, "bad_chat": 12}
AGENT_CASES_OTHER = 4  # each remaining agent behaviour, per agent kind
VALID_CASES = 120
EXTRA_FIELD_CASES = 30


def heavy_cases() -> list[Case]:
    """The few expensive inputs, once each rather than drawn."""

    def agent_job(agent: str, task: dict, outcome: str, reason: tuple[str, ...] = ()) -> Case:
        job = {"job_id": "", "agent": agent, "task": task, "run": RUN}
        return Case(
            f"agent: {task['do']} (heavy)",
            outcome,
            reason,
            msgpack.packb(job, use_bin_type=True),
            agent=agent,
        )

    def near_limit(job: dict) -> dict:
        """The job with a blob that brings it 64 bytes under the server's max_payload."""
        job["task"]["blob"] = ""
        size = len(msgpack.packb(job))
        job["task"]["blob"] = "z" * (MAX_PAYLOAD - 64 - size - 4)  # 4: the str32 header
        assert len(msgpack.packb(job)) == MAX_PAYLOAD - 64
        return job

    return [
        agent_job(ASYNC_AGENT, {"do": "print", "mib": 100}, "ok"),
        agent_job(SYNC_AGENT, {"do": "print", "mib": 100}, "ok"),
        agent_job(ASYNC_AGENT, {"do": "huge_result", "mib": 50}, "ok"),
        agent_job(ASYNC_AGENT, {"do": "huge_metrics", "n": 200_000}, "error", ("max_payload",)),
        agent_job(SYNC_AGENT, {"do": "huge_metrics", "n": 200_000}, "error", ("max_payload",)),
        # A job that fits the server's max_payload, whose trajectory (the task and the
        # reply) does not...
        Case(
            "agent: ok (heavy)",
            "error",
            ("max_payload",),
            msgpack.packb(
                near_limit(
                    {"job_id": "j-near", "agent": ASYNC_AGENT, "task": {"do": "ok"}, "run": RUN}
                )
            ),
        ),
        # ...and one whose dead letter (the job and the reason) does not
        Case(
            "huge payload",
            "wrong_subject",
            ("does not match its subject",),
            msgpack.packb(near_limit({"job_id": "j-near", "agent": "someone", "task": {}})),
        ),
    ]


def build_corpus() -> list[Case]:
    malformed: list[Case] = []
    for kind in corpus.FIELD_KINDS:
        malformed += draw(corpus.field_cases(kind), FIELD_CASES)
    for kind in corpus.MESSAGE_KINDS:
        malformed += draw(corpus.message_cases(kind), MORE_MESSAGE_CASES.get(kind, MESSAGE_CASES))
    by_id = draw(corpus.wrong_subject_cases(), WRONG_SUBJECT_CASES)
    for sync, kinds in ((False, corpus.ASYNC_KINDS), (True, corpus.SYNC_KINDS)):
        for kind in kinds:
            n = AGENT_CASES.get(kind, AGENT_CASES_OTHER)
            by_id += draw(corpus.agent_cases(kind, sync), n // 2 if sync else n)
    by_id += heavy_cases()
    by_id += draw(corpus.valid_cases(), VALID_CASES)
    by_id += draw(corpus.valid_cases(extra=True), EXTRA_FIELD_CASES)

    cases: list[Case] = []
    seen: set[bytes] = set()
    for i, case in enumerate(malformed):
        case = corpus.with_unique_id(case, f"m{i}")
        key = case.payload[: 64 * 1024]  # what a dead letter keeps of it
        if key not in seen:  # draws may repeat: one case per payload
            seen.add(key)
            cases.append(case)
    cases += [corpus.with_job_id(case, f"j{i}") for i, case in enumerate(by_id)]
    random.Random(20250101).shuffle(cases)  # valid jobs interleaved with the rest
    return cases


def start_consumer(name: str, agent: str, nats_url: str, llm: str, log_dir: Path):
    env = child_env(PYTHONPATH=os.pathsep.join([str(FUZZ), str(FUZZ.parent), str(ROOT)]))
    log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed by the caller
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentarium",
            *consumer_argv(agent, llm, ensure_tiny_model(), nats_url),
            "--burst",
            "--concurrency",
            "64",
            "--attempts",
            str(ATTEMPTS),
            "--retry-delay",
            "0.05",
            "--ack-wait",
            "20",
            "--proxy-host",
            "127.0.0.1",
        ],
        stdout=subprocess.DEVNULL,  # where 100 MB of agent prints go; logs are on stderr
        stderr=log,
        env=env,
    )
    return proc, log


def wait_watching_rss(proc: subprocess.Popen) -> tuple[int, float]:
    """Exit code and peak RSS (MiB) of a child: the kernel's high-water mark, VmHWM, read
    every 50 ms until it exits. (wait4's ru_maxrss would count the parent's memory too: a
    child inherits its parent's maximum across fork and exec.)"""
    peak_kib = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        peak_kib = max(peak_kib, int(line.split()[1]))
        except OSError:  # exited between poll() and open()
            pass
        time.sleep(0.05)
    return proc.returncode, peak_kib / 1024


async def dead_letters(js, topology) -> list[DeadLetter]:
    info = await js.stream_info(topology.dead_stream)
    sub = await js.pull_subscribe(
        f"{topology.prefix}.dead.>",
        durable=None,
        stream=topology.dead_stream,
        config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL),
    )
    letters: list[DeadLetter] = []
    while len(letters) < info.state.messages:
        msgs = await sub.fetch(min(256, info.state.messages - len(letters)), timeout=5)
        letters += [decode(DeadLetter, m.data) for m in msgs]
    await sub.unsubscribe()
    return letters


async def publish_all(js, topology, cases: list[Case]) -> None:
    limit = asyncio.Semaphore(256)

    async def one(case: Case) -> None:
        async with limit:
            await js.publish(topology.tasks_subject(case.agent), case.payload, headers=case.headers)

    await asyncio.gather(*(one(case) for case in cases))


def says(text: str | None, case: Case) -> bool:
    return bool(text) and any(word in text for word in case.reason)


@pytest.mark.timeout(240)
async def test_fuzzed_corpus_is_dead_lettered_or_stored_as_error_and_valid_jobs_complete(
    js, topology, nats_url, tmp_path
):
    started = time.monotonic()
    cases = build_corpus()
    generated_s = time.monotonic() - started
    fake = FakeSGLang()
    await fake.start()
    try:
        await publish_all(js, topology, cases)
        consumers = [
            start_consumer(name, f"{name}=fuzzagents:{fn}", nats_url, fake.url, tmp_path)
            for name, fn in ((ASYNC_AGENT, "rollout"), (SYNC_AGENT, "rollout_sync"))
        ]
        results = await asyncio.gather(
            *(asyncio.to_thread(wait_watching_rss, proc) for proc, _ in consumers)
        )
        for _, log in consumers:
            log.close()
    finally:
        await fake.close()
    logs = {
        name: (tmp_path / f"{name}.log").read_text(errors="replace")
        for name in (ASYNC_AGENT, SYNC_AGENT)
    }
    for (code, _), (name, text) in zip(results, logs.items(), strict=True):
        # --burst exits 1 when any job failed; a crash would not log its stop
        assert code == 1 and '"worker stopped"' in text, f"{name} exit {code}:\n{text[-3000:]}"

    letters = await dead_letters(js, topology)
    by_raw = {base64.b64decode(letter.raw): letter for letter in letters if letter.raw is not None}
    by_job: dict[str, list[DeadLetter]] = {}
    for letter in letters:
        by_job.setdefault(letter.job_id, []).append(letter)
    trajectories = {t.job_id: t for t in await TrajectoryReader(js, topology).read(RUN)}

    wrong: list[str] = []
    for case in cases:
        if case.outcome in ("invalid_job", "wrong_subject"):
            if case.job_id:
                found = by_job.get(case.job_id, [])
                letter = found[0] if len(found) == 1 else None
            else:
                letter = by_raw.get(case.payload[: 64 * 1024])
            if letter is None or letter.reason != case.outcome or not says(letter.error, case):
                wrong.append(f"{case.category}: {case.payload[:120]!r} -> {letter}")
            continue
        trajectory = trajectories.get(case.job_id)
        found = by_job.get(case.job_id, [])
        status = trajectory.status if trajectory else None
        expected_status = "error" if case.outcome == "agent_error" else case.outcome
        ok = status == expected_status
        if case.outcome == "agent_error":
            ok = ok and len(found) == 1 and found[0].reason == "agent_error"
            ok = ok and says(found[0].error, case) and trajectory.attempts == ATTEMPTS
        elif case.outcome != "ok":
            ok = ok and not found
        else:
            ok = ok and not found and trajectory.reward is not None
        if case.outcome in ("error", "timeout", "agent_error"):
            ok = ok and says(trajectory.error, case)
        if not ok:
            error = (trajectory.error or "")[-300:] if trajectory else ""
            wrong.append(f"{case.category} {case.job_id} {case.reason}: {status} {error!r} {found}")
    assert not wrong, f"{len(wrong)} of {len(cases)} cases wrong:\n" + "\n".join(wrong[:30])

    expected_letters = sum(
        c.outcome in ("invalid_job", "wrong_subject", "agent_error") for c in cases
    )
    assert len(letters) == expected_letters  # nothing else was dead-lettered (worker_error...)
    assert (await js.stream_info(topology.tasks_stream)).state.messages == 0

    peaks = [rss for _, rss in results]
    assert max(peaks) < RSS_BOUND_MIB, peaks
    malformed = [c for c in cases if c.outcome != "ok" or c.category.startswith("agent")]
    print(
        f"\nfuzzed worker corpus: {len(cases)} inputs, {len(malformed)} malformed or misbehaving; "
        f"generated in {generated_s:.1f}s, total {time.monotonic() - started:.1f}s; "
        f"consumer peak RSS MiB {[round(p) for p in peaks]}"
    )
    for category, n in sorted(Counter(c.category for c in cases).items()):
        print(f"  {n:5d}  {category}")
    assert len(malformed) >= 1000
