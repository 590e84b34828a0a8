"""The bad-input table: every numeric flag of every command at 0, -1 and, where it has one,
past its maximum. A value a command cannot use is refused before any work, with exit 2 and
one line that names the flag; a value it can use is listed in ALLOWED with what it means, so
the table is the whole list (docs/operations.md gives its count).

Each case runs ``agentarium.cli.main`` (in one child process for all: main sets up the
process's logging and tracing) with the other arguments the command needs (tests/badinput.py:
BASE), a broker address where nothing listens and no model loaded: a command that did any
work before checking its settings would fail here another way."""

from __future__ import annotations

import pytest
from badinput import BASE, NO_BROKER, numeric_flags, outcome, run_in_child

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
    ("--micro-batch-size", "0"): "no limit in rows (with no token limit: the batch in one pass)",
    ("--max-tokens-per-micro-batch", "0"): "no limit in tokens per pass",
    ("--logprob-chunk", "0"): "log-probs over the whole vocabulary at every position",
    ("--mlp-chunk", "0"): "feed-forward blocks whole (--memory small makes it 512)",
    ("--layer-chunk", "0"): "decoder layers whole (--memory small makes it 512)",
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
    ("--trajectories-max-bytes", "-1"): "no byte bound: trajectories kept by age only",
    ("--dead-max-bytes", "-1"): "no byte bound: dead letters kept by age only",
    ("--weights-max-bytes", "-1"): "no byte bound on the weights object store",
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


def one_line_naming(code: int, err: str, name: str) -> str | None:
    """None when ``err`` is one line (argparse's usage aside) naming ``name``, exit 2, no
    traceback; else what is wrong."""
    lines = [line for line in err.splitlines() if not line.startswith("{")]
    if lines and lines[0].startswith("usage:"):  # argparse: usage, then one line
        lines = lines[-1:]
    if code != 2 or len(lines) != 1 or name not in lines[0] or "Traceback" in err:
        return f"exit {code}: {err.strip()[-300:]!r}"
    return None


@pytest.mark.long(40)
def test_a_value_a_command_cannot_use_is_refused_in_one_line_naming_its_flag(tmp_path):
    results = run_in_child([[*p, *BASE[p], flag, value] for p, flag, value in CASES], tmp_path)
    wrong = [
        f"{' '.join(p)} {flag} {value}: {problem}"
        for (p, flag, value), (code, err) in zip(CASES, results, strict=True)
        if (problem := one_line_naming(code, err, flag))
    ]
    assert not wrong, "\n".join(wrong)


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


def test_a_missing_file_is_one_line_naming_it(tmp_path):
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "toy_tasks.jsonl").write_text('{"prompt": "x"}\n')
    results = run_in_child(MISSING_FILES, tmp_path)
    wrong = []
    for argv, (code, err) in zip(MISSING_FILES, results, strict=True):
        path = next(a for a in argv if a.startswith(("/nonexistent", "/proc/")))
        if problem := one_line_naming(code, err, path):
            wrong.append(f"{' '.join(argv)}: {problem}")
    assert not wrong, "\n".join(wrong)


def test_parquet_export_without_pyarrow_names_the_extra(tmp_path):
    """docs/evaluation.md shows --format parquet; without pyarrow it is one line naming the
    extra to install, before connecting."""
    hide = (
        "import importlib.util as u; real = u.find_spec; "
        "u.find_spec = lambda name, *a: None if name == 'pyarrow' else real(name, *a)"
    )
    argv = ["trajectories", "export", "--run", "r", "--format", "parquet", "--out", "r.parquet",
            "--nats-url", NO_BROKER]  # fmt: skip
    [(code, err)] = run_in_child([argv], tmp_path, prelude=hide)
    assert code == 2 and err.strip() == (
        "error: --format parquet needs pyarrow: pip install 'agentarium[parquet]' "
        "(or use --format jsonl)"
    ), err
