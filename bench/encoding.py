"""What JSON trajectories cost against msgpack: bytes per trajectory, encode and decode time.

A consumer run with ``--encoding json`` writes its trajectories (and dead letters) as JSON, so
readers in any language need only a NATS client; msgpack packs token ids as int32 and logprobs
as float32 bytes. This measures both encodings of the same trajectories, in process (no
broker): token ids drawn from a 150k vocabulary, logprobs as an engine reports them (float32
values), the chat ``messages`` left out (the same text in both encodings).

    python bench/encoding.py [--calls 8] [--prompt 2000] [--response 200] [--repeat 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from agentarium.schemas import JSON, MSGPACK, LLMCall, Trajectory, decode

VOCAB = 150_000


def make_trajectory(calls: int, prompt: int, response: int, seed: int = 0) -> Trajectory:
    rng = random.Random(seed)
    made = []
    for _ in range(calls):
        logprobs = np.float32([-rng.expovariate(2.0) for _ in range(response)]).tolist()
        made.append(
            LLMCall(
                prompt_ids=[rng.randrange(VOCAB) for _ in range(prompt)],
                response_ids=[rng.randrange(VOCAB) for _ in range(response)],
                response_logprobs=logprobs,
                finish_reason="stop",
                weight_version="run@3:0123456789abcdef",
                backend="http://sglang-0:30000",
                model="policy",
            )
        )
    return Trajectory(
        job_id="0" * 32,
        agent="toy",
        task_id="t0",
        group_id="1" * 32,
        status="ok",
        reward=1.0,
        metrics={"reply_chars": 12.0},
        task={"prompt": "repeat 7", "answer": "7"},
        calls=made,
    )


def median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=8, help="LLM calls per trajectory")
    parser.add_argument("--prompt", type=int, default=2000, help="prompt tokens per call")
    parser.add_argument("--response", type=int, default=200, help="response tokens per call")
    parser.add_argument("--repeat", type=int, default=200, help="timed rounds (median)")
    args = parser.parse_args()
    shapes = [(1, 40, 4), (args.calls, args.prompt, args.response)]
    print("| trajectory | encoding | bytes | encode µs | decode µs |")
    print("|---|---|---|---|---|")
    for calls, prompt, response in shapes:
        t = make_trajectory(calls, prompt, response)
        for enc in (MSGPACK, JSON):
            payload = enc.encode(t)
            assert decode(Trajectory, payload, enc.content_type).calls[0].prompt_ids == (
                t.calls[0].prompt_ids
            )
            encode_us = median_us(lambda enc=enc, t=t: enc.encode(t), args.repeat)
            decode_us = median_us(
                lambda enc=enc, p=payload: decode(Trajectory, p, enc.content_type), args.repeat
            )
            print(
                f"| {calls} × ({prompt} + {response}) tokens | {enc.name} | {len(payload):,} "
                f"| {encode_us:,.0f} | {decode_us:,.0f} |"
            )


if __name__ == "__main__":
    main()
