"""Evaluation results: one JSON line per (task, attempt), and the summary table built from them.

The summary, over T tasks each attempted K times:
- reward: mean ± std over the K attempts (each attempt's mean over its ok tasks);
- best-of-K: the mean over tasks of the best ok reward among the K attempts;
- pass@1 and pass@K: the unbiased estimator over each task's ok attempts (success = reward
  at least the threshold);
- errors and timeouts: infrastructure failures, counted apart and never scored as 0;
- calls per model, when cross-sampling mixed two models.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from agentarium.consumers import model_of_call
from agentarium.schemas import Trajectory

from ..agent_metrics import pass_at_k

RESULTS = "results.jsonl"
SUMMARY = "summary.json"


def result_line(traj: Trajectory, default_model: str = "") -> dict[str, Any]:
    """What results.jsonl keeps of one trajectory."""
    last = traj.calls[-1] if traj.calls else None
    output = ""
    if last is not None and last.messages:
        output = str(last.messages[-1].get("content") or "")
    error = (traj.error or "").strip().splitlines()
    return {
        "task_id": traj.task_id,
        "attempt": traj.sample_index,
        "job_id": traj.job_id,
        "status": traj.status,
        "reward": traj.reward,
        "metrics": dict(traj.metrics),
        "error": error[-1][:500] if error else None,
        "turns": len(traj.calls),
        "prompt_tokens": sum(len(c.prompt_ids) for c in traj.calls),
        "response_tokens": sum(len(c.response_ids) for c in traj.calls),
        "latency_s": round(max(0.0, traj.finished_at - traj.started_at), 4),
        "models": [model_of_call(c, default_model) for c in traj.calls],
        "output": output[:2000],
    }


def read_results(path: Path) -> list[dict[str, Any]]:
    """results.jsonl, skipping a line cut short by a crash."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def write_results(path: Path, lines: Iterable[dict[str, Any]]) -> None:
    """Replace the file atomically (a crash leaves the old one or the new one)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    os.replace(tmp, path)


def append_result(stream: IO[str], line: dict[str, Any]) -> None:
    stream.write(json.dumps(line) + "\n")
    stream.flush()


def final_results(lines: Iterable[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """One result per (task, attempt): an ok one if there is any, else the latest."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for line in lines:
        key = (str(line["task_id"]), int(line["attempt"]))
        if key not in best or best[key]["status"] != "ok":
            best[key] = line
    return best


def summarize(
    results: dict[tuple[str, int], dict[str, Any]],
    *,
    k: int,
    tasks: int,
    success_threshold: float = 1.0,
) -> dict[str, Any]:
    by_attempt: dict[int, list[float]] = defaultdict(list)
    by_task: dict[str, list[float]] = defaultdict(list)
    status: Counter[str] = Counter()
    models: Counter[str] = Counter()
    for (task_id, attempt), line in results.items():
        status[line["status"]] += 1
        models.update(line.get("models") or [])
        if line["status"] == "ok":
            by_attempt[attempt].append(float(line["reward"]))
            by_task[task_id].append(float(line["reward"]))
    attempt_means = [statistics.fmean(by_attempt[a]) for a in sorted(by_attempt) if by_attempt[a]]
    best = [max(r) for r in by_task.values()]
    summary: dict[str, Any] = {
        "tasks": tasks,
        "k": k,
        "pairs": tasks * k,
        "results": len(results),
        "missing": tasks * k - len(results),
        "ok": status["ok"],
        "errors": status["error"],
        "timeouts": status["timeout"],
        "reward_mean": statistics.fmean(attempt_means) if attempt_means else None,
        "reward_std": statistics.pstdev(attempt_means) if len(attempt_means) > 1 else 0.0,
        "reward_per_attempt": attempt_means,
        f"best_of_{k}": statistics.fmean(best) if best else None,
        "calls_by_model": dict(models),
        "success_threshold": success_threshold,
    }
    for n in sorted({1, k}):
        scored = [
            pass_at_k(len(r), sum(x >= success_threshold for x in r), n)
            for r in by_task.values()
            if len(r) >= n
        ]
        summary[f"pass@{n}"] = statistics.fmean(scored) if scored else None
    return summary


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def format_table(summary: dict[str, Any], *, title: str = "") -> str:
    k = summary["k"]
    rows: list[tuple[str, str]] = [
        ("tasks x attempts", f"{summary['tasks']} x {k} = {summary['pairs']}"),
        (
            "reward",
            f"{_fmt(summary['reward_mean'])} ± {_fmt(summary['reward_std'])}"
            f"  (mean ± std over {k} attempts)",
        ),
        (f"best-of-{k}", _fmt(summary[f"best_of_{k}"])),
    ]
    for n in sorted({1, k}):
        rows.append((f"pass@{n}", _fmt(summary[f"pass@{n}"])))
    rows.append(("ok", str(summary["ok"])))
    rows.append(("errors", str(summary["errors"])))
    rows.append(("timeouts", str(summary["timeouts"])))
    if summary["missing"]:
        rows.append(("missing", f"{summary['missing']} (run again with --resume)"))
    models = summary.get("calls_by_model") or {}
    if len(models) > 1:
        total = sum(models.values())
        rows.append(
            (
                "calls by model",
                " · ".join(
                    f"{name} {n} ({100 * n / total:.1f}%)" for name, n in sorted(models.items())
                ),
            )
        )
    width = max(len(name) for name, _ in rows)
    lines = [title] if title else []
    lines.append(f"{'metric'.ljust(width)}  value")
    lines.append(f"{'-' * width}  {'-' * 24}")
    lines.extend(f"{name.ljust(width)}  {value}" for name, value in rows)
    return "\n".join(lines)


def ordered(
    results: dict[tuple[str, int], dict[str, Any]], task_ids: Sequence[str]
) -> list[dict[str, Any]]:
    """Results in task-file order, attempts ascending."""
    position = {t: i for i, t in enumerate(task_ids)}
    return [
        results[key]
        for key in sorted(results, key=lambda kv: (position.get(kv[0], 1 << 30), kv[1]))
    ]
