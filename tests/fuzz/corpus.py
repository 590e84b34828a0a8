"""The fuzzed input corpus: hypothesis strategies for malformed jobs, messages and agents.

``draw(strategy, n)`` runs one derandomized ``@given`` collection pass (fixed seed,
``deadline=None``, a fixed ``max_examples``, generation only) and returns what it generated,
so a test can publish the whole corpus in bulk to one real nats-server and one running worker
instead of paying for a server per example. Every ``Case`` says what was wrong with it and
which words the reason the system gives must contain.
"""

from __future__ import annotations

import json
import math
import re
import string
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import msgpack
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
ASYNC_AGENT, SYNC_AGENT = "fuzz", "fuzzsync"
RUN = "fuzz"  # every job expected to store a trajectory stores it under this run


@contextmanager
def _without_local_constants() -> Iterator[None]:
    """Hypothesis (6.1xx) also draws constants it finds in the local modules loaded so far,
    so what a seeded run generates would depend on what else the test process imported
    (a lone test file and the whole suite would fuzz different inputs). Off while drawing."""
    try:
        from hypothesis.internal.conjecture import providers

        original = providers._get_local_constants
        empty = providers.Constants()
    except (ImportError, AttributeError):  # another hypothesis: nothing to turn off
        yield
        return
    providers._get_local_constants = lambda: empty
    providers.CONSTANTS_CACHE.cache.clear()
    try:
        yield
    finally:
        providers._get_local_constants = original
        providers.CONSTANTS_CACHE.cache.clear()


def draw(strategy: st.SearchStrategy, n: int) -> list:
    """``n`` examples of ``strategy`` (fewer if it has fewer), the same ones on every run."""
    out: list = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(value: Any) -> None:
        out.append(value)

    with _without_local_constants():
        collect()
    return out


@dataclass(frozen=True)
class Case:
    """One input and what must become of it.

    ``outcome``: ``invalid_job`` / ``wrong_subject`` (a dead letter with that reason),
    ``agent_error`` (an error trajectory and a dead letter), ``error`` (an error trajectory),
    ``timeout``, or ``ok``. ``reason``: words, any of which the dead letter's or trajectory's
    error must contain."""

    category: str
    outcome: str
    reason: tuple[str, ...] = ()
    payload: bytes = b""
    headers: dict[str, str] | None = None
    agent: str = ASYNC_AGENT  # whose subject it is published on
    job_id: str = ""  # set: outcomes are found by job id; empty: by the raw payload


# ---- values ---------------------------------------------------------------------------------
NAMES = st.text(alphabet=string.ascii_letters + string.digits + "_-", min_size=1, max_size=24)
JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=16)
)
JSON = st.recursive(
    JSON_SCALARS,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=12,
)
OBJECTS = st.dictionaries(st.text(max_size=8), JSON, max_size=4)
NON_STRINGS = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.booleans(),
    st.lists(st.integers(0, 9), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2),
)
BAD_NAMES = st.one_of(
    st.builds(
        lambda a, sep, b: a + sep + b,
        NAMES,
        st.sampled_from([".", "*", ">", " ", "\t", "\n", "/", "é", "\x00", "..", ".>"]),
        NAMES,
    ),
    st.sampled_from(["", ">", "*", "a.*", " ", "tasks.>"]),
    st.text(min_size=1, max_size=12).map(lambda s: s if not NAME_RE.fullmatch(s) else s + "."),
    st.text(alphabet="ab", min_size=129, max_size=160),
    NON_STRINGS,
)
NOT_INTS = st.one_of(
    st.text(max_size=4),
    st.floats().filter(lambda x: not x.is_integer()),
    st.booleans(),
    st.lists(st.integers(0, 3), max_size=2),
    st.integers(min_value=2**63, max_value=2**64 - 1),  # fits msgpack, not int64
    st.sampled_from([1e300, -1e300, 2.0**64]),
)
NOT_FLOATS = st.one_of(st.text(max_size=4), st.booleans(), st.lists(st.floats(), max_size=2))
NOT_BOOLS = st.one_of(st.integers(-2, 2), st.text(max_size=4), st.floats())
INT64 = st.integers(-(2**63), 2**63 - 1)
NOT_OBJECTS = st.one_of(
    st.lists(JSON, max_size=3), st.text(max_size=8), INT64, st.floats(), st.booleans()
)


# ---- valid jobs -----------------------------------------------------------------------------
LEAN_OBJECTS = st.dictionaries(st.text(max_size=6), JSON_SCALARS, max_size=3)


@st.composite
def lean_job_dicts(draw_: Callable) -> dict:
    """A valid job with little in it: the base a defect is applied to (cheap to draw)."""
    job: dict[str, Any] = {"job_id": "", "agent": "", "task": draw_(LEAN_OBJECTS)}
    job.update(
        draw_(
            st.fixed_dictionaries(
                {},
                optional={
                    "task_id": st.text(max_size=8),
                    "is_train": st.booleans(),
                    "deadline_s": st.floats(30, 600),
                    "sampling": st.fixed_dictionaries({"temperature": st.floats(0, 2)}),
                },
            )
        )
    )
    job["run"] = draw_(NAMES)
    return job


@st.composite
def job_dicts(draw_: Callable, *, run: str | None = None) -> dict:
    """A valid job as a dict (job_id and agent are set by the caller)."""
    job: dict[str, Any] = {"job_id": "", "agent": "", "task": draw_(OBJECTS)}
    size = draw_(st.integers(1, 8))
    optional = draw_(
        st.fixed_dictionaries(
            {},
            optional={
                "task_id": st.text(max_size=12),
                "group_id": st.text(max_size=12),
                "batch_id": st.text(max_size=8),
                "is_train": st.booleans(),
                "metadata": OBJECTS,
                "created_at": st.floats(0, 2e9),
                "deadline_s": st.floats(30, 600),
                "sampling": st.fixed_dictionaries(
                    {},
                    optional={
                        "temperature": st.floats(0, 2),
                        "top_p": st.floats(0.05, 1.0),
                        "top_k": st.just(-1) | st.integers(1, 50),  # 0 is refused (SGLang)
                        "max_new_tokens": st.integers(1, 64),
                        "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2),
                    },
                ),
            },
        )
    )
    job.update(optional)
    if draw_(st.booleans()):
        job["group_size"] = size
        job["sample_index"] = draw_(st.integers(0, size - 1))
    job["run"] = run if run is not None else draw_(NAMES)
    return job


