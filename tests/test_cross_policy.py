"""Cross-policy sampling in training rollouts: a consumer sends a fraction of the LLM calls to a
second model sharing the policy's tokenizer (checked at start), each call records who generated
it, and the trainer keeps the other model's tokens as context: masked out of the loss, out of
staleness and out of the importance weights."""

from __future__ import annotations

import shutil

import agentlib
import pytest
import torch
from fake_sglang import FakeSGLang
from tokenizers import Tokenizer, models
from trainlib import served

from agentarium.broker import Topology
from agentarium.cli import build_parser
from agentarium.commands import consumer_cmd
from agentarium.consumers import (
    ConsumerService,
    ConsumerSettings,
    ConsumerSpec,
    CrossSamplingError,
    CrossTarget,
    LLMTarget,
    TokenizerMismatch,
)
from agentarium.consumers.backends import SGLangBackend
from agentarium.consumers.backends.cross_sampling import check_same_tokenizer
from agentarium.formats.chat_template import ChatTemplate
from agentarium.producers import TaskProducer, TrajectoryReader
from agentarium.schemas import LLMCall, Trajectory, decode, encode
from agentarium.trainer.batch import Sample, build_rows, collate
from agentarium.trainer.groups import BUFFERED, GroupBuffer, Selection
from agentarium.trainer.rows import refusal, rows_of

pytestmark = pytest.mark.kernels  # run again under ATEN_CPU_CAPABILITY=avx2 (ops/test.sh)

torch.set_num_threads(1)

POLICY_IDS, OTHER_IDS = [49, 258], [50, 258]


def tokenizer_copy(src, dest):
    """Another model directory with the same tokenizer (another size of one family)."""
    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dest / name)
    return dest


def other_tokenizer(dest):
    """A model directory whose tokenizer gives other tokens the same ids."""
    dest.mkdir()
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(dest / "tokenizer.json"))
    return dest


# ---- the consumer ---------------------------------------------------------------------------


async def test_cross_sampled_calls_record_which_model_and_version(js, tiny_dir, tmp_path):
    # the policy's engine is at version 3; the other model is a stock server ("default" = 0)
    policy = FakeSGLang(
        output_ids=POLICY_IDS,
        text="1",
        weight_version=served("xpol", 3),
        tokenizer_path=str(tiny_dir),
    )
    other = FakeSGLang(
        output_ids=OTHER_IDS,
        text="2",
        tokenizer_path=str(tokenizer_copy(tiny_dir, tmp_path / "big")),
    )
    for server in (policy, other):
        await server.start()
    spec = ConsumerSpec(
        agent="xpol",
        fn=agentlib.three_turns,
        target=LLMTarget(urls=(policy.url,)),
        cross=CrossTarget(target=LLMTarget(urls=(other.url,)), ratio=0.5, name="big", seed=3),
        model_dir=str(tiny_dir),
        model_name="tiny",
        settings=ConsumerSettings.of(
            concurrency=1,  # one rollout at a time: the seeded coin gives the same calls each run
            proxy_host="127.0.0.1",
            attempts=1,
            fetch_timeout_s=0.2,
            drain_grace_s=5.0,
        ),
    )
    service = ConsumerService(js, Topology(), spec)
    try:
        await service.start()
        submitted = await TaskProducer(js).submit(
            "xpol", [{"prompt": "p", "n": 1}], run="xpol", group_size=4
        )
        stored = await TrajectoryReader(js).wait_for("xpol", submitted.job_ids, timeout=60)
    finally:
        await service.stop()
        for server in (policy, other):
            await server.close()
    trajectories = [decode(Trajectory, encode(t)) for t in stored.values()]  # over the wire
    calls = [c for t in trajectories for c in t.calls]
    assert len(calls) == 12 and all(t.ok for t in trajectories)
    for call in calls:
        if call.policy:
            assert (call.model, call.backend) == ("tiny", policy.url)
            assert call.weight_version == served("xpol", 3)
            assert call.response_ids == POLICY_IDS
        else:
            assert (call.model, call.weight_version, call.backend) == ("big", "default", other.url)
            assert call.response_ids == OTHER_IDS
    assert sum(c.policy for c in calls) == policy.count > 0
    assert sum(not c.policy for c in calls) == other.count > 0
    assert any(len({c.policy for c in t.calls}) == 2 for t in trajectories), "no mixed rollout"

    # the trainer: only the policy's tokens carry loss, only its versions count for staleness
    for t in trajectories:
        rows, _ = rows_of(t, "per-call")
        assert sum(sum(r.response_mask) for r in rows) == 2 * sum(c.policy for c in t.calls)
    buffer = GroupBuffer(group_timeout_s=600)
    for t in trajectories:
        assert buffer.add(t, None, now=0.0) == BUFFERED
    (group,), _ = buffer.select(1, Selection(version=5, max_staleness=2))
    # version 5 - 3 = 2: none is stale, though the other model's calls say version 0
    assert buffer.counters.dropped_stale == 0 and set(group.staleness) == {2}
    assert group.samples


