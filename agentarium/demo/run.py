"""``agentarium demo``: the whole RL loop on one CPU machine, on embedded defaults.

A local nats-server (JetStream store under --out), the local CPU engine serving the tiny
model, rollout consumers running the toy agent, the GRPO trainer and the weight syncer.
The toy task is "repeat the digit": the prompt names a digit and the reward is 1 when the
reply is that digit, so the right answer depends on the prompt and the best constant
policy scores 0.1 (always answering one digit is right for 1 prompt in 10). The model starts random (~1/263 per token) and learns from GRPO alone.
Tasks are fed continuously, a little ahead of the trainer, so rollouts never stop.

``--model smol`` trains the real model, SmolLM2-135M-Instruct, on few-shot single-digit
addition with an exact-answer reward instead (examples/arithmetic.py, agentarium/demo/real.py:
its defaults), and evaluates it on 20 held-out pairs before feeding and after the last step.

``--model smol --recipe calc`` trains the seed's example instead: a LangChain agent with a
calculator tool on two- and three-digit arithmetic (examples/calculator_agent.py), rank-16 LoRA,
the consumers and evals with ``--tool-fallback`` (SmolLM2's template renders no tools); its plot
adds the fraction of rollouts that called the tool and the held-out evals.
``--task-set repeat,next`` trains one policy on several task families at once: each family is
its own agent name with its own consumer(s), fed in equal proportion, and one trainer started
with one ``--agent`` per family (agentarium/demo/tasks.py); the report gives each task's reward.

``--sync-rollouts`` trains synchronously, the baseline asynchronous RL is measured against: one
step's tasks are released at a time, the next only once the engine serves the weights trained on
the last (read from the engines KV the syncer writes), and the trainer runs with
``--sync-rollouts``.

``--dynamic-sampling`` runs the trainer with DAPO's dynamic sampling: each flat group it drops
is replaced by one it asks for, which the demo's ``GroupRefill`` (one per agent) publishes.

``--lora-rank R`` trains LoRA adapters instead of every weight (on every linear layer and the
output head): the syncer loads each version into the engine as an adapter, and the consumers
ask for it (``--lora <run>``).

``--rollouts-only`` runs just the rollout half: publish a task file, wait for every trajectory.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import nats.errors
import nats.js.errors

from agentarium.broker import (
    NatsServer,
    NatsSettings,
    Topology,
    count_messages,
    provision,
    setup_logging,
)
from agentarium.inference import EngineControl, EngineControlError, max_lora_rank, wait_served
from agentarium.producers import GroupRefill, RunSession, expand_tasks, read_task_file
from agentarium.schemas import check_settings, setting
from agentarium.trainer import DEVICES, OPTIMIZER_STATES, TASK_ADV_NORMS

from ..models import resolve_model
from ..progress import ProgressBar, StatusLine
from .interrupt import STOP
from .processes import Child, ChildExited, check_alive, consumer_argv, start_child, stop_all
from .real import HeldOutEval, Preset, preset_of
from .report import report, task_column
from .tasks import FAMILIES, digit_tasks, parse_task_set, split_groups

# agentarium/examples: a link to the repository's examples/ in a checkout, package data in a wheel
DEFAULT_TASKS = Path(__file__).resolve().parents[1] / "examples" / "toy_tasks.jsonl"
# --lora-rank: every linear layer and the output head; the one-token toy task did not learn in
# 40 steps with adapters on the layers alone (all-linear), and did with the head's (benchmarks)
LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
)


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """The demo's settings; ``agentarium demo --help`` explains each one."""

    out: str = setting(
        "./agentarium-demo",
        help="output directory: broker store, logs, metrics.csv, reward.png (default %(default)s)",
    )
    model: str = setting(
        "tiny",
        metavar="tiny|smol|PATH",
        help="the policy: 'tiny' (random, learns to repeat a digit), 'smol' (SmolLM2-135M-"
        "Instruct, learns few-shot single-digit addition, exact answers, evaluated on held-out "
        "pairs before and after) or a model directory (tiny's task)",
    )
    # None: the model's own default (agentarium/demo/real.py, PRESETS), set in __post_init__,
    # so after construction each holds a value of its type
    recipe: str | None = setting(
        None,
        choices=("add", "calc"),
        help="with --model smol, what it learns: 'add' (few-shot single-digit addition, the "
        "default) or 'calc' (a LangChain agent with a calculator tool, on two- and three-digit "
        "arithmetic: examples/calculator_agent.py; rank-16 LoRA, 12 steps of 2 groups, the "
        "consumers with --tool-fallback; the plot adds the tool-call rate and the held-out evals)",
    )
    steps: int = setting(None, ge=1, help="training steps (default: tiny 300, smol 20, calc 12)")
    minutes: float = setting(
        None, gt=0, help="stop after this long at most (default: tiny 10, smol 20, calc 14)"
    )
    groups_per_step: int = setting(
        None, ge=1, help="GRPO groups per step (default: tiny 16, smol 8, calc 2)"
    )
    group_size: int = setting(
        8, ge=2, help="samples per task, one GRPO group (2 or more: one sample has no baseline)"
    )
    lr: float = setting(None, ge=0, help="learning rate (default: tiny 1e-3, smol 1e-5, calc 3e-4)")
    entropy_coef: float = setting(
        None,
        ge=0,
        help="entropy bonus keeping a random policy exploring until it learns (default: tiny "
        "0.02, smol 0)",
    )
    eval_k: int = setting(
        4, ge=1, help="with --model smol: attempts per held-out task of the base and trained evals"
    )
    max_staleness: int = setting(4, ge=0, help="drop trajectories more than this many versions old")
    ahead: int = setting(2, ge=1, help="steps' worth of tasks kept queued ahead of the trainer")
    consumers: int = setting(1, ge=1, help="consumer processes")
    concurrency: int = setting(64, ge=1, help="rollouts at once per consumer")
    seed: int = setting(0, help="seed for tasks and the trainer")
    digits: str = setting(
        "0123456789",
        help="digits the answers draw from (repeat's prompt names its answer); one digit makes a "
        "micro-task that needs no conditioning (default %(default)s)",
    )
    run: str = setting(
        factory=lambda: f"demo-{int(time.time())}", help="run id (default: demo-<unix time>)"
    )
    agent: str = setting(
        None,
        help="agent function (default: tiny agentarium.examples.toy:rollout, calc "
        "agentarium.examples.calculator_agent:rollout, smol "
        "agentarium.examples.arithmetic:rollout)",
    )
    agent_name: str = setting(
        None, help="agent name on the wire (default: tiny toy, smol add, calc calc)"
    )
    rollouts_only: bool = setting(
        False, help="no training: publish --tasks once and wait for every trajectory"
    )
    tasks: str = setting(
        str(DEFAULT_TASKS),
        help="task file for --rollouts-only: JSON lines, or a .parquet file in verl's format "
        "(default: the toy tasks)",
    )
    # Task families (agent names) trained at once, also as "repeat,next"; empty: the
    # single-task demo on `agent`.
    task_set: tuple[str, ...] = setting(
        (),
        metavar="TASK,TASK",
        help=f"train one policy on these tasks at once, each its own agent (of: "
        f"{', '.join(FAMILIES)}); default: the single-task demo on --agent",
    )
    # The multi-agent trainer's --task-adv-norm (none | token | trajectory); None: its default.
    task_adv_norm: str | None = setting(
        None,
        choices=TASK_ADV_NORMS,
        help="passed to the trainer: per-task advantage normalisation over tokens or "
        "trajectories (default: the trainer's)",
    )
    # Synchronous training: one step's tasks at a time, each batch released once the engine
    # serves the version trained on the previous one (the trainer's --sync-rollouts).
    sync_rollouts: bool = setting(
        False,
        help="synchronous training: one step's tasks at a time, the next released only once the "
        "engine serves the weights trained on the last (the trainer's --sync-rollouts; --ahead "
        "and --max-staleness do not apply)",
    )

    dynamic_sampling: bool = setting(
        False,
        help="the trainer's --dynamic-sampling: flat groups are dropped and the trainer asks "
        "for replacements, which the demo publishes (each step still trains "
        "--groups-per-step groups)",
    )

    lora_rank: int = setting(
        None,
        ge=0,
        help="train LoRA adapters of this rank instead of every weight (the trainer's "
        "--lora-rank): the syncer loads each adapter into the engine and the consumers ask for "
        "it; 0 = full fine-tuning",
    )
    optimizer_state: str = setting(
        "auto",
        choices=("auto", *OPTIMIZER_STATES),
        help="how the trainer keeps AdamW's moments (the trainer's --optimizer-state): fp32, "
        "or fp8 (3 bytes a parameter instead of 8: trainer/optim.py); auto: the trainer's "
        "--memory plan decides (fp8 for --model smol's full fine-tuning)",
    )
    engine: str | None = setting(
        None,
        metavar="URL|vllm",
        help="vllm: start vLLM's CPU build (`agentarium engine --backend vllm`, from its own "
        "virtualenv, built on first use: about 3 minutes) instead of the local CPU engine; "
        "or a running SGLang or vLLM server (or `agentarium engine`) serving --model's "
        "directory (e.g. SGLang on a GPU: bench/gpu_real_model.py), whose kind is asked; the "
        "syncer loads each version into it from --out's weights/ directory, which it must be "
        "able to read",
    )
    trainer_device: str = setting(
        "cpu", choices=DEVICES, help="where the trainer trains (the trainer's --device)"
    )

    def __post_init__(self) -> None:
        if self.recipe is not None and self.model != "smol":
            raise ValueError(f"--recipe {self.recipe} is a recipe of --model smol")
        preset = preset_of(self.model, self.recipe)
        for name in ("steps", "minutes", "groups_per_step", "lr", "entropy_coef", "lora_rank"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(preset, name))
        for name in ("agent", "agent_name"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(preset, name))
        check_settings(self)  # the ranges declared with each setting, once the presets filled in
        if not self.digits or not self.digits.isdigit():
            raise ValueError(f"--digits must be a non-empty string of digits, got {self.digits!r}")
        object.__setattr__(self, "task_set", parse_task_set(self.task_set))
        if self.groups_per_step < len(self.task_set):
            raise ValueError(
                f"groups-per-step ({self.groups_per_step}) must be at least the number of tasks "
                f"in --task-set ({len(self.task_set)}): every step holds groups of each task"
            )
        if self.task_adv_norm not in (None, *TASK_ADV_NORMS):
            raise ValueError(
                f"--task-adv-norm must be one of {', '.join(TASK_ADV_NORMS)}, got {self.task_adv_norm!r}"
            )
        if self.rollouts_only and self.task_set:
            raise ValueError("--rollouts-only publishes --tasks to one agent: drop --task-set")
        if self.rollouts_only and self.sync_rollouts:
            raise ValueError("--rollouts-only trains nothing: drop --sync-rollouts")
        if self.engine not in (None, "vllm") and not self.engine.startswith(
            ("http://", "https://")
        ):
            raise ValueError(f"--engine takes vllm or an http(s) URL, got {self.engine!r}")
        if self.engine == "vllm" and self.lora_rank:
            max_lora_rank(self.lora_rank)  # above vLLM's largest: refused before anything starts
        if self.task_set and self.model == "smol":
            raise ValueError("--task-set trains tiny's digit tasks: drop it with --model smol")

    @property
    def preset(self) -> Preset:
        return preset_of(self.model, self.recipe)

    def agents(self) -> dict[str, str]:
        """Agent name -> module:function of every agent the demo serves."""
        if not self.task_set:
            return {self.agent_name: self.agent}
        return {name: FAMILIES[name].agent for name in self.task_set}


