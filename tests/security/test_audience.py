"""Signed calls are bound to their audience (issue 31, "Security round 2"), against real service processes:
a call signed for the decode service is refused by the prefill service (each has its own nonce store,
so before this it was accepted there), and a call recorded before a service restarted is refused by the
new process at the same address (a fresh nonce store, within the 30 s window). A caller signing as the
router does (`SignedCalls`) learns who answers at an address from its signed /health identity, and
follows a restart there without a failed call."""

from __future__ import annotations

import uuid

import httpx
import pytest

from common.protocol import AbortRequest, encode
from common.security.internal_auth import SignedCalls
from common.security.secret import InternalSecret
from tests.support.cluster import INTERNAL_SECRET, Cluster, Proc, free_port, get_json

pytestmark = pytest.mark.services
SECRET = InternalSecret(INTERNAL_SECRET.encode())
FLAGS = ("--threads", "1", "--kv-cache-mb", "32")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    c = Cluster(None, str(tmp_path_factory.mktemp("logs")))
    try:
        yield c
    finally:
        c.stop()


class Recorder:
    """A signing client that keeps what it sent: the headers of its last /internal/ call."""

    def __init__(self) -> None:
        self.sent: list[httpx.Request] = []
        self.client = httpx.Client(
            timeout=30, auth=SignedCalls(SECRET), event_hooks={"request": [self.sent.append]}
        )

    def abort(self, url: str, rid: str) -> tuple[httpx.Response, dict[str, str], bytes]:
        """POST /internal/abort signed for the service at `url`; its answer, and the call as it went."""
        body = encode(AbortRequest(rid))
        r = self.client.post(url + "/internal/abort", content=body)
        call = [q for q in self.sent if q.url.path == "/internal/abort"][-1]
        return r, dict(call.headers), body


def replay(url: str, headers: dict[str, str], body: bytes) -> httpx.Response:
    """The recorded call sent again as it was (headers and body), to `url`."""
    keep = {k: v for k, v in headers.items() if k.lower().startswith("x-splitserve-")}
    return httpx.post(url + "/internal/abort", content=body, headers=keep, timeout=30)


def refusals(proc: Proc) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(proc.url + "/metrics").text.splitlines():
        if line.startswith("splitserve_internal_auth_refused_total{"):
            out[line.split('reason="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_call_signed_for_one_service_is_refused_by_another(cluster) -> None:  # type: ignore[no-untyped-def]
    decode_ = cluster.start("decode", *FLAGS)
    prefill = cluster.start("prefill", *FLAGS)
    rec = Recorder()
    r, headers, body = rec.abort(decode_.url, uuid.uuid4().hex)
    assert r.status_code == 200, r.text  # signed for the decode service, accepted there
    before = refusals(prefill)

    elsewhere = replay(prefill.url, headers, body)  # the same call, captured and sent to the prefill service
    assert elsewhere.status_code == 401, elsewhere.text
    assert "wrong_audience" in elsewhere.json()["error"]["message"]
    assert refusals(prefill).get("wrong_audience", 0) - before.get("wrong_audience", 0) == 1
    assert replay(decode_.url, headers, body).status_code == 401  # and at its own audience: a replay

    # the identity a caller signs for is the service's own, signed, for the address it answers at
    from common.security.identity import WorkerIdentity

    ident, sig = WorkerIdentity.from_json(get_json(decode_.url + "/health")["identity"])
    assert ident.verify(SECRET, sig) and ident.url == decode_.url and ident.role == "decode"
    assert headers["x-splitserve-audience"] == ident.audience
    assert not ident.verify(InternalSecret(b"not-the-cluster-secret-at-all!!"), sig)
    cluster.stop(decode_)
    cluster.stop(prefill)


def test_a_call_recorded_before_a_restart_is_refused_after_it(cluster) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    old = cluster.start("decode", *FLAGS, port=port)
    rec = Recorder()
    r, headers, body = rec.abort(old.url, uuid.uuid4().hex)
    assert r.status_code == 200, r.text
    old_id = get_json(old.url + "/health")["incarnation"]
    cluster.stop(old)

    new = cluster.start("decode", *FLAGS, port=port)  # same address, same worker id: a new incarnation
    assert get_json(new.url + "/health")["incarnation"] != old_id
    # well inside the 30 s window, with a nonce the new process never saw
    replayed = replay(new.url, headers, body)
    assert replayed.status_code == 401, replayed.text
    assert "wrong_audience" in replayed.json()["error"]["message"]

    # the signing client still has the old process's audience for this address: refused once, it reads
    # who answers there now and signs for it; the caller sees one answer, 200
    r, headers, _ = rec.abort(new.url, uuid.uuid4().hex)
    assert r.status_code == 200, r.text
    assert headers["x-splitserve-audience"].endswith("#" + get_json(new.url + "/health")["incarnation"])
    cluster.stop(new)


def test_no_call_is_signed_for_an_address_its_identity_does_not_name(cluster) -> None:  # type: ignore[no-untyped-def]
    """A signed identity counts only at the URL it names: read at another address (here the same process
    reached as localhost, as a relay would serve a copied /health), nothing is signed for it and the call
    fails as unreachable (the router then tries another service)."""
    decode_ = cluster.start("decode", *FLAGS)
    other = decode_.url.replace("127.0.0.1", "localhost")
    with httpx.Client(timeout=30, auth=SignedCalls(SECRET)) as c:
        with pytest.raises(httpx.ConnectError, match="presents the identity of"):
            c.post(other + "/internal/abort", content=encode(AbortRequest("x")))
        assert c.post(decode_.url + "/internal/abort", content=encode(AbortRequest("x"))).status_code == 200
    cluster.stop(decode_)
