"""EvalConfig: every setting of ``agentarium eval run``, declared once.

Its flags and ``--config`` keys are derived from these fields (schemas.settings). What eval
shares with the consumer is not declared again: the in-process consumer's model, agent
environment, reward and cross-sampling are the ``RolloutSettings`` section that
``agentarium consumer`` holds too, and its concurrency, attempts and redelivery timeout are
``consumers.ConsumerSettings``' own fields (``settings.shared``), its deadline and sampling
the jobs' own (``producers.JobOptions``, ``schemas.Sampling``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from agentarium.consumers import ConsumerProcess, ConsumerSettings, RolloutSettings
from agentarium.producers import JobOptions
from agentarium.schemas import (
    Sampling,
    SchemaError,
    check_name,
    check_settings,
    section,
    setting,
    settings,
)

LLM = "LLM (in-process consumer)"


def split_agent(value: str) -> tuple[str, str | None]:
    """``NAME[=module:function]`` -> (NAME, module:function or None)."""
    name, sep, spec = value.partition("=")
    try:
        check_name(name, "agent")
    except SchemaError as exc:
        raise ValueError(str(exc)) from None
    if sep and ":" not in spec:
        raise ValueError(f"--agent {value!r}: write NAME=module:function or NAME=exec:CMD")
    return name, (spec or None)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """``EvalConfig.of(**flat)`` from flat keys, as a config file spells them."""

    agent: str = setting(
        metavar="NAME[=module:function|=exec:CMD]",
        help="the agent; with =module:function, =exec:CMD (a program, see `agentarium "
        "consumer --help`) or --env the rollouts run in this process, otherwise on running "
        "`agentarium consumer` services for NAME",
    )
    tasks_file: str = setting(
        flag="--file",
        metavar="PATH",
        help="tasks, one JSON object per line, or a .parquet file, one task per row (verl's "
        "format)",
    )
    k: int = setting(1, ge=1, metavar="K", help="attempts per task")
    llm: tuple[str, ...] = setting(
        (),
        metavar="URL",
        group=LLM,
        help="SGLang-compatible server (or `agentarium engine`), or a vLLM server with "
        "--llm-engine vllm; repeat for a fleet",
    )
    llm_engine: str = settings.shared(ConsumerProcess, "llm_engine")
    openai_base: str | None = setting(
        None,
        metavar="URL",
        group=LLM,
        help="OpenAI-compatible base URL ending in /v1 (vLLM, hosted APIs): text only",
    )
    rollout: RolloutSettings = section(RolloutSettings)
    out_dir: str | None = setting(
        None, flag="--out", metavar="DIR", help="results directory (default evals/<run>)"
    )
    run: str | None = setting(
        None, metavar="RUN", help="run id (default: derived from agent, tasks, k and models)"
    )
    concurrency: int = settings.shared(ConsumerSettings, "concurrency")
    deadline_s: float = settings.shared(JobOptions, "deadline_s")
    sampling: Sampling = section(Sampling)  # --temperature, --max-new-tokens, ...: a job's own
    ack_wait_s: float = settings.shared(ConsumerSettings, "ack_wait_s")
    attempts: int = settings.shared(ConsumerSettings, "attempts")
    tool_fallback: bool = settings.shared(ConsumerSettings, "tool_fallback")
    timeout_s: float | None = setting(None, gt=0, help="give up waiting after this many seconds")
    success_threshold: float = setting(
        1.0, metavar="R", help="a rollout succeeds when its reward >= R, for pass@k"
    )
    seed: int | None = setting(None, help="seed of the cross-sampling coin")
    # Not settings, so no file holds them: what this invocation does (continue an unfinished
    # eval) and a credential (--api-key or OPENAI_API_KEY, never in a manifest either).
    resume: bool = False
    api_key: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_settings(self)
        name, fn = split_agent(self.agent)
        if self.llm and self.openai_base:
            raise ValueError("pass --llm (SGLang) or --openai-base (OpenAI-compatible), not both")
        if fn and self.rollout.env and not fn.startswith("exec:"):
            env = self.rollout.env
            raise ValueError(
                f"--agent {self.agent} names its own rollout function, and --env {env} asks "
                f"for the generic function-call agent: pass one or the other (--agent {name} "
                f"--env {env}, or drop --env)"
            )

    @property
    def agent_name(self) -> str:
        return split_agent(self.agent)[0]

    @property
    def agent_fn(self) -> str | None:
        """module:function or exec:CMD for an in-process consumer; None: the generic agent
        (--env) or running consumers."""
        return split_agent(self.agent)[1]

    @classmethod
    def of(cls, **values: Any) -> EvalConfig:
        """From flat keys (``concurrency=4``, ``cross_model=(url,)``); ``resume`` and
        ``api_key`` too."""
        runtime = {name: values.pop(name) for name in ("resume", "api_key") if name in values}
        unknown = set(values) - {k.name for k in settings.keys(cls)}
        if unknown:
            raise TypeError(f"unknown eval setting(s): {', '.join(sorted(unknown))}")
        return settings.build(cls, values, **runtime)  # type: ignore[no-any-return]
