"""``agentarium dashboard``: its JSON state agrees with ``broker status`` on a running pipeline,
and the page, in a real headless Chromium, follows the run live.

The pipeline is real (nats-server, rollout workers, an SGLang-shaped fake engine); the trainer's
side is its live-metrics publisher and the syncer's engine record, called as they call them.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import agentlib
import aiohttp
import pytest
import yaml
from chromium import Chromium
from worker_env import worker_for

from agentarium.broker import collect_status, ensure_provisioned
from agentarium.cli import main
from agentarium.dashboard import DashboardConfig, DashboardServer, LiveView
from agentarium.inference import record_engine
from agentarium.producers import TaskProducer, TrajectoryReader
from agentarium.schemas import WeightUpdate, encode_json
from agentarium.trainer.live import LiveMetrics
from agentarium.trainer.metrics import StepMetrics

RUN = "r1"
TRACE_URL = "http://localhost:16686/trace/{trace_id}"
SHOT_ENV = "AGENTARIUM_DASHBOARD_SCREENSHOT"  # also save the page there (docs/dashboard.png)


def dashboard(js, topology, **overrides) -> DashboardServer:
    config = DashboardConfig(port=0, trace_url=TRACE_URL, **overrides)
    return DashboardServer(LiveView(js, topology, config), config)


async def trainer_rows(js, topology, steps: range) -> None:
    """Step rows as the trainer loop publishes them, reward rising."""
    live = LiveMetrics(js, topology, run=RUN, agent="echo")
    for step in steps:
        row = StepMetrics(
            step=step,
            version=step // 2,
            reward_mean_received=round(0.1 + 0.8 * step / 40, 4),
            loss=round(0.5 / step, 4),
            tokens_per_s=1200.0 + step,
            dropped_stale=step // 5,
            staleness_mean=0.5,
        )
        assert await live.publish(row)


async def publish_policy(js, topology, version: int) -> None:
    update = WeightUpdate(run=RUN, version=version, object=f"{RUN}/v{version}", sha256="0" * 64)
    await (await js.key_value(topology.policy_bucket)).put(RUN, encode_json(update))


# ---- the JSON state ------------------------------------------------------------------------------


async def test_state_agrees_with_broker_status_and_caps_payloads(js, topology, fake):
    producer = TaskProducer(js, topology)
    await producer.submit(
        "echo",
        [{"task_id": f"t{i}", "prompt": f"say {i}"} for i in range(3)],
        run=RUN,
        group_size=2,
    )
    secret = "s" * 5000  # a dead letter's task may hold anything: only a preview may leave
    await producer.submit("bug", [{"task_id": "b", "n": 1, "secret": secret}], run=RUN)
    await producer.submit("later", [{"task_id": "w1"}, {"task_id": "w2"}], run=RUN)
    async with worker_for(js, "echo", agentlib.echo, [fake.url]) as worker:
        assert (await worker.run()).ok == 6
    async with worker_for(js, "bug", agentlib.always_raises, [fake.url], attempts=1) as worker:
        assert (await worker.run()).dead_lettered == 1
    await trainer_rows(js, topology, range(1, 4))
    await publish_policy(js, topology, 2)
    await record_engine(
        js, topology, run=RUN, url=fake.url, weight_version="1", status="failed", target_version=2
    )

    async with dashboard(js, topology, refresh_s=60) as server:
        await server.view.refresh()
        async with aiohttp.ClientSession() as http:
            async with http.get(server.url + "api/state") as response:
                assert response.status == 200
                assert "script-src 'self'" in response.headers["Content-Security-Policy"]
                state = await response.json()
            # a page elsewhere that rebinds its name to 127.0.0.1 gets nothing
            async with http.get(server.url + "api/state", headers={"Host": "evil.test"}) as r:
                assert r.status == 421
            async with http.get(server.url) as page:
                assert page.status == 200 and "dashboard.js" in await page.text()
    status = await collect_status(js, topology)

    assert state["error"] is None
    fields = ("waiting", "in_flight", "dead_lettered", "redelivered", "stranded", "workers")
    assert {a["agent"]: {f: a[f] for f in fields} for a in state["agents"]} == {
        a.agent: {f: getattr(a, f) for f in fields} for a in status.agents
    }
    by_agent = {a["agent"]: a for a in state["agents"]}
    assert by_agent["later"]["waiting"] == 2 and by_agent["bug"]["dead_lettered"] == 1

    (run,) = state["runs"]
    assert run["trajectories"] == status.trajectories[RUN] == 7  # 6 ok + bug's error
    assert (run["policy_version"], run["trainer_step"], run["agent"]) == (2, 3, "echo")
    assert state["metrics"][RUN]["step"] == [1, 2, 3]
    assert state["metrics"][RUN]["reward_mean_received"] == [0.12, 0.14, 0.16]

    (engine,) = state["engines"]
    assert (engine["engine"], engine["weight_version"], engine["status"]) == (
        fake.url,
        "1",
        "failed",
    )

    (letter,) = state["dead_letters"]
    assert (letter["agent"], letter["reason"]) == ("bug", "agent_error")
    assert len(letter["task"]) <= 240 and len(letter["error"]) <= 240
    assert '"secret": "sss' in letter["task"] and secret not in json.dumps(state)
    assert "raw" not in letter and "job" not in letter

    stored = await TrajectoryReader(js, topology).read(RUN)
    assert {t["job_id"] for t in state["trajectories"]} == {t.job_id for t in stored}
    for row in state["trajectories"]:
        assert len(row["trace_id"]) == 32
        assert row["trace_url"] == TRACE_URL.replace("{trace_id}", row["trace_id"])
    (echo_reward,) = [v for k, v in state["reward"].items() if k == "echo"]
    assert sum(echo_reward["n"]) == 6


# ---- the page, in Chromium -----------------------------------------------------------------------

SCRAPE = """(() => {
  const out = {renders: window.dashboard ? window.dashboard.renders : 0};
  for (const table of document.querySelectorAll("table")) {
    const rows = {};
    for (const tr of table.querySelectorAll("tr[data-row]")) {
      rows[tr.dataset.row] = Object.fromEntries(
        [...tr.querySelectorAll("td[data-field]")].map((td) => [td.dataset.field, td.textContent]));
    }
    out[table.id] = rows;
  }
  out.cards = Object.fromEntries([...document.querySelectorAll("[data-card]")].map(
    (c) => [c.dataset.card, c.querySelector(".value")?.textContent]));
  out.links = [...document.querySelectorAll("#trajectories a")].map((a) => a.href);
  out.series = [...document.querySelectorAll("svg [data-series]")].map(
    (t) => t.closest("svg").id + ":" + t.dataset.series);
  out.status = document.getElementById("status")?.textContent;
  return out;
})()"""


async def wait_for_page(page: Chromium, condition: str, timeout_s: float = 20) -> dict:
    """Resolve when, after some render, ``condition`` (JS over ``p``, the scraped page) holds."""
    script = f"""new Promise((resolve, reject) => {{
      const ready = () => {{ const p = {SCRAPE}; try {{ return ({condition}) ? p : null; }} catch (e) {{ return null; }} }};
      const done = (p) => {{ clearTimeout(timer); document.removeEventListener("dashboard:rendered", check); resolve(p); }};
      const timer = setTimeout(() => {{
        document.removeEventListener("dashboard:rendered", check);
        reject(new Error("the page never showed " + {json.dumps(condition)} + "; it shows " + JSON.stringify({SCRAPE})));
      }}, {int(timeout_s * 1000)});
      function check() {{ const p = ready(); if (p) done(p); }}
      document.addEventListener("dashboard:rendered", check);
      check();
    }})"""
    return await page.evaluate(script)


def assert_page_matches(scraped: dict, status) -> None:
    fields = ("waiting", "in_flight", "dead_lettered", "workers")
    assert {agent: {f: cells[f] for f in fields} for agent, cells in scraped["agents"].items()} == {
        a.agent: {f: str(getattr(a, f)) for f in fields} for a in status.agents
    }
    assert scraped["cards"]["waiting"] == str(sum(a.waiting for a in status.agents))
    assert scraped["cards"]["dead_lettered"] == str(sum(a.dead_lettered for a in status.agents))
    assert scraped["cards"]["workers"] == str(len(status.workers))


async def test_page_follows_the_run_live_in_chromium(js, topology, fake, tmp_path):
    producer = TaskProducer(js, topology)
    await producer.submit(
        "echo",
        [{"task_id": f"t{i}", "prompt": f"say {i}"} for i in range(4)],
        run=RUN,
        group_size=2,
    )
    await producer.submit("later", [{"task_id": "w1"}, {"task_id": "w2"}], run=RUN)
    # a job naming another agent on echo's subject: echo's worker dead-letters it (wrong_subject)
    # under the agent it names
    await js.publish(
        topology.tasks_subject("echo"),
        json.dumps({"job_id": "misrouted", "agent": "other", "task": {}}).encode(),
    )
    await trainer_rows(js, topology, range(1, 21))

    async with (
        dashboard(js, topology, refresh_s=0.25, reward_window_s=1.0) as server,
        Chromium(tmp_path / "chromium") as page,
    ):
        await page.goto(server.url)
        before = await wait_for_page(
            page,
            'p.agents.echo && p.agents.echo.waiting === "9" && p.runs.r1.trainer_step === "20"',
        )
        assert_page_matches(before, await collect_status(js, topology))
        assert before["agents"]["later"]["waiting"] == "2"

        # the run moves on while the page is open: a worker drains echo's queue, the trainer
        # steps on, a syncer reports its engine
        async with worker_for(js, "echo", agentlib.echo, [fake.url], burst=False) as worker:
            serving = asyncio.create_task(worker.run())
            try:
                await trainer_rows(js, topology, range(21, 41))
                await publish_policy(js, topology, 20)
                await record_engine(
                    js, topology, run=RUN, url=fake.url, weight_version=f"{RUN}@19:{'ab' * 8}",
                    status="updated", target_version=20,
                )  # fmt: skip
                after = await wait_for_page(
                    page,
                    'p.agents.echo.waiting === "0" && p.agents.echo.in_flight === "0" '
                    '&& p.agents.echo.dead_lettered === "1" && !("other" in p.agents) '
                    '&& p.agents.echo.workers === "1" '
                    '&& Object.keys(p.trajectories).length === 8 && p.runs.r1.trainer_step === "40" '
                    "&& Object.keys(p.engines).length === 1",
                )
                assert_page_matches(after, await collect_status(js, topology))
                shot = await page.screenshot(tmp_path / "dashboard.png")
                if os.environ.get(SHOT_ENV):
                    await page.screenshot(Path(os.environ[SHOT_ENV]))
            finally:
                worker.stop()
                await serving

    assert after["runs"]["r1"]["policy_version"] == "20"
    assert after["runs"]["r1"]["trajectories"] == "8"
    (engine,) = after["engines"].values()
    # one behind: the run's own version 19, while the policy is at 20
    assert (engine["weight_version"], engine["policy_version"]) == (f"{RUN}@19:{'ab' * 8}", "20")
    stored = await TrajectoryReader(js, topology).read(RUN)
    assert set(after["trajectories"]) == {t.job_id for t in stored}
    assert sorted(after["links"]) == sorted(
        TRACE_URL.replace("{trace_id}", t.trace_id) for t in stored
    )
    (letter,) = after["dead"].values()  # filed under the subject's agent: no row for "other"
    assert (letter["agent"], letter["reason"], letter["job_id"]) == (
        "echo",
        "wrong_subject",
        "misrouted",
    )
    charts = (
        "chart-waiting",
        "chart-reward-agent",
        "chart-reward-step",
        "chart-loss",
        "chart-stale",
    )
    for chart in charts:
        assert any(s.startswith(chart + ":") for s in after["series"]), (chart, after["series"])
    assert not page.console, page.console
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


# ---- the command ---------------------------------------------------------------------------------


def test_help_warns_about_exposing_it_and_bad_trace_url_says_what_to_fix(capsys):
    with pytest.raises(SystemExit):
        main(["dashboard", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "default 8266" in help_text and "default 127.0.0.1" in help_text
    assert "WARNING" in help_text and "dead letters" in help_text
    assert main(["dashboard", "--trace-url", "http://localhost:16686/trace/"]) == 2
    assert "has no {trace_id}" in capsys.readouterr().err


async def test_a_broker_from_an_older_release_gets_a_note_not_a_failure(js, topology):
    """No metrics stream or engines KV yet (provisioned before they existed): services start,
    the trainer's rows are dropped with a warning, the page says what to run."""
    await js.delete_stream(topology.metrics_stream)
    await js.delete_key_value(topology.engines_bucket)
    assert not await ensure_provisioned(js, topology)  # never re-creates views behind init's back
    live = LiveMetrics(js, topology, run=RUN, agent="echo")
    assert not await live.publish(StepMetrics(step=1, version=0)) and live.dropped == 1

    state = await LiveView(js, topology, DashboardConfig()).refresh()
    assert state["error"] is None
    assert any(
        topology.metrics_stream in n and "agentarium broker init" in n for n in state["notes"]
    )
    assert any(topology.engines_bucket in n for n in state["notes"])
    assert state["runs"] == [] and state["engines"] == []


