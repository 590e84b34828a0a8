"""Traces in a real LLM viewer: the pipeline exports to Arize Phoenix, and Phoenix's API says
what a user would see there.

Starts Phoenix (or uses one already running), a nats-server, the local CPU engine and a
rollout consumer (examples.toy), all exporting OTLP to Phoenix with message content on; it
produces jobs, trains one GRPO step on them, then asks Phoenix's REST API for the spans and
checks:
  - one trace per job: ``publish tasks`` -> ``rollout`` -> ``chat tiny``, each the parent of
    the next;
  - every chat span is an LLM span with the prompt and the answer visible (Phoenix's
    ``llm.input_messages`` / ``llm.output_messages``, which it derives from the GenAI
    conventions' ``gen_ai.input.messages`` / ``gen_ai.output.messages``), model and tokens;
  - every span has a kind (none "UNKNOWN").

Phoenix is ~190 MB of dependencies: install it in a venv of its own, never the project's:

    python3 -m venv /tmp/phoenix-venv && /tmp/phoenix-venv/bin/pip install arize-phoenix
    .venv/bin/python bench/phoenix_traces.py --phoenix /tmp/phoenix-venv/bin/phoenix
    .venv/bin/python bench/phoenix_traces.py --phoenix-url http://127.0.0.1:6006   # running one

Exit status 0 when every check holds. ``--keep`` leaves Phoenix up to look at in a browser.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentarium.broker import NatsServer, free_port  # noqa: E402
from agentarium.demo.processes import child_env, start_child  # noqa: E402
from agentarium.tiny import ensure_tiny_model  # noqa: E402

AGENT, RUN = "toy", "phoenix"


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def wait_until(predicate, timeout_s: float, what: str, every_s: float = 0.5):
    """Poll an external server (Phoenix) that offers no event to await."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise SystemExit(f"timed out after {timeout_s:g}s waiting for {what}")


