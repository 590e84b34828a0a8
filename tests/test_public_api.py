"""The names users import, pinned; and what importing them costs."""

from __future__ import annotations

import importlib
import subprocess
import sys

import agentarium

# The face, by the component each name comes from: a name that vanishes from agentarium, or
# is re-exported from elsewhere, fails here.
FACE = {
    "agentarium.orchestrator": {"AgentOrchestrator", "OrchestratorConfig"},
    "agentarium.models": {"resolve_model"},
    "agentarium.smol": {"ensure_smol_model"},
    "agentarium.tiny": {"ensure_tiny_model"},
    "agentarium.broker": {"NatsSettings", "Topology"},
    "agentarium.consumers": {"ChatResult", "ProgramOutput", "TracingLLM", "program_agent"},
    "agentarium.producers": {"SubmitResult", "TaskProducer", "TrajectoryReader"},
    "agentarium.schemas": {
        "DeadLetter",
        "Job",
        "LLMCall",
        "Sampling",
        "Trajectory",
        "WeightUpdate",
    },
}


def test_public_names_are_pinned_and_importable():
    assert set(agentarium.__all__) == {"__version__"}.union(*FACE.values())
    assert len(agentarium.__all__) == len(set(agentarium.__all__))
    for module, names in FACE.items():
        for name in names:
            assert getattr(agentarium, name) is getattr(importlib.import_module(module), name)


def test_the_cli_and_a_consumer_do_not_load_torch():
    # torch + transformers cost a consumer ~2.5 s and ~250 MB: only the engine and trainer load them.
    code = (
        "import sys, agentarium, agentarium.cli, agentarium.consumers.worker,"
        " agentarium.consumers.tracing.llm, agentarium.producers;"
        "agentarium.cli.build_parser();"
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
