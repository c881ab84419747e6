"""``--broker`` URLs: each topology parsed, and every malformed URL refused with a message naming the fault."""

from __future__ import annotations

import pytest

from gateway.config import BrokerTimings
from gateway.scaleout.redis_clients import BrokerAddress, Credentials, connect, parse_broker_url


def test_standalone_urls_are_left_to_redis_py() -> None:
    for url in ("redis://h:6379/0", "rediss://u:p@h:6380/2", "unix:///run/redis.sock?db=1"):
        a = parse_broker_url(url)
        assert a.topology == "standalone" and a.url == url and a.tls == url.startswith("rediss")


def test_sentinel_url_names_the_sentinels_the_service_and_the_database() -> None:
    a = parse_broker_url("redis+sentinel://tokenfan:s%40cret@s1:26379,s2,[::1]:26380/mymaster/3")
    assert a == BrokerAddress("sentinel", a.url, False, (("s1", 26379), ("s2", 26379), ("::1", 26380)),
                              "mymaster", 3, "tokenfan", "s@cret")
    assert parse_broker_url("redis+sentinel://s1:26379/m").db == 0


def test_cluster_url_names_its_startup_nodes_and_tls_options() -> None:
    a = parse_broker_url("rediss+cluster://:pw@n1:7000,n2:7001?ssl_ca_certs=/ca.pem")
    assert (a.topology, a.tls, a.hosts, a.password, a.username) == ("cluster", True, (("n1", 7000), ("n2", 7001)),
                                                                    "pw", None)
    assert a.tls_options == {"ssl_ca_certs": "/ca.pem"}


@pytest.mark.parametrize(("url", "says"), [
    ("http://h:6379", "unknown scheme"),
    ("redis+sentinel://s1:26379", "<service name>"),
    ("redis+sentinel://s1:26379/m/x", "not a number"),
    ("redis+sentinel:///m", "at least one host"),
    ("redis+cluster://n1:7000/0", "one database"),
    ("redis+cluster://n1:port", "bad port"),
    ("redis+cluster://n1:7000?ssl_ca_certs=/ca.pem", "unknown option"),
    ("rediss+cluster://n1:7000?db=1", "unknown option db"),
])
def test_malformed_urls_are_refused_with_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_broker_url(url)


def test_the_password_outside_the_url_is_used_only_when_the_url_has_none() -> None:
    t = BrokerTimings()
    given = connect("redis://h:6379/0", t, Credentials(password="env"))
    assert given.redis.connection_pool.connection_kwargs["password"] == "env"
    own = connect("redis://:url@h:6379/0", t, Credentials(password="env"))
    assert own.redis.connection_pool.connection_kwargs["password"] == "url"
    sentinel = connect("redis+sentinel://s1:26379/m", t, Credentials(password="env", sentinel_password="sp"))
    assert sentinel.redis.connection_pool.connection_kwargs["password"] == "env"
    assert sentinel._sentinel is not None
    assert sentinel._sentinel.sentinels[0].connection_pool.connection_kwargs["password"] == "sp"
    assert "env" not in sentinel.where() and "sp" not in sentinel.where()
