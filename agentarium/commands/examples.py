"""One or two runnable examples for every command, shown at the end of its ``--help``.

``tests/test_cli.py`` parses every example line with the real parser, so an example that
names a flag that no longer exists fails the suite."""

from __future__ import annotations

EXAMPLES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("broker", "up"): (
        "agentarium broker up --port 4222 --store ~/.cache/agentarium/nats",
        "agentarium broker up --port 0 --sync-interval always   # the server picks the port",
    ),
    ("broker", "init"): (
        "agentarium broker init --nats-url nats://127.0.0.1:4222 --agent toy",
        "agentarium broker init --ack-wait 120 --max-ack-pending 50000",
    ),
    ("broker", "status"): (
        "agentarium broker status",
        "agentarium broker status --run demo-1 --json",
    ),
    ("broker", "sweep"): (
        "agentarium broker sweep --dry-run",
        "agentarium broker sweep --agent toy --json",
    ),
    ("completion",): ('eval "$(agentarium completion bash)"',),
    ("consumer",): (
        "agentarium consumer --agent toy=agentarium.examples.toy:rollout --llm http://127.0.0.1:30000 "
        "--model tiny",
        "agentarium consumer --agent coder=exec:'python3 my_agent.py' --llm "
        "http://127.0.0.1:30000 --model smol --concurrency 8",
    ),
    ("dashboard",): (
        "agentarium dashboard   # then open http://127.0.0.1:8266/",
        "agentarium dashboard --run demo-1 --port 8300",
    ),
    ("demo",): (
        "agentarium demo   # the tiny model learns to repeat a digit, ~5 minutes",
        "agentarium demo --model smol --out smol-demo",
        "agentarium demo --model smol --recipe calc --out calc-demo   # a tool agent learns",
    ),
    ("engine",): (
        "agentarium engine --model tiny --port 30000",
        "agentarium engine --model smol --port 0 --max-batch 16",
    ),
    ("env", "serve"): (
        "agentarium env serve shell --capacity 8",
        "agentarium env serve sql --name sql-1 --idle-timeout 600",
    ),
    ("env", "bridge"): ("agentarium env bridge --agentbench http://127.0.0.1:5000 --name ab",),
    ("env", "status"): ("agentarium env status", "agentarium env status --json"),
    ("eval", "run"): (
        "agentarium eval run --agent toy=agentarium.examples.toy:rollout --file examples/toy_tasks.jsonl "
        "--k 4 --llm http://127.0.0.1:30000 --model tiny",
        "agentarium eval run --agent toy=agentarium.examples.toy:rollout --file examples/toy_tasks.jsonl "
        "--llm http://127.0.0.1:30000 --model tiny --out evals/toy --resume",
    ),
    ("eval", "summary"): ("agentarium eval summary evals/toy",),
    ("merge-lora",): (
        "agentarium merge-lora --model smol --adapter weights/run1/v20/model.safetensors "
        "--out merged/",
    ),
    ("plot",): ("agentarium plot metrics.csv -o reward.png",),
    ("produce",): (
        "agentarium produce --file examples/toy_tasks.jsonl --agent toy --run run1 --group-size 8",
        "agentarium produce --file tasks.jsonl --agent toy --eval --run eval1",
    ),
    ("sync",): (
        "agentarium sync --run run1 --engine http://127.0.0.1:30000",
        "agentarium sync --run run1 --engine http://127.0.0.1:30000 --weights-dir /shared/w "
        "--shared-path",
        "agentarium sync --run ctrl --engine http://127.0.0.1:30000 --base-model /models/smol"
        "   # take over engines that served another run",
        "agentarium sync --run run2 --engine http://127.0.0.1:30000 --shared-engines"
        "   # never load over another run's weights",
    ),
    ("trainer",): (
        "agentarium trainer --run run1 --agent toy --model tiny --metrics metrics.csv",
        "agentarium trainer --run run1 --agent toy --model smol --lora-rank 16 --lr 3e-4",
    ),
    ("trajectories", "show"): (
        "agentarium trajectories show --run run1",
        "agentarium trajectories show --run run1 --status error --follow",
    ),
    ("trajectories", "export"): (
        "agentarium trajectories export --run run1 --out run1.jsonl",
        "agentarium trajectories export --run run1 --format parquet --out run1.parquet",
    ),
}


def epilog_of(path: tuple[str, ...], existing: str | None) -> str:
    """``existing`` (a command's own epilog, if any), then its examples."""
    lines = ["examples:", *(f"  {example}" for example in EXAMPLES[path])]
    return "\n\n".join(part for part in (existing, "\n".join(lines)) if part)
