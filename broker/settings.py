"""NATS connection settings: URL, auth (user/password, token, nkey, creds) and TLS.

Every command reads the same environment variables, and flags override them:

    AGENTARIUM_NATS_URL       nats://127.0.0.1:4222 (comma-separated for a cluster)
    AGENTARIUM_NATS_USER / AGENTARIUM_NATS_PASSWORD
    AGENTARIUM_NATS_TOKEN
    AGENTARIUM_NATS_CREDS     a .creds file (JWT + nkey seed)
    AGENTARIUM_NATS_NKEY      an nkey seed file
    AGENTARIUM_NATS_TLS_CA / AGENTARIUM_NATS_TLS_CERT / AGENTARIUM_NATS_TLS_KEY
    AGENTARIUM_PREFIX         subject/stream prefix, default "agentarium"
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import nats
import nats.errors
import structlog

from agentarium.schemas import setting, settings

from .aio import cancel_and_wait
from .errors import BrokerUnavailable

DEFAULT_URL = "nats://127.0.0.1:4222"
log = structlog.get_logger("agentarium.broker")


@dataclass(frozen=True, kw_only=True)
class NatsSettings:
    """How a process reaches NATS; each flag (``--nats-*``, ``--prefix``) overrides its
    environment variable, which overrides the default."""

    url: str = setting(
        DEFAULT_URL,
        flag="--nats-url",
        metavar="URL",
        env="AGENTARIUM_NATS_URL",
        help="server URL(s), comma-separated",
    )
    user: str | None = setting(
        None, flag="--nats-user", metavar="USER", env="AGENTARIUM_NATS_USER", help="username"
    )
    password: str | None = setting(
        None,
        flag="--nats-password",
        metavar="PASSWORD",
        env="AGENTARIUM_NATS_PASSWORD",
        help="password (prefer the env var)",
    )
    token: str | None = setting(
        None, flag="--nats-token", metavar="TOKEN", env="AGENTARIUM_NATS_TOKEN", help="auth token"
    )
    creds_file: str | None = setting(
        None,
        flag="--nats-creds",
        metavar="FILE",
        env="AGENTARIUM_NATS_CREDS",
        help="a .creds file, JWT + nkey",
    )
    nkey_seed_file: str | None = setting(
        None,
        flag="--nats-nkey",
        metavar="FILE",
        env="AGENTARIUM_NATS_NKEY",
        help="an nkey seed file",
    )
    tls_ca: str | None = setting(
        None,
        flag="--nats-tls-ca",
        metavar="FILE",
        env="AGENTARIUM_NATS_TLS_CA",
        help="CA bundle to verify the server",
    )
    tls_cert: str | None = setting(
        None,
        flag="--nats-tls-cert",
        metavar="FILE",
        env="AGENTARIUM_NATS_TLS_CERT",
        help="client certificate",
    )
    tls_key: str | None = setting(
        None,
        flag="--nats-tls-key",
        metavar="FILE",
        env="AGENTARIUM_NATS_TLS_KEY",
        help="client key",
    )
    prefix: str = setting(
        "agentarium",
        flag="--prefix",
        metavar="NAME",
        env="AGENTARIUM_PREFIX",
        help="subject/stream prefix (default agentarium)",
    )
    connect_timeout_s: float = setting(5.0, flagless="how long one connection attempt may take")
    # A server that stops answering without closing the connection (a partition, a host gone)
    # is noticed after max_outstanding_pings unanswered pings: 20-30 s here, where nats-py's
    # defaults (120 s, 2) leave a client waiting on it for 4-6 minutes; then the client
    # reconnects to another server of the cluster.
    ping_interval_s: float = setting(10.0, flagless="see the comment: a silent server's bound")
    max_outstanding_pings: int = setting(2, flagless="see ping_interval_s")

    def __post_init__(self) -> None:
        for url in self.servers:
            if "://" not in url:
                raise ValueError(f"NATS URL {url!r} needs a scheme, e.g. nats://127.0.0.1:4222")
            scheme = url.split("://", 1)[0].lower()
            if scheme not in NATS_SCHEMES:
                raise ValueError(
                    f"NATS URL {redact_url(url)!r}: {scheme}:// is not a NATS scheme; use "
                    f"{', '.join(s + '://' for s in NATS_SCHEMES)} (e.g. nats://127.0.0.1:4222)"
                )
        if bool(self.user) != bool(self.password):
            raise ValueError("NATS user and password go together: set both or neither")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError(
                "a TLS client certificate needs its key: set both tls_cert and tls_key"
            )

    @property
    def servers(self) -> list[str]:
        return [u.strip() for u in self.url.split(",") if u.strip()]

    @property
    def safe_url(self) -> str:
        """``url`` for logs and messages: credentials written into it (``nats://user:pass@``,
        ``nats://token@``) replaced by ``***``."""
        return ",".join(redact_url(u) for u in self.servers)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> NatsSettings:
        """Settings from AGENTARIUM_* variables; non-None ``overrides`` (flags) win."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {
            key.name: env[key.meta.env]
            for key in settings.keys(cls)
            if key.meta.env and env.get(key.meta.env)
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def with_url(self, url: str) -> NatsSettings:
        return replace(self, url=url)

    def redacted(self) -> dict[str, Any]:
        """For logging the effective config: secrets replaced by '***'."""
        out = asdict(self)
        for secret in ("password", "token"):
            if out[secret]:
                out[secret] = "***"
        out["url"] = self.safe_url
        return out

    def _tls_context(self) -> ssl.SSLContext | None:
        if not (self.tls_ca or self.tls_cert):
            return None
        ctx = ssl.create_default_context(cafile=self.tls_ca)
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    async def connect(
        self, *, name: str = "agentarium", reconnect_forever: bool = True
    ) -> nats.NATS:
        """Connect, failing fast with a clear message on a bad URL or bad credentials.

        Long-running services reconnect forever after the first connection, so a broker
        restart is ridden out; the first connection is not retried for long, so a typo
        shows at once instead of a hang.
        """
        errors: list[str] = []
        connected_once = False
        refused = asyncio.Event()

        async def on_error(exc: Exception) -> None:
            detail = str(exc) or type(exc).__name__
            errors.append(detail)
            if (_is_auth_error(detail) or _is_untrusted(exc)) and not nc.is_connected:
                refused.set()  # nats-py would retry a refused login ~10 times: stop at the first
                return
            if connected_once:  # before that, the one error line below says what went wrong
                log.warning("nats error", error=detail)

        async def on_disconnect() -> None:
            if not nc.is_closed:  # also called on our own close(): not worth a warning then
                log.warning("nats disconnected", servers=self.safe_url)

        async def on_reconnect() -> None:
            log.info("nats reconnected", servers=self.safe_url)

        options: dict[str, Any] = {
            "servers": self.servers,
            "name": name,
            "connect_timeout": self.connect_timeout_s,
            "allow_reconnect": True,
            # one-shot commands: a refused or wrong URL fails in about 2 s, not 6-11
            "max_reconnect_attempts": -1 if reconnect_forever else 3,
            "reconnect_time_wait": 0.5,
            "ping_interval": self.ping_interval_s,
            "max_outstanding_pings": self.max_outstanding_pings,
            "error_cb": on_error,
            "disconnected_cb": on_disconnect,
            "reconnected_cb": on_reconnect,
            # Publishes made while disconnected are buffered up to this size.
            "pending_size": 64 * 1024 * 1024,
        }
        if self.user:
            options.update(user=self.user, password=self.password)
        if self.token:
            options["token"] = self.token
        if self.creds_file:
            options["user_credentials"] = self.creds_file
        if self.nkey_seed_file:
            options["nkeys_seed"] = self.nkey_seed_file
        tls = self._tls_context()
        if tls is not None:
            options["tls"] = tls

        nc = nats.NATS()
        connecting = asyncio.create_task(nc.connect(**options))
        refusal = asyncio.create_task(refused.wait())
        try:
            # The first connection is bounded in time; a refused login ends it at once.
            done, _ = await asyncio.wait(
                {connecting, refusal},
                timeout=self.connect_timeout_s * 2,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if connecting not in done:
                connecting.cancel()
                raise nats.errors.Error(errors[-1] if errors else "timed out")
            connecting.result()
            connected_once = True
        except asyncio.CancelledError:  # Ctrl-C while connecting: leave no client task behind
            # (nats-py's connect may swallow the cancel and still start its reader, pinger and
            # flusher, which asyncio.run would then find pending on a closed loop)
            await cancel_and_wait([connecting])
            await _close_quietly(nc)
            raise
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            await _close_quietly(nc)
            # A refused login can surface as a reset connection first: any auth error decides.
            auth = [e for e in errors if _is_auth_error(e)]
            detail = (
                auth[-1] if auth else errors[-1] if errors else (str(exc) or type(exc).__name__)
            )
            if any(_is_untrusted_detail(e) for e in errors):
                raise BrokerUnavailable(
                    f"NATS at {self.safe_url} presented a TLS certificate this client does not "
                    f"trust ({detail}): set AGENTARIUM_NATS_TLS_CA (--nats-tls-ca) to the CA "
                    "that signed the server's certificate"
                ) from exc
            if auth or _is_auth_error(detail):
                raise BrokerUnavailable(
                    f"NATS at {self.safe_url} refused the credentials ({detail}): check "
                    "AGENTARIUM_NATS_USER/PASSWORD, TOKEN, CREDS or NKEY"
                ) from exc
            raise BrokerUnavailable(
                f"cannot connect to NATS at {self.safe_url} ({detail}): start one with "
                "`agentarium broker up`, or set AGENTARIUM_NATS_URL / --nats-url"
            ) from exc
        finally:
            refusal.cancel()
        return nc


NATS_SCHEMES = ("nats", "tls", "ws", "wss")  # what nats-py connects with


def redact_url(url: str) -> str:
    """One server URL with its user info's secret replaced: ``user:***@`` or ``***@``."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    user, has_password, _ = userinfo.partition(":")
    masked = f"{user}:***" if has_password else "***"  # no password: the user part is a token
    return urlunsplit(parts._replace(netloc=f"{masked}@{host}"))


def _is_untrusted(exc: BaseException) -> bool:
    """The server's certificate failed verification: retrying cannot help."""
    return isinstance(exc, ssl.SSLCertVerificationError)


def _is_untrusted_detail(detail: str) -> bool:
    return "certificate verify failed" in detail.lower()


def _is_auth_error(detail: str) -> bool:
    lowered = detail.lower()
    return "authorization" in lowered or "authentication" in lowered


async def _close_quietly(nc: nats.NATS) -> None:
    try:
        await nc.close()
    except Exception:  # closing a half-open client can raise anything; nothing to save
        pass