async def test_the_consumer_refuses_a_cross_model_with_another_tokenizer(nats_url):
    policy = FakeSGLang(tokenizer_path="/models/tiny", tokenizer_fingerprint="a" * 64)
    other = FakeSGLang(tokenizer_path="/models/llama", tokenizer_fingerprint="b" * 64)
    for server in (policy, other):
        await server.start()
    argv = [
        "consumer", "--agent", "toy=agentarium.examples.toy:rollout", "--llm", policy.url,
        "--cross-model", other.url, "--cross-model-name", "llama", "--cross-ratio", "0.3",
        "--burst", "--nats-url", nats_url,
    ]  # fmt: skip
    args = build_parser().parse_args(argv)
    config, source = consumer_cmd.config_from_args(args)
    assert (
        config.rollout.cross_model,
        config.rollout.cross_model_name,
        config.rollout.cross_ratio,
    ) == (
        (other.url,),
        "llama",
        0.3,
    )
    try:
        with pytest.raises(CrossSamplingError) as refused:
            await consumer_cmd.consume(args, config, source)
    finally:
        for server in (policy, other):
            await server.close()
    message = str(refused.value)
    for part in (
        "'llama'",
        "'tiny'",
        "/models/llama",
        "/models/tiny",
        "aaaaaaaaaaaa",
        "bbbbbbbbbbbb",
    ):
        assert part in message, (part, message)
    assert policy.count == other.count == 0  # refused before any rollout


async def test_the_policy_engine_must_read_the_consumers_tokenizer(js, tiny_dir, tmp_path):
    # not only for cross-sampling: an engine on another model would read the consumer's ids in
    # its own vocabulary and every trajectory would be ok and wrong (tests/test_real_model.py
    # runs it against an engine serving SmolLM2)
    llama = FakeSGLang(tokenizer_path="/models/llama", tokenizer_fingerprint="b" * 64)
    unknown = FakeSGLang(tokenizer_path="Qwen/Qwen3-8B")  # no fingerprint, not a directory here
    same = FakeSGLang(tokenizer_path=str(tokenizer_copy(tiny_dir, tmp_path / "same")))
    for server in (llama, unknown, same):
        await server.start()

    def service(*servers: FakeSGLang) -> ConsumerService:
        spec = ConsumerSpec(
            agent="pol",
            fn=agentlib.three_turns,
            target=LLMTarget(urls=tuple(s.url for s in servers)),
            model_dir=str(tiny_dir),
            model_name="tiny",
            settings=ConsumerSettings.of(concurrency=1, proxy_host="127.0.0.1", proxy_port=0),
        )
        return ConsumerService(js, Topology(), spec)

    try:
        with pytest.raises(TokenizerMismatch) as refused:
            await service(same, llama).start()
        for started in (service(unknown), service(same)):  # nothing to compare, or the same
            await started.start()
            await started.stop()
    finally:
        for server in (llama, unknown, same):
            await server.close()
    message = str(refused.value)
    for part in ("'tiny'", str(tiny_dir), llama.url, "/models/llama", "bbbbbbbbbbbb"):
        assert part in message, (part, message)
    assert same.url not in message and llama.count == same.count == 0


