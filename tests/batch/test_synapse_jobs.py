"""The batch jobs on a real Synapse 1.163 database (``--synapse-config``), beside our
worker as its federation sender.

The world (tests/batch/synapse_world.py) is built once for the module: real rooms,
remotes joined over federation, deliveries by our worker, then planted divergence of
every class. The read-only jobs run once on it, at rest (:func:`at_rest`: the worker
stopped), and each test checks one job's findings for this module's remotes exactly
(the deployment is the session's, shared with other modules). The repair test, first
or last (the tests run in a random order; the read-only runs and the rows after them are
the fixture's), starts the worker again and repairs beside it while it sends: what was
lost or had no row arrives, once, and nothing else is sent twice.
"""

from __future__ import annotations

import io
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from federation_sender import cli
from federation_sender.batch.arguments import EXIT_FINDINGS
from federation_sender.batch.cli import run_batch
from federation_sender.testing.synapse_deployment import SynapseDeployment
from federation_sender.testing.synapse_peer import PeerNetwork
from federation_sender.testing.waiting import wait_until_blocking

from .synapse_world import DOWN, ROOMS, World, build

pytestmark = [pytest.mark.spark, pytest.mark.postgres]


def batch(spark: Any, w: World, *argv: str, worker_file: bool = False
          ) -> tuple[int, dict[str, Any]]:
    """``federation-sender batch <argv> --synapse-config homeserver.yaml [fed1.yaml]``
    as the main command line parses and merges it, on the shared Spark session."""
    files = [w.d.homeserver_yaml, *([w.d.worker_yaml] if worker_file else [])]
    synapse = [a for f in files for a in ("--synapse-config", str(f))]
    args = cli.build_parser().parse_args(
        ["batch", *argv, *synapse, "--json", "--quiet", "--partitions", "2"])
    settings = cli._load(args)  # the main command line's merge of Synapse's files
    out = io.StringIO()
    status = run_batch(args, settings, spark=spark, out=out)
    return status, json.loads(out.getvalue()) if out.getvalue() else {}


@pytest.fixture(scope="module")
def world(synapse_deployment: SynapseDeployment, network: PeerNetwork,
          tmp_path_factory: pytest.TempPathFactory) -> Any:
    w = build(synapse_deployment, network, tmp_path_factory.mktemp("ours"))
    yield w
    w.worker.stop()
    synapse_deployment.stop_federation_sender()


@dataclass
class AtRest:
    audit: tuple[int, dict[str, Any]]
    backfill: tuple[int, dict[str, Any]]
    health: tuple[int, dict[str, Any]]
    out: Path
    rows_before: dict[tuple[str, str], int | None]
    rows_after: dict[tuple[str, str], int | None]
    """The rows once the read-only jobs (the backfill's dry run among them) have run:
    read here, since the repair test may run before the dry run's test (random order)."""


@pytest.fixture(scope="module")
def at_rest(spark: Any, world: World, tmp_path_factory: pytest.TempPathFactory) -> AtRest:
    """The read-only jobs, once, before anything changes the planted state."""
    w = world
    out = tmp_path_factory.mktemp("jobs")
    rows = {(r, lbl): w.row(r, lbl) for lbl, r in ROOMS.items()}
    audit = batch(spark, w, "audit", "--output", str(out / "audit"))
    backfill = batch(spark, w, "backfill-destination-rooms", "--dry-run",
                     "--output", str(out / "backfill"))
    health = batch(spark, w, "health-report", "--output", str(out / "health"))
    return AtRest(audit=audit, backfill=backfill, health=health, out=out, rows_before=rows,
                  rows_after={k: w.row(*k) for k in rows})


def _csv(path: Path) -> list[dict[str, Any]]:
    return pd.read_csv(path).to_dict("records") if path.stat().st_size > 1 else []


def test_audit_finds_each_planted_class_exactly(world: World, at_rest: AtRest) -> None:
    w = world
    status, doc = at_rest.audit
    assert status == EXIT_FINDINGS, doc
    found = w.findings_of_mine(_csv(at_rest.out / "audit" / "findings.csv"))
    want = {k: (s, r, w.events[label]) for k, (s, r, label) in w.expected.items()}
    assert found == want
    # The sending rules: l3-l5's newest events (not proactive, an erased sender,
    # rejected) were never delivered and L's position is past them, yet nothing is
    # owed; J2 is owed nothing in room j (its own join is never sent back to it).
    s = doc["summary"]
    assert s["schema"] == "synapse" and s["high_water_mark"] >= w.so("s behind")
    for key in ("lost", "missing_row_no_row", "missing_row_row_behind", "pending_backoff",
                "pending_catch_up", "pending_sender_behind"):
        assert s[key] >= 1, key
    steps = " ".join(doc["next_steps"])
    assert "audit --repair" in steps
    assert "/_synapse/admin/v1/federation/destinations/" in steps and "reset_connection" in steps
    assert "is the federation sender running?" in steps


