"""Client identity, holdings, fair admission and the ``/v1/ws`` per-connection queue (pure, no sockets)."""

from __future__ import annotations

import pytest

from gateway.admission import Holdings, fair_refusal
from gateway.api.lanes import Lanes, WsClientError
from gateway.api.openai.ws_mux import Request, queue_full
from gateway.config import TrustedProxies
from gateway.errors import APIError
from gateway.http.clients import identify, key_client


def _scope(peer: str, *headers: tuple[bytes, bytes], key: str | None = None) -> dict:
    return {"type": "http", "client": (peer, 5555), "headers": list(headers),
            "state": {"api_key": key} if key else {}}


def test_a_client_is_its_key_when_keys_are_on_and_the_key_is_not_kept() -> None:
    client = identify(_scope("10.0.0.1", key="s3cret"), TrustedProxies())
    assert client == key_client("s3cret") and "s3cret" not in client
    assert identify(_scope("10.0.0.2", key="s3cret"), TrustedProxies()) == client  # any address


def test_x_forwarded_for_is_ignored_unless_the_peer_is_a_trusted_proxy() -> None:
    xff = (b"x-forwarded-for", b"1.2.3.4")
    assert identify(_scope("10.0.0.9", xff), TrustedProxies()) == "addr:10.0.0.9"
    assert identify(_scope("10.0.0.9", xff), TrustedProxies(["192.168.0.0/16"])) == "addr:10.0.0.9"
    assert identify(_scope("10.0.0.9", xff), TrustedProxies(["10.0.0.0/8"])) == "addr:1.2.3.4"


def test_the_client_is_the_rightmost_forwarded_address_that_is_not_a_trusted_proxy() -> None:
    trusted = TrustedProxies(["10.0.0.0/8", "::1"])
    spoofed = (b"x-forwarded-for", b"6.6.6.6, 1.2.3.4, 10.1.1.1")  # the client wrote 6.6.6.6 itself
    assert identify(_scope("10.0.0.9", spoofed), trusted) == "addr:1.2.3.4"
    assert identify(_scope("::1", (b"x-forwarded-for", b"1.2.3.4"), (b"x-forwarded-for", b"5.6.7.8")),
                    trusted) == "addr:5.6.7.8"  # two headers read as one list
    with pytest.raises(ValueError):
        TrustedProxies(["not-a-network"])


def test_holdings_refuse_at_the_limit_with_the_code_naming_it_and_forget_idle_clients() -> None:
    held = Holdings()
    held.acquire("subscriptions", "a", 2)
    held.acquire("subscriptions", "a", 2)
    with pytest.raises(APIError) as info:
        held.acquire("subscriptions", "a", 2)
    assert (info.value.status, info.value.code) == (429, "client_subscription_limit")
    assert "--max-subscriptions-per-client" in info.value.message and info.value.retry_after
    held.acquire("subscriptions", "b", 2)
    assert held.totals["subscriptions"] == 3 and held.clients("subscriptions") == 2
    for client in ("a", "a", "b"):
        held.release("subscriptions", client)
    assert held.totals["subscriptions"] == 0 and held.clients("subscriptions") == 0
    held.acquire("connections", "a", 0)  # 0 = no limit
    with pytest.raises(RuntimeError):
        held.release("generations", "a")


@pytest.mark.parametrize(("holding", "total", "clients", "queue", "refused"), [
    (0, 100, 5, True, False),  # holding nothing: always in
    (60, 100, 2, False, True),  # saturated (soft cap 75 reached? no: 100 >= 75) and above the average
    (40, 100, 2, False, False),  # below the average
    (50, 50, 1, False, False),  # under the soft cap
    (75, 75, 1, False, True),  # alone at the soft cap: the rest is kept for newcomers
    (30, 50, 2, True, True),  # the engines queue: above the average waits
    (25, 50, 2, True, False),  # equal clients do not
])
def test_fair_refusal(holding: int, total: int, clients: int, queue: bool, refused: bool) -> None:
    assert (fair_refusal(holding, total, clients, 75, queue) is not None) == refused


def _ws_lanes(active: int, queued: int) -> Lanes[Request]:
    return Lanes(active, active + queued + 1, queued, keep_idle=False, pending_error=queue_full)


def _req(i: int) -> Request:
    return Request(str(i), "completions", {})


def test_ws_requests_beyond_in_flight_wait_and_beyond_the_queue_are_refused_each() -> None:
    lanes = _ws_lanes(2, 1)
    assert [r.id for _, r in lanes.submit("0", _req(0))] == ["0"]
    assert [r.id for _, r in lanes.submit("1", _req(1))] == ["1"]
    assert lanes.submit("2", _req(2)) == []  # waits
    for i in (3, 4):
        with pytest.raises(WsClientError) as info:
            lanes.submit(str(i), _req(i))
        assert (info.value.error.status, info.value.error.code) == (429, "connection_queue_limit")
        assert "--ws-max-in-flight 2" in info.value.error.message and "--ws-max-queued 1" in info.value.error.message
        assert str(i) not in lanes  # a refused id leaves nothing behind
    assert [r.id for _, r in lanes.finished("0")] == ["2"]
    assert "0" not in lanes  # an id is free again once its request is over


def test_a_cancelled_waiting_ws_request_frees_its_place() -> None:
    lanes = _ws_lanes(1, 1)
    lanes.submit("a", _req(0))
    lanes.submit("b", _req(1))
    assert lanes.cancel("b") and "b" not in lanes and lanes.pending == 0
    assert not lanes.cancel("a")  # running: the task is cancelled instead
    lanes.submit("c", _req(2))
    assert [r.id for _, r in lanes.finished("a")] == ["2"]


def test_with_no_queue_a_ws_request_starts_when_a_slot_is_free() -> None:
    lanes = _ws_lanes(1, 0)
    assert lanes.submit("a", _req(0))
    with pytest.raises(WsClientError):
        lanes.submit("b", _req(1))
    lanes.finished("a")
    assert lanes.submit("b", _req(1))