def _step_batches(args: DemoConfig, rng: random.Random, published: int) -> list[tuple[str, list]]:
    """One step's worth of tasks as (agent, tasks) batches."""
    if not args.task_set:  # the single-task demo: one rng draw per task, as it always was
        tasks = args.preset.tasks(rng, args.groups_per_step, f"b{published}", args.digits)
        return [(args.agent_name, tasks)]
    return [
        (name, digit_tasks(rng, n, f"{name}-b{published}", args.digits, name))
        for name, n in split_groups(args.groups_per_step, args.task_set).items()
    ]


def _last_row(path: Path) -> dict | None:
    from agentarium.trainer import read_metrics

    try:
        rows = read_metrics(path)
    except (FileNotFoundError, KeyError, ValueError):
        return None
    return rows[-1] if rows else None


async def _feed_and_watch(
    args: DemoConfig, url: str, out: Path, trainer: Child, children: list[Child]
) -> None:
    # Whatever start-up did is undone in the finally, a Ctrl-C while connecting included (a
    # connection left open on a closed loop prints "Task was destroyed but it is pending!").
    session = RunSession(NatsSettings(url=url), args.run, name="agentarium-demo")
    refills: list[GroupRefill] = []
    display: StatusLine | None = None
    task = asyncio.current_task()
    try:
        await session.start()
        js, topo = session.js, session.topology
        assert session.producer is not None
        producer = session.producer
        rng = random.Random(args.seed)
        # rewritten in place on a terminal, a plain line every 5 s otherwise
        display = StatusLine(
            args.steps,
            fmt="[{bar:24}] step {n_fmt}/{total_fmt} {info}  {elapsed}",
            every_s=5.0,
            stream=sys.stdout,
        )
        metrics = out / "metrics.csv"
        for agent in args.agents() if args.dynamic_sampling else ():
            refill = GroupRefill(
                producer,
                run=args.run,
                agent=agent,
                tasks=_refill_source(args, rng, agent),
                group_size=args.group_size,
            )
            refills.append(await refill.start())
        started = time.monotonic()
        deadline = started + args.minutes * 60
        published_groups = 0
        step = 0
        row = None
        stored, next_count = 0, 0.0
        waiting = (0, time.monotonic())  # (step, since): every job published done, no new step
        while step < args.steps and time.monotonic() < deadline and trainer.proc.poll() is None:
            if task is not None and task.cancelling():
                # Ctrl-C cancelled the feed (STOP.run), but a call swallowed it: 3.11's
                # wait_for, under nats-py's requests, returns a result that arrived in the same
                # loop iteration instead (CPython gh-86296). Stop all the same.
                raise asyncio.CancelledError
            check_alive(children)  # an engine, consumer or syncer gone: an error, not a wait
            if args.sync_rollouts:
                # Synchronous: batch k+1 only once the engine serves version k, the weights
                # trained on batch k (version 0: the base weights, once the run's syncer has
                # recorded them). The wait doubles as the status refresh tick.
                released = published_groups // args.groups_per_step
                if released >= args.steps:
                    await asyncio.sleep(0.5)
                elif await wait_served(js, topo, args.run, released, timeout=0.5, synced=True):
                    for agent, batch in _step_batches(args, rng, published_groups):
                        await producer.submit(
                            agent, batch, run=args.run, group_size=args.group_size
                        )
                    published_groups += args.groups_per_step
            # Stay `ahead` steps in front of the trainer: enough to keep rollouts busy, few
            # enough that trajectories are not many versions stale when they are trained on.
            while not args.sync_rollouts and published_groups < _groups_wanted(args, step, row):
                for agent, batch in _step_batches(args, rng, published_groups):
                    await producer.submit(agent, batch, run=args.run, group_size=args.group_size)
                published_groups += args.groups_per_step
            row = _last_row(metrics) or row
            step = int(row["step"]) if row else 0
            if time.monotonic() >= next_count:  # the display's count: every 5 s at most
                next_count = time.monotonic() + 5.0
                try:
                    stored = await count_messages(
                        js, topo.trajectories_stream, topo.trajectories_filter(args.run)
                    )
                except (nats.errors.TimeoutError, nats.js.errors.Error):
                    # A status line must not end the run: a loaded machine's broker can take
                    # longer than a request's timeout (a smol run in a loaded suite did).
                    pass
            # The feed above replaces the groups the trainer reports dropped, but not all of
            # them under --dynamic-sampling (whose refill replaces only those its selection
            # drops, not a group timed out short of members): with every job published done and no step for three steps'
            # time, the trainer waits for groups that would never come. A step's worth more
            # lets it go on (a multi-task suite run stalled at step 6 of 60 that way, before
            # the feed counted the groups dropped as too stale).
            waiting, starved = _starved(
                waiting,
                step=step,
                done=not args.sync_rollouts and stored >= published_groups * args.group_size,
                step_s=float(row["step_s"]) if row else None,
                now=time.monotonic(),
            )
            if starved:
                for agent, batch in _step_batches(args, rng, published_groups):
                    await producer.submit(agent, batch, run=args.run, group_size=args.group_size)
                published_groups += args.groups_per_step
                next_count = 0.0  # count the new jobs' trajectories from the next tick
            elapsed = time.monotonic() - started
            if row:
                info = (
                    f"v{row['version']} reward {_rewards(row, args.task_set)}  "
                    f"{stored / elapsed:.0f} rollouts/s  stale-dropped {row['dropped_stale']}"
                )
            else:
                info = f"waiting for the first step ({stored} rollouts stored)"
            display.show(step, info)
            if not args.sync_rollouts:
                await asyncio.sleep(0.5)  # a status refresh tick, not a wait for an event
    finally:
        if display is not None:
            display.close()
        for refill in refills:
            await refill.close()
        await session.close()


