"""ConsumerProcess: the settings of one ``agentarium consumer`` process, declared once.

What it runs (the agent given as ``NAME=module:function`` or as a bare NAME on an
environment, the model whose tokenizer renders prompts, the LLM servers, cross-sampling),
then how (``ConsumerSettings``). The command derives its flags and file keys from these
fields (schemas.settings) and only wires and prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentarium.schemas import SchemaError, check_name, check_settings, section, setting

from .agents.env_agent import DEFAULT_MAX_TURNS, env_agent
from .agents.program import PREFIX, ProgramSettings, load_agent
from .config import ConsumerSettings
from .service import CrossTarget, LLMTarget, normalize_urls


@dataclass(frozen=True, kw_only=True)
class RolloutSettings:
    """What a consumer runs besides the agent and its LLM servers: ``agentarium consumer``
    and ``agentarium eval run`` both hold this section."""

    env: str | None = setting(
        None,
        metavar="ENV",
        help="run the generic function-call agent on environment ENV (`agentarium env serve "
        "ENV`), no code needed: each job's task opens a session, the model calls the "
        "environment's tools until it is done or --max-turns, and the reward is the session's "
        "score. Give --agent a bare NAME with it, e.g. --agent db --env sql. With "
        "--agent NAME=exec:CMD: the program acts in the session (AGENTARIUM_ENV_URL), which "
        "scores it",
    )
    max_turns: int = setting(
        DEFAULT_MAX_TURNS,
        ge=1,
        metavar="N",
        help="with --env: model calls per rollout before the episode is cut (truncated, scored "
        "as the environment scores it at close)",
    )
    model: str = setting(
        "tiny",
        metavar="tiny|smol|PATH",
        help="model directory whose tokenizer and chat template render prompts, or a built-in "
        "model: 'tiny' (default), 'smol'; the same model the --llm engines serve (checked at "
        "start); with `eval run --openai-base`: the API's model name",
    )
    model_name: str | None = setting(
        None, help="model name handed to endpoint-style agents and spans (default: from --model)"
    )
    reward: str | None = setting(
        None,
        metavar="module:fn",
        help="reward function fn(task, result, trajectory) -> float | dict",
    )
    # Cross-sampling: a call goes to this second model with probability cross_ratio;
    # recorded with policy false, never trained on.
    cross_model: tuple[str, ...] = setting(
        (),
        metavar="URL",
        help="cross-sampling: a second model's server, of the first one's kind (SGLang or "
        "`agentarium engine`, repeat for a fleet, sharing the policy's tokenizer: checked at "
        "start; or one OpenAI-compatible base with `eval run --openai-base`); each LLM call "
        "goes there with probability --cross-ratio, and is recorded as not the policy's: the "
        "trainer keeps its tokens as context and trains only on the policy's",
    )
    cross_model_name: str = setting(
        "cross",
        metavar="NAME",
        help="the second model's name in the recorded calls (and its API model name with "
        "`eval run --openai-base`)",
    )
    cross_ratio: float = setting(
        0.5,
        ge=0,
        le=1,
        metavar="P",
        help="probability that a call goes to --cross-model, decided per call",
    )
    program: ProgramSettings = section(ProgramSettings, prefix="program_")

    def __post_init__(self) -> None:
        check_settings(self)

    def cross(
        self,
        *,
        openai: bool = False,
        api_key: str | None = None,
        seed: int | None = None,
        engine: str = "sglang",
    ) -> CrossTarget | None:
        """The cross-sampling target (None without --cross-model): SGLang-compatible
        servers, or with ``openai`` the one OpenAI-compatible base named ``cross_model_name``."""
        urls = normalize_urls(list(self.cross_model))
        if not urls:
            return None
        if openai:
            if len(self.cross_model) != 1:
                raise ValueError(
                    "with an OpenAI-compatible model, --cross-model is one base URL, "
                    f"got {len(self.cross_model)}"
                )
            target = LLMTarget(
                openai_base=self.cross_model[0].rstrip("/"),
                openai_model=self.cross_model_name,
                api_key=api_key,
            )
        else:
            target = LLMTarget(urls=tuple(urls), engine=engine)
        return CrossTarget(
            target=target, ratio=self.cross_ratio, name=self.cross_model_name, seed=seed
        )


@dataclass(frozen=True, kw_only=True)
class ConsumerProcess:
    """One ``agentarium consumer`` process: what it runs (the agent, its model and LLM
    servers), then how (``ConsumerSettings``)."""

    agent: str = setting(
        metavar="NAME=module:function|NAME=exec:CMD|NAME",
        help="agent name and its rollout function, e.g. toy=agentarium.examples.toy:rollout. The function "
        "is rollout(task, llm) (async or not) or rollout(task, endpoint, model), or a Ray "
        "remote function. NAME=exec:CMD runs the command line CMD per rollout, in any "
        "language, its LLM calls through the gateway (OPENAI_BASE_URL, ANTHROPIC_BASE_URL; "
        "the --program-* settings). A bare NAME with --env runs the generic function-call "
        "agent instead",
    )
    llm: tuple[str, ...] = setting(
        (),
        metavar="URL",
        help="SGLang-compatible server (or `agentarium engine`), or a vLLM server with "
        "--llm-engine vllm; repeat for a fleet: least-loaded balancing, every sample of a "
        "group on the same server",
    )
    llm_engine: str = setting(
        "sglang",
        choices=("sglang", "vllm"),
        help="what the --llm servers are: sglang (SGLang's /generate, also `agentarium "
        "engine`) or vllm (vLLM's token-in/token-out /inference/v1/generate: start it with "
        "--enable-scale-out); both token-exact, trainable",
    )
    openai_base: str | None = setting(
        None,
        metavar="URL",
        help="instead of --llm: an OpenAI-compatible base URL ending in /v1 (vLLM, hosted "
        "APIs), called with --model's name; text only, so its calls cannot be trained on",
    )
    lora: str | None = setting(
        None,
        metavar="NAME",
        help="ask the LLM servers for this LoRA adapter (SGLang's lora_path): a trainer with "
        "--lora-rank publishes adapters that `agentarium sync` loads under the run's name, so "
        "pass the run id; the calls record the adapter's version",
    )
    rollout: RolloutSettings = section(RolloutSettings)
    consumer: ConsumerSettings = section(ConsumerSettings)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.llm and self.openai_base:
            raise ValueError("pass --llm (SGLang) or --openai-base (OpenAI-compatible), not both")


def parse_agent(value: str, env: str | None = None) -> tuple[str, str]:
    """``NAME=module:function`` -> (NAME, module:function); a bare NAME with ``env`` -> (NAME,
    "") for the generic function-call agent on that environment; ``NAME=exec:CMD`` -> (NAME,
    exec:CMD), with or without ``env`` (a program in a session of it)."""
    name, sep, spec = value.partition("=")
    if sep and env and not spec.startswith(PREFIX):  # a program may act in an environment
        raise ValueError(
            f"--agent {value!r} names its own rollout function, and --env {env} asks for the "
            f"generic function-call agent: pass --agent {name} --env {env}, or drop --env"
        )
    if not sep and not env:
        raise ValueError(
            f"--agent {value!r}: write NAME=module:function, e.g. toy=agentarium.examples.toy:rollout, "
            "NAME=exec:CMD for a program (--agent swe=exec:'node agent.js'), or NAME with "
            f"--env ENV for the generic agent on an environment (--agent {value} --env sql)"
        )
    try:
        check_name(name, "agent")
        if env:
            check_name(env, "env")
    except SchemaError as exc:
        raise ValueError(str(exc)) from None
    return name, spec


def build_agent(config: ConsumerProcess) -> tuple[str, Any]:
    """The agent's name and callable: the generic agent with ``env``, else a program agent
    (``exec:CMD``) or the imported function (``load_agent``)."""
    rollout = config.rollout
    name, spec_text = parse_agent(config.agent, rollout.env)
    if rollout.env and not spec_text:
        return name, env_agent(rollout.env, max_turns=rollout.max_turns)
    return name, load_agent(spec_text, rollout.program, rollout.env)
