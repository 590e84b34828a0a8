"""Task files from reasoning-gym's procedural generators, one agent name per family.

    python -m agentarium.examples.reasoning_gym_tasks --family basic_arithmetic --family leg_counting \\
        --n 64 --seed 0 > tasks.jsonl
    agentarium produce --file tasks.jsonl --agent-from data_source --group-size 8 --run rg1

Each line is one task: ``question``, ``answer`` (the reference) and ``metadata`` as
reasoning-gym made them, plus ``family``, ``agent_name`` and ``data_source`` (all three the
family's name, so ``produce --agent-from data_source`` sends every family to its own agent) and
``task_id`` ``<family>-<seed>-<index>``. The same flags give the same file: reasoning-gym's
generators are seeded and procedural, and nothing is downloaded (``pip install
'agentarium[reasoning]'``).

Before a family is written its rows are checked as the agent will see them: after a JSON round
trip, reasoning-gym's own ``score_answer`` must give the reference answer 1.0, so a family whose
scorer needs something JSON cannot carry (``arc_agi``, ``rearc``) is refused here, not
discovered as zero rewards. Families without a reference answer (``answer`` null: puzzles such
as ``rush_hour`` whose scorer checks a proposed solution) are written unchecked.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator

DEFAULT_FAMILIES = ("basic_arithmetic", "leg_counting", "spell_backward")


def family_tasks(family: str, n: int, seed: int) -> Iterator[dict]:
    """``n`` tasks of one reasoning-gym family, as JSON-ready dicts, checked against its scorer."""
    import reasoning_gym

    from agentarium.examples.reasoning_gym_agent import score

    try:
        dataset = reasoning_gym.create_dataset(family, size=n, seed=seed)
    except Exception as exc:  # reasoning-gym raises what its generators raise
        raise ValueError(
            f"reasoning-gym family {family!r} cannot be made with its default settings: {exc!r}"
        ) from exc
    for index in range(n):
        entry = dataset[index]
        task = json.loads(
            json.dumps(
                {
                    "task_id": f"{family}-{seed}-{index}",
                    "agent_name": family,
                    "data_source": family,
                    "family": family,
                    "question": entry["question"],
                    "answer": entry["answer"],
                    "metadata": entry.get("metadata", {}),
                }
            )
        )
        if task["answer"] is not None and score(task, task["answer"]) != 1.0:
            raise ValueError(
                f"reasoning-gym family {family!r}: its scorer does not accept the reference answer "
                f"of {task['task_id']} once the task went through JSON; pick another family"
            )
        yield task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agentarium.examples.reasoning_gym_tasks",
        description="Write reasoning-gym tasks as JSON lines, one agent name per family.",
    )
    parser.add_argument(
        "--family",
        action="append",
        metavar="NAME",
        help="a reasoning-gym dataset name; repeat for several "
        f"(default: {', '.join(DEFAULT_FAMILIES)}); --list shows them all",
    )
    parser.add_argument("--n", type=int, default=64, help="tasks per family (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default %(default)s)")
    parser.add_argument("--out", default="-", help="output file; '-' is stdout (the default)")
    parser.add_argument("--list", action="store_true", help="print every family name and exit")
    args = parser.parse_args(argv)
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        print(
            "error: reasoning-gym is not installed: pip install 'agentarium[reasoning]'",
            file=sys.stderr,
        )
        return 2
    from reasoning_gym.factory import DATASETS

    if args.list:
        print("\n".join(sorted(DATASETS)))
        return 0
    families = args.family or list(DEFAULT_FAMILIES)
    unknown = [f for f in families if f not in DATASETS]
    if unknown:
        print(f"error: unknown family {', '.join(unknown)}: --list shows them", file=sys.stderr)
        return 2
    if args.n < 1:
        print("error: --n must be >= 1", file=sys.stderr)
        return 2
    out = sys.stdout if args.out == "-" else open(args.out, "w")
    try:
        for family in families:
            for task in family_tasks(family, args.n, args.seed):
                out.write(json.dumps(task) + "\n")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
