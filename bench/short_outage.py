"""A short outage of a real Synapse receiver: how long after its return each sender's
message arrives, Synapse's own sender and ours in the same run.

One receiving Synapse 1.163 (SQLite, sending for itself) and, per ``--senders``, a
sending Synapse 1.163 deployment (PostgreSQL, a Redis of its own, Synapse's default
``federation:`` section, so ``max_long_retries`` 10) whose federation sender is
Synapse's own worker (``synapse``), our worker (``ours``), or our worker from another
checkout (``before``: ``--before-source``, e.g. the commit before the short-retry phase,
unpacked with ``git archive <commit> | tar -x -C DIR``). The receiver's user joins one
room on each; then (``testing/outage.py``) the receiver is stopped for ``--outage-s``,
one message is sent in each room meanwhile, and the receiver is started again; nobody
contacts the senders. Reported per sender: seconds from the receiver's federation port
accepting connections again to the message being visible to its user (None: not within
``--wait-s``), and the retry interval the sender had persisted for the receiver when it
was started again.

    .venv/bin/python bench/short_outage.py [--senders synapse ours [before]] \
        [--before-source DIR] [--outage-s 10] [--wait-s 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.our_sender import OurSender
from federation_sender.testing.outage import SendingRoom, join_rooms, short_outage
from federation_sender.testing.postgres import ephemeral_cluster
from federation_sender.testing.redis_server import ephemeral_redis
from federation_sender.testing.synapse_config import RedisAddress
from federation_sender.testing.synapse_deployment import SynapseDeployment, create_deployment


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--senders", nargs="+", default=["synapse", "ours"],
                   choices=["synapse", "ours", "before"])
    p.add_argument("--before-source", type=Path,
                   help="a checkout whose federation_sender package runs as 'before'")
    p.add_argument("--outage-s", type=float, default=10.0)
    p.add_argument("--wait-s", type=float, default=60.0)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if "before" in a.senders and a.before_source is None:
        p.error("--senders before needs --before-source")
    with (
        ephemeral_cluster() as cluster,
        tempfile.TemporaryDirectory(prefix="short-outage-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        root = Path(tmp)
        ca = LoopbackCA.create(root / "ca")
        receiver = create_deployment(root / "receiver", ca=ca)
        stack.callback(receiver.stop)
        receiver.start()
        rooms: dict[str, SendingRoom] = {}
        ours: dict[str, OurSender] = {}
        deployments: dict[str, SynapseDeployment] = {}
        for i, kind in enumerate(a.senders):
            redis = stack.enter_context(ephemeral_redis())
            d = create_deployment(root / kind, ca=ca, cluster=cluster,
                                  database_name=f"synapse_{i}",
                                  redis=RedisAddress(redis.host, redis.port),
                                  overrides={"federation": {}})
            stack.callback(d.stop)
            d.start()
            if kind == "synapse":
                d.start_federation_sender()
            else:
                source = a.before_source if kind == "before" else None
                sender = OurSender(d, root / f"{kind}-worker", source=source)
                stack.callback(sender.stop)
                sender.start()
                ours[kind] = sender
            alice = d.client.register(f"alice_{kind}")
            rooms[kind] = SendingRoom(d, alice, d.client.create_room(alice))
            deployments[kind] = d
        bob = receiver.client.register("bob")
        join_rooms(receiver, bob, rooms)
        persisted: dict[str, float] = {}

        def read_backoffs() -> None:
            for kind, d in deployments.items():
                ms = d.sql("SELECT coalesce(max(retry_interval), 0) FROM destinations "
                           f"WHERE destination = '{receiver.server_name}'").strip()
                persisted[kind] = int(ms or 0) / 1000

        result = short_outage(receiver, bob, rooms, a.outage_s, a.wait_s, read_backoffs)
        out: dict[str, Any] = {
            "outage_s": result.outage_s,
            "receiver_start_s": result.start_s,
            "arrival_after_return_s": result.arrival_s,
            "persisted_retry_interval_s": persisted,
        }
    print(json.dumps(out, indent=1), flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0 if all(v is not None for v in result.arrival_s.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
