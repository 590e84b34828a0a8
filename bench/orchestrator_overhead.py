"""Overhead of AgentOrchestrator per batch, beside the same batch driven by Ray tasks directly.

One batch = 128 tasks x group size 8 = 1,024 rollouts of a one-call agent against an instant
SGLang-shaped backend (bench/fake_fleet.py, a separate process), so what is measured is the
rollout layer, not a model. Same machine, same backend, same tensorization, side by side:

  orchestrator   initialize_batch_processing (validate, expand, publish 1,024 jobs to
                 JetStream) + wait_for_batch_completion (in-process consumer, concurrency 256,
                 trajectories stored and read back) + generate_training_batch (padded tensors)
  ray tasks      1,024 @ray.remote tasks, each rendering the chat template and POSTing to
                 /generate, ray.get on all of them, then the same tensorization

The sides take turns batch by batch (the order reversed every other round, the first round a
warm-up), in one process with the orchestrator open and Ray started, so each sees the same
machine; the ratio is printed per round too.

    .venv/bin/python bench/orchestrator_overhead.py [--batches 5] [--ray-cpus 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentarium import AgentOrchestrator  # noqa: E402
from agentarium.broker import NatsServer  # noqa: E402
from agentarium.demo.processes import child_env  # noqa: E402
from agentarium.orchestrator import tensorize  # noqa: E402
from agentarium.schemas import LLMCall, Trajectory  # noqa: E402
from agentarium.tiny import ensure_tiny_model  # noqa: E402

TASKS, GROUP = 128, 8
P, R = 64, 8


async def one_call(task: dict, llm) -> float:
    await llm.chat([{"role": "user", "content": task["prompt"]}], max_new_tokens=1)
    return 0.0


def start_fake() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "fake_fleet.py")],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    return proc, proc.stdout.readline().split(" on ", 1)[1].strip()


def tasks() -> list[dict]:
    return [{"task_id": f"t{i}", "prompt": f"repeat {i % 10}"} for i in range(TASKS)]


def orchestrator_batch(orch: AgentOrchestrator) -> dict[str, float]:
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    orch.initialize_batch_processing(tasks(), is_train=True)
    t1 = time.perf_counter()
    counts = orch.wait_for_batch_completion(timeout=300)
    t2 = time.perf_counter()
    batch, _ = orch.generate_training_batch(P, R)
    t3 = time.perf_counter()
    orch.reset_orchestrator_state()
    assert counts["ok"] == TASKS * GROUP and len(batch) == TASKS * GROUP, counts
    return {
        "publish": t1 - t0,
        "wait": t2 - t1,
        "tensorize": t3 - t2,
        "total": t3 - t0,
        "cpu": time.process_time() - cpu0,
    }


def ray_rollout(url: str):
    import ray

    model_dir = str(ensure_tiny_model())

    @ray.remote
    def rollout(task: dict, group_id: str, index: int) -> dict:
        from agentarium.formats.chat_template import ChatTemplate

        template = getattr(rollout, "_template", None) or ChatTemplate.from_model_dir(model_dir)
        rollout._template = template
        ids = template.encode_chat([{"role": "user", "content": task["prompt"]}])
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}
        request = urllib.request.Request(
            f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            data = json.loads(resp.read())
        logprobs = [t[0] for t in data["meta_info"]["output_token_logprobs"]]
        return {
            "prompt_ids": ids,
            "output_ids": data["output_ids"],
            "logprobs": logprobs,
            "group_id": group_id,
            "job_id": f"{group_id}-{index}",
        }

    return rollout


def ray_batch(rollout, task_cpus: float) -> dict[str, float]:
    import ray

    remote = rollout.options(num_cpus=task_cpus)
    t0 = time.perf_counter()
    refs = [remote.remote(t, t["task_id"], i) for t in tasks() for i in range(GROUP)]
    t1 = time.perf_counter()
    results = ray.get(refs)
    t2 = time.perf_counter()
    trajectories = [
        Trajectory(
            job_id=r["job_id"],
            agent="bench",
            task_id=r["group_id"],
            group_id=r["group_id"],
            status="ok",
            reward=0.0,
            calls=[
                LLMCall(
                    prompt_ids=r["prompt_ids"],
                    response_ids=r["output_ids"],
                    response_logprobs=r["logprobs"],
                    finish_reason="stop",
                )
            ],
        )
        for r in results
    ]
    batch, _ = tensorize(trajectories, max_prompt_length=P, max_response_length=R, pad_token_id=256)
    t3 = time.perf_counter()
    assert len(batch) == TASKS * GROUP
    return {"publish": t1 - t0, "wait": t2 - t1, "tensorize": t3 - t2, "total": t3 - t0}


def alternated(url: str, nats_url: str, args: argparse.Namespace) -> dict[str, list[dict]]:
    """Every side's batches in turns, the order reversed every other round; the first round
    warms every side up and is not counted."""
    import ray

    runs: dict[str, list[dict]] = {}
    with AgentOrchestrator(
        [url],
        nats_url=nats_url,
        group_size=GROUP,
        concurrency=256,
        advertise_host="127.0.0.1",
        proxy_host="127.0.0.1",
        progress=False,
    ) as orch:
        orch.register_agent_type("bench", one_call)
        # Ray kills workers beyond num_cpus after 1 s idle: while the other sides take their
        # turns, the 0.1-CPU side's twenty workers would die and restart every round (each
        # importing Ray and loading the tokenizer). Kept warm, as in a run of Ray alone.
        ray.init(
            num_cpus=args.ray_cpus,
            include_dashboard=False,
            log_to_driver=False,
            _system_config={"idle_worker_killing_time_threshold_ms": 3_600_000},
        )
        try:
            rollout = ray_rollout(url)
            sides = {"orchestrator": lambda: orchestrator_batch(orch)}
            for c in args.ray_task_cpus:
                sides[f"ray {c:g} cpu"] = lambda c=c: ray_batch(rollout, c)
            for round_ in range(args.batches + 1):
                order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
                for name in order:
                    result = sides[name]()
                    if round_:
                        runs.setdefault(name, []).append(result)
        finally:
            ray.shutdown()
    return runs


def report(label: str, runs: list[dict[str, float]]) -> None:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    lo, hi = min(r["total"] for r in runs), max(r["total"] for r in runs)
    cpu = (
        f"  {med['cpu'] / (TASKS * GROUP) * 1e6:6.0f} us/rollout, {med['cpu'] / med['total']:.2f} of a core"
        if "cpu" in med
        else ""
    )
    print(
        f"  {label:<16} {med['publish'] * 1e3:9.0f} {med['wait'] * 1e3:9.0f} "
        f"{med['tensorize'] * 1e3:10.0f} {med['total'] * 1e3:9.0f}  ({lo * 1e3:.0f}..{hi * 1e3:.0f})"
        f"  {TASKS * GROUP / med['total']:8.0f}{cpu}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=5, help="measured batches per side")
    parser.add_argument("--ray-cpus", type=int, default=2, help="num_cpus for ray.init")
    parser.add_argument(
        "--ray-task-cpus",
        type=float,
        nargs="+",
        default=[0.1, 1.0],
        help="num_cpus per Ray task, one row each (the seed's agents use 0.1)",
    )
    args = parser.parse_args()
    ensure_tiny_model()
    fake, url = start_fake()
    server = NatsServer(
        store_dir=Path(tempfile.mkdtemp(prefix="agentarium-bench-")) / "nats"
    ).start()
    try:
        runs = alternated(url, server.url, args)
    finally:
        server.stop()
        fake.terminate()
    print(
        f"\n{TASKS} tasks x group {GROUP} = {TASKS * GROUP} rollouts per batch, instant backend, "
        f"median of {args.batches} alternated rounds (ms; total min..max)"
    )
    print(
        f"  {'':<16} {'publish':>9} {'wait':>9} {'tensorize':>10} {'total':>9}  {'':<13}  rollouts/s"
        "  (orchestrator process CPU)"
    )
    for name, side in runs.items():
        report(name, side)
    orch = runs["orchestrator"]
    for name, side in runs.items():
        if name == "orchestrator":
            continue
        ratios = [r["total"] / o["total"] for o, r in zip(orch, side, strict=True)]
        median = statistics.median(r["total"] for r in side) / statistics.median(
            o["total"] for o in orch
        )
        print(
            f"  orchestrator vs {name}: {median:.2f}x rollouts/s (medians); per round "
            + ", ".join(f"{x:.2f}" for x in ratios)
        )


if __name__ == "__main__":
    main()
