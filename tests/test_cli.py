"""The `agentarium` command line itself: what a first-time user sees before any work is done."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from agentarium.broker import free_port
from agentarium.cli import build_parser, main


def all_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("agentarium",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from all_parsers(sub, (*path, name))


def run_cli(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code
    return code, err.getvalue()


@pytest.mark.parametrize(
    "group, commands",
    [
        ((), ("broker", "consumer", "produce", "trajectories", "eval", "demo")),
        (("broker",), ("up", "init", "status", "sweep")),
        (("eval",), ("run", "summary")),
        (("trajectories",), ("show", "export")),
    ],
    ids=["agentarium", "broker", "eval", "trajectories"],
)
def test_a_command_group_without_a_command_lists_its_commands(group, commands):
    code, err = run_cli(*group)
    assert code == 2
    assert "required" not in err and "_command" not in err, err
    prog = " ".join(("agentarium", *group))
    assert f"{prog}: name a command:" in err and f"`{prog} COMMAND --help`" in err
    listed = {m.group(1) for m in re.finditer(r"^  (\S+)  +\S", err, re.M)}
    assert set(commands) <= listed, err


def test_broker_up_takes_no_connection_flags_but_a_prefix():
    parser = build_parser()
    up = dict(all_parsers(parser))[("agentarium", "broker", "up")]
    assert "--nats-url" not in up.format_help() and "--prefix" in up.format_help()
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        parser.parse_args(["broker", "up", "--nats-url", "nats://127.0.0.1:4222"])
    assert parser.parse_args(["broker", "up", "--prefix", "x"]).nats_prefix == "x"
    # init and status connect to a server: they keep them
    assert "--nats-url" in dict(all_parsers(parser))[("agentarium", "broker", "init")].format_help()


def test_help_texts_are_plain_text():
    """Descriptions are read in a terminal: no reST markup (``code``, :class:) in any --help."""
    for path, parser in all_parsers(build_parser()):
        text = parser.format_help()
        assert not re.search(r"``|:(class|func|meth|mod):`", text), (" ".join(path), text)


def test_abbreviated_flags_are_refused():
    """`--group 4` must not silently mean `--group-size 4`."""
    parser = build_parser()
    argv = ["produce", "--agent", "toy", "--file", "tasks.jsonl", "--run", "r"]
    assert parser.parse_args([*argv, "--group-size", "4"]).group_size == 4
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        parser.parse_args([*argv, "--group", "4"])
    assert exc.value.code == 2 and "unrecognized arguments: --group 4" in err.getvalue()


def test_parquet_export_without_out_is_refused_before_connecting():
    no_broker = f"nats://127.0.0.1:{free_port()}"
    code, err = run_cli(
        "trajectories", "export", "--run", "run1", "--format", "parquet", "--nats-url", no_broker
    )
    assert code == 2 and "--format parquet writes a file: pass --out PATH" in err, err
    assert "cannot connect" not in err


def _refused(*argv: str) -> str:
    """``agentarium ARGV`` in a child process: it must fail with exit 2 and one stderr line
    (JSON log lines aside), no traceback; that line."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "agentarium", *argv], capture_output=True, text=True, timeout=120
    )
    lines = [line for line in result.stderr.splitlines() if not line.startswith("{")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_the_engine_refuses_a_taken_port_and_a_bad_host_in_one_line():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _refused("engine", "--model", "tiny", "--port", str(port))
    assert f"--port {port}" in line and "address already in use" in line.lower()
    assert "--port must be <= 65535" in _refused("engine", "--model", "tiny", "--port", "70000")
    assert "--host 256.1.1.1" in _refused("engine", "--model", "tiny", "--host", "256.1.1.1")
    # --backend vllm checks the port before it builds or starts anything
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _refused("engine", "--backend", "vllm", "--model", "tiny", "--port", str(port))
    assert f"--port {port}" in line and "address already in use" in line.lower()
    line = _refused("engine", "--model", "tiny", "--vllm-arg=--enable-lora")
    assert "--vllm-arg is for --backend vllm" in line
    # a local engine's setting vLLM has no counterpart for is refused, never dropped
    line = _refused("engine", "--backend", "vllm", "--prefix-cache-tokens", "4096")
    assert "--prefix-cache-tokens" in line and "0 turns it off" in line


def test_the_local_engines_settings_given_to_vllm_become_its_own():
    from agentarium.commands.engine_cmd import EngineCommand, vllm_settings
    from agentarium.inference.engine import EngineSettings

    command = EngineCommand(backend="vllm")
    assert vllm_settings(command) == ([], {})  # the local engine's defaults: vLLM's own
    given = EngineCommand(
        backend="vllm", engine=EngineSettings(threads=2, max_batch=32, prefix_cache_tokens=0)
    )
    argv, env = vllm_settings(given)
    assert argv == ["--max-num-seqs=32", "--no-enable-prefix-caching"]
    assert env == {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(monkeypatch, capsys):
    from agentarium import cli

    def broken(args):
        raise RuntimeError("something nobody foresaw")

    monkeypatch.setattr(cli, "build_parser", lambda: _parser_running(broken))
    assert cli.main(["x"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        "error: RuntimeError: something nobody foresaw (AGENTARIUM_DEBUG=1 shows the traceback)"
    )
    monkeypatch.setenv("AGENTARIUM_DEBUG", "1")
    with pytest.raises(RuntimeError, match="nobody foresaw"):
        cli.main(["x"])


def _parser_running(func) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    parser.set_defaults(func=func)
    return parser


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--max-steps", "-1"), "--max-steps must be >= 0"),  # it used to exit 0 after 0 steps
        (("--torch-threads", "0"), "--torch-threads must be >= 1"),
        (("--group-size", "1"), "--group-size must be >= 2"),
    ],
)
def test_the_trainer_refuses_settings_that_would_do_nothing(argv, says):
    line = _refused(
        "trainer", "--run", "r", "--agent", "a", "--model", "tiny",
        "--nats-url", "nats://127.0.0.1:1", *argv,
    )  # fmt: skip
    assert says in line, line


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="a CUDA device is here: --device cuda is fine"
)
def test_the_trainer_on_cuda_without_a_cuda_torch_says_so_in_one_line():
    line = _refused(
        "trainer", "--run", "r", "--agent", "a", "--model", "tiny", "--device", "cuda",
        "--nats-url", "nats://127.0.0.1:1",
    )  # fmt: skip
    assert "--device cuda" in line and "--device cpu" in line, line