def _groups_wanted(args: DemoConfig, step: int, row: Mapping[str, str] | None) -> int:
    """How many groups the feed keeps published: ``ahead`` steps' worth beyond the trainer's
    step, plus every group the trainer dropped (too few ok members, flat, every member too
    stale), which no step trains. Under ``--dynamic-sampling`` the trainer's own refill
    replaces the groups its selection drops, so they are not counted twice."""
    wanted = (step + args.ahead) * args.groups_per_step
    if row is None or args.dynamic_sampling:
        return wanted
    return wanted + sum(
        int(value)
        for column, value in row.items()
        if column.startswith("dropped_groups/") and value not in ("", None)
    )


def _starved(
    waiting: tuple[int, float], *, step: int, done: bool, step_s: float | None, now: float
) -> tuple[tuple[int, float], bool]:
    """Whether the trainer waits for groups that will not come: every job published is
    ``done`` and no step came for three steps' time (5 s at least; 30 s before the first).
    ``waiting`` is (step, since when) from the last call; returns the next one with it."""
    if not done or waiting[0] != step:
        return (step, now), False
    if now - waiting[1] > (max(5.0, 3 * step_s) if step_s is not None else 30.0):
        return (step, now), True
    return waiting, False


def _refill_source(args: DemoConfig, rng: random.Random, agent: str):
    """Replacement tasks for the trainer's dynamic sampling, drawn as the feed draws its own."""
    family = agent if args.task_set else "repeat"
    drawn = itertools.count()
    return lambda n: digit_tasks(rng, n, f"{agent}-d{next(drawn)}", args.digits, family)


