"""``sql``: answer questions about a small SQLite database, in the style of AgentBench's DBBench.

Each session gets its own in-memory SQLite database built from the task's tables. The agent
has two tools: ``execute_sql(query)`` runs one statement and shows the rows (at most
``MAX_ROWS``), ``commit_final_answer(answer)`` ends the episode. The reward is 1 when the
answer matches the task's expected values (as a multiset: order is not checked; numbers match
within 0.005, so a mean rounded to two decimals counts) and 0 otherwise; for an update task
(insert, update, delete) the answer is not read: the reward is 1 when the table's rows after
the episode equal the expected rows.

A task (a JSON object, or ``{"index": id}`` of one shipped in ``examples/sql_tasks.jsonl``)::

    {"id": "...", "kind": "select" | "join" | "aggregate" | "update", "question": "...",
     "tables": [{"name": "t", "columns": [{"name": "a", "type": "INTEGER"}, ...],
                 "rows": [[1, "x"], ...]}, ...],
     "answer": [...],                                  # select, join, aggregate
     "expected_table": {"name": "t", "rows": [...]},   # update
     "sql": "..."}                                     # the reference solution (not shown)

Bad actions get a tool message that says what was wrong, never an exception: no tool call,
arguments that are not a JSON object, an unknown tool, SQL that fails or runs over
``QUERY_TIME_S`` of CPU time. The database cannot reach the disk (ATTACH and VACUUM INTO are refused).
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

from agentarium.schemas import Observation, SessionOutcome, StepResult

from .base import Environment

# the repository root in a checkout, the agentarium package in a wheel: both hold examples/
TASKS_FILE = Path(__file__).resolve().parents[1] / "examples" / "sql_tasks.jsonl"
MAX_ROWS = 50  # rows shown per query; the rest are counted, not shown
MAX_TEXT = 8000  # characters of one tool result
MAX_STEPS = 20  # the episode ends (score 0) after this many steps without an answer
QUERY_TIME_S = 1.0
# A session's database may grow to this many bytes (PRAGMA max_page_count): rows an agent
# inserts stay in the worker's memory until the session ends, and one step's time limit alone
# would let 20 steps fill hundreds of MiB per session. A statement past it fails, its changes
# rolled back, and the agent reads why.
MAX_DB_BYTES = 32 * 1024 * 1024
KINDS = ("select", "join", "aggregate", "update")

SYSTEM_PROMPT = (
    "You answer questions about a SQLite database by calling tools. Call execute_sql with one "
    "SQL statement at a time to look at the data or to change it. When you know the answer, "
    "call commit_final_answer with it: a list of the values asked for (one value per row), or "
    "a single value. When the question asks you to change a table (insert, update or delete "
    'rows), make the change with execute_sql, then call commit_final_answer with "done".'
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "execute_sql",
            "description": "Run one SQL statement on the database and see its result rows.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "one SQL statement"}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "commit_final_answer",
            "description": "Give the final answer; this ends the episode.",
            "parameters": {
                "type": "object",
                "properties": {
                    "answer": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": "the values asked for, one per row (a single value is "
                        "a list of one)",
                    }
                },
                "required": ["answer"],
            },
        },
    },
]

NO_TOOL_CALL = (
    "No tool call found. Call execute_sql with a query to look at the database, or "
    "commit_final_answer with your answer."
)


@functools.cache
def load_tasks(path: Path = TASKS_FILE) -> dict[str, dict]:
    """The shipped tasks by id."""
    tasks: dict[str, dict] = {}
    with open(path, encoding="utf-8") as handle:
        for n, line in enumerate(handle, 1):
            if line.strip():
                task = json.loads(line)
                if task["id"] in tasks:
                    raise ValueError(f"{path}:{n}: duplicate task id {task['id']!r}")
                tasks[task["id"]] = task
    return tasks


def _quote(name: str) -> str:
    return '"' + str(name).replace('"', '""') + '"'


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str) and re.fullmatch(
        r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*", value
    ):
        return float(value)
    return None


def same_value(given: Any, expected: Any) -> bool:
    """Numbers within 0.005 (two decimals), text ignoring case and outer spaces, null as null."""
    if expected is None or given is None:
        return expected is None and (
            given is None or str(given).strip().lower() in ("", "none", "null")
        )
    a, b = _number(given), _number(expected)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0051)
    return str(given).strip().lower() == str(expected).strip().lower()


def same_multiset(given: list, expected: list) -> bool:
    if len(given) != len(expected):
        return False
    left = list(given)
    for value in expected:
        match = next((i for i, g in enumerate(left) if same_value(g, value)), None)
        if match is None:
            return False
        left.pop(match)
    return True


def answer_values(answer: Any, expected_len: int) -> list:
    """The committed answer as a list of values: a list as it is; a JSON list in a string read
    as one; a string with commas or line breaks split when several values are expected."""
    if isinstance(answer, (list, tuple)):
        return [v[0] if isinstance(v, (list, tuple)) and len(v) == 1 else v for v in answer]
    if isinstance(answer, str):
        text = answer.strip()
        if text.startswith("["):
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = None
            if isinstance(parsed, list):
                return answer_values(parsed, expected_len)
        if expected_len > 1:
            return [part.strip() for part in re.split(r"[,\n;]", text) if part.strip()]
    return [answer]


def _rows_equal(got: list[tuple], expected: list[list]) -> bool:
    if len(got) != len(expected):
        return False
    left = [list(r) for r in got]
    for row in expected:
        match = next(
            (
                i
                for i, g in enumerate(left)
                if len(g) == len(row) and all(same_value(a, b) for a, b in zip(g, row, strict=True))
            ),
            None,
        )
        if match is None:
            return False
        left.pop(match)
    return True


class SqlEnvironment(Environment):
    """One session: an in-memory SQLite database and one question."""

    name = "sql"

    def __init__(self) -> None:
        self.db: sqlite3.Connection | None = None
        self.task: dict = {}
        self.steps = 0
        self.queries = 0
        self.sql_errors = 0
        self.bad_calls = 0
        self.score = 0.0
        self.answer: Any = None
        self.committed = False

    @classmethod
    def indices(cls) -> list[str]:
        return list(load_tasks())

    # ---- reset ---------------------------------------------------------------------------
    async def reset(self, task: dict) -> Observation:
        if "index" in task and "tables" not in task:
            tasks = load_tasks()
            if task["index"] not in tasks:
                raise LookupError(f"no sql task {task['index']!r} (indices() lists them)")
            task = tasks[task["index"]]
        self.task = _checked(task)
        self.db = _database(self.task["tables"])
        described = "\n".join(
            f"- table {t['name']}: columns "
            + ", ".join(f"{c['name']} {c.get('type', '')}".strip() for c in t["columns"])
            for t in self.task["tables"]
        )
        user = f"{self.task['question']}\n\nThe database has:\n{described}"
        return Observation(
            messages=[
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": user},
            ],
            tools=TOOLS,
            info={"task_id": self.task.get("id", ""), "kind": self.task["kind"]},
        )

    # ---- step ----------------------------------------------------------------------------
    async def step(self, action: dict) -> StepResult:
        if self.db is None:
            raise RuntimeError("step before reset")
        self.steps += 1
        calls = action.get("tool_calls") if isinstance(action, dict) else None
        if not calls or not isinstance(calls, list):
            self.bad_calls += 1
            return self._result([{"role": "user", "content": NO_TOOL_CALL}], reward=None)
        messages = []
        for n, call in enumerate(calls):
            call = call if isinstance(call, dict) else {}
            call_id = str(call.get("id") or f"call_{self.steps}_{n}")
            function = call.get("function")
            function = function if isinstance(function, dict) else {}
            name = str(function.get("name") or "")
            content = await self._call(name, function.get("arguments"))
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}
            )
            if self.committed:
                break  # nothing after the final answer runs
        return self._result(messages, reward=self.score if self.committed else None)

    def _result(self, messages: list, reward: float | None) -> StepResult:
        out_of_steps = not self.committed and self.steps >= MAX_STEPS
        if out_of_steps:
            messages = [
                *messages,
                {"role": "user", "content": f"Out of steps ({MAX_STEPS}) without an answer."},
            ]
        return StepResult(
            messages=messages,
            reward=reward if not out_of_steps else 0.0,
            done=self.committed or out_of_steps,
            info={"step": self.steps},
        )

    async def _call(self, name: str, raw_arguments: Any) -> str:
        if name not in ("execute_sql", "commit_final_answer"):
            self.bad_calls += 1
            return (
                f"error: unknown tool {name!r}; the tools are execute_sql and commit_final_answer"
            )
        arguments = raw_arguments
        if isinstance(raw_arguments, str):
            try:
                arguments = json.loads(raw_arguments) if raw_arguments.strip() else {}
            except ValueError as exc:
                self.bad_calls += 1
                return f"error: the arguments of {name} are not valid JSON ({exc}): write a JSON object"
        if not isinstance(arguments, dict):
            self.bad_calls += 1
            return f"error: the arguments of {name} must be a JSON object"
        if name == "execute_sql":
            query = arguments.get("query")
            if not isinstance(query, str) or not query.strip():
                self.bad_calls += 1
                return 'error: execute_sql needs {"query": "<one SQL statement>"}'
            self.queries += 1
            return await asyncio.to_thread(self._execute, query)
        if "answer" not in arguments and "answers" not in arguments:
            self.bad_calls += 1
            return 'error: commit_final_answer needs {"answer": [...]}'
        self.answer = arguments.get("answer", arguments.get("answers"))
        self.committed = True
        self.score = self._score()
        return "Answer recorded."

    def _execute(self, query: str) -> str:
        assert self.db is not None
        # CPU time of the thread running the query, not wall time: on a loaded machine a
        # query that fills the database ran past a 1 s wall clock before it hit the size cap
        # (tests/test_env_worker.py); the handler runs in that same thread.
        deadline = time.thread_time() + QUERY_TIME_S
        self.db.set_progress_handler(lambda: int(time.thread_time() > deadline), 1000)
        try:
            cursor = self.db.execute(query)
            rows = cursor.fetchmany(MAX_ROWS + 1) if cursor.description else []
        except sqlite3.Error as exc:
            self.sql_errors += 1
            if "interrupted" in str(exc):
                return f"error: the query ran over {QUERY_TIME_S:g} s and was stopped"
            if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
                return (
                    f"error: the database is full: a session's database holds at most "
                    f"{MAX_DB_BYTES // 2**20} MiB; the statement was rolled back (with its "
                    "transaction, if one was open)"
                )
            return f"error: {type(exc).__name__}: {exc}"
        except (OverflowError, ValueError, MemoryError) as exc:  # e.g. a huge integer in text
            self.sql_errors += 1
            return f"error: {type(exc).__name__}: {exc}"
        finally:
            self.db.set_progress_handler(None, 0)
        if cursor.description is None:
            changed = cursor.rowcount if cursor.rowcount >= 0 else 0
            return f"OK: {changed} row(s) changed."
        shown = [tuple(r) for r in rows[:MAX_ROWS]]
        text = repr(shown)
        if len(rows) > MAX_ROWS:
            text += f"\n(only the first {MAX_ROWS} rows are shown)"
        if len(text) > MAX_TEXT:
            text = text[:MAX_TEXT] + f"\n(result cut at {MAX_TEXT} characters)"
        return text

    def _score(self) -> float:
        assert self.db is not None
        task = self.task
        if task["kind"] == "update":
            table = task["expected_table"]
            try:
                got = self.db.execute(f"SELECT * FROM {_quote(table['name'])}").fetchall()
            except sqlite3.Error:
                return 0.0
            return 1.0 if _rows_equal(got, table["rows"]) else 0.0
        expected = list(task["answer"])
        given = answer_values(self.answer, len(expected))
        return 1.0 if same_multiset(given, expected) else 0.0

    # ---- close ---------------------------------------------------------------------------
    async def close(self) -> SessionOutcome:
        if self.db is not None:
            self.db.close()
            self.db = None
        return SessionOutcome(
            score=self.score,
            metrics={
                "committed": float(self.committed),
                "queries": float(self.queries),
                "sql_errors": float(self.sql_errors),
                "bad_calls": float(self.bad_calls),
            },
            info={"task_id": self.task.get("id", ""), "kind": self.task.get("kind", "")},
            steps=self.steps,
        )


def _checked(task: dict) -> dict:
    """The task, or a ValueError saying what is missing (the worker answers it as a bad task)."""
    if not isinstance(task.get("question"), str):
        raise ValueError("an sql task needs a question (a string)")
    tables = task.get("tables")
    if not isinstance(tables, list) or not tables:
        raise ValueError("an sql task needs tables: [{name, columns, rows}, ...]")
    for t in tables:
        if not isinstance(t, dict) or not t.get("name") or not t.get("columns"):
            raise ValueError("each table needs a name and columns [{name, type}]")
    kind = task.get("kind", "select")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "update":
        expected = task.get("expected_table")
        if not isinstance(expected, dict) or "name" not in expected or "rows" not in expected:
            raise ValueError("an update task needs expected_table: {name, rows}")
    elif not isinstance(task.get("answer"), list):
        raise ValueError("a select, join or aggregate task needs answer: [values]")
    return {**task, "kind": kind}


def _database(tables: list[dict]) -> sqlite3.Connection:
    """An in-memory database with ``tables``, which cannot attach or write files, nor grow
    past ``MAX_DB_BYTES``."""
    db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    db.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)  # no ATTACH, no VACUUM INTO a file
    db.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 1_000_000)  # no string or blob over 1 MB
    db.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, 100_000)
    page_size = db.execute("PRAGMA page_size").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {MAX_DB_BYTES // page_size}")
    for t in tables:
        columns = ", ".join(
            f"{_quote(c['name'])} {c.get('type', '')}".strip() for c in t["columns"]
        )
        db.execute(f"CREATE TABLE {_quote(t['name'])} ({columns})")
        marks = ", ".join("?" for _ in t["columns"])
        db.executemany(f"INSERT INTO {_quote(t['name'])} VALUES ({marks})", t.get("rows", []))
    db.set_authorizer(_authorize)
    return db


# PRAGMAs an agent may run: reading the schema. Every other one is refused, since some would
# lift the session's limits (max_page_count, page_size, temp_store, cache_size, mmap_size).
READ_PRAGMAS = frozenset(
    {"table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
     "foreign_key_list"}
)  # fmt: skip
# TEMP objects live in the temp database, which has no page limit of its own here.
_TEMP_CREATES = frozenset(
    {sqlite3.SQLITE_CREATE_TEMP_TABLE, sqlite3.SQLITE_CREATE_TEMP_INDEX,
     sqlite3.SQLITE_CREATE_TEMP_TRIGGER, sqlite3.SQLITE_CREATE_TEMP_VIEW}
)  # fmt: skip


def _authorize(action: int, arg1: str | None, *_: Any) -> int:
    if action in (sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH) or action in _TEMP_CREATES:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_PRAGMA and (arg1 or "").lower() not in READ_PRAGMAS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK
