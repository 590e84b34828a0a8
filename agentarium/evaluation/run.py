"""``agentarium eval run``: every task K times through the rollout consumers, resumable.

Each (task, attempt) is a job with a deterministic id: ``job_id_for(run, "eval", task, attempt)``
(a retry of a failed pair uses the batch ``eval-retry<n>``, since a job id holds one
trajectory forever). The broker's TRAJECTORIES stream is the record of what ran: a rerun
reads it first, so ``--resume`` after a crash or Ctrl-C publishes only the pairs without an ok
trajectory (jobs still queued are deduplicated, jobs in flight in a killed process are
redelivered), and a finished eval does nothing and says so. The derived run id holds what the
``--llm`` servers serve (agentarium/evaluation/served.py: the local engine's weights checksum,
an SGLang server's model path and weight version), so the same command after the engine's
weights changed (the base model after the trained one) is another eval, never a rerun. ``results.jsonl`` in the output
directory is rebuilt from the stream on every run and appended to as trajectories arrive.

The rollouts run in this process when the agent is given as ``NAME=module:function``, or as
``NAME`` with ``--env ENV`` (the generic function-call agent on that environment), with
``--llm`` SGLang servers, or ``--openai-base`` for an OpenAI-compatible API, text only;
otherwise on whatever ``agentarium consumer`` services serve the agent.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from agentarium.broker import NatsSettings, Topology
from agentarium.consumers import (
    ConsumerService,
    ConsumerSettings,
    ConsumerSpec,
    EnvAgent,
    LLMTarget,
    load_agent,
    load_callable,
    normalize_urls,
)
from agentarium.consumers.agents import env_agent
from agentarium.formats import ChatTemplate
from agentarium.producers import JobOptions, RunSession, TrajectoryReader, make_job, task_id_of
from agentarium.producers import read_task_file as load_task_file
from agentarium.schemas import Job, Sampling, SchemaError, Trajectory, check_name
from agentarium.schemas import settings as schema_settings

from ..models import resolve_model
from ..progress import ProgressBar
from . import report
from .config import EvalConfig
from .served import ServedUnknown, served_weights

log = structlog.get_logger("agentarium.eval")

MANIFEST = "eval.json"
BATCH = "eval"
IDENTITY = ("agent", "tasks_sha256", "k", "run")


class EvalError(ValueError):
    """The eval cannot run as asked; the message says what to change."""


def read_task_file(path: Path) -> tuple[list[dict], list[str], str]:
    """Tasks (JSON lines, or parquet by extension), their ids (task_id/id, else the position)
    and the file's sha256."""
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        tasks = load_task_file(path).tasks
    except OSError as exc:
        raise EvalError(f"cannot read tasks file {path}: {exc}") from None
    except SchemaError as exc:
        raise EvalError(str(exc)) from None
    if not tasks:
        raise EvalError(
            f"{path} has no tasks: write one JSON object per line, or one parquet row per task"
        )
    ids = [task_id_of(t, i) for i, t in enumerate(tasks)]
    seen: dict[str, int] = {}
    for i, task_id in enumerate(ids):
        if task_id in seen:
            raise EvalError(
                f"tasks {seen[task_id]} and {i} of {path} share the id {task_id!r}: "
                "give every task a distinct task_id"
            )
        seen[task_id] = i
    return tasks, ids, digest


