"""Reload parts and their files, without a server: key and secret files, a rotation's previous secret, a part
that fails keeping the old material, the QUIC certificate swap, and the secrets the supervisor hands its workers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aioquic.quic.configuration import QuicConfiguration
from prometheus_client import CollectorRegistry, Counter

from gateway.config import GatewayConfig
from gateway.http.auth import Auth, AuthFileError, read_key_file, read_secret_file
from gateway.http.certs import generate
from gateway.http.reload import Reloader, add_auth_parts, auth_from
from gateway.http3.server import reload_certificate
from tokenfan.supervisor import worker_secrets


def test_key_file_skips_comments_and_blank_lines(tmp_path: Path) -> None:
    (tmp_path / "k").write_text("# ops keys\n  alpha  \n\nbeta\n#gamma\n")
    assert read_key_file(tmp_path / "k") == {"alpha", "beta"}


def test_secret_file_keeps_order_and_needs_one_secret(tmp_path: Path) -> None:
    (tmp_path / "s").write_text("new\nold\nnew\n")
    assert read_secret_file(tmp_path / "s") == (b"new", b"old")
    (tmp_path / "s").write_text("# none\n")
    with pytest.raises(AuthFileError, match="no secret"):
        read_secret_file(tmp_path / "s")
    with pytest.raises(AuthFileError, match="missing"):
        read_secret_file(tmp_path / "missing")


def test_a_token_of_the_previous_secret_verifies_until_it_expires_or_the_secret_is_dropped() -> None:
    auth = Auth(secret=b"one" * 11, token_ttl=60)
    token = auth.sign("s1", now=1000)
    auth.secret, auth.previous = b"two" * 11, (b"one" * 11,)  # rotated
    assert auth.verify("s1", token, now=1030)
    assert not auth.verify("s1", token, now=1061)  # expired
    assert auth.verify("s1", auth.sign("s1", now=1000), now=1030)  # the new secret signs
    assert not Auth(secret=b"one" * 11).verify("s1", auth.sign("s1", now=1000), now=1030)
    auth.previous = ()  # dropped
    assert not auth.verify("s1", token, now=1030)


def config(_: Path, **kw: object) -> GatewayConfig:
    return GatewayConfig(**kw)  # type: ignore[arg-type]


def test_reloading_keys_and_secrets_and_a_bad_file_keeps_the_old(tmp_path: Path) -> None:
    keys, secrets = tmp_path / "keys", tmp_path / "secrets"
    keys.write_text("a\nb\n")
    secrets.write_text("s-one\n")
    cfg = config(tmp_path, api_keys=("fixed",), api_key_file=keys, token_secret_file=secrets)
    auth = auth_from(cfg)
    assert auth.api_keys == {"fixed", "a", "b"} and auth.secret == b"s-one" and auth.required
    reloader = Reloader()
    reloader.counter = Counter("r", "r", ["part", "result"], registry=CollectorRegistry())
    add_auth_parts(reloader, auth, cfg)

    keys.write_text("b\nc\n")
    secrets.write_text("s-two\ns-one\n")
    assert asyncio.run(reloader.reload())
    assert auth.api_keys == {"fixed", "b", "c"} and (auth.secret, auth.previous) == (b"s-two", (b"s-one",))

    keys.unlink()
    secrets.write_text("\n")
    assert not asyncio.run(reloader.reload())
    assert auth.api_keys == {"fixed", "b", "c"} and auth.secret == b"s-two"
    assert reloader.counter.labels("api_keys", "error")._value.get() == 1
    assert reloader.counter.labels("token_secrets", "ok")._value.get() == 1

    keys.write_text("")  # no key left: still required, so everything is refused
    asyncio.run(reloader.reload())
    assert auth.api_keys == {"fixed"}
    auth.api_keys = frozenset()
    assert auth.enabled


def test_the_quic_certificate_is_swapped_only_for_a_pair_that_loads(tmp_path: Path) -> None:
    cert_a, key_a = generate(tmp_path / "a")
    cert_b, key_b = generate(tmp_path / "b")
    live = tmp_path / "live"
    live.mkdir()
    (live / "cert.pem").write_bytes(cert_a.read_bytes())
    (live / "key.pem").write_bytes(key_a.read_bytes())
    cfg = config(tmp_path, ssl_certfile=live / "cert.pem", ssl_keyfile=live / "key.pem")
    qc = QuicConfiguration(is_client=False)
    qc.load_cert_chain(live / "cert.pem", live / "key.pem")
    before = qc.certificate

    (live / "cert.pem").write_bytes(cert_b.read_bytes())  # the key is still a's
    with pytest.raises(ValueError, match="is not the key of"):
        reload_certificate(qc, cfg)
    (live / "key.pem").write_text("garbage")
    with pytest.raises(ValueError):
        reload_certificate(qc, cfg)
    assert qc.certificate == before
    (live / "key.pem").write_bytes(key_b.read_bytes())
    assert reload_certificate(qc, cfg).startswith("new certificate")
    assert qc.certificate != before
    assert reload_certificate(qc, cfg) == "certificate unchanged"


def test_workers_get_one_secret_and_the_keys_by_environment_not_argv() -> None:
    cfg, env = worker_secrets(GatewayConfig(api_keys=("k1", "k2"), workers=2))
    assert cfg.token_secret is None and cfg.api_keys == ()
    assert env["TOKENFAN_API_KEYS"] == "k1,k2" and len(env["TOKENFAN_TOKEN_SECRET"]) >= 32
    assert worker_secrets(GatewayConfig(token_secret="mine"))[1]["TOKENFAN_TOKEN_SECRET"] == "mine"
    assert "TOKENFAN_TOKEN_SECRET" not in worker_secrets(GatewayConfig(token_secret_file=Path("f")))[1]