async def test_tokenizer_check_compares_fingerprints_paths_and_says_when_it_cannot(
    tiny_dir, tmp_path
):
    tiny_fp = ChatTemplate.from_model_dir(tiny_dir).fingerprint
    same = str(tokenizer_copy(tiny_dir, tmp_path / "same"))
    other = str(other_tokenizer(tmp_path / "other"))

    async def check(policy_info: dict, cross_info: dict, local: str = "") -> None:
        servers = [FakeSGLang(**policy_info), FakeSGLang(**cross_info)]
        backends = []
        for server in servers:
            await server.start()
            backends.append(SGLangBackend([server.url], retries=0))
        try:
            await check_same_tokenizer(
                *backends, policy_name="tiny", cross_name="big", policy_tokenizer=local
            )
        finally:
            for backend, server in zip(backends, servers, strict=True):
                await backend.aclose()
                await server.close()

    # SGLang reports no fingerprint: computed from tokenizer_path when it is a directory here
    await check({"tokenizer_path": str(tiny_dir)}, {"tokenizer_path": same})
    with pytest.raises(
        CrossSamplingError, match="does not share the tokenizer of the policy 'tiny'"
    ):
        await check({"tokenizer_path": str(tiny_dir)}, {"tokenizer_path": other})
    # the local engine's fingerprint; the policy's side from the consumer's own --model
    await check(
        {"tokenizer_path": "Qwen/Qwen3-8B"},
        {"tokenizer_path": "/elsewhere", "tokenizer_fingerprint": tiny_fp},
        local=str(tiny_dir),
    )
    # the same tokenizer_path on both sides needs no fingerprint
    await check({"tokenizer_path": "Qwen/Qwen3-8B"}, {"tokenizer_path": "Qwen/Qwen3-8B"})
    with pytest.raises(CrossSamplingError, match="cannot check that the cross model 'big'"):
        await check({"tokenizer_path": str(tiny_dir)}, {"tokenizer_path": "Qwen/Qwen3-32B"})


# ---- the trainer ----------------------------------------------------------------------------


def call(prompt, response, logprobs, *, policy=True, **kw) -> LLMCall:
    return LLMCall(
        prompt_ids=prompt,
        response_ids=response,
        response_logprobs=logprobs,
        finish_reason="stop",
        policy=policy,
        model="tiny" if policy else "big",
        **kw,
    )


def traj(calls, reward=1.0, job="j1", group="g", size=1) -> Trajectory:
    return Trajectory(
        job_id=job,
        agent="a",
        task_id=group,
        group_id=group,
        group_size=size,
        status="ok",
        reward=reward,
        calls=calls,
    )


# policy turn, the other model's turn (with a tool result 6 before it), the policy again
MIXED = [
    call([1, 2, 3], [4, 5], [-0.1, -0.2]),
    call([1, 2, 3, 4, 5, 6], [7, 8], [-5.0, -6.0], policy=False, temperature=0.5, top_p=0.9),
    call([1, 2, 3, 4, 5, 6, 7, 8, 9], [10], [-0.3]),
]


