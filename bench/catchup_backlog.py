"""A backlog in one room, as real Synapse receivers see it: Synapse's own sender and
ours in the same run (issue 33, item 2).

One receiving Synapse 1.163 (SQLite, sending for itself) and, per ``--senders``, a
sending Synapse 1.163 deployment (PostgreSQL, a Redis of its own) whose federation
sender is Synapse's own worker (``synapse``) or ours (``ours``, its default
configuration; ``--gap`` sets its ``queue.catchup_max_gap_events``: a destination that
starts in catch-up, as after a SIGKILL, replays a room's gap up to that long, a page of
50 events at a time, and sends extremities beyond it). Both receivers keep Synapse's
default settings. For each sender and each ``--modes``: a new room the receiver's user
joins; then

* ``stop``: the federation sender is stopped, ``--events`` messages are sent, it is
  started again;
* ``sigkill``: ``--events`` messages are sent, the federation sender is killed
  (SIGKILL) after the first 10% of them, and started again once all are sent.

With ``--other-traffic`` (issue #44), 2 s after the restart, while the backlog is under
way, a message in another room (a second receiver user joined it) and a to-device
message to that user are sent: seconds until each is at the receiver.

Reported per sender and mode (``testing/backlog.py``): of the messages, how many the
receiver holds as live events (neither outliers nor backfilled), how many as outliers
or backfilled, how many are still staged, whether its log has a ``Pruning`` line for
the room, and seconds from the sender's restart until all were live with the staging
queue drained (None: not within ``--wait-s``, or nothing changed at the receiver for
``--stall-s`` with nothing staged: Synapse's own sender, which sends no more).

    .venv/bin/python bench/catchup_backlog.py [--events 1000] [--senders synapse ours] \
        [--modes stop sigkill] [--wait-s 600] [--stall-s 60] [--gap N] [--other-traffic] \
        [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from federation_sender.clock import SystemClock
from federation_sender.testing.backlog import (
    other_traffic,
    receiver_state,
    send_burst,
    sync_token,
    wait_live,
)
from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.our_sender import OurSender
from federation_sender.testing.outage import SendingRoom, join_rooms
from federation_sender.testing.postgres import ephemeral_cluster
from federation_sender.testing.redis_server import ephemeral_redis
from federation_sender.testing.synapse_config import RedisAddress
from federation_sender.testing.synapse_deployment import SynapseDeployment, create_deployment


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=1000)
    p.add_argument("--senders", nargs="+", default=["synapse", "ours"],
                   choices=["synapse", "ours"])
    p.add_argument("--modes", nargs="+", default=["stop", "sigkill"],
                   choices=["stop", "sigkill"])
    p.add_argument("--wait-s", type=float, default=600.0)
    p.add_argument("--stall-s", type=float, default=60.0)
    p.add_argument("--gap", type=int, default=None,
                   help="our queue.catchup_max_gap_events (default: our default)")
    p.add_argument("--other-traffic", action="store_true",
                   help="also time a message in another room and a to-device message")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    clock = SystemClock()
    out: dict[str, Any] = {"events": a.events, "gap": a.gap, "runs": []}
    complete = True
    with (
        ephemeral_cluster() as cluster,
        tempfile.TemporaryDirectory(prefix="catchup-backlog-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        root = Path(tmp)
        ca = LoopbackCA.create(root / "ca")
        receiver = create_deployment(root / "receiver", ca=ca)
        stack.callback(receiver.stop)
        receiver.start()
        for i, kind in enumerate(a.senders):
            redis = stack.enter_context(ephemeral_redis())
            d: SynapseDeployment = create_deployment(
                root / kind, ca=ca, cluster=cluster, database_name=f"synapse_{i}",
                redis=RedisAddress(redis.host, redis.port))
            stack.callback(d.stop)
            d.start()
            ours: OurSender | None = None
            if kind == "synapse":
                d.start_federation_sender()
            else:
                queue = {} if a.gap is None else {"catchup_max_gap_events": a.gap}
                ours = OurSender(d, root / "ours-worker", {"queue": queue})
                stack.callback(ours.stop)
                ours.start()

            def stop(kill: bool, d: SynapseDeployment = d, ours: OurSender | None = ours
                     ) -> None:
                if ours is None:
                    d.stop_federation_sender(kill=kill)
                else:
                    ours.stop(kill=kill)

            def start(d: SynapseDeployment = d, ours: OurSender | None = ours) -> None:
                if ours is None:
                    d.start_federation_sender()
                else:
                    ours.start()

            for mode in a.modes:
                alice = d.client.register(f"alice_{kind}_{mode}")
                room = SendingRoom(d, alice, d.client.create_room(alice))
                bob = receiver.client.register(f"bob_{kind}_{mode}")
                join_rooms(receiver, bob, {kind: room})
                if a.other_traffic:
                    other = SendingRoom(d, alice, d.client.create_room(alice))
                    carol = receiver.client.register(f"carol_{kind}_{mode}")
                    join_rooms(receiver, carol, {kind: other})
                    since = sync_token(receiver, carol)
                if mode == "stop":
                    stop(False)
                    ids = send_burst(d, alice, room.room_id, a.events)
                else:
                    ids = send_burst(d, alice, room.room_id, a.events,
                                     after=max(1, a.events // 10),
                                     then=lambda: stop(True))
                t0 = clock.monotonic_s()
                start()
                restart_s = round(clock.monotonic_s() - t0, 2)
                extra: dict[str, Any] = {}
                if a.other_traffic:
                    time.sleep(2.0)
                    extra = asdict(other_traffic(d, alice, other.room_id, receiver, carol,
                                                 since))
                    extra["backlog_live_then"] = receiver_state(receiver, room.room_id,
                                                                ids).live
                waiting_from = clock.monotonic_s() - t0
                took, _ = wait_live(receiver, room.room_id, ids, a.wait_s, a.stall_s)
                state = receiver_state(receiver, room.room_id, ids)
                run = {"sender": kind, "mode": mode, "restart_s": restart_s,
                       "all_live_after_s": None if took is None
                       else round(took + waiting_from, 2),
                       **asdict(state), **extra}
                complete = complete and took is not None and not state.pruned
                out["runs"].append(run)
                print(json.dumps(run), flush=True)
    print(json.dumps(out, indent=1), flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
