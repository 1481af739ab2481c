"""synapse-admin through our admin API: a Synapse server admin's access token works.

Users are made on the session's real Synapse 1.163 with its client and admin APIs; our
worker runs as the deployment's federation sender (``worker --synapse-config``) and is
asked exactly what synapse-admin asks on its federation pages (paths and query strings
as its data provider builds them: ``query-string`` sorts the keys, the list page has 10
rows sorted by destination, the rooms tab 50 rows with react-admin's default sort).
Refusals are compared with what Synapse itself answers to the same token. The cache of
accepted tokens is checked on a fake clock: a token logged out at Synapse stops working
once its entry is older than ``ttl_s``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from federation_sender.admin.errors import AdminError
from federation_sender.storage.synapse.database import create_synapse_engine
from federation_sender.synapse.admin_auth import SynapseAdminTokens
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.our_sender import OurSender
from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_deployment import SynapseDeployment

pytestmark = pytest.mark.postgres

API = "/_synapse/admin/v1/federation/destinations"
DEST = "synapse-admin-test.invalid"
ORIGIN = "https://admin.example.org"


@dataclass
class Reply:
    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def call(base: str, method: str, path: str, token: str | None = None,
         headers: dict[str, str] | None = None) -> Reply:
    req = urllib.request.Request(base + path, method=method, headers=headers or {})
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            return Reply(r.status, json.loads(raw) if raw else {}, dict(r.headers))
    except urllib.error.HTTPError as e:
        raw = e.read()
        return Reply(e.code, json.loads(raw) if raw else {}, dict(e.headers))


@dataclass
class Users:
    admin: User
    admin2: User
    normal: User


@pytest.fixture(scope="module")
def users(synapse_deployment: SynapseDeployment) -> Users:
    c = synapse_deployment.client
    tag = uuid.uuid4().hex[:8]
    return Users(c.register(f"sa_admin_{tag}", admin=True),
                 c.register(f"sa_admin2_{tag}", admin=True),
                 c.register(f"sa_user_{tag}"))


def puppet(d: SynapseDeployment, by: User, target: User, **body: Any) -> str:
    path = f"/_synapse/admin/v1/users/{urllib.parse.quote(target.user_id)}/login"
    token: str = d.client.call("POST", path, body, by.access_token)["access_token"]
    return token


def locked_admin(d: SynapseDeployment, by: User) -> User:
    """A new server admin, locked with Synapse's admin API."""
    user = d.client.register(f"sa_locked_{uuid.uuid4().hex[:8]}", admin=True)
    path = f"/_synapse/admin/v2/users/{urllib.parse.quote(user.user_id)}"
    d.client.call("PUT", path, {"locked": True}, by.access_token)
    return user