def default_run(cfg: EvalConfig, tasks_sha: str, served: Sequence[str] = ()) -> str:
    """The run id: a hash of what makes two evals the same one. ``served`` (what each --llm
    server serves, ``served_weights``) is part of it, so new weights behind the same URL and
    model name are a new eval."""
    model = cfg.openai_base or ",".join(cfg.llm) or "consumers"
    rollout = cfg.rollout
    # Spelled as when --cross-model was one URL and its ratio 0 without it, so an eval keeps
    # the run id it always had (and --resume finds it).
    crosses = list(rollout.cross_model)
    cross = crosses[0] if len(crosses) == 1 else (crosses or None)
    ratio = rollout.cross_ratio if crosses else 0.0
    parts = [cfg.agent_name, tasks_sha, cfg.k, model, rollout.model, cross, ratio]
    if rollout.env:  # an eval without it keeps the run id it always had
        parts += [rollout.env, rollout.max_turns]
    if served:  # likewise: evals on running consumers or an OpenAI API read nothing
        parts += [list(served)]
    if cfg.sampling != Sampling():  # another temperature (or budget) is another eval
        parts += [cfg.sampling.to_wire(binary=False)]
    blob = json.dumps(parts)
    return f"eval-{cfg.agent_name}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"[:128]


def job_for(run: str, task: dict, task_id: str, attempt: int, retry: int, cfg: EvalConfig) -> Job:
    batch = BATCH if retry == 0 else f"{BATCH}-retry{retry}"
    return make_job(
        agent=cfg.agent_name,
        task=task,
        task_id=task_id,
        run=run,
        batch_id=batch,
        group_batch_id=BATCH,  # a retry stays in its task's group
        sample_index=attempt,
        options=JobOptions(
            group_size=cfg.k,
            is_train=False,
            sampling=cfg.sampling,
            deadline_s=cfg.deadline_s,
            metadata={"eval": True, "retry": retry},
        ),
    )


