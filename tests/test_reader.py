"""TrajectoryReader and `agentarium trajectories show`, on trajectories published directly."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import replace

import pytest
import structlog
from trainlib import short_call

from agentarium.commands import trajectories_cmd as producers_cli
from agentarium.producers import StreamMissing, TrajectoryReader
from agentarium.schemas import Trajectory, encode, encode_json


def trajectory(
    run: str, agent: str, job_id: str, *, status: str = "ok", reward: float | None = 1.0, **kw
) -> Trajectory:
    call = short_call(weight_version="3")
    return Trajectory(
        job_id=job_id,
        agent=agent,
        task_id=f"task-{job_id}",
        group_id=f"group-{job_id}",
        run=run,
        status=status,
        reward=reward if status == "ok" else None,
        error=None if status == "ok" else "Traceback...\nRuntimeError: boom",
        calls=[call],
        **kw,
    )


async def store(js, topology, *trajectories: Trajectory, as_json: bool = False) -> None:
    futures = []
    for t in trajectories:
        payload = encode_json(t) if as_json else encode(t)
        futures.append(
            await js.publish_async(topology.trajectory_subject(t.run, t.agent, t.job_id), payload)
        )
    await asyncio.gather(*futures)


async def reader_consumers(js, topology) -> list[str]:
    return [c.name for c in await js.consumers_info(topology.trajectories_stream)]


@pytest.mark.nats_semantics
async def test_read_returns_what_is_stored_with_filters(js, topology):
    await store(
        js,
        topology,
        *(trajectory("r1", "a", f"a{i}") for i in range(5)),
        trajectory("r1", "b", "b0"),
        trajectory("r1", "b", "b1", status="error"),
        trajectory("r1", "b", "b2", status="timeout"),
        *(trajectory("r2", "a", f"x{i}") for i in range(3)),
    )
    reader = TrajectoryReader(js, topology)
    everything = await reader.read("r1")
    assert [t.job_id for t in everything] == ["a0", "a1", "a2", "a3", "a4", "b0", "b1", "b2"]
    assert everything[0].calls[0].response_ids == [4, 5] and everything[0].reward == 1.0
    assert [t.job_id for t in await reader.read("r1", "b")] == ["b0", "b1", "b2"]
    assert [t.job_id for t in await reader.read("r1", status="error")] == ["b1"]
    assert [t.job_id for t in await reader.read("r2", "a", status="ok")] == ["x0", "x1", "x2"]
    assert await reader.read("r2", "b") == []
    with pytest.raises(ValueError, match="status 'fine'"):
        await reader.read("r1", status="fine")
    assert await reader_consumers(js, topology) == []  # every read cleans up its consumer


@pytest.mark.nats_semantics
async def test_read_spans_many_batches(js, topology):
    await store(js, topology, *(trajectory("big", "a", f"j{i}") for i in range(700)))
    reader = TrajectoryReader(js, topology, batch=64)
    got = await reader.read("big")
    assert [t.job_id for t in got] == [f"j{i}" for i in range(700)]


async def test_empty_run_returns_at_once(js, topology, monkeypatch):
    """The defect guarded against is a read that waits out a lingering pull request (EXPIRES_S).
    The pull's lifetime is raised to 120 s here, so that defect costs >= 120 s, while a correct
    read (a consumer created, one answer, the consumer deleted) takes milliseconds: the bound of
    60 s separates the two with a 60 s margin either way, and no load on a 2-core machine turns
    milliseconds into a minute (a fixed 1 s bound was a wall-clock guess against a busy box)."""
    import agentarium.producers.reader as reader_module

    monkeypatch.setattr(reader_module, "EXPIRES_S", 120.0)
    monkeypatch.setattr(reader_module, "SILENCE_S", 123.0)
    await store(js, topology, trajectory("other", "a", "j0"))
    started = time.monotonic()
    assert await TrajectoryReader(js, topology).read("nothing-here") == []
    assert time.monotonic() - started < 60.0  # no fetch timeout was waited out


async def test_undecodable_messages_are_skipped_and_counted(js, topology):
    await store(js, topology, trajectory("g", "a", "good0"))
    await js.publish(topology.trajectory_subject("g", "a", "garbage"), b"\xc1\xc1 not msgpack")
    await js.publish(topology.trajectory_subject("g", "a", "partial"), b'{"job_id": "partial"}')
    await store(js, topology, trajectory("g", "a", "good1"), as_json=True)
    reader = TrajectoryReader(js, topology)
    assert [t.job_id for t in await reader.read("g")] == ["good0", "good1"]
    assert reader.skipped == 2
    assert await reader.get("g", "a", "garbage") is None
    assert reader.skipped == 3 and "skipped=3" in repr(reader)


async def test_get_returns_one_job_or_none(js, topology):
    await store(
        js, topology, trajectory("r", "a", "j1"), trajectory("r", "a", "j2", status="error")
    )
    reader = TrajectoryReader(js, topology)
    got = await reader.get("r", "a", "j2")
    assert got is not None and got.job_id == "j2" and got.status == "error" and got.reward is None
    assert await reader.get("r", "a", "missing") is None
    assert await reader.get("r", "b", "j1") is None


@pytest.mark.nats_semantics
async def test_wait_for_returns_when_all_jobs_have_landed(js, topology):
    await store(js, topology, trajectory("w", "a", "early"), trajectory("w", "a", "unrelated"))
    reader = TrajectoryReader(js, topology)
    progress: list[tuple[int, int]] = []
    first_seen = asyncio.Event()

    def on_progress(done: int, total: int) -> None:
        progress.append((done, total))
        first_seen.set()

    waiter = asyncio.create_task(
        reader.wait_for("w", ["early", "late1", "late2"], on_progress=on_progress)
    )
    await asyncio.wait_for(first_seen.wait(), 5)  # it has read what was already stored
    assert not waiter.done()
    await store(js, topology, trajectory("w", "b", "late1"), trajectory("w", "a", "late2"))
    found = await asyncio.wait_for(waiter, 10)
    assert set(found) == {"early", "late1", "late2"} and found["late1"].agent == "b"
    assert progress == [(1, 3), (2, 3), (3, 3)]
    assert await reader.wait_for("w", []) == {}
    assert await reader_consumers(js, topology) == []


async def test_wait_for_times_out_saying_how_many_are_missing(js, topology):
    await store(js, topology, trajectory("t", "a", "here"))
    reader = TrajectoryReader(js, topology)
    with pytest.raises(TimeoutError, match="2 of 3 trajectories of run 't' still missing"):
        await reader.wait_for("t", ["here", "gone1", "gone2"], timeout=0.3)


@pytest.mark.nats_semantics
async def test_follow_yields_stored_then_new_until_stopped(js, topology):
    await store(js, topology, trajectory("f", "a", "j0"), trajectory("f", "a", "j1"))
    reader = TrajectoryReader(js, topology)
    seen = []
    async with contextlib.aclosing(reader.follow("f", "a")) as stream:
        async for t in stream:
            seen.append(t.job_id)
            if len(seen) == 2:
                await store(
                    js, topology, trajectory("f", "b", "other-agent"), trajectory("f", "a", "j2")
                )
            if len(seen) == 3:
                break
    assert seen == ["j0", "j1", "j2"]
    assert await reader_consumers(js, topology) == []


@pytest.mark.nats_semantics
async def test_a_broker_without_streams_is_a_clear_error(nc, topology):
    reader = TrajectoryReader(nc.jetstream(), topology)
    with pytest.raises(StreamMissing, match="broker init"):
        await reader.read("r")
    with pytest.raises(StreamMissing, match="broker init"):
        await reader.get("r", "a", "j")


# the show command


@pytest.fixture
def logs_to_stderr():
    """As the CLI does: structlog's default would print to stdout, among the results."""
    old = structlog.get_config()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    try:
        yield
    finally:
        structlog.configure(**old)


