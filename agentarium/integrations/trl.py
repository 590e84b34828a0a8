"""TRL's GRPOTrainer with its rollouts run by Agentarium: a ``rollout_func`` and a weight callback.

    rollouts = AgentariumRollout(RolloutConfig(agent="toy", run="trl1"))
    trainer = GRPOTrainer(
        model=MODEL_DIR, reward_funcs=agent_reward, train_dataset=prompts, args=GRPOConfig(...),
        rollout_func=rollouts, callbacks=[rollouts.weight_sync(model_dir=MODEL_DIR)],
    )

**Rollouts.** TRL calls ``rollouts(prompts, trainer)`` with this process's prompts, each
repeated ``num_generations`` times next to each other (TRL's ``RepeatSampler``). Each run of
equal prompts (at most ``num_generations``) becomes one Agentarium group: one job per sample,
sampled as the trainer's ``GRPOConfig`` says (``temperature``, ``top_p``, ``top_k``,
``max_completion_length``), published through the producer SDK and awaited. The agent gets
``{"prompt": prompt}`` as its task, or the dataset row holding that prompt when ``rows`` is
given (``rollout_func`` is handed prompts only, so a reward needing the answer reads it from
the row). Job ids are new for every call (a random session id and a call counter), so no
earlier run's trajectory is ever taken for this one.

**What TRL receives** per sample: ``prompt_ids``, ``completion_ids`` and ``logprobs``, and
``env_mask``: a multi-turn rollout is one sequence (``agentarium.integrations.samples``), the
model's tokens 1, tool results and environment turns between them 0. Extra keys, handed by
TRL to every reward function: ``agentarium_reward`` (the agent's reward), ``agentarium_status``,
``agentarium_metrics`` (the agent's metrics dict), ``agentarium_weight_version`` (the oldest
version of the run that sampled the completion), ``agentarium_token_versions`` (each completion
token's own version, aligned with ``completion_ids``: an engine updated mid-rollout samples one
completion with two; None where ``env_mask`` is 0) and ``agentarium_turns``. ``agent_reward`` is the reward function that returns the agent's reward.

**Failed rollouts are never reward 0.** A sample whose rollout ended ``error`` or
``timeout``, never arrived, or is not one sequence gets ``agentarium_reward`` None, which
``agent_reward`` returns: TRL marks a sample that every reward function scored None
unscorable, keeps it out of its group's mean and std, and gives it advantage 0. Its
completion is one end-of-sequence token with ``env_mask`` 0, so no token of it is in the loss
either (a group's other samples keep their real prompt; a sample of a group where none came
back gets that one token as its prompt too).

**Weights.** ``rollouts.weight_sync(model_dir=...)`` is a ``TrainerCallback`` that publishes the
model after every optimizer step through the trainer's own transports
(``trainer.publisher_for``: the object store by default, which ``agentarium sync`` beside each
engine loads; a shared path; or streaming straight into the engines), as version ``base +
global_step``, ``base`` one above the run's latest version (1 for a new run). At train begin
it publishes the weights TRL starts from as ``base`` (whatever the engines served before: an
earlier run's policy, or this run's before TRL resumed). Before each call's rollouts, the
rollout function waits until every engine of the run serves the last version published (the
engines KV, ``inference.wait_served``), so every step's samples come from the weights TRL just
trained: TRL stays on-policy. One process (TRL without several accelerate processes): the
versions are counted by the process that publishes.

**LoRA.** When TRL's model is a peft LoRA model (``GRPOTrainer(..., peft_config=LoraConfig(...))``
or a ``PeftModel`` handed in), each version is its adapter alone (``trainer.peft_adapter``: the
A and B matrices and the ``LoraConfig``, what ``agentarium trainer --lora-rank`` publishes), not
the merged weights; the version at train begin is TRL's starting adapter. The syncer loads it
with ``/load_lora_adapter`` under the run's name, so the engines serve their base + the adapter
(SGLang serves it to requests that name it: consumers with ``--lora <run>``; the local engine
to every request). A peft model the engines could not serve that way is refused at train begin,
and so is the stream transport (which broadcasts whole tensors).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from transformers import TrainerCallback

from agentarium.broker import NatsSettings
from agentarium.orchestrator.loop_thread import LoopThread
from agentarium.producers import JobOptions, make_job
from agentarium.schemas import Job, Sampling
from agentarium.trainer import TrainerConfig, TrainerProcess, peft_adapter, publisher_for

from .client import RolloutClient
from .config import RolloutConfig, sampling
from .samples import Sample, sample_of

log = structlog.get_logger("agentarium.integrations.trl")

EXTRA_KEYS = (
    "agentarium_reward",
    "agentarium_status",
    "agentarium_metrics",
    "agentarium_weight_version",
    "agentarium_token_versions",
    "agentarium_turns",
)


def agent_reward(completions: list, agentarium_reward: list, **kwargs: Any) -> list:
    """TRL reward function: the agent's reward, None for a failed rollout (TRL leaves it out)."""
    log_metric = kwargs.get("log_metric")
    if log_metric is not None and agentarium_reward:
        failed = sum(r is None for r in agentarium_reward) / len(agentarium_reward)
        log_metric("agentarium/failed_frac", failed)
    return list(agentarium_reward)


