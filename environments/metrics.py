"""An environment worker's Prometheus series: sessions, starts, steps, errors, expiries.

Defined once per process on the default registry, which ``agentarium env serve|bridge
--metrics-port`` serves (broker.MetricsServer), beside the same figures in ``$SRV.STATS``
(those are what ``agentarium env status`` reads; these are for a Prometheus that scrapes every
worker). The only label is the environment's name, plus an error code from the fixed list
``schemas.ENV_ERROR_CODES``: never a session or job id. Several workers in one process (tests)
share their environment's series.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# A step of a light environment takes microseconds on the worker; a shell command or an
# AgentBench task's turn, seconds to minutes.
STEP_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
)

SESSIONS = Gauge(
    "agentarium_env_sessions_open", "Sessions this process's workers hold now", ["env"]
)
CAPACITY = Gauge(
    "agentarium_env_sessions_capacity", "The most sessions this process's workers hold", ["env"]
)
ACCEPTING = Gauge(
    "agentarium_env_accepting",
    "Workers of this process listening on the start subject now (with room, not draining)",
    ["env"],
)
STARTS = Counter("agentarium_env_session_starts", "Sessions started (reset answered)", ["env"])
REJECTED = Counter(
    "agentarium_env_session_rejections",
    "Starts answered 503: the worker was full or draining (the client backs off and retries)",
    ["env"],
)
STEPS = Counter("agentarium_env_steps", "Steps answered", ["env"])
STEP_SECONDS = Histogram(
    "agentarium_env_step_duration_seconds",
    "One step on the worker, request in to reply out",
    ["env"],
    buckets=STEP_BUCKETS,
)
CLOSED = Counter("agentarium_env_sessions_closed", "Sessions closed by their client", ["env"])
EXPIRED = Counter(
    "agentarium_env_sessions_expired",
    "Sessions the worker closed: idle past --idle-timeout, past their deadline, or left at the "
    "end of a drain",
    ["env"],
)
ERRORS = Counter(
    "agentarium_env_errors",
    "Requests answered 500: the environment raised in reset, step or close (its session ends)",
    ["env"],
)
REFUSED = Counter(
    "agentarium_env_requests_refused",
    "Requests answered with an error, by code: 400 bad request or task, 404 unknown session, "
    "408 past its deadline, 409 seq out of order, 413 too large, 500 the environment raised, "
    "503 full or draining",
    ["env", "code"],
)


class EnvMetrics:
    """One environment's children of the series, resolved once per worker."""

    def __init__(self, env: str) -> None:
        self.env = env
        self.sessions = SESSIONS.labels(env)
        self.capacity = CAPACITY.labels(env)
        self.accepting = ACCEPTING.labels(env)
        self.starts = STARTS.labels(env)
        self.rejected = REJECTED.labels(env)
        self.steps = STEPS.labels(env)
        self.step_seconds = STEP_SECONDS.labels(env)
        self.closed = CLOSED.labels(env)
        self.expired = EXPIRED.labels(env)
        self.errors = ERRORS.labels(env)

    def refused(self, code: int) -> None:
        REFUSED.labels(self.env, str(code)).inc()
