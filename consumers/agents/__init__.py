"""Agents: loading user agents and adapting every shape to one async call (``loading.py``),
program agents (``exec:CMD``, ``program*.py``), the environment client and the generic
environment agent (``envclient.py``, ``env_agent.py``), and ``verifiers`` environments as agents
(``verifiers_agent.py``)."""

from .env_agent import EnvAgent, env_agent
from .envclient import EnvClient, EnvSession
from .loading import (
    AgentLoadError,
    AgentRunner,
    AgentSpec,
    AgentThreads,
    RewardError,
    SyncLLM,
    extract_reward,
    finite_reward,
    load_callable,
)
from .program import ProgramAgent, ProgramFailed, ProgramSettings, load_agent, program_agent
from .program_run import ProgramOutput
from .verifiers_agent import VerifiersAgent, VerifiersRolloutError, verifiers_agent

__all__ = [
    "AgentLoadError",
    "AgentRunner",
    "AgentSpec",
    "AgentThreads",
    "EnvAgent",
    "EnvClient",
    "EnvSession",
    "ProgramAgent",
    "ProgramFailed",
    "ProgramOutput",
    "ProgramSettings",
    "RewardError",
    "SyncLLM",
    "VerifiersAgent",
    "VerifiersRolloutError",
    "env_agent",
    "extract_reward",
    "finite_reward",
    "load_agent",
    "load_callable",
    "program_agent",
    "verifiers_agent",
]
