"""Two copies of our worker as ``fed1`` of a real Synapse 1.163: the second refuses to
start with one line (it finds the instance lock the first holds in Synapse's database)
and exits non-zero; the first keeps sending (storage/instance_lock.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from federation_sender.testing.synapse_peer import PeerNetwork
from tests.synapse.backend_support import ROOT, OurWorker

pytestmark = pytest.mark.postgres


def test_second_copy_refuses_to_start_and_the_first_keeps_sending(
    ours: OurWorker, network: PeerNetwork, tmp_path: Path
) -> None:
    d = ours.d
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    room_id = d.client.create_room(alice)
    peer = network.add_peer()
    network.join(peer, room_id, d.server_name)

    second = OurWorker(d, tmp_path / "second")  # its own data directory, same fed1
    result = subprocess.run(
        [sys.executable, "-m", "federation_sender", "worker", "-c", str(second.config),
         "--synapse-config", str(d.homeserver_yaml), "--synapse-config", str(d.worker_yaml)],
        capture_output=True, text=True, timeout=60, cwd=second.directory,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    refusals = [ln for ln in result.stderr.splitlines() if ln.startswith("federation-sender: ")]
    assert len(refusals) == 1, result.stderr[-2000:]
    assert refusals[0].startswith(
        "federation-sender: another process is running as instance 'fed1': it holds the "
        "instance lock on postgresql "
    ), refusals[0]
    assert "'federation-sender fed1 lock'" in refusals[0]
    assert "Traceback" not in result.stderr + result.stdout

    assert ours.running
    sent = d.client.send_message(alice, room_id, "after the second copy gave up")
    network.wait_for(lambda: sent in peer.event_counts(room_id), what="the first still sends")
    assert peer.event_counts(room_id)[sent] == 1