def test_plot_of_a_csv_without_steps_names_what_is_missing(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("reward_mean_received,x\n0.5,1\n")
    line = _refused("plot", str(bad), "-o", str(tmp_path / "r.png"))
    assert "no 'step' column" in line, line


def test_export_writes_into_a_folder_it_creates(tmp_path):
    from agentarium.evaluation.export import write_jsonl

    out = tmp_path / "not" / "yet" / "x.jsonl"
    assert write_jsonl(iter([{"a": 1}, {"a": 2}]), out) == 2
    assert out.read_text().splitlines() == ['{"a": 1}', '{"a": 2}']


def test_a_server_without_jetstream_is_named_as_such(tmp_path):
    """A nats-server started without -js: one line that says JetStream is missing, not
    'ServiceUnavailableError: code=None'."""
    import json
    import subprocess
    import time

    from agentarium.broker import find_nats_server

    ports = tmp_path / "ports"
    ports.mkdir()
    server = subprocess.Popen(
        [find_nats_server(), "-a", "127.0.0.1", "-p", "-1", "--ports_file_dir", str(ports)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not list(ports.glob("*.ports")):  # the server writes it once it listens
            assert time.monotonic() < deadline and server.poll() is None
            time.sleep(0.05)
        url = json.loads(next(ports.glob("*.ports")).read_text())["nats"][0]
        for argv in (("broker", "status"), ("broker", "init")):
            line = _refused(*argv, "--nats-url", url)
            assert "without JetStream" in line and "-js" in line, line
    finally:
        server.terminate()
        server.wait()


def test_a_wrong_nats_url_fails_in_one_line_without_log_noise():
    import subprocess
    import sys

    from agentarium.broker import free_port

    for url, says in (
        (f"nats://127.0.0.1:{free_port()}", "cannot connect to NATS"),
        ("http://127.0.0.1:4222", "http:// is not a NATS scheme"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "agentarium", "broker", "status", "--nats-url", url],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
        assert says in result.stderr


def test_every_command_ends_its_help_with_examples_that_parse():
    """Each command's --help ends with runnable examples, and each parses with today's flags
    (so an example can't outlive a renamed flag)."""
    import shlex

    from agentarium.cli import leaf_parsers
    from agentarium.commands.examples import EXAMPLES

    parser = build_parser()
    leaves = dict(leaf_parsers(parser))
    assert set(leaves) == set(EXAMPLES), set(leaves) ^ set(EXAMPLES)
    for path, leaf in leaves.items():
        help_text = leaf.format_help()
        assert "\nexamples:\n" in help_text and help_text.rstrip().endswith(EXAMPLES[path][-1])
        for example in EXAMPLES[path]:
            argv = shlex.split(example, comments=True)
            if argv[0] == "eval":  # eval "$(agentarium completion bash)"
                argv = shlex.split(argv[1].strip("$()"))
            assert argv[0] == "agentarium", example
            args = parser.parse_args(argv[1:])  # exits (SystemExit) on a flag that is gone
            assert args.func is leaf.get_default("func"), example


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("def rollout(:\n    pass\n", "has a syntax error: invalid syntax"),
        ("raise RuntimeError('no key set')\n", "raised RuntimeError: no key set"),
    ],
)
def test_a_broken_agent_module_is_one_line_naming_the_module(source, says, tmp_path):
    """A user's agent file that does not import: the consumer says which module and why, in
    one line, before it connects anywhere."""
    import subprocess
    import sys

    (tmp_path / "broken_agent.py").write_text(source)
    result = subprocess.run(
        [sys.executable, "-m", "agentarium", "consumer", "--agent", "a=broken_agent:rollout",
         "--llm", "http://127.0.0.1:1", "--model", "tiny", "--nats-url", "nats://127.0.0.1:1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": f"{tmp_path}"},
    )  # fmt: skip
    lines = [line for line in result.stderr.splitlines() if not line.startswith("{")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "'broken_agent'" in lines[0] and says in lines[0] and "Traceback" not in result.stderr


def test_the_engine_command_serves_the_tiny_model(tiny_dir, tmp_path):
    """`agentarium engine` prints the URL it serves on, and answers /generate there (not a
    `kernels` test: what it asserts holds on any kernels)."""
    log = tmp_path / "engine.err"  # a file, not a pipe: nothing reads it while the engine runs
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentarium", "engine", "--model", str(tiny_dir), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        )
    try:
        line = proc.stdout.readline()
        assert line.startswith("engine ready on http://127.0.0.1:"), log.read_text()
        url = line.split()[-1]

        async def check() -> dict:
            async with aiohttp.ClientSession() as http:
                async with http.post(
                    f"{url}/generate",
                    json={
                        "text": "1+1=",
                        "sampling_params": {"max_new_tokens": 2, "temperature": 0.0},
                    },
                ) as resp:
                    assert resp.status == 200
                    return await resp.json()

        assert len(asyncio.run(check())["output_ids"]) == 2
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    assert '"event": "engine listening"' in log.read_text()