def encode(job: dict, how: str) -> tuple[bytes, dict[str, str] | None]:
    if how == "json":
        return json.dumps(job).encode(), None
    if how == "json-header":
        return json.dumps(job).encode(), {"Content-Type": "application/json"}
    return msgpack.packb(job, use_bin_type=True), None


ENCODINGS = st.sampled_from(["msgpack", "json", "json-header"])


# ---- one defect per job ---------------------------------------------------------------------
@dataclass(frozen=True)
class Defect:
    category: str
    apply: Callable[[dict], None]
    reason: tuple[str, ...]
    encodings: tuple[str, ...] = ("msgpack", "json", "json-header")
    by_job_id: bool = False  # the job still decodes far enough to be found by id


def _set(field: str, value: Any) -> Callable[[dict], None]:
    def apply(job: dict) -> None:
        job[field] = value

    return apply


def _set_sampling(field: str, value: Any) -> Callable[[dict], None]:
    def apply(job: dict) -> None:
        job["sampling"] = {**job.get("sampling", {}), field: value}

    return apply


def _drop(field: str) -> Callable[[dict], None]:
    def apply(job: dict) -> None:
        job.pop(field, None)

    return apply


def _nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = {"k": value} if i % 2 else [value]
    return value


JSON_ONLY = ("json", "json-header")  # ints msgpack cannot pack
MSGPACK_ONLY = ("msgpack",)  # values JSON cannot carry


FIELD_KINDS = (
    "missing",
    "name",
    "str",
    "int",
    "group",
    "bool",
    "deadline",
    "created_at",
    "object",
    "object_deep",
    "object_bigint",
    "object_msgpack",
    "sampling",
    "sampling_type",
    "schema_version",
)


@st.composite
def defects(draw_: Callable, kind: str) -> Defect:
    if kind == "missing":
        field = draw_(st.sampled_from(["job_id", "agent", "task"]))
        return Defect("missing field", _drop(field), (f"job.{field}: required field missing",))
    if kind == "name":
        field = draw_(st.sampled_from(["job_id", "agent", "run"]))
        value = draw_(BAD_NAMES)
        return Defect(f"bad name ({field})", _set(field, value), (f"job.{field}",))
    if kind == "str":
        field = draw_(st.sampled_from(["task_id", "group_id", "batch_id"]))
        return Defect("wrong type", _set(field, draw_(NON_STRINGS)), (f"job.{field}",))
    if kind == "int":
        field = draw_(st.sampled_from(["sample_index", "group_size"]))
        return Defect("wrong type", _set(field, draw_(NOT_INTS)), (f"job.{field}",))
    if kind == "group":
        size = draw_(st.integers(-(2**63), 0) | st.just(0))
        if draw_(st.booleans()):
            return Defect("absurd group", _set("group_size", size), ("job.group_size",))
        good = draw_(st.integers(1, 8))
        index = draw_(st.integers(good, 2**63 - 1) | st.integers(-(2**63), -1))

        def apply(job: dict) -> None:
            job.update(group_size=good, sample_index=index)

        return Defect("absurd group", apply, ("job.sample_index",))
    if kind == "bool":
        return Defect("wrong type", _set("is_train", draw_(NOT_BOOLS)), ("job.is_train",))
    if kind == "deadline":
        value = draw_(
            st.floats(max_value=0.0)
            | st.sampled_from([math.nan, math.inf, -math.inf, 0, -1])
            | NOT_FLOATS
        )
        return Defect("absurd deadline", _set("deadline_s", value), ("job.deadline_s",))
    if kind == "created_at":
        return Defect("wrong type", _set("created_at", draw_(NOT_FLOATS)), ("job.created_at",))
    if kind == "object":
        field = draw_(st.sampled_from(["task", "metadata"]))
        return Defect("wrong type", _set(field, draw_(NOT_OBJECTS)), (f"job.{field}",))
    if kind == "object_deep":
        field = draw_(st.sampled_from(["task", "metadata"]))
        depth = draw_(st.integers(64, 480))  # msgpack packs at most 511 levels
        return Defect("deeply nested", _set(field, {"deep": _nested(depth)}), ("nested",))
    if kind == "object_bigint":
        field = draw_(st.sampled_from(["task", "metadata"]))
        big = draw_(
            st.integers(min_value=2**64, max_value=10**100)
            | st.integers(min_value=-(10**100), max_value=-(2**63) - 1)
        )
        return Defect(
            "number out of range", _set(field, {"n": [big]}), ("64 bits",), encodings=JSON_ONLY
        )
    if kind == "object_msgpack":
        field = draw_(st.sampled_from(["task", "metadata"]))
        value, reason = draw_(
            st.sampled_from(
                [
                    ({1: "int key"}, "object key"),
                    ({b"bytes key": 1}, "object key"),
                    ({"b": b"\x00\xff"}, "JSON values only"),
                    ({"e": msgpack.ExtType(5, b"ext")}, "JSON values only"),
                    ({"t": msgpack.Timestamp(1, 0)}, "JSON values only"),
                    ({"n": None, "inner": {2: [1]}}, "object key"),
                ]
            )
        )
        return Defect(
            "not JSON (msgpack types)", _set(field, value), (reason,), encodings=MSGPACK_ONLY
        )
    if kind == "sampling":
        field, value = draw_(
            st.one_of(
                st.tuples(
                    st.just("temperature"),
                    st.floats(max_value=-1e-9) | st.sampled_from([math.nan, math.inf]),
                ),
                st.tuples(
                    st.just("top_p"),
                    st.floats(max_value=0.0)
                    | st.floats(min_value=1.0, exclude_min=True)
                    | st.just(math.nan),
                ),
                st.tuples(st.just("max_new_tokens"), st.integers(-(2**63), 0) | NOT_INTS),
                st.tuples(st.just("top_k"), NOT_INTS),
                st.tuples(
                    st.just("stop"),
                    st.lists(NON_STRINGS, min_size=1, max_size=3) | INT64 | st.floats(),
                ),
                st.tuples(st.just("temperature"), NOT_FLOATS),
            )
        )
        return Defect("absurd sampling", _set_sampling(field, value), (f"sampling.{field}",))
    if kind == "sampling_type":
        return Defect("wrong type", _set("sampling", draw_(NOT_OBJECTS)), ("job.sampling",))
    assert kind == "schema_version"
    value = draw_(
        st.integers(min_value=2, max_value=2**63 - 1)
        | st.text(max_size=3)
        | st.booleans()
        | st.floats()
    )
    return Defect("wrong schema_version", _set("schema_version", value), ("schema_version",))