def show_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    producers_cli.add_show_arguments(parser)
    return parser.parse_args(list(argv))


async def test_show_prints_a_table_and_json_lines(js, topology, settings, capsys, logs_to_stderr):
    await store(
        js, topology, trajectory("s", "a", "j-ok"), trajectory("s", "a", "j-err", status="error")
    )
    assert await producers_cli.run_show(show_args("--run", "s"), settings) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == [
        "job",
        "group",
        "sample",
        "status",
        "reward",
        "calls",
        "resp_tok",
        "version",
        "error",
    ]
    assert lines[1].split() == ["j-ok", "group-j-ok", "0/1", "ok", "1", "1", "2", "3"]
    assert lines[2].split()[:4] == ["j-err", "group-j-err", "0/1", "error"]
    assert lines[2].endswith("RuntimeError: boom")

    assert (
        await producers_cli.run_show(
            show_args("--run", "s", "--json", "--status", "error"), settings
        )
        == 0
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["job_id"] for r in rows] == ["j-err"]
    assert rows[0]["calls"][0]["response_ids"] == [4, 5]  # lists, not packed bytes


def test_every_show_flag_has_help():
    parser = argparse.ArgumentParser()
    producers_cli.add_show_arguments(parser)
    assert all(action.help for action in parser._actions)


