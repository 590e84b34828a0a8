"""Where a consumer's CPU goes per rollout, from a py-spy raw profile (collapsed stacks).

    py-spy record --pid PID --format raw --threads --nonblocking -o profile.txt
    .venv/bin/python bench/profile_summary.py profile.txt [--cpu-us 380]

Each sample is put in one bucket: the deepest of the pipeline's own steps on its stack
(decode the job, the rollout span, the chat template, the HTTP call, encode, publish, ack...),
or, for samples outside any step (callbacks the event loop runs), the library whose code it
was in. With ``--cpu-us`` (CPU microseconds per rollout measured without the profiler) each
share is also shown in microseconds per rollout. Threads parked on the agent pool's queue are
idle, not work, and are left out.
"""

from __future__ import annotations

import argparse
import collections

# Steps of one rollout, matched anywhere on the stack; the deepest match names the sample.
STEPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fetch jobs (pull requests, Msg objects)", ("Intake.run", "JobPuller.", "fetch (")),
    ("decode job (msgpack + validation)", ("DeliveryHandler._decode", "decode (schemas/codec.py")),
    ("trace context from headers", ("extract_context",)),
    (
        "rollout bookkeeping (task, deadline, proxy)",
        (
            "run_rollout",
            "_Rollout.",
            "DeliveryHandler._run",
            "DeliveryHandler.handle",
            "DeliveryHandler._process",
        ),
    ),
    ("agent runner (sync agents: thread hop)", ("AgentRunner.", "AgentThreads.", "_settle_call")),
    ("LLM call bookkeeping (LLMCall, attributes)", ("TracingLLM.",)),
    ("chat template + tokenizer", ("ChatTemplate.", "chat_template.py")),
    ("HTTP client (request, response)", ("SGLangBackend.", "HttpPool.", "HttpConnection.")),
    ("parse /generate response", ("parse_generate_response",)),
    ("build trajectory", ("trajectory_for",)),
    (
        "publish trajectory + puback",
        ("publish_trajectory", "Publisher.", "_settle", "DeliveryHandler._publish"),
    ),
    ("encode trajectory (msgpack)", ("encode (schemas/codec.py",)),
    ("ack", ("Msg.ack", "Msg.in_progress")),
    ("prometheus metrics", ("prometheus_client/", "RolloutMetrics.", "observe_llm")),
    (
        "spans (OpenTelemetry)",
        (
            "opentelemetry/",
            "(trace/",
            "(context/",
            "(attributes/",
            "_decorator.py",
            "propagat",
            "(sdk/",
        ),
    ),
    ("logging (structlog)", ("structlog/",)),
    ("registry + heartbeats", ("_registry_loop", "_heartbeat_loop", "publish_worker")),
    ("agent code", ("(examples/",)),
)
# Samples outside every step: the library they were in, nearest the leaf first.
LIBRARIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("NATS client: read, parse, dispatch", ("nats/",)),
    ("HTTP client: callbacks (aiohttp)", ("aiohttp/",)),
    (
        "event loop (asyncio/uvloop: scheduling, select)",
        ("asyncio/", "selectors.py", "uvloop", "events.py"),
    ),
)


def _agent_thread_wait() -> str:
    """The frame of a sync agent's thread parked on its pool's queue (the line, found in the
    source, so that the thread's real work on other lines still counts)."""
    import inspect

    from agentarium.consumers.agents.loading import AgentThreads

    lines, first = inspect.getsourcelines(AgentThreads._work)
    offset = next(i for i, line in enumerate(lines) if "self._queue.get()" in line)
    return f"AgentThreads._work (consumers/agents/loading.py:{first + offset})"


IDLE = ("_worker (concurrent/futures/thread.py:81)", _agent_thread_wait())


def bucket(frames: list[str]) -> str:
    found = None
    for frame in frames:
        for name, needles in STEPS:
            if any(n in frame for n in needles):
                found = name
    if found is not None:
        return found
    for frame in reversed(frames):
        for name, needles in LIBRARIES:
            if any(n in frame for n in needles):
                return name
    return "other"


def summarize(text: str, cpu_us: float | None = None, *, top: int = 40) -> str:
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in text.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        if frames[-1] in IDLE:
            continue
        counts[bucket(frames[1:])] += int(n)  # frames[0] names the thread
        total += int(n)
    if not total:
        return "  (no samples)"
    lines = []
    for name, n in counts.most_common(top):
        share = n / total
        per = f"{share * cpu_us:7.0f} us" if cpu_us else ""
        lines.append(f"  {share:6.1%} {per}  {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("profile")
    parser.add_argument("--cpu-us", type=float, default=None)
    args = parser.parse_args()
    with open(args.profile) as f:
        print(summarize(f.read(), args.cpu_us))
