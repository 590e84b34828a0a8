"""Agentarium's wire contracts: the only place wire compatibility lives."""

from . import settings
from .codec import (
    ENCODINGS,
    JSON,
    JSON_CONTENT_TYPE,
    MSGPACK,
    MSGPACK_CONTENT_TYPE,
    Encoding,
    decode,
    encode,
    encode_json,
    encoding,
    is_json,
    loads,
)
from .deadletter import DeadLetter
from .demand import GroupDemand, GroupSupply
from .env import (
    ENV_ERROR_CODES,
    EnvCall,
    EnvError,
    EnvStart,
    EnvStarted,
    EnvWorkerStats,
    Observation,
    SessionOutcome,
    StepResult,
)
from .errors import DecodeError, SchemaError
from .fields import SCHEMA_VERSION
from .job import DEFAULT_DEADLINE_S, Job, Sampling
from .names import check_name
from .settings import SettingError, check_settings, section, setting
from .trajectory import FINISH_REASONS, STATUSES, LLMCall, Trajectory, spans_problem
from .weights import WeightIdentity, WeightUpdate, run_version, versions_label

__all__ = [
    "DEFAULT_DEADLINE_S",
    "ENCODINGS",
    "JSON",
    "MSGPACK",
    "Encoding",
    "encoding",
    "FINISH_REASONS",
    "JSON_CONTENT_TYPE",
    "MSGPACK_CONTENT_TYPE",
    "SCHEMA_VERSION",
    "STATUSES",
    "DeadLetter",
    "ENV_ERROR_CODES",
    "EnvCall",
    "EnvError",
    "EnvStart",
    "EnvStarted",
    "EnvWorkerStats",
    "GroupDemand",
    "GroupSupply",
    "Observation",
    "SessionOutcome",
    "StepResult",
    "DecodeError",
    "Job",
    "LLMCall",
    "Sampling",
    "SchemaError",
    "SettingError",
    "Trajectory",
    "WeightIdentity",
    "WeightUpdate",
    "check_name",
    "check_settings",
    "decode",
    "encode",
    "encode_json",
    "is_json",
    "loads",
    "section",
    "setting",
    "settings",
    "run_version",
    "spans_problem",
    "versions_label",
]
