"""A program agent's working directory, one per rollout, removed after it (kept on failure only
when asked).

    <base>/agentarium-<job_id>-<random>/   mode 0700, the program's user's
        task.json                          the task; also the program's stdin
        work/                              its current directory (AGENTARIUM_WORKDIR)
        home/                              HOME: a harness's config and caches stay out of work/
        tmp/                               TMPDIR

When the program runs as another user (the consumer is root) every part of it is that user's,
and a setup function's files are handed over before the program starts.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("agentarium.consumers")

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


@dataclass(frozen=True)
class Workdir:
    root: Path
    user: tuple[int, int] | None  # (uid, gid) owning it; None: the consumer's

    @classmethod
    def create(
        cls, base: str | None, job_id: str, task: dict, user: tuple[int, int] | None
    ) -> Workdir:
        name = _UNSAFE.sub("_", job_id)[:80]
        if base:
            Path(base).mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix=f"agentarium-{name}-", dir=base))
        workdir = cls(root, user)
        for part in (workdir.work, workdir.home, workdir.tmp):
            part.mkdir(mode=0o700)
        workdir.task_file.write_text(json.dumps(task) + "\n")
        workdir.hand_over()
        return workdir

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def task_file(self) -> Path:
        return self.root / "task.json"

    def hand_over(self) -> None:
        """Everything under the root becomes the program's user's (no-op as the consumer's)."""
        if self.user is None:
            return
        uid, gid = self.user
        os.lchown(self.root, uid, gid)
        for top, dirs, files in os.walk(self.root):
            for name in dirs + files:
                os.lchown(os.path.join(top, name), uid, gid)

    def user_variables(self) -> dict[str, str]:
        """USER and LOGNAME of the user the program runs as, when it has a name."""
        uid = self.user[0] if self.user is not None else os.geteuid()
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            return {}
        return {"USER": name, "LOGNAME": name}

    def kept_note(self, kept: bool) -> str:
        return f"\n(its working directory is kept: {self.root})" if kept else ""

    def close(self, *, keep: bool) -> None:
        if keep:
            log.warning("kept a failed program's working directory", path=str(self.root))
            return
        if sys.version_info >= (3, 12):
            shutil.rmtree(self.root, onexc=_writable_and_retry)
        else:  # onerror, deprecated from 3.12 on
            shutil.rmtree(self.root, onerror=_writable_and_retry)


def _writable_and_retry(function: object, path: str, exc: object) -> None:
    """A program may leave a directory without write permission (its own files, mode 0500):
    open it up and remove again; anything else is logged, not raised (the rollout is over)."""
    parent = os.path.dirname(path)
    try:
        os.chmod(parent, stat.S_IRWXU)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, stat.S_IRWXU)
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except OSError as again:
        log.warning(
            "cannot remove part of a program's working directory", path=path, error=str(again)
        )