def _rewards(row: dict, tasks: tuple[str, ...]) -> str:
    """The status line's reward: overall, then each task's where the CSV has its column."""
    received = row.get("reward_mean_received")
    text = f"{float(received):.2f}" if received not in (None, "", "nan") else "-"
    parts = []
    for task in tasks if len(tasks) > 1 else ():
        column = task_column(list(row), task)
        if column and row[column] not in ("", "nan"):
            parts.append(f"{task} {float(row[column]):.2f}")
    return f"{text} ({', '.join(parts)})" if parts else text


async def _rollouts_only(args: DemoConfig, url: str, out: Path) -> dict:
    tasks = read_task_file(args.tasks).tasks  # JSON lines, or parquet by extension
    batch_id, jobs = expand_tasks(args.agent_name, tasks, run=args.run, group_size=args.group_size)
    started = time.monotonic()
    # The same bar as AgentOrchestrator.wait_for_batch_completion draws.
    bar = ProgressBar(len(jobs), label="trajectories", stream=sys.stdout, every_s=5.0)
    async with RunSession(NatsSettings(url=url), args.run, name="agentarium-demo") as session:
        await session.submit(jobs, bar.update)
        print(
            f"published run={args.run} batch={batch_id} jobs={len(jobs)} "
            f"({len(tasks)} tasks x group size {args.group_size})",
            flush=True,
        )
        found = await session.wait()
    bar.close()
    elapsed = time.monotonic() - started
    with open(out / "trajectories.jsonl", "w") as f:
        for traj in found.values():
            f.write(json.dumps(traj.to_wire(binary=False)) + "\n")
    ok = [t for t in found.values() if t.status == "ok"]
    return {
        "trajectories": len(found),
        "ok": len(ok),
        "seconds": round(elapsed, 2),
        "rollouts_per_s": round(len(found) / elapsed, 1),
        "reward_mean": round(sum(t.reward or 0.0 for t in ok) / len(ok), 4) if ok else None,
    }


