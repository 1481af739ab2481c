"""An empty Synapse database, its schema created by Synapse itself.

``update_synapse_database`` (shipped with Synapse) prepares a database exactly as a
starting homeserver would, without running one: a few seconds instead of a server
start. Tests clone the result as a template (``CREATE DATABASE .. TEMPLATE``), so each
test gets a fresh Synapse schema in milliseconds.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from federation_sender.testing.postgres import PostgresCluster


def synapse_bin(python: Path, script: str) -> Path:
    return python.parent / script


def create_synapse_schema(cluster: PostgresCluster, dbname: str, python: Path) -> str:
    """Create ``dbname`` (C collation, as Synapse requires) with Synapse's schema;
    returns its URL."""
    cluster.psql(
        f'CREATE DATABASE "{dbname}" TEMPLATE template0 '
        "LC_COLLATE 'C' LC_CTYPE 'C' ENCODING 'UTF8'"
    )
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "signing.key"
        key.write_text("ed25519 a_test AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA\n")
        config = {
            "server_name": "schema.test",
            "report_stats": False,
            "signing_key_path": str(key),
            "media_store_path": str(Path(tmp) / "media"),
            "database": {
                "name": "psycopg2",
                "args": {
                    "user": cluster.user,
                    "host": "127.0.0.1",
                    "port": cluster.port,
                    "dbname": dbname,
                },
            },
        }
        cfg = Path(tmp) / "homeserver.yaml"
        cfg.write_text(json.dumps(config))
        done = subprocess.run(
            [str(synapse_bin(python, "update_synapse_database")), "--database-config", str(cfg)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["?"])[-1]
            raise RuntimeError(f"update_synapse_database failed: {last}")
    return cluster.url(dbname)


def clone_database(cluster: PostgresCluster, template: str, name: str) -> str:
    cluster.psql(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return cluster.url(name)
