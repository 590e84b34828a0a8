"""Rollout consumers: the worker loop, agent adapters, the tracing LLM client and proxy, backends,
the consumer service that assembles them, and the weight syncer that keeps the engines on
the latest policy version (``consumers.sync``). The local CPU engine (torch) is the sub-package
``consumers.engine``, imported only by what serves a model."""

from .agents import AgentLoadError, AgentSpec, RewardError, load_callable
from .backends import CrossSamplingBackend, model_of_call
from .chat_template import ChatTemplate
from .config import ConsumerSettings, default_worker_id
from .counters import Counters
from .env_agent import EnvAgent, env_agent
from .envclient import EnvClient, EnvSession
from .errors import (
    BackendUnavailable,
    BadRequest,
    CrossSamplingError,
    EnvClientError,
    EnvironmentFailed,
    EnvironmentTimeout,
    EnvironmentUnavailable,
    EnvRequestError,
    LLMError,
    TokenizerMismatch,
    ToolsNotRendered,
)
from .fleet import Fleet, FleetPolicy
from .llm import ChatResult, TracingLLM
from .process import ConsumerProcess, RolloutSettings, build_agent, parse_agent
from .program import (
    ProgramAgent,
    ProgramFailed,
    ProgramSettings,
    load_agent,
    program_agent,
)
from .program_run import ProgramOutput
from .proxy import TracingProxy
from .service import (
    ConsumerService,
    ConsumerSpec,
    CrossTarget,
    LLMTarget,
    normalize_urls,
    start_proxy,
)
from .sync import SyncConfig, SyncResult, WeightSyncer, run_sync
from .verifiers_agent import VerifiersAgent, VerifiersRolloutError, verifiers_agent
from .worker import Worker

__all__ = [
    "AgentLoadError",
    "AgentSpec",
    "BackendUnavailable",
    "BadRequest",
    "ChatResult",
    "ChatTemplate",
    "ConsumerService",
    "ConsumerProcess",
    "ConsumerSettings",
    "ConsumerSpec",
    "Counters",
    "CrossSamplingBackend",
    "CrossSamplingError",
    "CrossTarget",
    "EnvAgent",
    "EnvClient",
    "EnvClientError",
    "EnvRequestError",
    "EnvSession",
    "EnvironmentFailed",
    "EnvironmentTimeout",
    "EnvironmentUnavailable",
    "Fleet",
    "FleetPolicy",
    "LLMError",
    "LLMTarget",
    "ProgramAgent",
    "ProgramFailed",
    "ProgramOutput",
    "ProgramSettings",
    "RewardError",
    "RolloutSettings",
    "SyncConfig",
    "SyncResult",
    "TokenizerMismatch",
    "ToolsNotRendered",
    "TracingLLM",
    "TracingProxy",
    "VerifiersAgent",
    "VerifiersRolloutError",
    "WeightSyncer",
    "Worker",
    "default_worker_id",
    "build_agent",
    "env_agent",
    "load_agent",
    "load_callable",
    "parse_agent",
    "model_of_call",
    "normalize_urls",
    "program_agent",
    "run_sync",
    "start_proxy",
    "verifiers_agent",
]
