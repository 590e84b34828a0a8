"""NATS over TLS with client certificates: a CA, a server and a client certificate are made
here (the ``cryptography`` package), nats-server requires and verifies client certificates,
and the producer and a consumer talk to it through ``NatsSettings``' TLS options (the
``AGENTARIUM_NATS_TLS_*`` variables, ``--nats-tls-*`` flags). A client that does not trust the
CA, or has no certificate, is refused."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import agentlib
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from fake_sglang import FakeSGLang
from worker_env import worker_for

from agentarium.broker import BrokerUnavailable, NatsServer, NatsSettings, Topology, provision
from agentarium.producers import TaskProducer, TrajectoryReader

pytestmark = pytest.mark.nats_semantics


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, key, cert: x509.Certificate) -> tuple[str, str]:
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path.with_suffix(".pem")), str(path.with_suffix(".key"))


def _cert(name: str, key, issuer_cert, issuer_key, *, ca: bool = False, usage=None, san=None):
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_cert.subject if issuer_cert else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    out = tmp_path_factory.mktemp("pki")
    ca_key = _key()
    ca = _cert("agentarium-test-ca", ca_key, None, None, ca=True)
    ca_pem, _ = _write(out / "ca", ca_key, ca)
    server_key = _key()
    server = _cert(
        "nats",
        server_key,
        ca,
        ca_key,
        usage=[ExtendedKeyUsageOID.SERVER_AUTH],
        san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
    )
    server_pem, server_keyfile = _write(out / "server", server_key, server)
    client_key = _key()
    client = _cert(
        "agentarium-consumer", client_key, ca, ca_key, usage=[ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    client_pem, client_keyfile = _write(out / "client", client_key, client)
    return {
        "ca": ca_pem,
        "server_cert": server_pem,
        "server_key": server_keyfile,
        "client_cert": client_pem,
        "client_key": client_keyfile,
    }


@pytest.fixture
def tls_server(tmp_path, pki):
    """nats-server requiring TLS and a client certificate signed by the test CA."""
    server = NatsServer(
        store_dir=tmp_path / "nats",
        extra_args=(
            "--tlsverify",
            "--tlscert",
            pki["server_cert"],
            "--tlskey",
            pki["server_key"],
            "--tlscacert",
            pki["ca"],
        ),
    ).start()
    yield server
    server.stop()


async def test_jobs_and_trajectories_travel_over_tls_with_client_certificates(tls_server, pki):
    settings = NatsSettings.from_env(
        {
            "AGENTARIUM_NATS_URL": f"tls://127.0.0.1:{tls_server.port}",
            "AGENTARIUM_NATS_TLS_CA": pki["ca"],
            "AGENTARIUM_NATS_TLS_CERT": pki["client_cert"],
            "AGENTARIUM_NATS_TLS_KEY": pki["client_key"],
        }
    )
    topo = Topology()
    fake = FakeSGLang()
    await fake.start()
    producer_nc = await settings.connect(name="tls-producer")
    consumer_nc = await settings.connect(name="tls-consumer")
    try:
        assert producer_nc.connected_url.scheme == "tls"
        js = producer_nc.jetstream()
        await provision(js, topo)
        result = await TaskProducer(js, topo).submit(
            "echo", [{"task_id": f"t{i}", "prompt": "hi"} for i in range(3)], run="tls"
        )
        assert result.published == 3
        async with worker_for(
            consumer_nc.jetstream(), "echo", agentlib.echo, [fake.url], worker_id="tls-worker"
        ) as worker:
            counters = await worker.run()
        assert counters.ok == 3, counters
        stored = await TrajectoryReader(js, topo).read("tls")
        assert sorted(t.job_id for t in stored) == sorted(result.job_ids)
        assert all(t.status == "ok" and t.calls for t in stored)
    finally:
        for nc in (producer_nc, consumer_nc):
            await nc.close()
        await fake.close()


async def test_a_client_that_does_not_trust_the_ca_or_has_no_certificate_is_refused(
    tls_server, pki, monkeypatch
):
    url = f"tls://127.0.0.1:{tls_server.port}"
    # Client certificate, but the system's CAs only: the server's certificate is not trusted.
    untrusting = NatsSettings(
        url=url, tls_cert=pki["client_cert"], tls_key=pki["client_key"], connect_timeout_s=2
    )
    # "Not retried" counted, not timed: every attempt opens a TCP connection through nats-py's
    # TcpTransport.connect (a retry would be a second call, 0.5 s later), so the count is exact
    # whatever the machine's load (a 2 s wall bound against a busy box was a guess).
    from nats.aio.transport import TcpTransport

    attempts = []
    plain_connect = TcpTransport.connect

    async def counted(self, *args, **kwargs):
        attempts.append(args[0])
        return await plain_connect(self, *args, **kwargs)

    monkeypatch.setattr(TcpTransport, "connect", counted)
    with pytest.raises(BrokerUnavailable, match="presented a TLS certificate") as refused:
        await untrusting.connect(name="tls-no-ca", reconnect_forever=False)
    monkeypatch.setattr(TcpTransport, "connect", plain_connect)
    assert "certificate verify failed" in str(refused.value).lower()
    assert "AGENTARIUM_NATS_TLS_CA" in str(refused.value)
    assert len(attempts) == 1, f"a certificate that fails to verify is not retried: {attempts}"
    # Trusts the CA but shows no certificate: the server (--tlsverify) refuses it.
    anonymous = NatsSettings(url=url, tls_ca=pki["ca"], connect_timeout_s=2)
    with pytest.raises(BrokerUnavailable, match="cannot connect to NATS"):
        await anonymous.connect(name="tls-no-cert", reconnect_forever=False)
    # Plain TCP to a TLS-only server: refused too (the server requires TLS).
    plain = NatsSettings(url=f"nats://127.0.0.1:{tls_server.port}", connect_timeout_s=2)
    with pytest.raises(BrokerUnavailable):
        await plain.connect(name="tls-plain", reconnect_forever=False)
