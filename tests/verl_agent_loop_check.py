"""Run inside verl's virtualenv by tests/test_verl_agent_loop.py (argv: model dir, out JSON,
the address of verl's server: here the local engine's).

verl's own ``AgentLoopWorker`` (its config composed from verl's ``ppo_trainer.yaml`` with
hydra, as ``verl.trainer.main_ppo`` composes it) generates one batch through the
``agentarium`` loop of ``examples/verl_agent_loop.yaml``: every sample becomes an Agentarium
job that the test's consumer runs on the local engine. Then the same worker generates the
usable samples again through verl's own ``single_turn_agent`` loop, its LLM client replaying
the tokens and log-probs each trajectory recorded. Both DataProtos come out of verl's own
post-processing; they must agree field by field, and the prompt verl renders must be the
prompt the consumer sent. Failed samples, verl's GRPO estimator and DataProto.union (what the
trainer does with the batch next) are checked on the agentarium batch.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import verl
from hydra import compose, initialize_config_dir
from verl import DataProto
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.trainer.ppo import core_algos
from verl.workers.rollout.replica import TokenOutput

ROOT = Path(__file__).resolve().parents[1]
N, PROMPT_LEN, RESPONSE_LEN = 4, 96, 8
PROMPTS = {"a": "repeat 3", "b": "repeat 5", "flaky": "repeat 7"}  # flaky: half its rollouts fail
COMPARED = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids")


def verl_config(model_dir: str):
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(
            config_name="ppo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={model_dir}",
                "actor_rollout_ref.rollout.name=sglang",
                f"actor_rollout_ref.rollout.n={N}",
                f"actor_rollout_ref.rollout.prompt_length={PROMPT_LEN}",
                f"actor_rollout_ref.rollout.response_length={RESPONSE_LEN}",
                "actor_rollout_ref.rollout.calculate_log_probs=true",
                f"actor_rollout_ref.rollout.agent.agent_loop_config_path={ROOT}/examples/verl_agent_loop.yaml",
                "actor_rollout_ref.rollout.agent.default_agent_loop=agentarium",
            ],
        )


def objects(values) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def batch(rows: list[tuple[str, str]], agent_name: str) -> DataProto:
    """verl's generation batch: rows (uid, prompt) already repeated as RayPPOTrainer does."""
    return DataProto.from_dict(
        non_tensors={
            "raw_prompt": objects([[{"role": "user", "content": p}] for _, p in rows]),
            "uid": objects([u for u, _ in rows]),
            "data_source": objects(["toy"] * len(rows)),
            "reward_model": objects([{"ground_truth": p[-1], "style": "rule"} for _, p in rows]),
            "flaky": objects([u == "flaky" for u, _ in rows]),
            "agent_name": objects([agent_name] * len(rows)),
            "priority": np.arange(len(rows), dtype=np.int64),
        }
    )


class Balancer:
    """What the agentarium loop asks of verl's load balancer (a Ray actor there): its servers,
    here the local engine standing in for verl's SGLang server."""

    def __init__(self, address: str) -> None:
        self.get_all_servers = self  # get_all_servers.remote(), as on an actor handle
        self.address = address

    async def remote(self) -> list[str]:
        return [self.address]


class Replay:
    """An LLM client for verl's single-turn loop: the recorded reply of row ``priority``."""

    def __init__(self, calls: dict[int, dict], server: str) -> None:
        self.calls = calls
        self.prompts: dict[int, list[int]] = {}
        self._load_balancer = Balancer(server)  # verl 0.9.1's LLMServerClient attribute

    async def generate(self, request_id, *, prompt_ids, sampling_params, priority=0, **kwargs):
        self.prompts[int(priority)] = list(prompt_ids)
        call = self.calls[int(priority)]
        return TokenOutput(token_ids=call["response_ids"], log_probs=call["logprobs"])


async def trajectories(job_ids: list[str]) -> dict[str, dict]:
    from agentarium.broker import NatsSettings, Topology
    from agentarium.producers import TrajectoryReader

    settings = NatsSettings.from_env()
    nc = await settings.connect(name="verl-check")
    try:
        reader = TrajectoryReader(nc.jetstream(), Topology(settings.prefix))
        out = {}
        for job_id in job_ids:
            t = await reader.get("verl", "toy", job_id)
            assert t is not None, job_id
            out[job_id] = t
        return out
    finally:
        await nc.close()


