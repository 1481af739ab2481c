"""Latency and CPU against the offered rate: our worker (the production path: the real
federation client, an ed25519 signature per request, telemetry on) as Synapse 1.163's
``federation_sender`` on one real deployment (``bench/synapse_compare.py``'s: Synapse
on its default logging, ``--dests`` fake remote servers in ``--rooms`` rooms), sent
messages at each rate of ``--rates`` (messages a second, to every destination) for
``--duration-s`` seconds in turn, ``--samples`` rounds over the rates.

Per rate: delay p50 / p99 (persisted to received, per message and destination), PDUs
per transaction, and CPU per delivered PDU of the sender and of its PostgreSQL
backends (as in ``bench/synapse_compare.py``). ``--senders ours synapse`` runs Synapse's
own sender too, interleaved (it falls behind at a lower rate: give it a ``--timeout-s``);
``--senders ours base --base-source DIR`` another version of ours (``DIR`` holding its
``federation_sender`` package, e.g. the code before the send-at-once rule).

    .venv/bin/python bench/rate_sweep.py [--dests 415] [--rates 1 5 15 30] \
        [--duration-s 30] [--samples 1] [--senders ours [base|synapse]] \
        [--base-source DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.synapse_compare import (
    Result,
    Sender,
    make_scene,
    run_sample,
    synapse_default_log_config,
)
from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.postgres import ephemeral_cluster
from federation_sender.testing.redis_server import ephemeral_redis
from federation_sender.testing.synapse_config import RedisAddress
from federation_sender.testing.synapse_deployment import create_deployment
from federation_sender.testing.synapse_peer import PeerNetwork


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dests", type=int, default=415)
    p.add_argument("--rooms", type=int, default=1)
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 5.0, 15.0, 30.0])
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--senders", nargs="+", default=["ours"],
                   choices=["ours", "synapse", "base"])
    p.add_argument("--base-source", type=Path,
                   help="sender 'base': our worker from this directory's federation_sender "
                        "package (e.g. git archive main federation_sender | tar -x -C DIR)")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    base = argparse.Namespace(
        dests=a.dests, rooms=a.rooms, rate=1.0, duration_s=a.duration_s, mode="live",
        event_persisters=0, timeout_s=a.timeout_s, events=0, concurrency=1, poke=True,
    )
    results: list[Result] = []
    with (
        ephemeral_cluster() as cluster,
        tempfile.TemporaryDirectory(prefix="rate-sweep-") as tmp,
        ephemeral_redis() as redis_server,
    ):
        root = Path(tmp)
        ca = LoopbackCA.create(root / "ca")
        d = create_deployment(root / "hs", ca=ca, cluster=cluster, database_name="synapse_0",
                              redis=RedisAddress(redis_server.host, redis_server.port))
        for name, log in (("main", root / "hs" / "main.log"),
                          ("worker", d.sender.log_path if d.sender else None)):
            if log is not None:
                (root / "hs" / f"{name}.log.yaml").write_text(synapse_default_log_config(log))
        d.start()
        senders = [Sender(k, d, root / "hs", base_source=a.base_source) for k in a.senders]
        try:
            with PeerNetwork(ca, root / "peers", reuse_event_ids=True,
                             keep_pdus=False) as net:
                scene = make_scene(d, net, base)
                for sample in range(a.samples):
                    for rate in a.rates:
                        for sender in senders:
                            r = run_sample(scene, sender, "light", sample,
                                           replace_ns(base, rate=rate))
                            results.append(r)
                            print(json.dumps(asdict(r)), flush=True)
        finally:
            for sender in senders:
                sender.stop()
            d.stop()
    table = summarize(results)
    for row in table:
        print(json.dumps(row), flush=True)
    if a.json:
        a.json.write_text(json.dumps({"samples": [asdict(r) for r in results],
                                      "summary": table, "argv": sys.argv[1:]}, indent=1))
    return 0 if all(r.error is None and r.missing == 0 for r in results) else 1


def replace_ns(ns: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(ns), **changes})


def summarize(results: list[Result]) -> list[dict[str, Any]]:
    """Per sender and rate: the medians over the samples."""
    rows = []
    for kind in dict.fromkeys(r.sender for r in results):
        for rate in dict.fromkeys(r.rate for r in results):
            rs = [r for r in results if r.sender == kind and r.rate == rate]
            row: dict[str, Any] = {"sender": kind, "rate": rate, "samples": len(rs),
                                   "missing": sum(r.missing for r in rs),
                                   "duplicates": sum(r.duplicates for r in rs)}
            for key in ("delay_p50_s", "delay_p99_s", "pdus_per_txn", "cpu_ms_per_pdu",
                        "db_cpu_ms_per_pdu", "total_cpu_ms_per_pdu", "harness_cores",
                        "main_cores"):
                vals = [v for r in rs if (v := getattr(r, key)) is not None]
                row[key] = statistics.median(vals) if vals else None
            rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