def run_demo(args: DemoConfig) -> int:
    """Run the demo in the foreground; the exit code: 0 when it trained (or, with
    ``rollouts_only``, stored trajectories).

    Ctrl-C (SIGINT to the whole process group) or SIGTERM at any moment, start-up included:
    every child gets SIGTERM at once and a shared 30 s grace, then SIGKILL; then the broker,
    which sits in a process group of its own so that it outlives its clients' drains (10 s,
    then SIGKILL); then the report. So the demo exits 130 within about 45 s at worst, a few
    seconds when every child drains at once as it should."""
    STOP.install()  # Ctrl-C and SIGTERM, whatever the demo inherited (interrupt.py)
    setup_logging("warning", json=True)  # the demo prints its own progress; children log to files
    # The demo's prompts are toy digits: show them on chat spans (the GenAI conventions' opt-in
    # switch, inherited by every child) unless the user set the switch themselves.
    os.environ.setdefault("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    out = Path(args.out).expanduser().resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # Not reached by the terminal's Ctrl-C (own_group): stopped here, after every child.
    server = NatsServer(store_dir=out / "nats", log_file=logs / "nats-server.log", own_group=True)
    children: list[Child] = []
    started = time.monotonic()
    interrupted = False
    failed: ChildExited | None = None
    evals: HeldOutEval | None = None
    try:
        with STOP.interruptible():
            model_dir = resolve_model(args.model)  # smol: converted once, about a minute
        print(f"model {args.model}: {model_dir}")
        # before starting anything: a server to use, or vLLM's virtualenv to build (minutes)
        external = kind = None
        if args.engine == "vllm":
            kind = "vllm"
            with STOP.interruptible():
                _vllm_ready()
        elif args.engine is not None:
            external, kind = _reachable(args.engine)
        server.start()  # a Ctrl-C meanwhile acts once it is there to stop (15 s at most)
        started = time.monotonic()
        print(f"nats-server (JetStream) at {server.url}, store {out / 'nats'}")
        print(
            f"watch it live: agentarium dashboard --nats-url {server.url}, then open http://127.0.0.1:8266/"
        )
        nats = ["--nats-url", server.url]
        evals = (
            HeldOutEval(args, server.url, model_dir, out, engine_kind=kind or "sglang")
            if args.preset.held_out_eval
            else None
        )
        provisioned = (*args.agents(), *([evals.agent] if evals else []))
        STOP.run(lambda: _provision(server.url, provisioned))
        # The engine and the trainer load torch and the model at the same time (the trainer
        # needs no URL); everything that needs the engine's URL waits for it.
        # A Ctrl-C while a child starts acts once it is in `children` (interrupt.py).
        engine = trainer = None
        if external is None:
            engine = start_child("engine", engine_argv(args, model_dir), logs, watch_ready=True)
            children.append(engine)
        if not args.rollouts_only:
            trainer = start_child("trainer", trainer_argv(args, model_dir, out, server.url), logs)
            children.append(trainer)
        if engine is not None:
            with STOP.interruptible():  # vLLM: 30-40 s to load and warm up on 2 cores
                engine_url = engine.wait_ready(timeout_s=600.0 if kind == "vllm" else 120.0)
            where = "vLLM" if kind == "vllm" else "local engine"
        else:
            assert external is not None  # --engine was given
            engine_url, where = external, "engine"
        agents = args.agents()
        for (name, agent), i in itertools.product(agents.items(), range(args.consumers)):
            argv = consumer_argv(
                f"{name}={agent}",
                engine_url,
                model_dir,
                server.url,
                "--concurrency",
                str(args.concurrency),
                # Stopping, its rollouts are of no use (the trainer stops too), and on a Ctrl-C
                # the engine they wait for stops with them: 5 s, not 30, to drain.
                "--drain-grace",
                "5",
                *(["--lora", args.run] if args.lora_rank else []),
                *(["--tool-fallback"] if args.preset.tool_fallback else []),
                *(["--llm-engine", "vllm"] if kind == "vllm" else []),
            )
            name_i = f"consumer-{i}" if not args.task_set else f"consumer-{name}-{i}"
            children.append(start_child(name_i, argv, logs))
        running = ", ".join(f"{name}={agent}" for name, agent in agents.items())
        print(
            f"{where} at {engine_url}; {args.consumers} consumer(s) per agent running "
            f"{running}; logs in {logs}"
            if args.task_set
            else f"{where} at {engine_url}; {args.consumers} consumer(s) running {args.agent}; logs in {logs}"
        )
        if args.rollouts_only:
            summary = STOP.run(lambda: _rollouts_only(args, server.url, out))
            print(json.dumps(summary))
            print(f"trajectories written to {out / 'trajectories.jsonl'}")
            return 0 if summary["trajectories"] else 1
        sync_argv = [
            "sync",
            "--run",
            args.run,
            "--engine",
            engine_url,
            "--weights-dir",
            str(out / "weights"),
            *nats,
        ]
        children.append(start_child("sync", sync_argv, logs))
        assert trainer is not None
        if evals is not None:  # on the base weights: nothing is fed, so nothing is trained yet
            evals.run("base", engine_url)
        print(
            f"trainer and weight syncer running; run {args.run}: {args.groups_per_step} groups x "
            f"{args.group_size} per step, up to {args.steps} steps or {args.minutes:g} minutes"
        )
        STOP.run(lambda: _feed_and_watch(args, server.url, out, trainer, children))
        check_alive(children)  # the trainer's own exit too: non-zero is a failure
        if evals is not None:
            # the last version on the engine, nothing else running on it
            with STOP.interruptible():
                trainer.terminate(timeout_s=120)  # done at --steps already, or by --minutes
                for child in children:
                    if child.name.startswith("consumer"):
                        child.terminate()
            evals.run("trained", engine_url, after_run=args.run)
        STOP.check()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (STOP): stop, then report what ran
        STOP.ignore()
        interrupted = True
        print("\ninterrupted: stopping the demo's processes", flush=True)
    except ChildExited as exc:  # stop the rest, report what ran, fail
        STOP.ignore()
        failed = exc
        print(f"\nerror: {exc}", file=sys.stderr, flush=True)
    finally:
        STOP.ignore()
        # Every child at once, one grace for all (each already drains on a Ctrl-C: waiting for
        # them one by one added their graces up); the broker last, once no one needs it (the
        # trainer acks its last checkpoint through it).
        stop_all(children, timeout_s=30.0)
        server.stop()
    held_out = {
        label: summary["reward_mean"]
        for label, summary in (evals.summaries.items() if evals else ())
        if summary.get("reward_mean") is not None
    }
    code = report(
        out,
        time.monotonic() - started,
        args.digits,
        args.task_set,
        args.model,
        agent=args.agent_name,
        held_out=held_out,
    )
    if evals is not None and not interrupted and failed is None:
        evals.report()
    return 130 if interrupted else 1 if failed is not None else code


def _reachable(url: str) -> tuple[str, str]:
    """``url`` once its engine answers ``/model_info`` (within a minute: it may still be
    loading), and what it is ("sglang": SGLang or the local engine; "vllm"), else an error
    naming it."""

    async def ask() -> tuple[dict, str]:
        async with EngineControl() as control:
            deadline = time.monotonic() + 60
            while True:
                try:
                    return await control.model_info(url), await control.kind(url)
                except EngineControlError as exc:
                    if exc.status is not None or time.monotonic() > deadline:
                        raise ValueError(
                            f"--engine {url}: no SGLang or vLLM server answers there ({exc})"
                        ) from None
                await asyncio.sleep(1.0)

    info, kind = STOP.run(ask)
    print(f"engine at {url} ({kind}) serves {info.get('model_path', '?')}")
    return url.rstrip("/"), kind


def _vllm_ready() -> None:
    """vLLM's virtualenv, built here when it is not (ops/vllm_venv.sh, minutes): before the
    broker starts, so that a build that fails stops nothing."""
    from agentarium.inference import VllmUnavailable, vllm_python

    try:
        vllm_python(build=False)
    except VllmUnavailable:
        print("building vLLM's virtualenv (ops/vllm_venv.sh: about 3 minutes, 3.5 GB)", flush=True)
        try:
            vllm_python()
        except VllmUnavailable as exc:
            raise ValueError(f"--engine vllm: {exc}") from None


def engine_argv(args: DemoConfig, model_dir: Path) -> list[str]:
    """``agentarium engine``'s arguments for the engine the demo starts: the local one, or
    vLLM (``--engine vllm``), which loads LoRA adapters only when started with them."""
    argv = ["engine", "--model", str(model_dir), "--port", "0"]
    if args.engine != "vllm":
        return argv
    argv += ["--backend", "vllm"]
    if args.lora_rank:
        rank = max_lora_rank(args.lora_rank)  # vLLM takes 8 or 16, not 12
        argv += ["--vllm-arg=--enable-lora", f"--vllm-arg=--max-lora-rank={rank}"]
    return argv


async def _provision(url: str, agents: tuple[str, ...]) -> None:
    nc = await NatsSettings(url=url).connect(name="agentarium-demo")
    try:
        await provision(nc.jetstream(), Topology(), agents=agents)
    finally:  # a Ctrl-C meanwhile too: no connection left pending on a closed loop
        await nc.close()


def lora_targets(args: DemoConfig, model_dir: Path) -> tuple[str, ...]:
    """The demo's LoRA targets; without ``lm_head`` when vLLM serves a model whose output head
    is its own (not tied to the embedding): vLLM 0.32 refuses such an adapter ("expected target
    modules in {...} but received ['lm_head']"), found by the suite's tiny-model vLLM test."""
    if args.engine != "vllm":
        return LORA_TARGETS
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("tie_word_embeddings", True):
        return LORA_TARGETS
    return tuple(m for m in LORA_TARGETS if m != "lm_head")


def trainer_argv(
    args: DemoConfig, model_dir: Path, out: Path, nats_url: str, *, checkpoints: bool = True
) -> list[str]:
    """``agentarium trainer``'s arguments: one ``--agent`` per agent the demo serves; without
    ``checkpoints`` no checkpoint directory (groups are acked at once, as bench/async_vs_sync.py
    measures)."""
    return [
        "trainer",
        "--run",
        args.run,
        *[word for name in args.agents() for word in ("--agent", name)],
        *(["--task-adv-norm", args.task_adv_norm] if args.task_adv_norm else []),
        "--model",
        str(model_dir),
        "--group-size",
        str(args.group_size),
        "--groups-per-step",
        str(args.groups_per_step),
        "--lr",
        str(args.lr),
        "--entropy-coef",
        str(args.entropy_coef),
        "--publish-every",
        "1",
        "--max-staleness",
        str(args.max_staleness),
        *(["--sync-rollouts"] if args.sync_rollouts else []),
        *(["--dynamic-sampling"] if args.dynamic_sampling else []),
        *(["--lora-rank", str(args.lora_rank)] if args.lora_rank else []),
        *(["--optimizer-state", args.optimizer_state] if args.optimizer_state != "auto" else []),
        *(
            ["--max-tokens-per-micro-batch", str(args.preset.max_tokens_per_micro_batch)]
            if args.preset.max_tokens_per_micro_batch
            else []
        ),
        *[
            w
            for m in (lora_targets(args, model_dir) if args.lora_rank else ())
            for w in ("--lora-target-modules", m)
        ],
        "--metrics",
        str(out / "metrics.csv"),
        *(["--checkpoint-dir", str(out / "checkpoints")] if checkpoints else []),
        "--max-steps",
        str(args.steps),
        "--torch-threads",
        "1",
        "--device",
        args.trainer_device,
        "--seed",
        str(args.seed),
        "--nats-url",
        nats_url,
    ]