async def main(model_dir: str, out_path: str, server: str) -> None:
    import agentarium.integrations.verl  # noqa: F401 - registers "agentarium"

    heavy = {
        "agentarium.consumers",
        "agentarium.orchestrator",
        "agentarium.trainer.loop",
        "agentarium.trainer.step",
    }
    assert not heavy & set(sys.modules), heavy & set(sys.modules)  # the light client side only

    config = verl_config(model_dir)
    rows = [(u, p) for u, p in PROMPTS.items() for _ in range(N)]  # repeat(interleave=True)
    replay = Replay({}, server)
    worker = AgentLoopWorker(config, llm_client=replay)
    ours = await worker.generate_sequences(batch(rows, "agentarium"))
    status = list(ours.non_tensor_batch["agentarium_status"])
    job_ids = list(ours.non_tensor_batch["agentarium_job_id"])
    stored = await trajectories(job_ids)

    # verl's own single-turn loop on the same tokens, for every usable sample
    usable = [i for i, s in enumerate(status) if s == "ok"]
    for i in usable:
        call = stored[job_ids[i]].calls[0]
        replay.calls[i] = {
            "response_ids": list(call.response_ids),
            "logprobs": [float(x) for x in call.response_logprobs],
        }
    theirs = await worker.generate_sequences(batch(rows, "single_turn_agent").select_idxs(usable))
    report = {"status": status, "usable": usable, "fields": {}}
    for n, i in enumerate(usable):
        call = stored[job_ids[i]].calls[0]
        assert replay.prompts[i] == list(call.prompt_ids), (i, replay.prompts[i], call.prompt_ids)
        for key in COMPARED:
            a, b = ours.batch[key][i], theirs.batch[key][n]
            assert torch.equal(a, b), (key, i, a.tolist(), b.tolist())
            report["fields"][key] = report["fields"].get(key, 0) + 1
        a, b = ours.batch["rollout_log_probs"][i], theirs.batch["rollout_log_probs"][n]
        assert torch.allclose(a, b), ("rollout_log_probs", i)
    report["fields"]["rollout_log_probs"] = len(usable)

    # rewards: the agent's, at the last response token, as verl places a loop's reward_score
    scores = ours.batch["rm_scores"]
    rewards = ours.batch["rm_scores"].sum(-1).tolist()
    for i in usable:
        assert rewards[i] == stored[job_ids[i]].reward, i
        last = int(ours.batch["attention_mask"][i, PROMPT_LEN:].sum()) - 1
        assert scores[i, last] == rewards[i]
    failed = [i for i, s in enumerate(status) if s != "ok"]
    flaky = [i for i, (u, _) in enumerate(rows) if u == "flaky"]
    ok_flaky = [rewards[i] for i in flaky if i in usable]
    for i in failed:
        assert ours.batch["response_mask"][i].sum() == 0, i  # no loss token
        assert abs(rewards[i] - float(np.mean(ok_flaky))) < 1e-6, (i, rewards[i], ok_flaky)

    # verl's GRPO: the failed samples' advantage is 0, the group's mean is the usable one's
    adv, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=scores,
        response_mask=ours.batch["response_mask"],
        index=ours.non_tensor_batch["uid"],
    )
    for i in failed:
        assert torch.count_nonzero(adv[i]) == 0, i
    report["advantages"] = {str(i): float(adv[i].abs().max()) for i in flaky}

    # the trainer's next move: the repeated input batch (its dataset tensor, RLHFDataset's
    # dummy_tensor in agent-loop mode, and its non-tensors: uid...) united with the generated
    # one; verl asserts that every key both hold is equal
    given = batch(rows, "agentarium")
    given.batch = DataProto.from_dict(tensors={"dummy_tensor": torch.zeros(len(rows), 1)}).batch
    ours.union(given)
    report["rewards"] = rewards
    Path(out_path).write_text(json.dumps(report))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