def test_rows_mask_exactly_the_cross_sampled_tokens():
    (row,), how = rows_of(traj(MIXED), "concat")
    assert how == "concat" and row.input_ids == list(range(1, 11))
    assert row.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 0, 1]  # 7, 8: the other model's
    assert row.old_logprobs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, 0, 0, -0.3])
    assert row.temperature == [1.0] * 10

    rows, how = rows_of(traj(MIXED), "per-call")
    assert how == "per-call" and [r.call_index for r in rows] == [0, 1, 2]
    assert [r.response_mask for r in rows] == [[1, 1], [0, 0], [1]]
    assert rows[1].response_logprobs == [0.0, 0.0]
    # the trainer builds no row without a policy token
    built, stats = build_rows([Sample(traj(MIXED), 1.0)], multi_turn="per-call")
    assert len(built) == 2 and stats.context_rows == 1 and stats.model_tokens == 3

    # every call cross-sampled: rows of context only
    rows, how = rows_of(traj([MIXED[1]]), "concat")
    assert how == "cross_only" and rows[0].response_mask == [0, 0]

    # verl batches take the same masks; a cross-only rollout is counted
    from agentarium.orchestrator.tensorize import tensorize

    batch, metrics = tensorize(
        [traj(MIXED, 1.0, job="m"), traj([MIXED[1]], 0.0, job="c")],
        max_prompt_length=4,
        max_response_length=8,
        pad_token_id=0,
    )
    assert batch.tensors["response_mask"].tolist() == [
        [1, 1, 0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert batch.tensors["rollout_log_probs"][0, 2:6].tolist() == [0.0] * 4
    assert metrics["batch/cross_only"] == 1 and metrics["batch/model_tokens"] == 3
    # the other model's sampling (top_p 0.9 here) is not the policy's to reproduce
    assert refusal(traj(MIXED)) is None
    assert "top_p=0.9" in refusal(traj([MIXED[0], call([1], [2], [-1.0], top_p=0.9)]))


def test_staleness_and_statistics_count_only_the_policys_calls():
    buffer = GroupBuffer(group_timeout_s=600)

    def member(job, reward, calls):
        assert buffer.add(traj(calls, reward, job=job, size=4), None, now=0.0) == BUFFERED

    # m0's only old call is the other model's ("default" = 0; m1's is not even a version, and
    # neither is foreign: another model's version is never read as the policy's)
    run = "default"  # traj()'s
    member(
        "m0", 1.0, [call([1], [2], [-1.0], weight_version=served(run, 9)), *cross_call("default")]
    )
    member(
        "m1",
        0.0,
        [*cross_call("v2-instruct"), call([1], [2], [-1.0], weight_version=served(run, 10))],
    )
    member("m2", 0.0, [call([1], [2], [-1.0], weight_version=served(run, 4))])  # stale: 10 - 4 > 2
    member("m3", 1.0, cross_call("default"))  # no policy call: statistics only
    (group,), dropped = buffer.select(1, Selection(version=10, max_staleness=2))
    assert not dropped and buffer.counters.invalid == 0
    assert {s.trajectory.job_id: s.staleness for s in group.samples} == {"m0": 1, "m1": 0}
    assert (buffer.counters.dropped_stale, buffer.counters.cross_only) == (1, 1)
    # advantages over all four rewards (mean 0.5, std 0.577): m3 counts, unsampled
    advantages = {s.trajectory.job_id: s.advantage for s in group.samples}
    assert advantages == pytest.approx({"m0": 0.866025, "m1": -0.866025}, abs=1e-5)
    assert sorted(group.other_job_ids) == ["m2", "m3"]

    # a group whose members are all cross-sampled has nothing to train: dropped, counted
    other = GroupBuffer(group_timeout_s=600)
    for i in range(2):
        other.add(traj(cross_call("default"), float(i), job=f"c{i}", group="h", size=2), None, 0.0)
    chosen, dropped = other.select(1, Selection(version=0, max_staleness=2))
    assert not chosen and [g.group_id for g in dropped] == ["h"]
    assert other.counters.cross_only == 2 and other.counters.groups_used == 0


def cross_call(version: str) -> list[LLMCall]:
    return [call([1], [3], [-2.0], policy=False, weight_version=version)]


def test_importance_weights_exclude_the_cross_sampled_tokens():
    from agentarium.tiny import ensure_tiny_model
    from agentarium.trainer.step import StepSettings, Totals, forward_backward, load_model

    model = load_model(ensure_tiny_model(), "cpu")
    prompt = [257, 40, 41]

    def trajectory(cross_logprobs: list[float], cross_policy: bool = False) -> Trajectory:
        first = call(prompt, [48, 49], [-1.5, -2.5])
        second = call(
            [*prompt, 48, 49, 60], [70, 71], cross_logprobs, policy=cross_policy, temperature=1.0
        )
        last = call([*prompt, 48, 49, 60, 70, 71, 61], [52, 258], [-1.0, -2.0])
        return traj([first, second, last])

    def step(t: Trajectory, tis: bool):
        batch = collate(build_rows([Sample(t, 0.7, staleness=9, tis=tis)])[0], pad_id=256)
        model.zero_grad(set_to_none=True)
        loss, sums = forward_backward(model, None, batch, StepSettings(), Totals.of(batch), "cpu")
        return loss, sums, [p.grad.clone() for p in model.parameters()]

    for tis in (False, True):  # the ratio, and the truncated IS weights of a stale row
        base = step(trajectory([-0.5, -0.7]), tis)
        wild = step(trajectory([-40.0, 3.0]), tis)  # another model's log-probs: never read
        assert base[1].tokens == wild[1].tokens == 4  # the policy's four tokens only
        # No tolerance: the cross-sampled tokens' log-probs reach the loss only through
        # torch.where(mask, ..., 0) (trainer/grpo.py aggregate), which puts exact zeros in their
        # place, so both runs sum the same numbers on the same shapes with the same kernels:
        # bitwise equal (measured so on both kernel sets). Any difference means they were read.
        assert wild[0] == base[0]
        assert wild[1].ratio == base[1].ratio
        for a, b in zip(base[2], wild[2], strict=True):
            assert torch.equal(a, b)
    # were those tokens the policy's, they would count (and change the loss)
    own = step(trajectory([-40.0, 3.0], cross_policy=True), True)
    assert own[1].tokens == 6 and own[0] != pytest.approx(base[0], abs=1e-4)
