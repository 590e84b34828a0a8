"""The bad-input table: every numeric flag of every command at 0, -1 and, where it has one,
past its maximum. A value a command cannot use is refused before any work, with exit 2 and
one line that names the flag; a value it can use is listed in ALLOWED with what it means, so
the table is the whole list (docs/operations.md gives its count).

Each case runs ``agentarium.cli.main`` in this process with the other arguments the command
needs (tests/badinput.py: BASE), a broker address where nothing listens and no model loaded:
a command that did any work before checking its settings would fail here another way."""

from __future__ import annotations

import pytest
from badinput import BASE, NO_BROKER, numeric_flags, outcome

from agentarium.cli import main

# (flag, value) a command takes as it is, with what it means there.
ALLOWED: dict[tuple[str, str], str] = {
    ("--port", "0"): "the server picks a free port and prints it",
    ("--monitor-port", "0"): "nats-server's monitoring on a port it picks",
    ("--metrics-port", "0"): "the metrics server picks a free port (logged)",
    ("--proxy-port", "0"): "the proxy picks a free port",
    ("--seed", "0"): "a seed",
    ("--seed", "-1"): "a seed",
    ("--lr", "0"): "the lr-0 control run: sample and train, weights unchanged",
    ("--weight-decay", "0"): "no weight decay (the default)",
    ("--grad-clip", "0"): "no clipping",
    ("--kl-coef", "0"): "no KL term (and no reference model)",
    ("--entropy-coef", "0"): "no entropy bonus",
    ("--clip-low", "0"): "PPO's lower clip at ratio 1",
    ("--clip-high", "0"): "PPO's upper clip at ratio 1",
    ("--max-staleness", "0"): "on-policy: only trajectories of the current version",
    ("--max-steps", "0"): "set up, write the resolved config, train nothing",
    ("--micro-batch-size", "0"): "the whole batch in one pass",
    ("--logprob-chunk", "0"): "log-probs over the whole vocabulary at every position",
    ("--lora-rank", "0"): "full fine-tuning",
    ("--ray-workers", "0"): "train in this process",
    ("--task-wait", "0"): "never wait for a short task's groups",
    ("--overlong-reward", "0"): "an overlong reply's reward",
    ("--overlong-reward", "-1"): "an overlong reply's reward (a penalty)",
    ("--success-threshold", "0"): "a reward threshold; rewards may be 0 or negative",
    ("--success-threshold", "-1"): "a reward threshold; rewards may be 0 or negative",
    ("--min-reward", "0"): "export rows with reward >= 0",
    ("--min-reward", "-1"): "export rows with reward >= -1",
    ("--temperature", "0"): "greedy decoding",
    ("--top-k", "-1"): "no top-k (SGLang's spelling)",
    ("--cross-ratio", "0"): "no call sampled from the cross model",
    ("--drain-grace", "0"): "on SIGTERM, release in-flight work at once",
    ("--program-kill-grace", "0"): "SIGKILL right after SIGTERM",
    ("--program-output-bytes", "0"): "keep none of a program's output",
    ("--retry-delay", "0"): "retry a failed job at once",
    ("--llm-retries", "0"): "no retry of a failed LLM call",
    ("--fleet-outage-limit", "0"): "never hold work during an outage: fail at once",
    ("--prefix-cache-tokens", "0"): "no prefix cache",
}

# Past the maximum, where a flag has one.
PAST_MAX: dict[str, str] = {
    "--port": "65536",
    "--monitor-port": "65536",
    "--metrics-port": "65536",
    "--proxy-port": "65536",
    "--top-p": "1.01",
    "--cross-ratio": "1.01",
    "--clip-low": "1",
}

FLAGS = numeric_flags()
CASES = [
    (path, flag, value)
    for path, flag, _ in FLAGS
    for value in ("-1", "0", *([PAST_MAX[flag]] if flag in PAST_MAX else []))
    if (flag, value) not in ALLOWED
]


def test_the_table_covers_every_numeric_flag_of_every_command():
    assert {path for path, _, _ in FLAGS} <= set(BASE)
    assert len(FLAGS) >= 130 and len(CASES) >= 220  # docs/operations.md gives the counts
    known = {flag for _, flag, _ in FLAGS}
    assert {flag for flag, _ in ALLOWED} <= known and set(PAST_MAX) <= known


@pytest.mark.parametrize(("path", "flag", "value"), CASES, ids=lambda v: str(v))
def test_a_value_a_command_cannot_use_is_refused_in_one_line_naming_its_flag(
    path, flag, value, capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # nothing a command might write lands in the checkout
    try:
        code = main([*path, *BASE[path], flag, value])
    except SystemExit as exc:  # argparse refuses: usage, then "error: argument FLAG: ..."
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("{")]
    assert code == 2, err
    assert flag in lines[-1] and "Traceback" not in err, err
    assert len(lines) == 1 or lines[0].startswith("usage:"), err  # argparse: usage, then one


@pytest.mark.parametrize(("flag", "value"), sorted(ALLOWED))
def test_each_allowed_value_is_taken_by_every_command_that_has_the_flag(flag, value):
    for path, name, _ in FLAGS:
        if name == flag:
            refused, said = outcome(path, flag, value)
            assert not refused, (path, said)


MISSING = "/nonexistent/agentarium-test/x"

# Every command that reads a file or folder the user names, given one that does not exist.
MISSING_FILES: list[tuple[str, ...]] = [
    ("produce", "--agent", "toy", "--file", f"{MISSING}.jsonl", "--nats-url", NO_BROKER),
    ("produce", "--file", "examples/toy_tasks.jsonl", "--config", f"{MISSING}.yaml"),
    ("trainer", "--config", f"{MISSING}.yaml"),
    ("consumer", "--config", f"{MISSING}.yaml"),
    ("env", "serve", "shell", "--config", f"{MISSING}.yaml"),
    ("eval", "run", *BASE[("eval", "run")][:2], "--file", f"{MISSING}.jsonl",
     "--llm", "http://127.0.0.1:1", "--model", "tiny", "--nats-url", NO_BROKER),
    ("eval", "summary", MISSING),
    ("plot", f"{MISSING}.csv"),
    ("merge-lora", "--model", "tiny", "--adapter", MISSING, "--out", "merged"),
    ("engine", "--model", MISSING),
    ("broker", "up", "--port", "0", "--store", "/proc/agentarium-nope"),
]  # fmt: skip


@pytest.mark.parametrize("argv", MISSING_FILES, ids=lambda argv: " ".join(argv[:2]))
def test_a_missing_file_is_one_line_naming_it(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "toy_tasks.jsonl").write_text('{"prompt": "x"}\n')
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("{")]
    assert code == 2 and len(lines) == 1, err
    path = next(a for a in argv if a.startswith(("/nonexistent", "/proc/")))
    assert path in lines[0] and "Traceback" not in err, err


def test_parquet_export_without_pyarrow_names_the_extra(capsys, monkeypatch):
    """docs/evaluation.md shows --format parquet; without pyarrow it is one line naming the
    extra to install, before connecting."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a)
    )
    argv = ["trajectories", "export", "--run", "r", "--format", "parquet", "--out", "r.parquet"]
    assert main([*argv, "--nats-url", NO_BROKER]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: --format parquet needs pyarrow: pip install 'agentarium[parquet]' "
        "(or use --format jsonl)"
    )
