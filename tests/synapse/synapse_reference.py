"""Run inside Synapse's own virtualenv: what Synapse's federation sender would send.

``python synapse_reference.py homeserver.yaml worker.yaml device_lists DEST FROM LIMIT``
prints ``[upto, [[edu_type, content], ...]]`` from Synapse's own
``get_device_updates_by_remote`` on the deployment's database, as its
``federation_sender`` worker computes it (the worker is set up, never started: it opens
the database and nothing else). ``device_lists_drain DEST LIMIT`` does what the worker
does over successful transactions: windows from 0, each followed by Synapse's own
``mark_as_sent_devices_by_remote``, until none is left; it prints the list of windows.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main() -> None:
    from synapse.app.generic_worker import GenericWorkerServer
    from synapse.config.homeserver import HomeServerConfig
    from twisted.internet import defer, task

    hs_yaml, worker_yaml, what, *args = sys.argv[1:]
    config = HomeServerConfig.load_config("reference", ["-c", hs_yaml, "-c", worker_yaml])
    hs = GenericWorkerServer(config.server.server_name, config=config)
    hs.setup()
    store = hs.get_datastores().main

    async def run() -> Any:
        if what == "device_lists":  # LIMIT may be a comma-separated list: one answer each
            dest, frm, limits = args
            answers = [await store.get_device_updates_by_remote(dest, int(frm), int(limit))
                       for limit in limits.split(",")]
            return answers if "," in limits else answers[0]
        if what == "device_lists_drain":
            dest, limit = args
            windows, position = [], 0
            while True:
                upto, edus = await store.get_device_updates_by_remote(dest, position, int(limit))
                if not edus:
                    return windows
                windows.append([upto, edus])
                await store.mark_as_sent_devices_by_remote(dest, upto)
                position = upto
        raise SystemExit(f"unknown query {what}")

    def go(_reactor: Any) -> Any:
        d = defer.ensureDeferred(run())
        d.addCallback(lambda out: print(json.dumps(out)))
        return d

    task.react(go)


if __name__ == "__main__":
    main()