class EvalRun:
    """One invocation of ``eval run``; ``await run()`` returns the process exit code."""

    def __init__(
        self, cfg: EvalConfig, settings: NatsSettings, out=sys.stdout, err=sys.stderr
    ) -> None:
        self.cfg = cfg
        self.agent = cfg.agent_name
        rollout = cfg.rollout
        self.settings = settings
        self.out = out
        self.err = err
        self.tasks, self.task_ids, self.tasks_sha = read_task_file(Path(cfg.tasks_file))
        # What the --llm servers serve is read when the eval runs (``_read_served``): until
        # then a derived run id (and the default out dir) is not known.
        self.served: list[str] = []
        self._identify()
        self.primary_name = rollout.model_name or (
            rollout.model if cfg.openai_base else Path(rollout.model).name
        )
        self.in_process = bool(cfg.agent_fn or rollout.env)
        self.env_agent: EnvAgent | None = None
        if rollout.env and not cfg.agent_fn:  # with exec:CMD, the program acts in the env
            try:
                self.env_agent = env_agent(rollout.env, max_turns=rollout.max_turns)
            except ValueError as exc:
                raise EvalError(f"--env {rollout.env!r}: {exc}") from None
        if rollout.cross_model and not self.in_process:
            raise EvalError(
                "cross-sampling wraps the consumer's backend, so it needs an in-process "
                "consumer: pass --agent NAME=module:function (or --env ENV)"
            )
        if self.in_process and not (cfg.llm or cfg.openai_base):
            raise EvalError(
                "an in-process consumer needs an LLM: pass --llm URL (SGLang or "
                "`agentarium engine`) or --openai-base URL --model NAME"
            )

    def _identify(self) -> None:
        cfg = self.cfg
        self.run_id = cfg.run or default_run(cfg, self.tasks_sha, self.served)
        check_name(self.run_id, "run")
        self.out_dir = Path(cfg.out_dir) if cfg.out_dir else Path("evals") / self.run_id

    async def _read_served(self) -> None:
        """What each --llm server serves (weights checksum, or model path and version), into
        the manifest and the derived run id."""
        if not self.cfg.llm:
            return
        try:
            self.served = await served_weights(normalize_urls(list(self.cfg.llm)))
        except ServedUnknown as exc:
            raise EvalError(str(exc)) from None
        self._identify()

    def manifest(self) -> dict[str, Any]:
        cfg, rollout = self.cfg, self.cfg.rollout
        return {
            "version": 1,
            "agent": self.agent,
            "run": self.run_id,
            "k": cfg.k,
            "tasks_file": str(cfg.tasks_file),
            "tasks_sha256": self.tasks_sha,
            "task_ids": self.task_ids,
            "model": self.primary_name,
            "served": self.served,
            "cross_model": rollout.cross_model_name if rollout.cross_model else None,
            "cross_ratio": rollout.cross_ratio if rollout.cross_model else 0.0,
            "success_threshold": cfg.success_threshold,
            "config": {  # its settings only: never the api_key
                k: str(v) if isinstance(v, Path) else v
                for k, v in schema_settings.flatten(cfg).items()
            },
        }

    def _check_out_dir(self) -> None:
        path = self.out_dir / MANIFEST
        if not path.exists():
            return
        old = json.loads(path.read_text())
        changed = [key for key in IDENTITY if old.get(key) != self.manifest()[key]]
        if "served" in old and old["served"] != self.served:  # older manifests hold none
            changed.append("served weights")
        if changed:
            raise EvalError(
                f"{self.out_dir} holds another eval (different {', '.join(changed)}): "
                "choose another --out"
            )

    def _say(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    async def run(self) -> int:
        cfg = self.cfg
        await self._read_served()
        self._check_out_dir()
        existed = (self.out_dir / MANIFEST).exists()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / MANIFEST).write_text(json.dumps(self.manifest(), indent=2) + "\n")
        session = RunSession(self.settings, self.run_id, name="agentarium-eval")
        consumer = None
        try:
            await session.start()  # its feed starts before the read: nothing is missed
            js, topology = session.js, session.topology
            stored = await TrajectoryReader(js, topology).read(self.run_id, self.agent)
            final, pending = self._plan(stored)
            results_path = self.out_dir / report.RESULTS
            report.write_results(results_path, report.ordered(final, self.task_ids))
            if not pending:
                self._say(
                    f"nothing to do: all {len(self.tasks)} x {cfg.k} (task, attempt) pairs "
                    f"of run {self.run_id} already have a result in {self.out_dir}"
                )
                return self._finish(final)
            if existed and not cfg.resume:
                raise EvalError(
                    f"{self.out_dir} holds an unfinished eval ({len(final)} of "
                    f"{len(self.tasks) * cfg.k} pairs done): pass --resume to run the "
                    f"other {len(pending)}"
                )
            self._say(
                f"eval run {self.run_id}: {len(pending)} of {len(self.tasks) * cfg.k} "
                f"(task, attempt) pairs to run" + (f" ({len(final)} kept)" if final else "")
            )
            if self.in_process:
                consumer = await self._start_consumer(js, topology)
            progress = ProgressBar(len(pending), label="pairs", stream=self.err, every_s=5.0)
            with open(results_path, "a") as sink:

                def on_result(traj: Trajectory) -> None:
                    line = report.result_line(traj, self.primary_name)
                    report.append_result(sink, line)
                    key = (traj.task_id, traj.sample_index)
                    if line["status"] == "ok" or key not in final or final[key]["status"] != "ok":
                        final[key] = line
                    progress.update(traj)

                await session.submit(pending, on_result)
                try:
                    await session.wait(cfg.timeout_s)
                except TimeoutError as exc:
                    self._say(f"error: {exc}")
                finally:
                    progress.close()
            report.write_results(results_path, report.ordered(final, self.task_ids))
            return self._finish(final)
        finally:
            if consumer is not None:
                await consumer.stop()
            await session.close()

    def _plan(self, stored: list[Trajectory]) -> tuple[dict, list[Job]]:
        """Results that stand, and the jobs still to run."""
        by_pair: dict[tuple[str, int], list[Trajectory]] = defaultdict(list)
        for traj in stored:
            by_pair[(traj.task_id, traj.sample_index)].append(traj)
        final: dict[tuple[str, int], dict] = {}
        pending: list[Job] = []
        for task, task_id in zip(self.tasks, self.task_ids, strict=True):
            for attempt in range(self.cfg.k):
                trajs = by_pair.get((task_id, attempt), [])
                ok = [t for t in trajs if t.ok]
                if ok:
                    final[(task_id, attempt)] = report.result_line(ok[0], self.primary_name)
                elif trajs and not self.cfg.resume:
                    final[(task_id, attempt)] = report.result_line(trajs[-1], self.primary_name)
                else:
                    pending.append(
                        job_for(self.run_id, task, task_id, attempt, len(trajs), self.cfg)
                    )
        return final, pending

    async def _start_consumer(self, js: Any, topology: Topology) -> ConsumerService:
        cfg, rollout = self.cfg, self.cfg.rollout
        assert self.in_process, "run() starts an in-process consumer only with agent_fn or env"
        fn = self.env_agent or load_agent(cfg.agent_fn or "", rollout.program, rollout.env)
        reward_fn = load_callable(rollout.reward, "reward function") if rollout.reward else None
        if cfg.openai_base:
            target = LLMTarget(
                openai_base=cfg.openai_base.rstrip("/"),
                openai_model=rollout.model,
                api_key=cfg.api_key,
            )
            template, model_dir = None, None
        else:
            target = LLMTarget(urls=tuple(normalize_urls(list(cfg.llm))), engine=cfg.llm_engine)
            model_dir = str(resolve_model(rollout.model))
            template = ChatTemplate.from_model_dir(model_dir, tool_fallback=cfg.tool_fallback)
        try:
            cross = rollout.cross(
                openai=bool(cfg.openai_base),
                api_key=cfg.api_key,
                seed=cfg.seed,
                engine=cfg.llm_engine,
            )
        except ValueError as exc:
            raise EvalError(str(exc)) from None
        spec = ConsumerSpec(
            agent=self.agent,
            fn=fn,
            target=target,
            model_dir=model_dir,
            model_name=self.primary_name,
            reward_fn=reward_fn,
            cross=cross,
            settings=ConsumerSettings.of(
                concurrency=cfg.concurrency,
                proxy_host="127.0.0.1",
                advertise_host="127.0.0.1",
                attempts=cfg.attempts,
                ack_wait_s=cfg.ack_wait_s,
                tool_fallback=cfg.tool_fallback,
                worker_id=f"{self.run_id}-{self.agent}"[:120],
            ),
        )
        service = ConsumerService(js, topology, spec, template=template)
        return await service.start()

    def _finish(self, final: dict) -> int:
        cfg = self.cfg
        summary = report.summarize(
            final, k=cfg.k, tasks=len(self.tasks), success_threshold=cfg.success_threshold
        )
        summary["run"] = self.run_id
        (self.out_dir / report.SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
        title = f"eval {self.run_id}: agent {self.agent} ({self.out_dir})"
        print(report.format_table(summary, title=title), file=self.out, flush=True)
        return 0 if summary["missing"] == 0 else 1


def print_summary(out_dir: Path, out=sys.stdout) -> int:
    """``eval summary DIR``: the table again, from results.jsonl and eval.json."""
    manifest_path = out_dir / MANIFEST
    if not manifest_path.exists():
        raise EvalError(f"{out_dir} has no {MANIFEST}: pass the --out directory of an eval run")
    manifest = json.loads(manifest_path.read_text())
    final = report.final_results(report.read_results(out_dir / report.RESULTS))
    summary = report.summarize(
        final,
        k=manifest["k"],
        tasks=len(manifest["task_ids"]),
        success_threshold=manifest.get("success_threshold", 1.0),
    )
    title = f"eval {manifest['run']}: agent {manifest['agent']} ({out_dir})"
    print(report.format_table(summary, title=title), file=out, flush=True)
    return 0


def run_eval(cfg: EvalConfig, settings: NatsSettings) -> int:
    return asyncio.run(EvalRun(cfg, settings).run())