def test_compose_publishes_it_on_the_hosts_loopback_only():
    compose = yaml.safe_load((Path(__file__).parents[1] / "docker-compose.yml").read_text())
    service = compose["services"]["dashboard"]
    # inside its container it must listen on every interface for the port mapping to reach it
    assert service["ports"] == ["127.0.0.1:8266:8266"] and "0.0.0.0" in service["command"]


async def test_dashboard_exports_the_queue_gauges_from_the_status_it_reads(js, topology):
    """With --metrics-port the dashboard is the one process exporting the queue gauges
    (docs/operations.md): the numbers are the broker status its page shows."""
    from prometheus_client.parser import text_string_to_metric_families

    from agentarium.broker import (
        MetricsServer,
        collect_status,
        collect_stream_metrics,
        render_metrics,
    )

    await TaskProducer(js, topology).submit(
        "gauged", [{"task_id": f"g{i}"} for i in range(3)], run=RUN, group_size=2
    )
    server = MetricsServer(0, host="127.0.0.1")
    view = LiveView(js, topology, DashboardConfig())
    view.stream_metrics = collect_stream_metrics(js, topology, registry=server.registry)
    await view.refresh()
    body, _ = render_metrics(server.registry)
    samples = {
        (s.name, s.labels.get("agent")): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    status = await collect_status(js, topology)
    [agent] = [a for a in status.agents if a.agent == "gauged"]
    assert samples[("agentarium_queue_waiting_jobs", "gauged")] == agent.waiting == 6
    assert samples[("agentarium_dead_letter_jobs", "gauged")] == agent.dead_lettered == 0
