"""Credentials never reach a log line, an error message or stdout.

A run against ops/nats/auth.conf (one password per role) passes the passwords every way a
user can: ``--nats-password``, ``AGENTARIUM_NATS_PASSWORD``, and written into the URL
(``nats://consumer:<password>@host``); a token server takes ``--nats-token`` and
``nats://<token>@host`` (the variables and the flags meet in ``NatsSettings.from_env``). ``broker init``, ``produce``, a
``consumer --burst``, a one-step ``trainer`` and ``broker status`` run at debug level with
JSON logs, plus a wrong password and an unreachable server (error paths print the URL). All
their output is searched for every secret.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess

import pytest
import trainlib
from fake_sglang import FakeSGLang
from nats_configs import agentarium_cli, single_node

from agentarium.broker import BrokerUnavailable, NatsServer, NatsSettings, Topology, free_port
from agentarium.tiny import ensure_tiny_model

ROLES = ("admin", "producer", "consumer", "trainer")
RUN, AGENT = "secrets", "toy"


def run_cli(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return agentarium_cli(
        *args, timeout=timeout, AGENTARIUM_LOG_LEVEL="debug", AGENTARIUM_LOG_FORMAT="json", **env
    )


def json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


@pytest.fixture
def passwords(monkeypatch):
    # a letter first: nats-server reads a $VAR starting with a digit as a number
    chosen = {role: "p" + secrets.token_hex(12) for role in ROLES}
    every_role = ("admin", "producer", "consumer", "trainer", "sync", "orchestrator", "dashboard")
    for role in (*every_role, "environment"):
        monkeypatch.setenv(
            f"AGENTARIUM_{role.upper()}_PASSWORD", chosen.get(role, "p" + secrets.token_hex(12))
        )
    return chosen


@pytest.mark.timeout(240)
async def test_no_password_or_token_appears_in_any_output(tmp_path, passwords):
    server = single_node(tmp_path, config="auth.conf").server.start()
    token = "t" + secrets.token_hex(16)
    token_server = NatsServer(
        store_dir=tmp_path / "token-nats", extra_args=("--auth", token)
    ).start()
    fake = FakeSGLang()
    await fake.start()
    host = f"127.0.0.1:{server.port}"
    url = f"nats://{host}"
    outputs: dict[str, subprocess.CompletedProcess] = {}

    def cli(name: str, *args: str, **env: str) -> None:
        outputs[name] = run_cli(*args, **env)

    try:
        # admin, password as a flag
        await asyncio.to_thread(
            cli,
            "broker init",
            "broker", "init", "--agent", AGENT, "--nats-url", url,
            "--nats-user", "admin", "--nats-password", passwords["admin"],
        )  # fmt: skip
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text(
            "".join(
                f'{{"task_id": "t{i}", "prompt": "repeat {i}", "answer": "{i}"}}\n'
                for i in range(4)
            )
        )
        # producer, password in the environment
        await asyncio.to_thread(
            cli,
            "produce",
            "produce", "--agent", AGENT, "--file", str(tasks), "--run", RUN, "--nats-url", url,
            AGENTARIUM_NATS_USER="producer", AGENTARIUM_NATS_PASSWORD=passwords["producer"],
        )  # fmt: skip
        # consumer, password written into the URL
        await asyncio.to_thread(
            cli,
            "consumer",
            "consumer", "--agent", f"{AGENT}=agentarium.examples.toy:rollout", "--llm", fake.url,
            "--burst", "--concurrency", "4", "--proxy-host", "127.0.0.1",
            "--nats-url", f"nats://consumer:{passwords['consumer']}@{host}",
        )  # fmt: skip
        # trainer: one step on two hand-made groups (toy rewards on a fake LLM are flat)
        admin = await NatsSettings(url=url, user="admin", password=passwords["admin"]).connect()
        try:
            for g in range(2):
                await trainlib.publish(
                    admin.jetstream(),
                    Topology(),
                    trainlib.one_call_group(
                        g,
                        run=RUN,
                        agent=AGENT,
                        job_id=lambda g, i: f"hand-{g}-{i}",
                        group_id=f"hand-{g}",
                        reward=lambda g, i: float(i % 2),
                    ),
                )
        finally:
            await admin.close()
        await asyncio.to_thread(
            cli,
            "trainer",
            "trainer", "--run", RUN, "--agent", AGENT, "--model", str(ensure_tiny_model()),
            "--group-size", "4", "--groups-per-step", "2", "--max-steps", "1",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--torch-threads", "1",
            "--nats-url", url,
            AGENTARIUM_NATS_USER="trainer", AGENTARIUM_NATS_PASSWORD=passwords["trainer"],
        )  # fmt: skip
        # a token three ways
        token_host = f"127.0.0.1:{token_server.port}"
        await asyncio.to_thread(
            cli, "init (token flag)",
            "broker", "init", "--nats-url", f"nats://{token_host}", "--nats-token", token,
        )  # fmt: skip
        await asyncio.to_thread(
            cli, "status (token url)", "broker", "status", "--nats-url", f"nats://{token}@{token_host}"
        )  # fmt: skip
        # error paths print the URL: a wrong password in it, and a server that is not there
        wrong = "w" + secrets.token_hex(12)
        await asyncio.to_thread(
            cli, "wrong password", "broker", "status", "--nats-url", f"nats://admin:{wrong}@{host}"
        )  # fmt: skip
        # (in-process, with a short timeout: the same message the CLI prints)
        nobody = NatsSettings(
            url=f"nats://admin:{passwords['admin']}@127.0.0.1:{free_port()}",
            connect_timeout_s=0.5,
        )
        with pytest.raises(BrokerUnavailable) as unreachable:
            await nobody.connect(reconnect_forever=False)
    finally:
        await fake.close()
        token_server.stop()
        server.stop()

    # Each command did its job (so its whole logging path ran), or failed as intended.
    failed = {n: p.stderr[-1500:] for n, p in outputs.items() if p.returncode != 0}
    assert set(failed) == {"wrong password"}, failed
    assert "published=4" in outputs["produce"].stdout
    consumer_logs = json_lines(outputs["consumer"].stderr)
    assert any(e.get("event") == "worker stopped" and e.get("ok") == 4 for e in consumer_logs), (
        outputs["consumer"].stderr[-2000:]
    )
    trainer_logs = json_lines(outputs["trainer"].stderr)
    assert any(e.get("event") == "step done" for e in trainer_logs), outputs["trainer"].stderr[
        -2000:
    ]
    assert "refused the credentials" in outputs["wrong password"].stderr
    assert "admin:***@" in outputs["wrong password"].stderr  # the URL, redacted
    assert "cannot connect to NATS at nats://admin:***@" in str(unreachable.value)
    assert passwords["admin"] not in str(unreachable.value)
    # The effective config is logged, with the secrets masked.
    logged = [e["nats"] for e in consumer_logs + trainer_logs if isinstance(e.get("nats"), dict)]
    assert logged and all("***" in (n.get("password") or "") + n["url"] for n in logged)

    secrets_used = [*passwords.values(), token, wrong]
    for name, proc in outputs.items():
        text = proc.stdout + proc.stderr
        assert len(text) > 0, name
        for secret in secrets_used:
            assert secret not in text, f"a secret appears in the output of {name}"