def test_backfill_dry_run_finds_the_missing_rows_and_writes_nothing(
        world: World, at_rest: AtRest) -> None:
    w = world
    status, doc = at_rest.backfill
    assert status == 0, doc
    missing = w.findings_of_mine(
        [{**r, "status": "missing_row"} for r in
         _csv(at_rest.out / "backfill" / "missing_rows.csv")])
    assert missing == {k: v for k, v in
                       {k: (s, r, w.events[lb]) for k, (s, r, lb) in w.expected.items()}.items()
                       if v[0] == "missing_row"}
    assert doc["summary"]["dry_run"] is True
    assert at_rest.rows_after == at_rest.rows_before


def test_health_report_shows_who_is_down_and_what_catch_up_owes(
        world: World, at_rest: AtRest) -> None:
    w = world
    status, doc = at_rest.health
    assert status == 0, doc
    d = at_rest.out / "health"
    down = {r["destination"]: r for r in _csv(d / "down.csv")}
    assert w.name("B") in down and down[w.name("B")]["backing_off"]
    assert down[w.name("B")]["down_since_ts"] > 0
    assert not {w.name(r) for r in DOWN if r != "B"} & down.keys()  # cleared
    debt = {r["destination"]: r for r in _csv(d / "catchup_debt.csv")}
    for role in ("B", "C"):  # one refused message each, in one room
        assert (debt[w.name(role)]["rooms_behind"], debt[w.name(role)]["events_behind"]) == (
            1, 1), role
    assert w.name("L") not in debt and w.name("M") not in debt  # position raised; no row
    rooms = {r["room_id"]: r for r in _csv(d / "rooms_unreachable.csv")}
    assert rooms[w.rooms["b"]]["unreachable_servers"] == 1
    assert w.name("B") in rooms[w.rooms["b"]]["examples"]
    page = (d / "health.html").read_text()
    assert "Destinations down" in page and "Catch-up debt" in page and w.name("B") in page
    assert doc["summary"]["destinations_down"] >= 1


def test_repair_beside_the_running_worker_loses_nothing_and_sends_nothing_twice(
        spark: Any, world: World, at_rest: AtRest) -> None:
    w = world
    w.worker.start()
    # The worker catches up C (its backoff was cleared) and processes S's event.
    w.delivered("C", "c refused")
    w.delivered("S", "s behind")
    # Live traffic into A's room while the repair runs: the worker writes A's row for
    # newer events meanwhile; the repair's older row for it must not win.
    stop = threading.Event()
    sent: list[str] = []

    def traffic() -> None:
        while not stop.is_set() and len(sent) < 30:
            sent.append(w.send(f"a live {len(sent)}", "a"))

    t = threading.Thread(target=traffic, name="traffic", daemon=True)
    t.start()
    try:
        status, doc = batch(spark, w, "audit", "--repair", worker_file=True)
    finally:
        stop.set()
        t.join(60)
    assert status == EXIT_FINDINGS, doc  # the findings as they were before the repair
    # Rows for m and a2 at least (the worker may have written A's row for a newer
    # event first: then the repair's older one does not count as upserted).
    assert doc["summary"]["upserted"] >= 2 and doc["summary"]["positions_lowered"] >= 1
    w.events["a last"] = sent[-1]
    w.delivered("A", "a last")
    # Lost and rowless events reach L and M from the next wake-up sweep (each second
    # here), whether their queues are live (they read the lowered position again) or
    # not (started in catch-up mode).
    w.delivered("L", "l2 lost")
    w.delivered("M", "m refused")
    wait_until_blocking(lambda: w.row("A", "a"), "A's row at the newest live event",
                        accept=lambda so: so == w.so("a last"), timeout_s=30)
    assert w.row("A", "a2") == w.so("a2 second")
    assert w.row("M", "m") == w.so("m refused")
    with w.net.locked():
        for role, peer in w.peers.items():
            if role == "B":
                continue
            twice = {e: n for e, n in peer.event_counts().items() if n > 1}
            assert twice == {}, role
    for label in ("l3 not proactive", "l4 by bob", "l5 rejected"):
        assert w.events[label] not in w.peers["L"].event_ids_seen, label
    assert all(e in w.peers["A"].event_ids_seen for e in sent)