@st.composite
def field_cases(draw_: Callable, kind: str) -> Case:
    job = draw_(lean_job_dicts())
    job["job_id"], job["agent"] = "placeholder", ASYNC_AGENT
    defect = draw_(defects(kind))
    defect.apply(job)
    how = draw_(st.sampled_from(defect.encodings))
    payload, headers = encode(job, how)
    return Case(defect.category, "invalid_job", defect.reason, payload, headers)


# ---- whole-message defects --------------------------------------------------------------------
MESSAGE_KINDS = (
    "garbage",
    "msgpack_non_dict",
    "json_non_object",
    "broken_json",
    "invalid_utf8_json",
    "invalid_utf8_msgpack",
    "lone_surrogate",
    "deep_json",
    "deep_msgpack",
    "unhashable_key",
    "content_type",
    "huge_garbage",
)


@st.composite
def message_cases(draw_: Callable, kind: str) -> Case:
    job = draw_(lean_job_dicts())
    job["job_id"], job["agent"] = "placeholder", ASYNC_AGENT
    if kind == "garbage":
        data = draw_(st.binary(max_size=300))
        return Case("garbage bytes", "invalid_job", ("payload", "job."), data)
    if kind == "msgpack_non_dict":
        value = draw_(st.one_of(st.lists(JSON, max_size=4), JSON_SCALARS, st.binary(max_size=20)))
        return Case(
            "msgpack decoding to a non-dict",
            "invalid_job",
            ("payload must be an object/map",),
            msgpack.packb(value, use_bin_type=True),
        )
    if kind == "json_non_object":
        value = draw_(st.one_of(st.lists(JSON, max_size=4), JSON_SCALARS))
        return Case(
            "JSON that is not an object",
            "invalid_job",
            ("payload must be an object/map",),
            json.dumps(value).encode(),
            {"Content-Type": "application/json"},
        )
    if kind == "broken_json":
        text = json.dumps(job)
        cut = draw_(st.integers(1, max(1, len(text) - 1)))
        return Case("broken JSON", "invalid_job", ("not valid JSON",), text[:cut].encode())
    if kind == "invalid_utf8_json":
        bad = draw_(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80"]))
        job["task"] = {"text": "MARK"}
        data = json.dumps(job).encode().replace(b"MARK", bad)
        # \xed\xa0\x80 is a surrogate's encoding: Python's JSON reads it, the check refuses it
        return Case("invalid UTF-8", "invalid_job", ("not valid JSON", "Unicode"), data)
    if kind == "lone_surrogate":  # valid JSON text that no encoder can write back
        field = draw_(st.sampled_from(["task", "metadata", "task_id", "batch_id"]))
        job[field] = {"s": "MARK"} if field in ("task", "metadata") else "MARK"
        data = json.dumps(job).encode().replace(b"MARK", b"\\udc80")
        return Case("invalid UTF-8", "invalid_job", ("Unicode",), data)
    if kind == "invalid_utf8_msgpack":
        bad = draw_(st.sampled_from([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80"]))
        job["task"] = {"text": "MARK"}
        data = msgpack.packb(job, use_bin_type=True).replace(
            b"\xa4MARK", bytes([0xA0 | len(bad)]) + bad
        )
        return Case("invalid UTF-8", "invalid_job", ("not valid msgpack",), data)
    if kind == "deep_json":
        depth = draw_(st.integers(1_000, 100_000))
        data = (
            b'{"job_id":"x","agent":"fuzz","task":' + b'{"a":' * depth + b"1" + b"}" * depth + b"}"
        )
        return Case("deeply nested", "invalid_job", ("nested",), data)
    if kind == "deep_msgpack":
        depth = draw_(st.integers(1_030, 100_000))
        data = b"\x83\xa6job_id\xa1x\xa5agent\xa4fuzz\xa4task" + b"\x91" * depth + b"\xc0"
        return Case("deeply nested", "invalid_job", ("nested",), data)
    if kind == "unhashable_key":
        # a map keyed by an array: msgpack can say it, Python cannot hold it
        key = draw_(st.lists(st.integers(0, 1000), min_size=1, max_size=4))
        data = b"\x81" + msgpack.packb(key) + msgpack.packb(draw_(JSON_SCALARS))
        return Case("msgpack decoding to a non-dict", "invalid_job", ("unhashable",), data)
    if kind == "content_type":
        how, header = draw_(
            st.sampled_from(
                [
                    ("msgpack", "application/json"),
                    ("msgpack", "APPLICATION/JSON; charset=utf-8"),
                    ("json", "application/msgpack"),
                    ("json", "text/plain"),
                    ("json", "application/octet-stream"),
                ]
            )
        )
        payload, _ = encode(job, how)
        kind_named = "JSON" if "json" in header.lower() else "msgpack"
        return Case(
            "wrong content type",
            "invalid_job",
            (f"not valid {kind_named}",),
            payload,
            {"Content-Type": header},
        )
    assert kind == "huge_garbage"
    size = draw_(st.integers(100_000, 1_000_000))
    seed = draw_(st.binary(min_size=16, max_size=16))
    data = b"\xc1" + (seed * (size // 16 + 1))[:size]  # 0xc1: never valid msgpack
    return Case("huge payload", "invalid_job", ("truncated to 65536",), data)


@st.composite
def wrong_subject_cases(draw_: Callable) -> Case:
    job = draw_(lean_job_dicts())
    job["agent"] = draw_(NAMES.filter(lambda n: n not in (ASYNC_AGENT, SYNC_AGENT)))
    payload, headers = encode(job, draw_(ENCODINGS))
    return Case("wrong subject", "wrong_subject", ("does not match its subject",), payload, headers)


# ---- misbehaving agents ---------------------------------------------------------------------
RETURNS = {
    "nan": "the reward is nan",
    "inf": "the reward is inf",
    "-inf": "the reward is -inf",
    "reward_nan": "the reward is nan",
    "reward_inf": "the reward is inf",
    "object": "no reward",
    "generator": "no reward",
    "ndarray": "no reward",
    "huge_int": "too large",
    "string": "no reward",
    "none": "no reward",
    "list": "no reward",
    "set": "no reward",
    "bytes": "no reward",
    "complex": "no reward",
    "reward_property_raises": "the reward property exploded",
    "reward_string": "no reward",
}
EXCEPTIONS = {
    "ValueError": "ValueError",
    "Unprintable": "Unprintable",
    "MemoryError": "MemoryError",
    "KeyboardInterrupt": "KeyboardInterrupt",
    "SystemExit0": "SystemExit",
    "SystemExit3": "SystemExit",
    "SystemExitText": "SystemExit",
    "GeneratorExit": "GeneratorExit",
    "CustomBase": "CustomBase",
    "CancelledError": "CancelledError",
    "StopAsyncIteration": "StopAsyncIteration",
    "TimeoutError": "TimeoutError",
}
BAD_CHATS = {
    "messages_str": "chat messages must be dicts",
    "messages_ints": "chat messages must be dicts",
    "negative_tokens": "max_new_tokens must be >= 1",
    "unknown_option": "unknown sampling option",
    "hot_temperature": "temperature",
    "top_p_zero": "top_p must be in (0, 1]",
}


SYNC_KINDS = ("return", "raise", "hang", "recursion", "junk_metrics", "print")
ASYNC_KINDS = (*SYNC_KINDS, "ignore_cancel", "bad_chat", "stop_iteration", "forgot_await")


@st.composite
def agent_cases(draw_: Callable, kind: str, sync: bool) -> Case:
    """A valid job whose agent misbehaves (the job id is set by the caller)."""
    task: dict[str, Any] = {"do": kind}
    deadline = 600.0
    if kind == "return":
        task["value"] = draw_(st.sampled_from(sorted(RETURNS)))
        outcome, reason = "agent_error", RETURNS[task["value"]]
    elif kind == "raise":
        task["exc"] = draw_(st.sampled_from(sorted(EXCEPTIONS)))
        big = (
            task["exc"] in ("ValueError", "SystemExitText", "CustomBase")
            and draw_(st.integers(0, 9)) == 0
        )
        task["size"] = 3_000_000 if big else 0
        outcome = "agent_error"
        reason = "characters cut" if big else EXCEPTIONS[task["exc"]]
    elif kind == "hang":
        deadline = draw_(st.floats(0.2, 0.8))
        # The sync one sleeps past its deadline, then returns: by a margin that a loaded
        # machine stalling the worker's event loop for seconds does not eat.
        task["for_s"] = deadline + 4.0
        outcome, reason = "timeout", "deadline"
    elif kind == "ignore_cancel":
        deadline = draw_(st.floats(0.2, 0.5))
        task["for_s"] = draw_(st.floats(4.0, 5.0))  # past the deadline and its 1 s grace
        outcome, reason = "timeout", "deadline"
    elif kind == "bad_chat":
        task["call"] = draw_(st.sampled_from(sorted(BAD_CHATS)))
        outcome, reason = "agent_error", BAD_CHATS[task["call"]]
    elif kind == "stop_iteration":
        outcome, reason = "agent_error", "StopIteration"
    elif kind == "forgot_await":
        outcome, reason = "agent_error", "no reward"
    elif kind == "recursion":
        outcome, reason = "agent_error", "RecursionError"
    elif kind == "print":
        task["mib"] = draw_(st.integers(1, 4))
        outcome, reason = "ok", ""
    else:  # junk metrics are dropped: the rollout is fine
        outcome, reason = "ok", ""
    agent = SYNC_AGENT if sync else ASYNC_AGENT
    job = draw_(lean_job_dicts())  # the rest of the job varies too
    task.update(
        draw_(st.fixed_dictionaries({}, optional={"n": INT64, "note": st.text(max_size=8)}))
    )
    job.update(agent=agent, task=task, run=RUN, deadline_s=deadline)
    payload, headers = encode(job, draw_(ENCODINGS))
    return Case(f"agent: {kind}", outcome, (reason,) if reason else (), payload, headers, agent)


@st.composite
def valid_cases(draw_: Callable, *, extra: bool = False) -> Case:
    job = draw_(job_dicts(run=RUN))
    sync = draw_(st.booleans())
    job["agent"] = SYNC_AGENT if sync else ASYNC_AGENT
    job["task"]["do"] = "ok"
    if extra:  # unknown fields are ignored (forward compatibility): still a valid job
        extras = draw_(
            st.dictionaries(
                st.text(min_size=1, max_size=10).filter(lambda k: k not in KNOWN),
                JSON,
                min_size=1,
                max_size=3,
            )
        )
        job.update(extras)
        job["sampling"] = {**job.get("sampling", {}), "unknown_knob": 1}
    payload, headers = encode(job, draw_(ENCODINGS))
    return Case("extra fields" if extra else "valid", "ok", (), payload, headers, job["agent"])


KNOWN = frozenset(
    "job_id agent task task_id group_id sample_index group_size run batch_id is_train sampling "
    "deadline_s metadata created_at schema_version".split()
)


def with_job_id(case: Case, job_id: str) -> Case:
    """The case with its job's id set (cases whose job decodes are found by it)."""
    headers = case.headers or {}
    is_json = headers.get("Content-Type", "").startswith("application/json") or (
        case.payload[:1] == b"{"
    )
    job = json.loads(case.payload) if is_json else msgpack.unpackb(case.payload, raw=False)
    job["job_id"] = job_id
    payload = json.dumps(job).encode() if is_json else msgpack.packb(job, use_bin_type=True)
    return replace(case, payload=payload, job_id=job_id)


def with_unique_id(case: Case, job_id: str) -> Case:
    """A malformed job made unique: its id set when it has one and the defect is elsewhere,
    so two cases never share a raw payload."""
    marker = b"placeholder"
    if marker in case.payload and len(job_id) <= len(marker):
        padded = job_id.encode().ljust(len(marker), b"_")
        return replace(case, payload=case.payload.replace(marker, padded, 1))
    return case


# ---- the trainer's input: trajectories ------------------------------------------------------
TINY_VOCAB = 263  # agentarium/tiny.py


@dataclass(frozen=True)
class Poison:
    """A trajectory a trainer must survive. ``fate``: ``undecodable`` (acked and skipped, the
    log names the field), ``bad_version`` (not the run's weights: a member of its group that
    is never trained, counted as foreign_weights and logged), ``refused`` (kept out
    of training, ``rows.refusal`` says why), ``failed`` (a member out of the statistics), or
    ``harmless`` (trained: nothing in it can hurt a step)."""

    category: str
    fate: str
    reason: tuple[str, ...]
    wire: dict | None = None  # the trajectory as a msgpack dict (None: ``payload``)
    payload: bytes = b""


def good_call() -> dict:
    return {
        "prompt_ids": [257, 50, 258],
        "response_ids": [49, 258],
        "response_logprobs": [-5.5, -5.6],
        "finish_reason": "stop",
    }


def _packed(values: list, dtype: str) -> bytes:
    import numpy as np

    return np.asarray(values, dtype=dtype).tobytes()


TRAJECTORY_KINDS = (
    "lengths",
    "packed_bytes",
    "finish_reason",
    "status",
    "ok_reward",
    "types",
    "garbage",
    "schema_version",
    "bad_version",
    "logprobs",
    "token_range",
    "sampling",
    "unreproducible",
    "failed",
    "empty",
)


@st.composite
def poisons(draw_: Callable, kind: str) -> Poison:
    """One poisoned member of a group (ids, group and run are set by the caller)."""
    call = good_call()
    traj: dict[str, Any] = {"status": "ok", "reward": draw_(st.floats(-1, 1)), "calls": [call]}
    if kind == "lengths":
        n = draw_(st.integers(0, 6).filter(lambda k: k != 2))
        call["response_logprobs"] = _packed([-1.0] * n, "<f4")
        return Poison("mismatched tokens and logprobs", "undecodable", ("response_logprobs",), traj)
    if kind == "packed_bytes":
        field = draw_(st.sampled_from(["prompt_ids", "response_ids", "response_logprobs"]))
        call[field] = draw_(st.binary(min_size=1, max_size=15).filter(lambda b: len(b) % 4))
        return Poison("packed arrays cut short", "undecodable", ("multiple of 4",), traj)
    if kind == "finish_reason":
        call["finish_reason"] = draw_(
            st.text(max_size=8).filter(lambda s: s not in ("stop", "length", "abort", "tool_calls"))
        )
        return Poison("unknown finish reason", "undecodable", ("finish_reason",), traj)
    if kind == "status":
        traj["status"] = draw_(
            st.text(max_size=8).filter(lambda s: s not in ("ok", "error", "timeout"))
        )
        return Poison("unknown status", "undecodable", ("trajectory.status",), traj)
    if kind == "ok_reward":
        reward = draw_(st.sampled_from([math.nan, math.inf, -math.inf, None, "missing"]))
        if reward == "missing":
            del traj["reward"]
        else:
            traj["reward"] = reward
        return Poison(
            "status ok without a finite reward", "undecodable", ("trajectory.reward",), traj
        )
    if kind == "types":
        field, value, reason = draw_(
            st.one_of(
                st.tuples(st.just("group_size"), NOT_INTS, st.just("trajectory.group_size")),
                st.tuples(st.just("is_train"), NOT_BOOLS, st.just("trajectory.is_train")),
                st.tuples(
                    st.just("metrics"),
                    st.dictionaries(
                        st.text(max_size=4), st.text(max_size=4), min_size=1, max_size=2
                    ),
                    st.just("trajectory.metrics"),
                ),
                st.tuples(
                    st.just("calls"),
                    NOT_OBJECTS.filter(lambda v: v != []),
                    st.just("trajectory.calls"),
                ),
                st.tuples(
                    st.just("calls"),
                    st.lists(NON_STRINGS, min_size=1, max_size=2),
                    st.just("trajectory.calls[0]"),
                ),
                st.tuples(st.just("job_id"), BAD_NAMES, st.just("trajectory.job_id")),
                st.tuples(st.just("task"), NOT_OBJECTS, st.just("trajectory.task")),
            )
        )
        traj[field] = value
        return Poison("wrong type", "undecodable", (reason,), traj)
    if kind == "garbage":
        data = draw_(
            st.one_of(
                st.binary(max_size=200).map(lambda b: b"\xc1" + b),
                st.lists(JSON_SCALARS, max_size=3).map(lambda v: msgpack.packb(v)),
            )
        )
        return Poison("garbage bytes", "undecodable", ("payload",), payload=data)
    if kind == "schema_version":
        traj["schema_version"] = draw_(st.integers(2, 2**31))
        return Poison("wrong schema_version", "undecodable", ("schema_version",), traj)
    if kind == "bad_version":
        call["weight_version"] = draw_(
            st.sampled_from(["-3", "+3", " 7", "1.5", "v2", "1_000", "NaN", "²"])
            | st.text(min_size=1, max_size=6).filter(
                lambda s: not (s.isascii() and s.isdigit()) and s != "default"
            )
        )
        return Poison("wrong weight version", "bad_version", ("weight_version",), traj)
    if kind == "logprobs":
        bad = draw_(st.sampled_from([math.nan, math.inf, -math.inf]))
        call["response_logprobs"] = _packed([-1.0, bad], "<f4")
        return Poison("non-finite log-probs", "refused", ("log-prob",), traj)
    if kind == "token_range":
        field = draw_(st.sampled_from(["prompt_ids", "response_ids"]))
        bad = draw_(st.integers(TINY_VOCAB, 2**31 - 1) | st.integers(-(2**31), -1))
        call[field] = (
            _packed([bad, 258], "<i4") if field == "response_ids" else _packed([257, bad], "<i4")
        )
        return Poison("token ids outside the vocabulary", "refused", ("vocabulary",), traj)
    if kind == "sampling":
        field = draw_(st.sampled_from(["temperature", "top_p"]))
        call[field] = draw_(st.sampled_from([math.nan, math.inf]))
        reason = "top_p" if field == "top_p" else "not finite"
        return Poison("non-finite sampling", "refused", (reason, "not finite"), traj)
    if kind == "unreproducible":
        field, value, reason = draw_(
            st.sampled_from(
                [
                    ("top_p", 0.9, "top_p"),
                    ("top_k", 20, "top_k"),
                    ("temperature", 0.0, "greedy"),
                ]
            )
        )
        call[field] = value
        return Poison("unreproducible sampling", "refused", (reason,), traj)
    if kind == "failed":
        traj["status"] = draw_(st.sampled_from(["error", "timeout"]))
        traj["reward"] = draw_(st.sampled_from([None, math.nan, math.inf, 3.0]))
        call["response_ids"] = _packed([TINY_VOCAB + 5, 2**31 - 1], "<i4")  # never read
        return Poison("failed member", "failed", (), traj)
    assert kind == "empty"
    traj["calls"] = draw_(
        st.sampled_from([[], [{**call, "response_ids": [], "response_logprobs": []}]])
    )
    return Poison("empty response", "harmless", (), traj)


# ---- HTTP surfaces: the local engine and the tracing proxy ------------------------------------
@dataclass(frozen=True)
class Request:
    """One HTTP request. ``reason``: words the 4xx answer's message must contain (any of them);
    ``lenient``: a 200 is an acceptable answer too (a chat template may render odd content)."""

    category: str
    path: str
    body: bytes
    reason: tuple[str, ...] = ()
    lenient: bool = False


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _deep_json(depth: int) -> bytes:
    return b"[" * depth + b"1" + b"]" * depth


@st.composite
def bad_bodies(draw_: Callable, valid: dict) -> tuple[str, bytes, tuple[str, ...]]:
    """A body that is not a JSON object (or not JSON at all), as any JSON endpoint gets."""
    kind = draw_(st.sampled_from(["garbage", "non_object", "empty", "invalid_utf8", "deep", "cut"]))
    if kind == "garbage":
        data = draw_(st.binary(min_size=1, max_size=100).map(lambda b: b"\x00" + b))
        return "not JSON", data, ("JSON",)
    if kind == "non_object":
        value = draw_(st.one_of(st.lists(JSON, max_size=3), JSON_SCALARS))
        return "JSON that is not an object", _json(value), ("object", "JSON", "messages", "empty")
    if kind == "empty":
        return "empty body", draw_(st.sampled_from([b"", b" ", b"\n"])), ("empty", "JSON")
    if kind == "invalid_utf8":
        data = _json({**valid, "x": "MARK"}).replace(
            b"MARK", draw_(st.sampled_from([b"\xff", b"\xc3\x28"]))
        )
        return "invalid UTF-8", data, ("JSON", "utf-8")
    if kind == "deep":
        depth = draw_(st.integers(2_000, 200_000))
        return "deeply nested", b'{"x":' + _deep_json(depth) + b"}", ("JSON", "nested")
    text = _json(valid).decode()
    cut = draw_(st.integers(1, len(text) - 1))
    return "broken JSON", text[:cut].encode(), ("JSON",)


GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
NOT_INTEGRAL = st.one_of(  # what no integer field takes (big ints are in range for some)
    st.text(max_size=4),
    st.floats().filter(lambda x: not x.is_integer()),
    st.booleans(),
    st.lists(st.integers(0, 3), max_size=2),
)
BAD_NUMBERS = st.one_of(
    NOT_FLOATS, st.sampled_from([math.nan, math.inf, -math.inf]), st.none().map(lambda _: {})
)
# (field, value) a request's sampling refuses, whichever API spells it
BAD_TEMPERATURE = st.tuples(st.just("temperature"), st.floats(max_value=-1e-9) | BAD_NUMBERS)
BAD_TOP_P = st.tuples(
    st.just("top_p"),
    st.floats(max_value=0.0) | st.floats(min_value=1.0, exclude_min=True) | BAD_NUMBERS,
)
GENERATE_DEFECTS = ("body", "input_ids", "text", "sampling", "top", "unsupported", "unknown")


@st.composite
def generate_requests(draw_: Callable, kind: str) -> Request:
    """A bad ``POST /generate`` for the local engine (SGLang's API)."""
    body: dict[str, Any] = json.loads(json.dumps(GENERATE))
    if kind == "body":
        category, data, reason = draw_(bad_bodies(GENERATE))
        return Request(category, "/generate", data, reason)
    if kind == "input_ids":
        value = draw_(
            st.one_of(
                st.lists(
                    st.integers(TINY_VOCAB, 10**30) | st.integers(max_value=-1),
                    min_size=1,
                    max_size=3,
                ),
                st.lists(st.floats() | st.booleans() | st.text(max_size=3), min_size=1, max_size=3),
                st.lists(st.lists(st.integers(0, 9), max_size=2), min_size=1, max_size=2),
                st.just([]),
                st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2),
                st.integers(),
            )
        )
        body["input_ids"] = value
        return Request("bad input_ids", "/generate", _json(body), ("input_ids", "prompt"))
    if kind == "text":
        variant = draw_(st.sampled_from(["both", "neither", "type"]))
        if variant == "both":
            body["text"] = "hi"
        elif variant == "neither":
            del body["input_ids"]
        else:
            del body["input_ids"]
            body["text"] = draw_(NON_STRINGS.filter(lambda v: v is not None and v != {}))
        return Request("text and input_ids", "/generate", _json(body), ("input_ids", "text"))
    if kind == "sampling":
        field, value = draw_(
            st.one_of(
                st.tuples(st.just("max_new_tokens"), st.integers(max_value=-1) | NOT_INTEGRAL),
                st.tuples(st.just("max_new_tokens"), st.integers(4096, 10**30)),
                BAD_TEMPERATURE,
                BAD_TOP_P,
                st.tuples(st.just("top_k"), st.integers(max_value=-2) | NOT_INTEGRAL),
                st.tuples(
                    st.just("min_p"),
                    st.floats(max_value=-1e-9)
                    | st.floats(min_value=1.0, exclude_min=True)
                    | BAD_NUMBERS,
                ),
                st.tuples(
                    st.just("stop"),
                    st.lists(NON_STRINGS, min_size=1, max_size=2)
                    | st.just([""])
                    | INT64.filter(bool),
                ),
                st.tuples(
                    st.just("stop_token_ids"),
                    st.lists(st.text(max_size=2) | st.floats(), min_size=1, max_size=2)
                    | st.text(min_size=1, max_size=3),
                ),
                st.tuples(
                    st.just("sampling_seed"),
                    st.integers(min_value=2**64, max_value=10**30)
                    | st.integers(min_value=-(10**30), max_value=-(2**63) - 1)
                    | NOT_INTEGRAL,
                ),
                st.tuples(st.just("ignore_eos"), NOT_BOOLS),
            )
        )
        if field == "sampling_params":
            body["sampling_params"] = value
        else:
            body["sampling_params"][field] = value
        reason = (
            ("context length",)
            if field == "max_new_tokens" and isinstance(value, int) and value > 0
            else (field,)
        )
        return Request("absurd sampling", "/generate", _json(body), reason)
    if kind == "top":
        field, value = draw_(
            st.one_of(
                st.tuples(
                    st.just("sampling_params"),
                    NOT_OBJECTS.filter(lambda v: v not in ([], "", 0, 0.0, False)),
                ),
                st.tuples(
                    st.just("logprob_start_len"),
                    st.integers(3, 10**30) | st.integers(max_value=-2) | NOT_INTEGRAL,
                ),
                st.tuples(
                    st.just("top_logprobs_num"),
                    st.integers(TINY_VOCAB + 1, 10**30) | st.integers(max_value=-1),
                ),
                st.tuples(
                    st.just("rid"), st.lists(st.text(max_size=3), min_size=1, max_size=2) | INT64
                ),
                st.tuples(st.just("return_logprob"), NOT_BOOLS),
            )
        )
        body[field] = value
        return Request("wrong type", "/generate", _json(body), (field,))
    if kind == "unsupported":
        where, field, value = draw_(
            st.sampled_from(
                [
                    ("top", "image_data", "x"),
                    ("top", "lora_path", "/x"),
                    ("sampling", "n", 2),
                    ("sampling", "frequency_penalty", 0.5),
                    ("sampling", "json_schema", "{}"),
                    ("sampling", "regex", "a+"),
                    ("sampling", "logit_bias", {"1": 5}),
                ]
            )
        )
        (body if where == "top" else body["sampling_params"])[field] = value
        return Request("unsupported option", "/generate", _json(body), (field,))
    assert kind == "unknown"
    where = draw_(st.sampled_from(["top", "sampling"]))
    field = draw_(st.text(min_size=1, max_size=12).filter(lambda f: f not in _ENGINE_KNOWN))
    (body if where == "top" else body["sampling_params"])[field] = draw_(JSON)
    return Request("unknown field", "/generate", _json(body), ("unknown",))


_ENGINE_KNOWN = frozenset(
    "text input_ids sampling_params return_logprob logprob_start_len top_logprobs_num "
    "return_text_in_logprobs rid stream image_data video_data audio_data input_embeds "
    "token_ids_logprob lora_path lora_id session_params custom_logit_processor "
    "return_hidden_states log_metrics no_logs extra_key priority data_parallel_rank "
    "max_new_tokens temperature top_p top_k min_p stop stop_token_ids sampling_seed ignore_eos "
    "skip_special_tokens no_stop_trim n min_new_tokens frequency_penalty presence_penalty "
    "repetition_penalty json_schema regex ebnf structural_tag logit_bias custom_params "
    "stop_regex spaces_between_special_tokens stream_interval".split()
)


@st.composite
def control_requests(draw_: Callable) -> Request:
    """The engine's other routes with bodies they must refuse."""
    path, body, reason = draw_(
        st.sampled_from(
            [
                ("/abort_request", {}, "rid"),
                ("/abort_request", {"rid": 5}, "rid"),
                ("/abort_request", {"rid": ["a"]}, "rid"),
                ("/pause_generation", {"mode": "nap"}, "pause mode"),
                ("/pause_generation", {"mode": 3}, "pause mode"),
                ("/update_weight_version", {}, "new_version"),
                ("/update_weights_from_disk", {}, "model_path"),
                ("/update_weights_from_disk", {"model_path": 7}, "model_path"),
                (
                    "/update_weights_from_disk",
                    {"model_path": "/m", "load_format": "gguf"},
                    "load_format",
                ),
            ]
        )
    )
    if draw_(st.booleans()):
        category, data, why = draw_(bad_bodies(body or {"x": 1}))
        if path == "/pause_generation" and category == "empty body":
            data = b"[1]"  # an empty body is a pause with the default mode: valid
        return Request(f"{path}: {category}", path, data, why + (reason,))
    return Request(f"{path}: bad field", path, _json(body), (reason,))


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CHAT_DEFECTS = ("body", "messages", "content", "tools", "sampling", "unsupported")


@st.composite
def chat_requests(draw_: Callable, kind: str) -> Request:
    """A malformed OpenAI chat completion request for a rollout's tracing proxy endpoint."""
    body: dict[str, Any] = json.loads(json.dumps(CHAT))
    path = "/chat/completions"
    if kind == "body":
        category, data, reason = draw_(bad_bodies(CHAT))
        return Request(category, path, data, reason)
    if kind == "messages":
        value = draw_(
            st.one_of(
                st.just("missing"),
                NOT_OBJECTS.filter(lambda v: not isinstance(v, list)),
                st.dictionaries(st.text(max_size=3), JSON, max_size=2),
                st.lists(
                    INT64 | st.floats() | st.booleans() | st.text(max_size=4),
                    min_size=1,
                    max_size=3,
                ),
            )
        )
        if value == "missing":
            del body["messages"]
        else:
            body["messages"] = value
        return Request("bad messages", path, _json(body), ("messages",))
    if kind == "content":  # odd but JSON: a template may render it or refuse it, never a 500
        message = draw_(
            st.fixed_dictionaries(
                {},
                optional={
                    "role": JSON,
                    "content": JSON,
                    "name": JSON,
                    "tool_calls": JSON,
                    "tool_call_id": JSON,
                    "reasoning_content": JSON,
                },
            )
        )
        body["messages"] = draw_(st.sampled_from([[message], [CHAT["messages"][0], message]]))
        return Request("odd message content", path, _json(body), (), lenient=True)
    if kind == "tools":
        body["tools"] = draw_(
            st.one_of(
                st.dictionaries(st.text(max_size=3), JSON, min_size=1, max_size=2),
                st.lists(JSON, min_size=1, max_size=3),
                st.text(min_size=1, max_size=5),
            )
        )
        if draw_(st.booleans()):
            body["tool_choice"] = draw_(JSON)
        return Request("odd tools", path, _json(body), (), lenient=True)
    if kind == "sampling":
        field, value = draw_(
            st.one_of(
                BAD_TEMPERATURE,
                BAD_TOP_P,
                st.tuples(
                    st.just("max_tokens"),
                    st.integers(max_value=0) | NOT_INTEGRAL | st.integers(10**6, 10**30),
                ),
                st.tuples(
                    st.just("max_completion_tokens"),
                    st.integers(max_value=0) | st.text(min_size=1, max_size=3),
                ),
                st.tuples(st.just("top_k"), st.integers(max_value=-2) | NOT_INTEGRAL),
                st.tuples(
                    st.just("min_p"), st.floats(min_value=1.0, exclude_min=True) | BAD_NUMBERS
                ),
                st.tuples(
                    st.just("seed"),
                    st.integers(min_value=2**64, max_value=10**30)
                    | st.text(min_size=1, max_size=3),
                ),
                st.tuples(
                    st.just("stop"), st.lists(INT64, min_size=1, max_size=2) | INT64 | st.just({})
                ),
                st.tuples(st.just("frequency_penalty"), st.floats(0.1, 2.0)),
            )
        )
        body[field] = value
        names = {
            "max_tokens": "max_new_tokens",
            "max_completion_tokens": "max_new_tokens",
            "seed": "sampling_seed",
        }
        # an integer past 64 bits is refused by the JSON decoder itself, before any field
        reason = (field, names.get(field, field), "context", "64-bit")
        return Request("absurd sampling", path, _json(body), reason)
    assert kind == "unsupported"
    field, value, reason = draw_(
        st.sampled_from(
            [
                ("n", 2, "n > 1"),
                ("n", "x", "n > 1"),
                ("logprobs", True, "logprobs"),
                ("tool_choice", "required", "tool_choice"),
                ("guided_json", {}, "guided_json"),
                ("response_format", {"type": "grammar"}, "response_format"),
            ]
        )
    )
    body[field] = value
    return Request("unsupported option", path, _json(body), (reason,))


# ---- the gateway's other APIs: OpenAI Responses and Anthropic Messages -----------------------
RESPONSES = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
MESSAGES = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# each API's route, a valid body, the fields its translation reads, the list holding the
# conversation, and the item / block / tool types it knows
_API = {
    "responses": (
        "/responses",
        RESPONSES,
        "input instructions tools tool_choice text reasoning include truncation "
        "previous_response_id max_output_tokens temperature stream".split(),
        "input",
        "message function_call function_call_output reasoning input_text output_text".split(),
    ),
    "messages": (
        "/messages",
        MESSAGES,
        "messages system tools tool_choice thinking output_config stop_sequences max_tokens "
        "temperature top_k stream".split(),
        "messages",
        "text tool_use tool_result image thinking custom auto none any".split(),
    ),
}
GATEWAY_DEFECTS = tuple(f"{api} {kind}" for api in _API for kind in ("body", "field", "items"))


@st.composite
def gateway_requests(draw_: Callable, kind: str) -> Request:
    """A malformed or odd Responses / Messages request: a 4xx naming what is wrong, or (odd but
    well formed) a 200; never a 5xx."""
    api, defect = kind.split()
    path, valid, fields, conversation, types = _API[api]
    if defect == "body":
        category, data, reason = draw_(bad_bodies(valid))
        return Request(f"{api}: {category}", path, data, reason)
    body: dict[str, Any] = json.loads(json.dumps(valid))
    if defect == "field":
        field = draw_(st.sampled_from(fields))
        body[field] = draw_(JSON)
        return Request(f"{api}: odd {field}", path, _json(body), (), lenient=True)
    # items: objects shaped like input items, content blocks or tools, in the conversation
    # (three times in four) or in the tools
    shaped = st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(types) | JSON,
            "role": st.sampled_from(["user", "assistant", "system", "developer"]) | JSON,
            "content": JSON | st.lists(st.fixed_dictionaries({"type": st.sampled_from(types)})),
            "text": JSON,
            "name": JSON,
            "id": JSON,
            "call_id": JSON,
            "tool_use_id": JSON,
            "arguments": JSON,
            "input": JSON,
            "output": JSON,
        },
    )
    field = draw_(st.sampled_from([conversation] * 3 + ["tools"]))
    if field == "messages":  # Anthropic's messages: a role, and blocks as content
        shaped = st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant"]) | JSON},
            optional={"content": JSON | st.lists(shaped, min_size=1, max_size=3)},
        )
    body[field] = draw_(st.lists(shaped, min_size=1, max_size=3))
    return Request(f"{api}: odd {field} items", path, _json(body), (), lenient=True)
