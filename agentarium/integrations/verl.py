"""verl's agent loop with its rollouts run by Agentarium: ``agent_name: agentarium``.

verl (0.9.1) runs one agent loop per sample inside its ``AgentLoopWorker`` processes and
collects their ``AgentLoopOutput``s into the training batch. This loop sends the sample to
Agentarium as one job (the sample's dataset fields as its task, its chat as ``task["prompt"]``,
verl's ``uid`` as its group), waits for the trajectory and returns it as verl's own output:
``prompt_ids``, ``response_ids`` and ``response_mask`` (a multi-turn rollout is one sequence,
the model's tokens 1 and tool results 0, by the trainer's row rule), ``response_logprobs``
from the engine, ``reward_score`` from the agent. Turn it on with the YAML of
``examples/verl_agent_loop.yaml``::

    actor_rollout_ref.rollout.agent.agent_loop_config_path=examples/verl_agent_loop.yaml
    actor_rollout_ref.rollout.agent.default_agent_loop=agentarium

Its keys other than ``name`` and ``_target_`` are settings: ``RolloutConfig``'s (``agent``,
``run``, ``deadline_s``, ``grace_s``) and ``NatsSettings``' (``url``, ``prefix``, ...; default
the ``AGENTARIUM_*`` environment). The class is also registered as ``agentarium``, which needs
the same keys: without them it says so.

**The LLM calls go to verl's own servers**, so verl's weight sync keeps them serving the
policy: the consumers run ``agentarium consumer --llm http://<verl server>`` (SGLang rollout:
its HTTP server speaks the API the consumers call). The loop announces the servers it finds
behind verl's load balancer in the engines KV (``agentarium broker status``, the dashboard),
status ``announced``, which is where ``ops/verl_gpu_recipe.sh`` reads them.

**A failed sample** (``error``, ``timeout``, never stored, or not one sequence) is never scored
as 0 and carries no loss token: its response is one end-of-sequence token with mask 0, and its
``reward_score`` is the mean reward of the usable samples of its group in this worker, so it
does not move the group's mean and its advantage is 0 (verl takes the group's statistics over
every sample of a ``uid``, and its batch keeps the ``uid`` the trainer gave). What it still
changes is the std's count: k usable of n scale the others' advantages by sqrt((n-1)/(k-1))
over a group without it. A group with no usable sample scores 0 throughout: flat, no signal.
Their ``agentarium_status`` (extra field) says what happened.

Imported in verl's virtualenv (``ops/verl_venv.sh``), it loads Agentarium's client side only:
``schemas``, ``broker``, ``producers`` and the torch-free ``trainer`` face.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import secrets
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import structlog
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register

from agentarium.broker import NatsSettings
from agentarium.inference import record_engine
from agentarium.producers import JobOptions, make_job

from .client import RolloutClient
from .config import RolloutConfig, sampling
from .samples import Sample, sample_of

log = structlog.get_logger("agentarium.integrations.verl")

NAME = "agentarium"
SESSION = secrets.token_hex(4)  # this process's jobs: fresh ids, never an earlier run's
GROUP_BATCH = "verl"  # with verl's uid, the group id every worker of the run agrees on
_ROLLOUT_KEYS = {f.name for f in dataclasses.fields(RolloutConfig)}
_NATS_KEYS = {f.name for f in dataclasses.fields(NatsSettings)}
_CLIENTS: dict[tuple, RolloutClient] = {}
_LOCKS: dict[int, asyncio.Lock] = {}
_ANNOUNCED: set[tuple] = set()


def settings_of(options: Mapping[str, Any]) -> tuple[RolloutConfig, NatsSettings]:
    """The loop's YAML keys as RolloutConfig and NatsSettings (the environment fills in the
    connection); an unknown key is refused, naming the known ones."""
    unknown = sorted(set(options) - _ROLLOUT_KEYS - _NATS_KEYS)
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(unknown)} for the agentarium agent loop: its keys are "
            f"{', '.join(sorted(_ROLLOUT_KEYS))} and the connection's {', '.join(sorted(_NATS_KEYS))}"
        )
    if "agent" not in options:
        raise ValueError(
            "the agentarium agent loop needs its settings (agent, run, ...): point "
            "actor_rollout_ref.rollout.agent.agent_loop_config_path at a YAML like "
            "examples/verl_agent_loop.yaml"
        )
    rollout = RolloutConfig(**{k: v for k, v in options.items() if k in _ROLLOUT_KEYS})
    nats = NatsSettings.from_env(**{k: v for k, v in options.items() if k in _NATS_KEYS})
    return rollout, nats


async def shared_client(rollout: RolloutConfig, nats: NatsSettings) -> RolloutClient:
    """One client per event loop and run: every agent loop of a worker process shares it."""
    loop = asyncio.get_running_loop()
    key = (id(loop), nats.url, nats.prefix, rollout.run)
    lock = _LOCKS.setdefault(id(loop), asyncio.Lock())
    async with lock:
        client = _CLIENTS.get(key)
        if client is None:
            client = await RolloutClient(nats, rollout.run, name="agentarium-verl").start()
            _CLIENTS[key] = client
    return client


class GroupBoard:
    """This process's samples by group: the index of each within its group, and once a failed
    one's group is settled, what its other members returned."""

    def __init__(self) -> None:
        self._joined: dict[str, int] = {}
        self._active: dict[str, int] = {}
        self._done: dict[str, list[Sample]] = {}
        self._changed: dict[str, asyncio.Event] = {}

    def join(self, group: str) -> int:
        index = self._joined.get(group, 0)
        self._joined[group] = index + 1
        self._active[group] = self._active.get(group, 0) + 1
        self._changed.setdefault(group, asyncio.Event())
        return index

    def finish(self, group: str, sample: Sample) -> None:
        self._done.setdefault(group, []).append(sample)
        self._changed[group].set()

    async def settled(self, group: str, timeout: float) -> list[Sample]:
        """What every member of ``group`` that joined here returned, once all have (or at the
        timeout, what has come)."""
        deadline = time.monotonic() + timeout
        event = self._changed[group]
        while len(self._done.get(group, [])) < self._joined[group]:
            event.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(event.wait(), left)
            except TimeoutError:
                break
        return list(self._done.get(group, []))

    def leave(self, group: str) -> None:
        self._active[group] -= 1
        if self._active[group] == 0:  # the last member is done with the group
            for table in (self._joined, self._active, self._done, self._changed):
                table.pop(group, None)


_BOARDS: dict[int, GroupBoard] = {}
_INDEX = itertools.count()


def _plain(value: Any) -> Any:
    """A dataset value as JSON (numpy arrays and scalars included); TypeError otherwise."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise TypeError(type(value).__name__)


def task_of(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The job's task: the sample's dataset fields that are JSON, its chat as ``prompt``."""
    task: dict[str, Any] = {}
    for key, value in fields.items():
        try:
            task[key] = _plain(value)
        except TypeError:
            continue  # images, processor outputs: not a task's business
    if "raw_prompt" in task:
        task["prompt"] = task.pop("raw_prompt")
    return task


@register(NAME)
class AgentariumAgentLoop(AgentLoopBase):
    """One sample, one Agentarium job (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        base = {"trainer_config", "server_manager", "tokenizer", "processor", "dataset_cls"}
        base |= {"data_config", "hf_model_type", "tools", "name"}  # name: the YAML entry's
        options = {k: kwargs.pop(k) for k in list(kwargs) if k not in base}
        super().__init__(*args, **kwargs)
        self.rollout, self.nats = settings_of(options)
        self.response_length = int(self.rollout_config.response_length)
        self.group_size = int(self.rollout_config.n)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        started = time.perf_counter()
        messages = list(kwargs.get("raw_prompt", []))
        group = str(kwargs.get("uid") or f"u{next(_INDEX)}")
        board = _BOARDS.setdefault(id(asyncio.get_running_loop()), GroupBoard())
        index = board.join(group)  # before any await: a batch's samples all join first
        try:
            client = await shared_client(self.rollout, self.nats)
            await self._announce(client)
            job = make_job(
                agent=self.rollout.agent,
                task=task_of(kwargs),
                task_id=group,
                run=self.rollout.run,
                batch_id=f"verl-{SESSION}",
                group_batch_id=GROUP_BATCH,
                sample_index=index,
                options=JobOptions(
                    group_size=max(self.group_size, index + 1),
                    sampling=sampling(
                        sampling_params.get("temperature", 1.0),
                        sampling_params.get("top_p", 1.0),
                        sampling_params.get("top_k", -1),
                        self.response_length,
                    ),
                    deadline_s=self.rollout.deadline_s,
                    metadata={"verl_uid": group},
                ),
            )
            [trajectory] = await client.run([job], timeout=self.rollout.wait_s)
            sample = sample_of(trajectory)
            board.finish(group, sample)
            if sample.usable:
                return self._output(sample, job.job_id, started)
            siblings = await board.settled(group, self.rollout.wait_s)
            usable = [s.reward for s in siblings if s.usable and s.reward is not None]
            imputed = float(np.mean(usable)) if usable else 0.0
            return await self._failed(sample, job.job_id, messages, imputed, started)
        finally:
            board.leave(group)

    async def _announce(self, client: RolloutClient) -> None:
        """Record the servers behind verl's load balancer in the engines KV, once per process."""
        key = (id(asyncio.get_running_loop()), self.rollout.run)
        balancer = getattr(self.server_manager, "_load_balancer", None)  # verl 0.9.1's client
        if key in _ANNOUNCED or balancer is None:
            return
        _ANNOUNCED.add(key)
        try:
            servers = await balancer.get_all_servers.remote()
        except Exception as exc:  # noqa: BLE001 - a view, never a reason to fail the rollout
            log.warning("verl's servers could not be listed", error=repr(exc))
            return
        for address in servers:
            url = address if str(address).startswith("http") else f"http://{address}"
            await record_engine(
                client.js,
                client.topology,
                run=self.rollout.run,
                url=url,
                weight_version=None,
                status="announced",
                target_version=0,
                message="a verl rollout server: run `agentarium consumer --llm` at it",
            )
        log.info("verl servers announced", run=self.rollout.run, servers=list(servers))

    def _extra(self, sample: Sample, job_id: str) -> dict[str, Any]:
        return {
            "turn_scores": [],  # the keys verl's own loops always set
            "tool_rewards": [],
            "agentarium_status": sample.status,
            "agentarium_job_id": job_id,
            "agentarium_weight_version": sample.weight_version,
            # each response token's version of the run, aligned with response_ids (None where
            # the mask is 0): an engine updated mid-rollout samples one response with two
            "agentarium_token_versions": sample.token_versions[: self.response_length],
            "agentarium_metrics": sample.metrics,
        }

    def _output(self, sample: Sample, job_id: str, started: float) -> AgentLoopOutput:
        n = self.response_length
        return AgentLoopOutput(
            prompt_ids=self._cap_text_prompt_length(sample.prompt_ids),
            response_ids=sample.completion_ids[:n],
            response_mask=sample.mask[:n],
            response_logprobs=sample.logprobs[:n],
            reward_score=sample.reward,
            num_turns=2 * max(sample.turns, 1),
            metrics={"generate_sequences": time.perf_counter() - started},
            extra_fields=self._extra(sample, job_id),
        )

    async def _failed(
        self, sample: Sample, job_id: str, messages: list, reward: float, started: float
    ) -> AgentLoopOutput:
        prompt_ids = await self.ct_build_initial_tokens(messages)  # verl's own rendering
        eos = self.tokenizer.eos_token_id
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=[int(eos if eos is not None else 0)],
            response_mask=[0],
            response_logprobs=[0.0],
            reward_score=reward,
            num_turns=2,
            metrics={"generate_sequences": time.perf_counter() - started},
            extra_fields=self._extra(sample, job_id),
        )
