"""Program agents: an agent that is a command line, in any language (``NAME=exec:CMD``).

    agentarium consumer --agent swe=exec:"node agent.js" --llm URL --program-scorer tests:score

Per rollout (docs/design.md, "Program agents"): a fresh working directory, the task as JSON on
stdin and in a file, the rollout's gateway in the variables the SDKs read, an environment
otherwise minimal, the program run under its supervisor (consumers/agents/program_run.py) as its own
user where the consumer is root, its output kept bounded in the trajectory's
``metadata["program"]``, and the reward from the scorer, else from the last JSON line the
program printed. ``ProgramAgent`` is an async agent of the endpoint shape, so the rollout's
deadline, drain and failure rules apply as to any other; a plain frozen dataclass, so a
``ConsumerSpec`` holding one pickles for a Ray actor.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import pwd
import shlex
import shutil
from dataclasses import dataclass, field
from typing import Any

import structlog

from agentarium.schemas import check_name, check_settings, setting

from ..rollout_context import current
from ..tracing.proxy import secret_of
from .loading import AgentLoadError, RewardError, load_callable
from .program_env import bridge, outcome_reward
from .program_run import ProgramOutput, run_program
from .program_workdir import Workdir

log = structlog.get_logger("agentarium.consumers")

PREFIX = "exec:"
KIB = 1024
GROUP = "program agents (--agent NAME=exec:CMD)"
# Set by the consumer for every run: a program_env entry may not name them.
GATEWAY_VARIABLES = (
    "OPENAI_BASE_URL",
    "OPENAI_API_BASE",
    "OPENAI_API_KEY",
    "ANTHROPIC_BASE_URL",
    "ANTHROPIC_API_KEY",
)


class ProgramFailed(RuntimeError):
    """The program exited non-zero, was killed by a signal it was not sent, or did not start:
    an agent error (retried, then dead-lettered), its stderr's tail in the message."""