def _traceback_of(exc: Exception) -> str:
    import traceback

    try:
        raise exc
    except Exception:
        return traceback.format_exc()


def test_show_prints_the_whole_error_reason_on_the_row():
    reason = "the calculator tool returned a malformed expression: " + "x" * 120 + " (end)"
    t = trajectory("s", "a", "j-err", status="error")
    row = producers_cli.table_row(replace(t, error=_traceback_of(ValueError(reason))))
    assert "\n" not in row and row.split()[:4] == ["j-err", "group-j-err", "0/1", "error"]
    assert row.endswith(f"ValueError: {reason}")
    # a multi-line exception message stays whole, joined on the row; the frames are left out
    error = _traceback_of(RuntimeError("tool failed:\n  exit code 2\n  stderr: no such file"))
    row = producers_cli.table_row(replace(t, error=error))
    assert row.endswith("RuntimeError: tool failed: exit code 2 stderr: no such file")
    assert "File " not in row and "raise exc" not in row
    # an error that is not a traceback is shown in full
    error = "LLM backend failed: " + "all 3 servers refused the connection; " * 4
    assert producers_cli.table_row(replace(t, error=error)).endswith(error.strip())


async def test_show_of_a_run_with_no_trajectories_says_so(js, topology, settings, capsys):
    """A mistyped --run fails in one line (exit 1); a run whose trajectories the filters
    exclude is an empty result (exit 0)."""
    await store(js, topology, trajectory("s", "a", "j-ok"))
    assert await producers_cli.run_show(show_args("--run", "nosuchrun"), settings) == 1
    err = capsys.readouterr().err
    assert "no trajectories of run 'nosuchrun' on this broker: check --run" in err
    assert await producers_cli.run_show(show_args("--run", "s", "--status", "error"), settings) == 0
    assert "0 trajectories" in capsys.readouterr().err


async def test_export_of_a_run_with_no_trajectories_says_so(js, topology, nats_url, tmp_path):
    import asyncio
    import sys

    await store(js, topology, trajectory("s", "a", "j-ok"))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentarium", "trajectories", "export", "--run", "nosuchrun",
        "--out", str(tmp_path / "x.jsonl"), "--nats-url", nats_url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    lines = [line for line in err.decode().splitlines() if not line.startswith("{")]
    assert proc.returncode == 1, err
    assert lines == [
        "error: no trajectories of run 'nosuchrun' on this broker: check --run (and --agent, "
        "--prefix, --nats-url)"
    ], err