def start_phoenix(binary: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    port, grpc_port = free_port(), free_port()
    env = dict(
        os.environ,
        PHOENIX_WORKING_DIR=str(workdir),
        PHOENIX_HOST="127.0.0.1",
        PHOENIX_PORT=str(port),
        PHOENIX_GRPC_PORT=str(grpc_port),
    )
    log = open(workdir / "phoenix.log", "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen([binary, "serve"], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            tail = (workdir / "phoenix.log").read_text(errors="replace")[-2000:]
            raise SystemExit(f"phoenix exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    wait_until(healthy, 120, "Phoenix to answer /healthz")
    return proc, url


def spans_in_phoenix(url: str, since: datetime, project: str = "default") -> list[dict]:
    """The spans that started after ``since`` (a Phoenix reused between runs keeps old ones)."""
    spans, cursor = [], None
    while True:
        query = f"limit=1000&start_time={urllib.parse.quote(since.isoformat())}"
        query += f"&cursor={cursor}" if cursor else ""
        try:
            page = get_json(f"{url}/v1/projects/{project}/spans?{query}")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:  # the project appears with its first span
                return []
            raise
        spans += page["data"]
        cursor = page.get("next_cursor")
        if not cursor:
            return spans


def run(cmd: list[str], env: dict, timeout_s: float = 300) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "agentarium", *cmd],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if out.returncode != 0:
        raise SystemExit(f"agentarium {cmd[0]} failed ({out.returncode}):\n{out.stderr[-3000:]}")


def run_pipeline(phoenix_url: str, workdir: Path, tasks: int, group_size: int) -> None:
    env = child_env(
        OTEL_EXPORTER_OTLP_ENDPOINT=phoenix_url,
        OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT="true",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    model = str(ensure_tiny_model())
    lines = (ROOT / "examples" / "toy_tasks.jsonl").read_text().splitlines()[:tasks]
    task_file = workdir / "tasks.jsonl"
    task_file.write_text("\n".join(lines) + "\n")
    server = NatsServer(store_dir=workdir / "nats").start()
    nats = ["--nats-url", server.url]
    try:
        run(["broker", "init", *nats], env)
        engine = start_child(
            "engine",
            ["engine", "--model", model, "--port", "0"],
            workdir / "logs",
            wait_ready=True,
            env=env,
        )
        try:
            run(
                [
                    "produce",
                    "--agent",
                    AGENT,
                    "--file",
                    str(task_file),
                    "--group-size",
                    str(group_size),
                    "--run",
                    RUN,
                    *nats,
                ],
                env,
            )
            run(
                [
                    "consumer",
                    "--agent",
                    f"{AGENT}=agentarium.examples.toy:rollout",
                    "--llm",
                    engine.url,
                    "--model",
                    "tiny",
                    "--burst",
                    *nats,
                ],
                env,
            )
        finally:
            engine.terminate()
        run(
            [
                "trainer",
                "--run",
                RUN,
                "--agent",
                AGENT,
                "--model",
                model,
                "--group-size",
                str(group_size),
                "--groups-per-step",
                str(tasks),
                "--max-steps",
                "1",
                "--no-publish",
                "--metrics",
                str(workdir / "metrics.csv"),
                *nats,
            ],
            env,
        )
    finally:
        server.stop()


def check(spans: list[dict], jobs: int) -> dict:
    """What a user of Phoenix would see, as numbers; ``problems`` lists what is wrong."""
    by_trace: dict[str, list[dict]] = defaultdict(list)
    for span in spans:
        by_trace[span["context"]["trace_id"]].append(span)
    problems: list[str] = []
    connected = 0
    for trace_id, members in by_trace.items():
        names = defaultdict(list)
        for span in members:
            names[span["name"]].append(span)
        if "publish tasks" not in names:
            continue  # the train step's own trace
        (publish,) = names["publish tasks"]
        rollouts = names.get("rollout", [])
        chats = [s for name, group in names.items() if name.startswith("chat ") for s in group]
        publish_id = publish["context"]["span_id"]
        ok = (
            len(rollouts) == 1
            and rollouts[0]["parent_id"] == publish_id
            and chats
            and all(c["parent_id"] == rollouts[0]["context"]["span_id"] for c in chats)
        )
        if ok:
            connected += 1
        else:
            problems.append(f"trace {trace_id} is not publish -> rollout -> chat: {dict(names)}")
    llm = [s for s in spans if s["name"].startswith("chat ")]
    visible = 0
    for span in llm:
        a = span["attributes"]
        prompt = a.get("llm.input_messages.0.message.content")
        answer = a.get("llm.output_messages.0.message.content")
        if span["span_kind"] == "LLM" and prompt and answer is not None:
            visible += 1
        else:
            problems.append(f"LLM span {span['context']['span_id']} hides its messages: {a}")
    kinds: dict[str, set] = defaultdict(set)
    for span in spans:
        kinds[span["name"]].add(span["span_kind"])
    unknown = [n for n, k in kinds.items() if "UNKNOWN" in k]
    if unknown:
        problems.append(f"spans without a kind: {unknown}")
    if connected != jobs:
        problems.append(f"{connected} connected job traces for {jobs} jobs")
    sample = llm[0]["attributes"] if llm else {}
    rollout = next((s["attributes"] for s in spans if s["name"] == "rollout"), {})
    return {
        "spans": len(spans),
        "job_traces": connected,
        "jobs": jobs,
        "llm_spans": len(llm),
        "llm_spans_with_prompt_and_answer": visible,
        "kinds": {name: sorted(k) for name, k in sorted(kinds.items())},
        "sample_llm_span": {
            k: sample.get(k)
            for k in (
                "llm.model_name",
                "llm.system",
                "llm.token_count.prompt",
                "llm.token_count.completion",
                "llm.input_messages.0.message.role",
                "llm.input_messages.0.message.content",
                "llm.output_messages.0.message.content",
            )
        },
        "sample_rollout_span": {k: rollout.get(k) for k in ("input.value", "output.value")},
        "problems": problems,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--phoenix", default="/tmp/phoenix-venv/bin/phoenix", help="the phoenix command"
    )
    where.add_argument("--phoenix-url", help="a Phoenix already running (its HTTP port)")
    parser.add_argument("--tasks", type=int, default=4, help="distinct prompts")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt")
    parser.add_argument("--keep", action="store_true", help="leave Phoenix up until Ctrl-C")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="agentarium-phoenix-"))
    phoenix = None
    if args.phoenix_url:
        url = args.phoenix_url.rstrip("/")
    else:
        if not Path(args.phoenix).exists():
            raise SystemExit(
                f"{args.phoenix} not found: python3 -m venv /tmp/phoenix-venv && "
                "/tmp/phoenix-venv/bin/pip install arize-phoenix, or pass --phoenix-url"
            )
        phoenix, url = start_phoenix(args.phoenix, workdir)
    try:
        since = datetime.now(UTC)
        started = time.monotonic()
        run_pipeline(url, workdir, args.tasks, args.group_size)
        jobs = args.tasks * args.group_size
        # publish + rollout + chat per job, and the train step; each process flushed at exit.
        expected = 3 * jobs + 1
        spans = wait_until(
            lambda: (s := spans_in_phoenix(url, since)) and len(s) >= expected and s,
            60,
            f"{expected} spans in Phoenix",
        )
        report = check(spans, jobs)
        report["seconds"] = round(time.monotonic() - started, 1)
        report["phoenix"] = url
        print(json.dumps(report, indent=2))
        if args.keep and phoenix is not None:
            print(f"Phoenix at {url}; Ctrl-C to stop")
            phoenix.wait()
        return 1 if report["problems"] else 0
    except KeyboardInterrupt:
        return 130
    finally:
        if phoenix is not None:
            phoenix.terminate()
            phoenix.wait(30)


if __name__ == "__main__":
    sys.exit(main())