def sampling_of(args: Any) -> Sampling:
    """The job's sampling from a GRPOConfig."""
    return sampling(
        args.temperature,
        getattr(args, "top_p", 1.0) or 1.0,
        getattr(args, "top_k", 0),
        getattr(args, "max_completion_length", None) or 256,
    )


def _key(prompt: Any) -> str:
    return json.dumps(prompt, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def groups_of(prompts: list, size: int) -> list[tuple[int, int]]:
    """(first index, members) of each run of equal prompts, runs cut at ``size``."""
    out: list[tuple[int, int]] = []
    keys = [_key(p) for p in prompts]
    for i, key in enumerate(keys):
        start, members = out[-1] if out else (0, 0)
        if out and members < size and keys[start] == key:
            out[-1] = (start, members + 1)
        else:
            out.append((i, 1))
    return out


@dataclass(frozen=True)
class TaskRows:
    """Dataset rows by their prompt, so each job carries its whole row (its answer included)."""

    rows: dict[str, dict[str, Any]]

    @classmethod
    def of(cls, rows: Iterable[Mapping[str, Any]]) -> TaskRows:
        by_prompt: dict[str, dict[str, Any]] = {}
        for index, row in enumerate(rows):
            if "prompt" not in row:
                raise ValueError(f"row {index} has no 'prompt' column: {sorted(row)}")
            key = _key(row["prompt"])
            if key in by_prompt and by_prompt[key] != dict(row):
                raise ValueError(
                    f"rows {index} and an earlier one share the prompt {row['prompt']!r} but "
                    "differ: a rollout is handed its prompt only, so it could not tell them apart"
                )
            by_prompt[key] = dict(row)
        return cls(by_prompt)

    def task(self, prompt: Any) -> dict[str, Any]:
        row = self.rows.get(_key(prompt))
        if row is None:
            raise ValueError(
                f"prompt {prompt!r} is in none of the rows given to AgentariumRollout: pass the "
                "dataset the trainer samples from"
            )
        return row


class AgentariumRollout:
    """TRL's ``rollout_func`` (see the module docstring); ``close()`` when training is done."""

    def __init__(
        self,
        config: RolloutConfig,
        *,
        settings: NatsSettings | None = None,
        rows: Iterable[Mapping[str, Any]] | None = None,
    ) -> None:
        self.config = config
        self.settings = settings or NatsSettings.from_env()
        self.rows = TaskRows.of(rows) if rows is not None else None
        self.session_id = secrets.token_hex(4)
        self.calls = 0
        self.target_version = 0  # what the engines must serve before the next rollouts
        self._loop: LoopThread | None = None
        self._client: RolloutClient | None = None

    def __repr__(self) -> str:
        return (
            f"<AgentariumRollout agent={self.config.agent!r} run={self.config.run!r} "
            f"calls={self.calls} target_version={self.target_version} {self._client!r}>"
        )

    # ---- the background loop --------------------------------------------------------------
    @property
    def client(self) -> RolloutClient:
        """Connected on first use, on a private event loop thread."""
        if self._client is None:
            loop = LoopThread(name="agentarium-trl")
            client = RolloutClient(self.settings, self.config.run, name="agentarium-trl")
            try:
                loop.call(client.start())
            except BaseException:
                loop.call(client.close(), timeout=30)
                loop.stop()
                raise
            self._loop, self._client = loop, client
        return self._client

    def call(self, coro: Any) -> Any:
        """Run a coroutine on the client's loop and return its result."""
        _ = self.client  # connects on first use
        assert self._loop is not None
        return self._loop.call(coro)

    def close(self) -> None:
        if self._loop is not None:
            if self._client is not None:
                self._loop.call(self._client.close(), timeout=30)
            self._loop.stop()
        self._loop, self._client = None, None

    def __enter__(self) -> AgentariumRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- rollout_func -----------------------------------------------------------------------
    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        training = bool(trainer.model.training)
        size = trainer.num_generations if training else trainer.num_generations_eval
        step = int(trainer.state.global_step)
        groups = groups_of(prompts, size)
        jobs = self.jobs(prompts, groups, sampling_of(trainer.args), training=training, step=step)
        if self.target_version > 0:
            self.wait_served(self.target_version)
        trajectories = self.call(self.client.run(jobs, timeout=self.config.wait_s))
        samples = [sample_of(t) for t in trajectories]
        self._warn_unusable(samples, step)
        return self.output(samples, groups, eos_id=_eos_id(trainer))

    def jobs(
        self,
        prompts: list,
        groups: list[tuple[int, int]],
        sampling: Sampling,
        *,
        training: bool,
        step: int,
    ) -> list[Job]:
        """One job per sample, each run of equal prompts a group, ids fresh for this call."""
        batch_id = f"trl-{self.session_id}-{self.calls}"
        self.calls += 1
        jobs = []
        for g, (start, members) in enumerate(groups):
            prompt = prompts[start]
            task = self.rows.task(prompt) if self.rows is not None else {"prompt": prompt}
            for i in range(members):
                jobs.append(
                    make_job(
                        agent=self.config.agent,
                        task=task,
                        task_id=f"p{g}",
                        run=self.config.run,
                        batch_id=batch_id,
                        sample_index=i,
                        options=JobOptions(
                            group_size=members,
                            is_train=training,
                            sampling=sampling,
                            deadline_s=self.config.deadline_s,
                            metadata={"trl_step": step},
                        ),
                    )
                )
        return jobs

    def wait_served(self, version: int) -> None:
        timeout = self.config.served_timeout_s
        if not self.call(self.client.wait_served(version, timeout)):
            raise TimeoutError(
                f"the engines of run {self.config.run!r} did not serve version {version} within "
                f"{timeout}s: is `agentarium sync --run {self.config.run} --engine URL` running "
                "beside every engine (or the stream transport reaching them)? "
                "`agentarium broker status` shows what each engine serves"
            )

    @staticmethod
    def output(samples: list[Sample], groups: list[tuple[int, int]], *, eos_id: int) -> dict:
        """TRL's dict. An unusable sample: its group's prompt (one EOS without one), one EOS
        token as its completion, env_mask 0, reward None."""
        out: dict[str, list] = {
            "prompt_ids": [],
            "completion_ids": [],
            "logprobs": [],
            "env_mask": [],
            **{key: [] for key in EXTRA_KEYS},
        }
        for start, members in groups:
            group = samples[start : start + members]
            fallback = next((s.prompt_ids for s in group if s.usable), [eos_id])
            for sample in group:
                if sample.usable:
                    out["prompt_ids"].append(sample.prompt_ids)
                    out["completion_ids"].append(sample.completion_ids)
                    out["logprobs"].append(sample.logprobs)
                    out["env_mask"].append(sample.mask)
                    out["agentarium_token_versions"].append(sample.token_versions)
                else:
                    out["prompt_ids"].append(list(fallback))
                    out["completion_ids"].append([eos_id])
                    out["logprobs"].append([0.0])
                    out["env_mask"].append([0])
                    out["agentarium_token_versions"].append([None])
                out["agentarium_reward"].append(sample.reward)
                out["agentarium_status"].append(sample.status)
                out["agentarium_metrics"].append(sample.metrics)
                out["agentarium_weight_version"].append(sample.weight_version)
                out["agentarium_turns"].append(sample.turns)
        return out

    def _warn_unusable(self, samples: list[Sample], step: int) -> None:
        counts: dict[str, int] = {}
        for sample in samples:
            if not sample.usable:
                counts[sample.status] = counts.get(sample.status, 0) + 1
        if counts:
            example = next(s.error for s in samples if not s.usable)
            log.warning(
                "rollouts without a usable sample: reward None (left out by TRL), no loss token",
                step=step,
                of=len(samples),
                example=(example or "")[:300],
                **counts,
            )

    # ---- weights ----------------------------------------------------------------------------
    def weight_sync(
        self,
        *,
        model_dir: str,
        process: TrainerProcess | None = None,
        device: str = "cpu",
    ) -> AgentariumWeightSync:
        """The callback that publishes weights after every optimizer step (``process``: the
        transport, as ``agentarium trainer``'s flags choose it; default the object store)."""
        return AgentariumWeightSync(self, model_dir=model_dir, process=process, device=device)


class AgentariumWeightSync(TrainerCallback):
    """Publishes the model as version ``base + global_step`` after each optimizer step, and
    makes the next rollouts wait until the engines serve it (module docstring, "Weights")."""

    def __init__(
        self,
        rollout: AgentariumRollout,
        *,
        model_dir: str,
        process: TrainerProcess | None = None,
        device: str = "cpu",
    ) -> None:
        self.rollout = rollout
        self.process = process or TrainerProcess()
        self.config = TrainerConfig(
            run=rollout.config.run,
            agent=rollout.config.agent,
            model_dir=str(model_dir),
            device=device,
        )
        self.base = 0
        self.published: list[int] = []
        self.adapter: Any = None  # a peft model's AdapterExport: what is published of it
        self._publisher: Any = None

    def __repr__(self) -> str:
        what = "" if self.adapter is None else f" {self.adapter!r}"
        return f"<AgentariumWeightSync base={self.base} published={self.published[-1:]}{what}>"

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
        self.adapter = peft_adapter(model)
        if self.adapter is not None:  # publisher_for refuses the stream transport for LoRA
            rank = int(self.adapter.config()["r"])
            self.config = dataclasses.replace(self.config, lora_rank=rank)
        make_publisher = publisher_for(self.config, self.process)  # refuses before connecting
        client = self.rollout.client
        self._publisher = make_publisher(client.js, client.topology, self.config)
        if self._publisher is None:  # publish off: the engines keep what they serve
            return
        latest = getattr(self._publisher, "latest_version", None)
        previous = int((self.rollout.call(latest()) if latest is not None else None) or 0)
        # The weights TRL starts from, first: the engines may serve anything until then (an
        # earlier run's policy, or this run's before TRL resumed from a checkpoint).
        start = int(state.global_step)
        self.base = previous + 1 - start
        self._publish(model, previous + 1, start)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
        if self._publisher is None or not state.is_world_process_zero:
            return
        step = int(state.global_step)
        self._publish(model, self.base + step, step)

    def _publish(self, model: Any, version: int, step: int) -> None:
        if model is None:
            raise ValueError("AgentariumWeightSync needs the model: TRL passes it to callbacks")
        weights = model if self.adapter is None else self.adapter
        self.rollout.call(self._publisher.publish(weights, version, step))
        self.published.append(version)
        self.rollout.target_version = version

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any):
        close = getattr(self._publisher, "close", None)  # a streaming publisher leaves its group
        if close is not None:
            self.rollout.call(close())


def _eos_id(trainer: Any) -> int:
    ids = getattr(trainer, "eos_token_ids", None)
    if ids:
        return int(ids[0])
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    return int(tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0)
