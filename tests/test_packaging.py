"""The distribution installs one name, ``agentarium``, and a user's own packages cannot shadow it.

The wheel is built from a copy of the source tree (pip builds in place, and the suite must not
write into the checkout), without build isolation (nothing is downloaded: setuptools comes from
this environment), and installed into a fresh virtualenv with no index. The virtualenv reads its
dependencies from this environment's site-packages through a ``.pth`` line: a ``.pth`` line adds
a path without running the ``.pth`` files inside it, so an editable install of the checkout there
does not leak in, and the environment's ``PYTHONPATH`` is dropped for the same reason.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHADOWS = ("broker", "consumers", "producers", "schemas", "trainer", "environments", "examples")
SKIP = {".git", ".venv", "build", "dist", "__pycache__", ".mypy_cache", ".ruff_cache"}

USER_SCRIPT = """
import sys

import agentarium
from agentarium.integrations.trl import AgentariumRollout

assert agentarium.TaskProducer.__module__.startswith("agentarium."), agentarium.TaskProducer
assert AgentariumRollout.__module__ == "agentarium.integrations.trl"
assert agentarium.__file__.startswith(sys.prefix), agentarium.__file__  # the wheel, not the repo
leaked = sorted(name for name in {shadows!r} if name in sys.modules)
assert not leaked, f"agentarium imported the user's own packages: {{leaked}}"
import broker, trainer  # the user's own, untouched
assert broker.USERS and trainer.USERS
print("ok")
"""


def _ignore(directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n in SKIP or n.endswith(".egg-info")}


@pytest.mark.long(40)
@pytest.mark.timeout(300)
def test_the_wheel_installs_agentarium_alone_and_resists_shadowing(tmp_path):
    pytest.importorskip("setuptools")
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, symlinks=True, ignore=_ignore)
    dist = tmp_path / "dist"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    build = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps"]
    build += ["--no-build-isolation", "--no-index", "-q", "-w", str(dist)]
    subprocess.run(build, check=True, env=env, capture_output=True, timeout=240)
    (wheel,) = dist.glob("agentarium-*.whl")

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    tops = {name.split("/")[0] for name in names}
    (metadata,) = tops - {"agentarium"}
    assert metadata.endswith(".dist-info") and "agentarium" in tops, tops
    for data in ("agentarium/examples/toy_tasks.jsonl", "agentarium/schemas/json/job.schema.json"):
        assert data in names, data
    assert "agentarium/inference/engine/engine.py" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps"]
    install += ["--no-index", "-q", str(wheel)]
    subprocess.run(install, check=True, env=env, capture_output=True, timeout=120)
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    ours |= set(site.getsitepackages())
    (Path(purelib) / "dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")

    user = tmp_path / "user"
    for name in SHADOWS:
        (user / name).mkdir(parents=True)
        (user / name / "__init__.py").write_text(f'"""A user\'s own {name}."""\nUSERS = True\n')
    (user / "trainer.py").write_text('"""A user\'s own trainer module."""\nUSERS = True\n')
    (user / "train.py").write_text(USER_SCRIPT.format(shadows=SHADOWS))
    ran = subprocess.run(
        [python, "train.py"], cwd=user, env=env, capture_output=True, text=True, timeout=240
    )
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stderr[-3000:]

    cli = subprocess.run(
        [venv / "bin" / "agentarium", "--help"], cwd=user, env=env, capture_output=True, text=True
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "usage: agentarium" in cli.stdout
