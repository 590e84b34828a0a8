"""RolloutConfig: what an RL framework's rollout hook asks of Agentarium, declared once.

The TRL ``rollout_func`` and the verl agent loop both publish one job per sample to one
agent of one run and wait for its trajectory; these are their settings (verl reads them from
its agent-loop YAML, ``examples/trl_trainer.py`` derives its flags from them).
"""

from __future__ import annotations

from dataclasses import dataclass

from agentarium.schemas import Sampling, check_name, check_settings, setting

ROLLOUTS = "rollouts through Agentarium"


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """One agent of one run, and how long a rollout is waited for."""

    agent: str = setting(
        group=ROLLOUTS,
        metavar="NAME",
        help="the Agentarium agent that runs every rollout (`agentarium consumer --agent NAME=...` "
        "must be running)",
    )
    run: str = setting(
        "default",
        group=ROLLOUTS,
        help="run id: trajectories land on trajectories.<run>.<agent>.*, weights on the run's "
        "policy key",
    )
    deadline_s: float = setting(
        600.0,
        gt=0,
        group=ROLLOUTS,
        help="each rollout's wall-clock limit; past it the consumer stores it as timeout",
    )
    grace_s: float = setting(
        60.0,
        ge=0,
        group=ROLLOUTS,
        help="how long past its deadline a rollout's trajectory is waited for before the sample "
        "counts as missing (no consumer ran it)",
    )
    served_timeout_s: float = setting(
        300.0,
        gt=0,
        group=ROLLOUTS,
        help="after publishing new weights, longest wait for every engine of the run to serve "
        "them before the next rollouts (the syncer beside each engine loads them)",
    )

    def __post_init__(self) -> None:
        check_name(self.agent, "agent")
        check_name(self.run, "run")
        check_settings(self)

    @property
    def wait_s(self) -> float:
        """How long one rollout's trajectory is waited for."""
        return self.deadline_s + self.grace_s


def sampling(temperature: float, top_p: float, top_k: int | None, max_new_tokens: int) -> Sampling:
    """A job's sampling from a framework's settings: a top_k of 0 or less means off (TRL says 0,
    verl -1; Agentarium -1)."""
    top_k = int(top_k or 0)
    return Sampling(
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k if top_k > 0 else -1,
        max_new_tokens=int(max_new_tokens),
    )
