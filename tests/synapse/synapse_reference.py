"""Run inside Synapse's own virtualenv: what Synapse's federation sender would send.

``python synapse_reference.py homeserver.yaml worker.yaml device_lists DEST FROM LIMIT``
prints ``[upto, [[edu_type, content], ...]]`` from Synapse's own
``get_device_updates_by_remote`` on the deployment's database, as its
``federation_sender`` worker computes it (the worker is set up, never started: it opens
the database and nothing else).
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
        if what == "device_lists":
            dest, frm, limit = args
            return await store.get_device_updates_by_remote(dest, int(frm), int(limit))
        raise SystemExit(f"unknown query {what}")

    def go(_reactor: Any) -> Any:
        d = defer.ensureDeferred(run())
        d.addCallback(lambda out: print(json.dumps(out)))
        return d

    task.react(go)


if __name__ == "__main__":
    main()