@dataclass(frozen=True, kw_only=True)
class ProgramSettings:
    """How a program agent (``NAME=exec:CMD``) runs; the ``program_`` settings of
    ``agentarium consumer`` and ``eval run``."""

    scorer: str | None = setting(
        None,
        metavar="module:fn",
        group=GROUP,
        help="the reward is fn(task, workdir, output), called once the program "
        "exited 0, in its working directory (a Path) before it is removed; output is a "
        "ProgramOutput (exit_code, stdout, stderr tails, result: the last JSON object "
        "printed). Without it: with --env the session's score, else the program's last "
        'stdout line {"reward": x, "metrics": {...}}',
    )
    setup: str | None = setting(
        None,
        metavar="module:fn",
        group=GROUP,
        help="fn(task, workdir) prepares the working directory before the program "
        "starts (writes a repository to fix, say)",
    )
    user: str = setting(
        "auto",
        metavar="auto|self|USER",
        group=GROUP,
        help="the user the program runs as. auto: nobody when the consumer is "
        "root, else the consumer's own user (the program can then read what the consumer "
        "can); self: the consumer's user; a name or uid[:gid]: that user (needs root)",
    )
    env: tuple[str, ...] = setting(
        (),
        metavar="NAME[=VALUE]",
        group=GROUP,
        help="a variable for the program, repeatable: NAME passes the consumer's "
        "value on, NAME=VALUE sets it. Nothing else of the consumer's environment reaches the "
        "program but PATH and LANG",
    )
    output_bytes: int = setting(
        64 * KIB,
        ge=0,
        metavar="BYTES",
        group=GROUP,
        help="the tail of stdout, and of stderr, kept in the trajectory",
    )
    kill_grace_s: float = setting(
        0.5,
        ge=0,
        group=GROUP,
        help="at the deadline or a drain, SIGTERM to every process of the program, "
        "then SIGKILL after this long",
    )
    keep_failed: bool = setting(
        False,
        group=GROUP,
        help="keep the working directory of a run that failed or timed out (its "
        "path is in the error and the log); others are always removed",
    )
    workdir_base: str | None = setting(
        None,
        metavar="DIR",
        group=GROUP,
        help="where working directories are made (default: the system's temporary directory)",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        for entry in self.env:
            name = entry.partition("=")[0]
            if not name.isidentifier():
                raise ValueError(f"--program-env {entry!r}: write NAME or NAME=VALUE")
            if name in GATEWAY_VARIABLES or name.startswith("AGENTARIUM_"):
                raise ValueError(
                    f"--program-env {entry!r}: {name} is set by the consumer for every run "
                    "(the rollout's own gateway endpoint and key); drop it"
                )


def parse_command(spec: str) -> tuple[str, ...]:
    """``exec:CMD`` -> CMD split as a shell would (no shell runs it), its program found on
    PATH and its arguments that name files relative to here made absolute (the program runs
    in its own directory)."""
    text = spec[len(PREFIX) :] if spec.startswith(PREFIX) else spec
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise AgentLoadError(f"agent {spec!r}: cannot split the command line ({exc})") from None
    if not words:
        raise AgentLoadError(
            f"agent {spec!r} names no program: write exec:CMD, e.g. exec:'node agent.js'"
        )
    found = shutil.which(words[0])
    if found is None:
        raise AgentLoadError(
            f"agent {spec!r}: program {words[0]!r} is not an executable file"
            + ("" if "/" in words[0] else " on PATH")
        )
    return (os.path.abspath(found), *(_absolute(w) for w in words[1:]))


def _absolute(word: str) -> str:
    if "/" in word and not word.startswith("-") and os.path.exists(word):
        return os.path.abspath(word)
    return word


@functools.cache
def _loaded(spec: str, what: str) -> Any:
    return load_callable(spec, what)


def run_as(user: str) -> tuple[int, int] | None:
    """(uid, gid) to run as, or None for the consumer's own user."""
    root = os.geteuid() == 0
    if user == "self" or (user == "auto" and not root):
        return None
    name = "nobody" if user == "auto" else user
    uid_text, _, gid_text = name.partition(":")
    try:
        entry = pwd.getpwuid(int(uid_text)) if uid_text.isdigit() else pwd.getpwnam(uid_text)
        uid, gid = entry.pw_uid, entry.pw_gid
    except KeyError:
        if not uid_text.isdigit():
            raise ValueError(f"--program-user {user!r}: no such user") from None
        uid, gid = int(uid_text), int(uid_text)
    if gid_text:
        gid = int(gid_text)
    if (uid, gid) == (os.geteuid(), os.getegid()):
        return None
    if not root:
        raise ValueError(
            f"--program-user {user!r} needs a root consumer (this one runs as uid "
            f"{os.geteuid()}): run it as root, or pass --program-user self"
        )
    return uid, gid


@dataclass(frozen=True)
class ProgramAgent:
    """``async (task, endpoint, model, envs) -> reward``: one run of ``command`` per rollout;
    with ``env``, in a session of that environment service, which scores it."""

    command: tuple[str, ...]
    settings: ProgramSettings = field(default_factory=ProgramSettings)
    env: str | None = None

    def __post_init__(self) -> None:
        run_as(self.settings.user)  # refuses a user this consumer cannot become, at load
        for spec, what in ((self.settings.scorer, "scorer"), (self.settings.setup, "setup")):
            if spec:
                _loaded(spec, f"program {what}")
        if self.env is not None:
            check_name(self.env, "env")

    async def __call__(self, task: dict, endpoint: str, model: str, envs: Any = None) -> Any:
        if self.env is None:
            return await self._run(task, endpoint, model)
        if envs is None:
            raise AgentLoadError(
                f"program agent on environment {self.env!r}: run by a consumer, which hands it "
                "the environment client"
            )
        async with envs.session(self.env, task) as session:
            async with bridge().route(session) as url:
                result = await self._run(task, endpoint, model, {"AGENTARIUM_ENV_URL": url})
        return result if self.settings.scorer else outcome_reward(session)

    async def _run(
        self, task: dict, endpoint: str, model: str, extra: dict[str, str] | None = None
    ) -> Any:
        rollout, settings = current(), self.settings
        user = run_as(settings.user)
        workdir = Workdir.create(settings.workdir_base, rollout.job_id, task, user)
        secret, done = secret_of(endpoint), False

        def record(output: ProgramOutput) -> None:  # a timeout's trajectory holds it too
            rollout.notes["program"] = output.without(secret).summary()

        try:
            if settings.setup:
                await _call(_loaded(settings.setup, "program setup"), task, workdir.work)
                workdir.hand_over()
            env = self.environment(workdir, endpoint, model, rollout.deadline_s)
            output = await run_program(
                self.command,
                cwd=str(workdir.work),
                env={**env, **(extra or {})},
                stdin_path=str(workdir.task_file),
                user=user,
                grace_s=settings.kill_grace_s,
                output_bytes=settings.output_bytes,
                on_end=record,
                orphan_dir=None if settings.keep_failed else str(workdir.root),
            )
            output = output.without(secret)
            if not output.ok:
                raise ProgramFailed(output.failure() + workdir.kept_note(settings.keep_failed))
            if settings.scorer:
                scorer = _loaded(settings.scorer, "program scorer")
                result = await _call(scorer, task, workdir.work, output)
            elif self.env is not None:
                result = None  # the session's score, once it closed
            else:
                result = self._reward_line(output)
            done = True
            return result
        finally:
            keep = settings.keep_failed and not done
            if keep:
                rollout.notes.setdefault("program", {})["workdir"] = str(workdir.root)
            workdir.close(keep=keep)

    def environment(
        self, workdir: Workdir, endpoint: str, model: str, deadline_s: float | None
    ) -> dict[str, str]:
        """The program's whole environment: the gateway's variables, the run's, PATH and LANG,
        and ``--program-env``."""
        secret = secret_of(endpoint)
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "HOME": str(workdir.home),
            "TMPDIR": str(workdir.tmp),
            **workdir.user_variables(),
        }
        for entry in self.settings.env:
            name, sep, value = entry.partition("=")
            if sep:
                env[name] = value
            elif name in os.environ:
                env[name] = os.environ[name]
        anthropic_base = endpoint.rstrip("/").removesuffix("/v1")
        env.update(
            OPENAI_BASE_URL=endpoint,
            OPENAI_API_BASE=endpoint,  # older clients' name (litellm, langchain)
            OPENAI_API_KEY=secret,
            ANTHROPIC_BASE_URL=anthropic_base,  # the SDK appends /v1/messages
            ANTHROPIC_API_KEY=secret,
            AGENTARIUM_BASE_URL=endpoint,
            AGENTARIUM_API_KEY=secret,
            AGENTARIUM_MODEL=model,
            AGENTARIUM_TASK_FILE=str(workdir.task_file),
            AGENTARIUM_WORKDIR=str(workdir.work),
            AGENTARIUM_JOB_ID=current().job_id,
        )
        if deadline_s is not None:
            env["AGENTARIUM_DEADLINE_S"] = f"{deadline_s:g}"
        return env

    @staticmethod
    def _reward_line(output: ProgramOutput) -> dict:
        result = output.result
        if result is None or ("reward" not in result and "score" not in result):
            raise RewardError(
                "the program printed no reward: end its stdout with a JSON line "
                '{"reward": x} (and "metrics": {...} if you like), or pass --program-scorer '
                "module:fn"
            )
        return result


async def _call(fn: Any, *args: Any) -> Any:
    """An async function awaited; a plain one in a thread (a scorer running a test suite
    must not hold the event loop)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    value = await asyncio.to_thread(fn, *args)
    return await value if inspect.isawaitable(value) else value


def program_agent(command: str, *, env: str | None = None, **settings: Any) -> ProgramAgent:
    """A program agent for ``command`` (``"node agent.js"``, with or without ``exec:``), for
    ``register_agent_type``; ``env``: in a session of that environment; ``settings``:
    ``ProgramSettings``' fields (``scorer=``, ...)."""
    return ProgramAgent(parse_command(command), ProgramSettings(**settings), env)


def load_agent(spec: str, program: ProgramSettings | None = None, env: str | None = None) -> Any:
    """The agent a spec names: ``exec:CMD`` a ``ProgramAgent`` with ``program``'s settings (in
    sessions of ``env`` when given), otherwise ``load_callable`` (``module:function``,
    ``verifiers:...``)."""
    if spec.startswith(PREFIX):
        return ProgramAgent(parse_command(spec), program or ProgramSettings(), env)
    return load_callable(spec, "agent")
