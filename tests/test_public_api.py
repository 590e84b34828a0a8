"""The names users import, pinned; and what importing them costs."""

from __future__ import annotations

import subprocess
import sys

import agentarium

PUBLIC = [
    "AgentOrchestrator",
    "ChatResult",
    "DeadLetter",
    "Job",
    "LLMCall",
    "NatsSettings",
    "OrchestratorConfig",
    "Sampling",
    "SubmitResult",
    "TaskProducer",
    "Topology",
    "TracingLLM",
    "Trajectory",
    "TrajectoryReader",
    "WeightUpdate",
    "__version__",
    "ensure_smol_model",
    "ensure_tiny_model",
    "resolve_model",
]


def test_public_names_are_pinned_and_importable():
    assert sorted(agentarium.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(agentarium, name) is not None


def test_the_cli_and_a_consumer_do_not_load_torch():
    # torch + transformers cost a consumer ~2.5 s and ~250 MB: only the engine and trainer load them.
    code = (
        "import sys, agentarium, agentarium.cli, consumers.worker, consumers.llm, producers;"
        "agentarium.cli.build_parser();"
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
