"""Module-scoped fixtures the real-Synapse tests share (the Synapse deployment itself and
the fake remote servers, ``network``, are in tests/conftest.py, which
tests/storage/synapse shares too). A module that needs something else defines its own
fixture of the same name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from federation_sender.testing.synapse_deployment import SynapseDeployment
from tests.synapse.backend_support import OurWorker


@pytest.fixture(scope="module")
def ours(
    synapse_deployment: SynapseDeployment, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OurWorker]:
    """Our worker as the deployment's federation sender, Synapse's own stopped; on the
    way out Synapse's is stopped too in case a test handed over to it."""
    synapse_deployment.stop_federation_sender()
    worker = OurWorker(synapse_deployment, tmp_path_factory.mktemp("ours"))
    worker.start()
    yield worker
    worker.stop()
    synapse_deployment.stop_federation_sender()