@pytest.fixture(scope="module")
def ours(synapse_deployment: SynapseDeployment, users: Users,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[OurSender]:
    """Our worker beside Synapse, with one destination backing off in one room."""
    d = synapse_deployment
    room = d.client.create_room(users.admin)
    so = d.sql(f"SELECT max(stream_ordering) FROM events WHERE room_id = '{room}'").strip()
    d.sql(
        "INSERT INTO destinations (destination, retry_last_ts, retry_interval, failure_ts, "
        f"last_successful_stream_ordering) VALUES ('{DEST}', "
        f"(extract(epoch from now()) * 1000)::bigint, 86400000, 1700000000000, {so}); "
        f"INSERT INTO destination_rooms VALUES ('{DEST}', '{room}', {so})"
    )
    d.stop_federation_sender()
    worker = OurSender(d, tmp_path_factory.mktemp("ours-admin"))
    try:
        worker.start()
        yield worker
    finally:
        worker.stop()
        d.sql(f"DELETE FROM destination_rooms WHERE destination = '{DEST}'; "
              f"DELETE FROM destinations WHERE destination = '{DEST}'")


def admin_url(ours: OurSender) -> str:
    return f"http://127.0.0.1:{ours.admin_port}"


def test_synapse_admins_token_drives_synapse_admins_federation_pages(
    ours: OurSender, users: Users
) -> None:
    base, token = admin_url(ours), users.admin.access_token
    q = urllib.parse.quote(DEST, safe="")
    listed = call(base, "GET", f"{API}?dir=f&from=0&limit=10&order_by=destination", token)
    assert listed.status == 200, listed.body
    assert listed.headers["Access-Control-Allow-Origin"] == "*"
    # The session's Synapse knows other tests' destinations too: page as synapse-admin
    # does (its next page is the same request with from=next_token).
    names = [x["destination"] for x in listed.body["destinations"]]
    while DEST not in names and "next_token" in listed.body:
        listed = call(base, "GET", f"{API}?dir=f&from={listed.body['next_token']}&limit=10"
                      "&order_by=destination", token)
        assert listed.status == 200, listed.body
        names = [x["destination"] for x in listed.body["destinations"]]
    assert DEST in names
    one = call(base, "GET", f"{API}/{q}", token)
    assert one.status == 200 and one.body["failure_ts"] == 1700000000000, one.body
    rooms = call(base, "GET", f"{API}/{q}/rooms?dir=b&from=0&limit=50&order_by=id", token)
    assert rooms.status == 200 and rooms.body["total"] == 1, rooms.body
    reset = call(base, "POST", f"{API}/{q}/reset_connection", token,
                 {"Content-Type": "application/json"})
    assert (reset.status, reset.body) == (200, {})
    after = call(base, "GET", f"{API}/{q}", token)
    assert after.body["retry_last_ts"] == 0 and after.body["retry_interval"] == 0
    assert f"admin action by Synapse admin {users.admin.user_id}" in ours.log_path.read_text()


def test_server_version_is_open_and_shaped_like_synapses(ours: OurSender) -> None:
    got = call(admin_url(ours), "GET", "/_synapse/admin/v1/server_version")
    assert got.status == 200
    assert list(got.body) == ["server_version"]
    assert got.body["server_version"].startswith("federation-sender ")


def test_whoami_answers_as_synapse_for_synapse_admin_login(
    ours: OurSender, users: Users, synapse_deployment: SynapseDeployment
) -> None:
    """synapse-admin logs in with an access token through versions, then whoami: a
    Synapse admin's token is that admin (the puppeted one for an admin login), as
    Synapse says; our static token is our admin user."""
    d = synapse_deployment
    base = admin_url(ours)
    assert call(base, "GET", "/_matrix/client/versions").status == 200
    for token in (users.admin.access_token, puppet(d, users.admin, users.admin2)):
        mine = call(base, "GET", "/_matrix/client/v3/account/whoami", token)
        theirs = call(d.client_url, "GET", "/_matrix/client/v3/account/whoami", token)
        assert mine.status == theirs.status == 200, mine.body
        assert mine.body["user_id"] == theirs.body["user_id"]
        assert mine.body["is_guest"] is theirs.body["is_guest"] is False
    static = call(base, "GET", "/_matrix/client/v3/account/whoami", ours.admin_token)
    assert static.status == 200
    assert static.body["user_id"] == f"@federation-sender-admin:{d.server_name}"
    unknown = call(base, "GET", "/_matrix/client/v3/account/whoami", "syt_nope")
    assert (unknown.status, unknown.body["errcode"]) == (401, "M_UNKNOWN_TOKEN")


def test_static_token_still_works(ours: OurSender) -> None:
    got = call(admin_url(ours), "GET", f"{API}?dir=f&from=0&limit=10&order_by=destination",
               ours.admin_token)
    assert got.status == 200


def test_refusals_are_synapses(
    ours: OurSender, users: Users, synapse_deployment: SynapseDeployment
) -> None:
    """Each token gets the status and errcode Synapse gives it on the same route."""
    d = synapse_deployment
    cases = {
        "admin": (users.admin.access_token, 200, None),
        "normal user": (users.normal.access_token, 403, "M_FORBIDDEN"),
        "unknown": ("syt_not_a_token_" + uuid.uuid4().hex, 401, "M_UNKNOWN_TOKEN"),
        "admin as a normal user": (puppet(d, users.admin, users.normal), 403, "M_FORBIDDEN"),
        "admin as another admin": (puppet(d, users.admin, users.admin2), 200, None),
        "expired": (puppet(d, users.admin, users.admin2, valid_until_ms=1), 401,
                    "M_UNKNOWN_TOKEN"),
        "locked admin": (locked_admin(d, users.admin).access_token, 401, "M_USER_LOCKED"),
    }
    path = f"{API}?dir=f&from=0&limit=10&order_by=destination"
    for name, (token, status, errcode) in cases.items():
        mine = call(admin_url(ours), "GET", path, token)
        theirs = call(d.client_url, "GET", path, token)
        assert (mine.status, mine.body.get("errcode")) == (status, errcode), name
        assert (theirs.status, theirs.body.get("errcode")) == (status, errcode), name
        if status == 401:
            assert mine.body["soft_logout"] == theirs.body["soft_logout"], name


def test_cors_preflight_as_the_browser_sends_it(ours: OurSender) -> None:
    q = urllib.parse.quote(DEST, safe="")
    for method, path, asked in [
        ("GET", f"{API}?dir=f&from=0&limit=10&order_by=destination", "authorization"),
        ("POST", f"{API}/{q}/reset_connection", "authorization,content-type"),
    ]:
        got = call(admin_url(ours), "OPTIONS", path, headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": asked})
        assert got.status in (200, 204)
        h = {k.lower(): v for k, v in got.headers.items()}
        assert h["access-control-allow-origin"] in ("*", ORIGIN)
        assert method in h["access-control-allow-methods"]
        allowed = {x.strip().lower() for x in h["access-control-allow-headers"].split(",")}
        assert set(asked.split(",")) <= allowed


@pytest.fixture
async def verifier(
    synapse_deployment: SynapseDeployment, clock: FakeClock
) -> AsyncIterator[SynapseAdminTokens]:
    engine = create_synapse_engine(synapse_deployment.database_url, pool_size=1)
    yield SynapseAdminTokens(engine, clock, ttl_s=30.0)
    await engine.dispose()


async def test_logged_out_token_stops_working_within_the_cache_ttl(
    verifier: SynapseAdminTokens, clock: FakeClock, synapse_deployment: SynapseDeployment
) -> None:
    d = synapse_deployment
    user = d.client.register(f"sa_gone_{uuid.uuid4().hex[:8]}", admin=True)
    assert await verifier.verify(user.access_token) == f"Synapse admin {user.user_id}"
    d.client.call("POST", "/_matrix/client/v3/logout", {}, user.access_token)
    clock.advance(verifier.ttl_s - 1)
    assert await verifier.verify(user.access_token) == f"Synapse admin {user.user_id}"
    assert verifier.lookups == 1
    clock.advance(1)
    with pytest.raises(AdminError) as refused:
        await verifier.verify(user.access_token)
    assert (refused.value.status, refused.value.errcode) == (401, "M_UNKNOWN_TOKEN")


async def test_cached_token_still_expires_at_valid_until(
    verifier: SynapseAdminTokens, clock: FakeClock, users: Users,
    synapse_deployment: SynapseDeployment,
) -> None:
    until = int(clock.time_s() * 1000) + 10_000
    token = puppet(synapse_deployment, users.admin, users.admin2, valid_until_ms=until)
    assert "as " + users.admin2.user_id in await verifier.verify(token)
    clock.advance(11)
    with pytest.raises(AdminError) as refused:
        await verifier.verify(token)
    assert refused.value.extra == {"soft_logout": True}
    assert verifier.lookups == 1

