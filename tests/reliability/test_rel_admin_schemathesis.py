"""schemathesis against the admin API's own OpenAPI document.

The app runs on a real loopback listener (in a child process, ``admin_server.py``,
since schemathesis calls synchronously) over a seeded SQLite database and the fake queue
control. Every operation is called with generated parameters, with the right token
(and, separately, without one); all of schemathesis' checks run: no 5xx, status codes,
content types, headers and bodies as documented, and the methods a route does not
have (405 with ``Allow``). Only ``negative_data_rejection`` is left out (below).

Default: 60 cases per operation. ``FUZZ_LONG=1``: 2,000.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
import schemathesis.checks
from hypothesis import HealthCheck, settings

from federation_sender.admin.app import openapi_document
from federation_sender.admin.middleware import OPEN_ADMIN_PATHS

TOKEN = "schemathesis-admin-token"
CASES = 2_000 if os.environ.get("FUZZ_LONG") else 60

schema = schemathesis.openapi.from_dict(openapi_document())


class ServedApp:
    """The admin app on 127.0.0.1 in a child process (``admin_server.py`` says why)."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        script = Path(__file__).with_name("admin_server.py")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(self.db), TOKEN],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the port, once it listens (or "" if it died)
        assert line.strip().isdigit(), f"admin server did not start (exit {self.proc.poll()})"
        self.port = int(line)

    def stop(self) -> None:
        if self.proc is None:
            return
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()  # the server stops when its stdin closes
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            self.proc.stdout.close()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApp]:
    app = ServedApp(tmp_path_factory.mktemp("schemathesis") / "admin.db")
    app.start()
    yield app
    app.stop()


HYPOTHESIS = settings(
    max_examples=CASES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@schema.parametrize()
@HYPOTHESIS
def test_admin_api_conforms_to_its_openapi_document(case: Any, served: ServedApp) -> None:
    case.call_and_validate(
        base_url=served.base_url,
        headers={"Authorization": f"Bearer {TOKEN}"},
        # Unknown query parameters are ignored on purpose, as Synapse does, so tools
        # written against Synapse keep working: that is what this check flags.
        excluded_checks=[schemathesis.checks.negative_data_rejection],
    )


@schema.parametrize()
@settings(HYPOTHESIS, max_examples=max(CASES // 4, 10))
def test_admin_api_without_a_token_is_refused_as_documented(
    case: Any, served: ServedApp
) -> None:
    response = case.call(base_url=served.base_url, headers={"Authorization": "Bearer nope"})
    if (case.path.startswith("/_synapse/admin/") and case.method.upper() != "OPTIONS"
            and case.path not in OPEN_ADMIN_PATHS):
        # (OPTIONS is the CORS preflight, open by design: it carries no data; so is
        # server_version, open in Synapse too.)
        assert response.status_code == 401, (case.path, response.text)
    assert response.status_code < 500
    case.validate_response(response)
