"""A Synapse deployment that restricts outbound federation to its federation sender.

:func:`restrict_outbound_federation` rewrites a written (not yet started)
:class:`SynapseDeployment`'s ``homeserver.yaml`` so that every process sends its
outbound federation requests through the instance ``fed1`` (Synapse's
``outbound_federation_restricted_to``), which ``instance_map`` places at a loopback
port: our worker, run as ``fed1``, serves it. :func:`add_generic_worker` adds a Synapse
``generic_worker`` with a client listener (it reads the same ``homeserver.yaml``, so it
is restricted too).
"""

from __future__ import annotations

import json
from typing import Any

from federation_sender.testing.ports import free_port
from federation_sender.testing.synapse_client import SynapseClient
from federation_sender.testing.synapse_config import log_config
from federation_sender.testing.synapse_deployment import SynapseDeployment, SynapseProcess


def restrict_outbound_federation(deployment: SynapseDeployment, *, port: int | None = None,
                                 tls: bool = False) -> int:
    """Restrict outbound federation to the deployment's sender instance; returns the
    port ``instance_map`` gives it."""
    port = port or free_port()
    path = deployment.homeserver_yaml
    config: dict[str, Any] = json.loads(path.read_text())
    config["instance_map"][deployment.instance_name] = {
        "host": "127.0.0.1", "port": port, "tls": tls,
    }  # fmt: skip
    config["outbound_federation_restricted_to"] = [deployment.instance_name]
    path.write_text(json.dumps(config, indent=1))
    return port


def add_generic_worker(deployment: SynapseDeployment, name: str) -> tuple[SynapseProcess,
                                                                          SynapseClient]:
    """A ``generic_worker`` serving the client API on a port of its own (not started)."""
    d = deployment.directory
    port = free_port()
    listener = {
        "port": port, "bind_addresses": ["127.0.0.1"], "type": "http", "tls": False,
        "x_forwarded": False, "resources": [{"names": ["client"], "compress": False}],
    }  # fmt: skip
    worker_file = d / f"{name}.yaml"
    worker_file.write_text(json.dumps({
        "worker_app": "synapse.app.generic_worker",
        "worker_name": name,
        "worker_listeners": [listener],
        "worker_log_config": str(d / f"{name}.log.yaml"),
    }))  # fmt: skip
    (d / f"{name}.log.yaml").write_text(json.dumps(log_config(d / f"{name}.log")))
    process = SynapseProcess(
        name,
        [str(deployment.python), "-m", "synapse.app.generic_worker",
         "-c", str(deployment.homeserver_yaml), "-c", str(worker_file)],
        d, d / f"{name}.log", f"http://127.0.0.1:{port}/health",
    )  # fmt: skip
    shared_secret = deployment.layout.shared_secret
    return process, SynapseClient(f"http://127.0.0.1:{port}", shared_secret)
