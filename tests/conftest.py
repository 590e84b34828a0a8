"""Shared fixtures: a real nats-server per test, clients on it, and in-memory span export.

The chain is ``nats_server -> nats_url -> settings -> nc -> js`` (nats.py's own test
layout). ``nats_server`` keeps its port and store across ``stop()``/``kill()`` and
``start()``, so a test can restart the broker under a live client.
"""

from __future__ import annotations

import os

import pytest
from httplib import serve  # noqa: F401 (the fixture: byte-for-byte HTTP servers, tests/httplib.py)
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

# the first pass's order, after -m has deselected (tests/suite_order.py)
from suite_order import pytest_collection_modifyitems  # noqa: F401

from agentarium.broker import NatsServer, NatsSettings, Topology, find_nats_server, provision
from agentarium.broker.errors import ServerLaunchError
from agentarium.broker.server import ENV_BINARY
from agentarium.broker.version import binary_version, format_version

# Helpers moved out of test modules assert as the tests do: pytest explains their failures too.
pytest.register_assert_rewrite("otlp", "updatelib")

_EXPORTER = InMemorySpanExporter()

# Every Ray the tests start (theirs, the trainer's, a demo's) runs its workers at nice 0: at
# Ray's default of 15, a rank beside the suite's other busy workers got a few per cent of a
# core, and tests/test_ray_dp.py's 9-14 s tests took 237-290 s in the first pass (two of its
# module teardowns then timed out in ray.shutdown).
os.environ.setdefault("RAY_worker_niceness", "0")


def _nats_server_line() -> str:
    how = f"${ENV_BINARY}" if os.environ.get(ENV_BINARY) else "default resolution"
    try:
        binary = find_nats_server()
    except ServerLaunchError as exc:
        return f"nats-server: none ({exc})"
    return f"nats-server: {binary} (v{format_version(binary_version(binary))}, {how})"


def pytest_report_header(config) -> str:
    """Which nats-server every fixture launches: $AGENTARIUM_NATS_SERVER, or the default
    resolution of ``broker.find_nats_server`` (never a virtualenv's bin first on PATH)."""
    return _nats_server_line()


def pytest_sessionstart(session) -> None:
    """``-q`` hides the header: say which nats-server runs anyway, first thing."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and session.config.get_verbosity() < 0:
        reporter.write_line(_nats_server_line())


def _install_span_exporter() -> None:
    """Once per session: export every span to memory. Reuse a provider someone else set."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    if hasattr(provider, "add_span_processor"):
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))


_install_span_exporter()


@pytest.fixture(scope="session", autouse=True)
def agentarium_home(tmp_path_factory):
    """One AGENTARIUM_HOME per session, so the tiny model is built once and never in ~/.cache."""
    home = tmp_path_factory.mktemp("agentarium-home")
    old = os.environ.get("AGENTARIUM_HOME")
    os.environ["AGENTARIUM_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("AGENTARIUM_HOME", None)
    else:
        os.environ["AGENTARIUM_HOME"] = old


@pytest.fixture(scope="session")
def smol_dir(agentarium_home, tmp_path_factory):
    """The built-in real model (``--model smol``), converted once for the whole run.

    The conversion costs about a minute of CPU, so parallel workers share one copy: it is built
    under the run's shared temporary root (xdist's workers' common parent), or in
    ``$AGENTARIUM_TEST_SMOL_HOME`` when set (ops/test.sh's tiers share one), while a file lock
    makes the other workers wait for it, and it is linked into this session's
    ``$AGENTARIUM_HOME/models/`` so ``--model smol`` in any process of the test resolves to it.
    Without the ``smol`` extra the tier is skipped (failed under ``CI=true``).
    """
    import fcntl
    from pathlib import Path

    from agentarium.smol import SmolModelError, ensure_smol_model

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    # ops/test.sh names one folder for all its tiers (the avx2 tier reuses the first pass's)
    shared = Path(os.environ.get("AGENTARIUM_TEST_SMOL_HOME") or Path(root) / "smol-home")
    shared.mkdir(parents=True, exist_ok=True)
    try:
        with open(shared / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            built = ensure_smol_model(shared)
    except SmolModelError as exc:
        if os.environ.get("CI", "").lower() == "true":
            raise
        pytest.skip(f"the real-model tier needs the smol extra: {exc}")
    link = Path(agentarium_home) / "models" / built.name
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(built, target_is_directory=True)
    return link


@pytest.fixture
def span_exporter() -> InMemorySpanExporter:
    """The session's in-memory span exporter, emptied for this test."""
    _EXPORTER.clear()
    return _EXPORTER


@pytest.fixture
def nats_server(tmp_path):
    """A nats-server with JetStream on a free port, store in ``tmp_path/"nats"``."""
    server = NatsServer(store_dir=tmp_path / "nats").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture
def settings(nats_url) -> NatsSettings:
    return NatsSettings(url=nats_url)


@pytest.fixture
async def nc(settings):
    client = await settings.connect(name="agentarium-test")
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def topology() -> Topology:
    return Topology()


@pytest.fixture
async def js(nc, topology):
    """JetStream on ``nc``, with every stream, consumer and bucket provisioned."""
    context = nc.jetstream()
    await provision(context, topology)
    return context


@pytest.fixture(scope="module")
def tiny_dir(agentarium_home):
    """The built-in tiny model, built once per session under the session's AGENTARIUM_HOME."""
    from agentarium.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="module")
def template(tiny_dir):
    from agentarium.formats.chat_template import ChatTemplate

    return ChatTemplate.from_model_dir(tiny_dir)


@pytest.fixture(scope="module")
def engine_url(tiny_dir):
    """The real local engine serving the tiny model, one per test module."""
    from fake_sglang import local_engine

    with local_engine(tiny_dir) as url:
        yield url


@pytest.fixture
async def replying(template):
    """Start SGLang fakes whose reply is ``text`` as real tiny-tokenizer ids (``kwargs``:
    FakeSGLang's); closed after the test."""
    from fake_sglang import FakeSGLang

    started: list[FakeSGLang] = []

    async def make(text: str = "five", **kwargs) -> FakeSGLang:
        ids = template.encode(text) + [template.eos_token_ids[0]]
        fake = FakeSGLang(reply=lambda body: (ids, text), **kwargs)
        await fake.start()
        started.append(fake)
        return fake

    yield make
    for fake in started:
        await fake.close()


@pytest.fixture
async def fake():
    """An SGLang fake (tests/fake_sglang.py) on a free port, closed after the test."""
    from fake_sglang import FakeSGLang

    server = FakeSGLang()
    await server.start()
    yield server
    await server.close()


@pytest.fixture
async def gateway(fake, template):
    """A rollout's gateway on the SGLang fake: ``(proxy, llm, endpoint)`` for job ``job-1``."""
    from agentarium.consumers.backends import SGLangBackend
    from agentarium.consumers.tracing.llm import TracingLLM
    from agentarium.consumers.tracing.proxy import TracingProxy
    from agentarium.schemas import Sampling

    backend = SGLangBackend([fake.url], retries=0, backoff=0.0)
    proxy = TracingProxy(host="127.0.0.1")
    await proxy.start()
    llm = TracingLLM(backend, template, Sampling(max_new_tokens=64), "g", "job-1", "tiny")
    with proxy.register("job-1", llm) as endpoint:
        yield proxy, llm, endpoint
    await proxy.close()
    await backend.aclose()
