from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from federation_sender.config import TelemetrySettings
from federation_sender.redaction import REDACTED, redact, redact_url
from federation_sender.telemetry.logging import (
    TextFormatter,
    escape_controls,
    log_context,
    setup_logging,
)

log = logging.getLogger("federation_sender.queue.test")


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def configure(fmt: str, *secrets: str) -> io.StringIO:
    out = io.StringIO()
    setup_logging(TelemetrySettings(log_format=fmt, log_level="DEBUG"),  # type: ignore[arg-type]
                  stream=out, secrets=secrets)
    return out


def test_text_lines_carry_destination_and_txn(restore_root: None) -> None:
    out = configure("text")
    with log_context(destination="a.org"):
        log.info("queued %d pdus", 3)
        with log_context(txn_id="t1", room_id="!r:x"):
            log.warning("sending")
    log.info("outside")
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("INFO federation_sender.queue.test [destination=a.org] queued 3 pdus")
    assert "[destination=a.org txn_id=t1 room_id=!r:x] sending" in lines[1]
    assert lines[2].endswith("federation_sender.queue.test outside")


def test_json_lines(restore_root: None) -> None:
    out = configure("json")
    with log_context(destination="b.org", txn_id="t2"):
        try:
            raise ValueError("broken")
        except ValueError:
            log.exception("attempt failed")
    log.info("plain")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["destination"] == "b.org" and first["txn_id"] == "t2"
    assert first["level"] == "ERROR" and first["message"] == "attempt failed"
    assert "ValueError: broken" in first["exc_info"]
    assert first["ts"].endswith("Z")
    assert second["destination"] is None and second["txn_id"] is None


async def test_context_is_inherited_by_tasks_and_isolated_between_them(
        restore_root: None) -> None:
    out = configure("json")

    async def send(dest: str) -> None:
        with log_context(destination=dest):
            await asyncio.sleep(0)
            log.info("tick")
            await asyncio.sleep(0)
            log.info("tock")

    with log_context(txn_id="shared"):
        await asyncio.gather(send("x.org"), send("y.org"))
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert sorted(r["destination"] for r in records) == ["x.org", "x.org", "y.org", "y.org"]
    assert {r["txn_id"] for r in records} == {"shared"}


@pytest.mark.parametrize("text, secret", [
    ("Authorization: Bearer syt_abc.DEF-123", "syt_abc.DEF-123"),
    ('X-Matrix origin="a.org",destination="b.org",key="ed25519:k",sig="QmFzZTY0c2ln"',
     "QmFzZTY0c2ln"),
    ("GET /x?access_token=abcdef&limit=1", "abcdef"),
    ('{"password": "hunter2", "next_token": "5"}', "hunter2"),
    ("ed25519 a_AbCd ZGVhZGJlZWZkZWFkYmVlZmRlYWRiZWVmZGVhZGJlZWY=", "ZGVhZGJlZWZk"),
    ("token=sekrit", "sekrit"),
    ("connecting to postgresql+psycopg://fs:pg-pass@db:5432/fs", "pg-pass"),
    ("replication: redis://:redis-pass@redis:6379/0 channel hs", "redis-pass"),
    ("url='redis://user:p%40ss@host/1'", "p%40ss"),
])
def test_redaction_patterns(text: str, secret: str) -> None:
    cleaned = redact(text)
    assert secret not in cleaned
    assert REDACTED in cleaned


def test_redaction_keeps_harmless_text() -> None:
    text = 'next_token=5 txn_id=17 destination=a.org "signatures" ok'
    assert redact(text) == text
    for url in ("https://a.org/_matrix/x@y", "redis://redis:6379/0", "sqlite:///./data/x.db",
                "postgresql://fs@db/fs"):
        assert redact(url) == url == redact_url(url)


def test_alembic_is_quiet_at_info(restore_root: None, tmp_path: Path) -> None:
    from federation_sender.storage.engine import create_engine
    from federation_sender.storage.migrate import upgrade

    out = configure("text")
    logging.getLogger().setLevel(logging.INFO)

    async def migrate() -> None:
        engine = create_engine(f"sqlite:///{tmp_path}/a.db")
        try:
            await upgrade(engine)
        finally:
            await engine.dispose()

    asyncio.run(migrate())
    assert "alembic" not in out.getvalue()


def test_registered_secrets_and_tracebacks_are_redacted(restore_root: None) -> None:
    out = configure("text", "admin-token-XYZ")
    log.info("config loaded: %r", {"admin": {"token_file": "admin-token-XYZ"}})
    try:
        raise RuntimeError("header was Bearer zzz-top-secret")
    except RuntimeError:
        log.exception("boom")
    text = out.getvalue()
    assert "admin-token-XYZ" not in text
    assert "zzz-top-secret" not in text
    assert text.count(REDACTED) >= 2


def test_setup_is_idempotent(restore_root: None) -> None:
    configure("text")
    configure("json")
    ours = [h for h in logging.getLogger().handlers if h.get_name() == "federation_sender"]
    assert len(ours) == 1


# --- log injection (issue #42.2) ------------------------------------------------------

FORGED = "2026-12-01T00:00:00.000Z ERROR forged.logger X"


def test_text_lines_escape_line_breaks_in_message_arguments(restore_root: None) -> None:
    out = configure("text")
    log.info("admin request for %s", f"x\n{FORGED}\r\n{FORGED}")
    (line,) = out.getvalue().splitlines()
    assert line.endswith(f"admin request for x\\n{FORGED}\\r\\n{FORGED}")


def test_text_lines_escape_context_fields_and_logger_names(restore_root: None) -> None:
    out = configure("text")
    with log_context(destination=f"evil.org\n{FORGED}", txn_id="t\x1b[31m"):
        logging.getLogger(f"federation_sender.queue\n{FORGED}").warning("queued")
    (line,) = out.getvalue().splitlines()
    assert f"[destination=evil.org\\n{FORGED} txn_id=t\\x1b[31m]" in line
    assert f"federation_sender.queue\\n{FORGED} " in line


def test_text_tracebacks_keep_their_lines_but_only_the_record_starts_at_the_margin(
    restore_root: None,
) -> None:
    out = configure("text")
    try:
        raise ValueError(f"bad name\n{FORGED}")
    except ValueError:
        log.exception("attempt failed")
    first, *rest = out.getvalue().splitlines()
    assert first.endswith("attempt failed")
    assert rest and all(line.startswith("    ") for line in rest)
    assert "    ValueError: bad name" in rest
    assert f"    {FORGED}" in rest  # a continuation, not a record of its own


@pytest.mark.parametrize("char", [*map(chr, range(0x20)), "\x7f", *map(chr, range(0x80, 0xA0)),
                                  "\u2028", "\u2029"])
def test_every_control_character_is_escaped(restore_root: None, char: str) -> None:
    out = configure("text")
    with log_context(destination=f"d{char}"):
        log.info("m%s", char)
    text = out.getvalue()
    assert text.endswith("\n") and len(text.splitlines()) == 1
    assert char not in text[:-1]


@settings(max_examples=200, deadline=None)
@given(message=st.text(), field=st.text(), name=st.text(min_size=1))
def test_a_text_record_is_one_line_whatever_it_holds(message: str, field: str,
                                                      name: str) -> None:
    formatter = TextFormatter()
    record = logging.LogRecord(name, logging.INFO, __file__, 1, "%s", (message,), None)
    record.context = {"destination": field, field or "k": message}
    rendered = formatter.format(record)
    assert len(rendered.splitlines()) == 1
    assert escape_controls(rendered) == rendered
