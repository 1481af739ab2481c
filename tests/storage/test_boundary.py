"""The storage boundary holds: who may import what (read from the source, no database).

* (The pure core, ``queue/core/``, imports no storage module, nor asyncio, aiohttp,
  SQLAlchemy, the clock or telemetry: an import-linter contract in pyproject.toml says
  so, indirect imports included.)
* The queue engine, the admin API, the EDU fan-outs and the intake reach storage only
  through ``storage/protocols.py`` and build no SQL.
* Outside ``storage/`` (whose ``storage/synapse/`` is the Synapse dialect, and the places
  that stand in for other processes: ``testing/``, ``sim/``), nothing builds SQL or
  reads the schema: no SQLAlchemy query building and no SQL text (the batch jobs' too:
  theirs is in ``storage/batch_*.py``). Engine types, URL parsing and error classes are
  not SQL (``sqlalchemy.ext.asyncio``, ``sqlalchemy.engine``, ``sqlalchemy.exc``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import federation_sender

PACKAGE = Path(federation_sender.__file__).parent
THROUGH_PROTOCOLS = ("queue", "admin", "edus", "intake")
MAY_BUILD_SQL = ("storage", "testing", "sim")
NOT_SQL = ("sqlalchemy.ext.asyncio", "sqlalchemy.engine", "sqlalchemy.exc")
SQL_TEXT = re.compile(
    r"\b(SELECT\s.+\sFROM|INSERT\s+INTO|DELETE\s+FROM|UPDATE\s+\w+\s+SET"
    r"|(CREATE|DROP)\s+(\w+\s+)?(TABLE|INDEX)|ALTER\s+TABLE)\b",
    re.IGNORECASE | re.DOTALL,
)


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _modules(*under: str) -> list[Path]:
    found: list[Path] = []
    for u in under:
        p = PACKAGE / u
        found.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    return found


def _rel(p: Path) -> str:
    return p.relative_to(PACKAGE).as_posix()


def test_engine_admin_edus_and_intake_use_only_the_protocols() -> None:
    # The boundary's Protocols: the transaction's aggregates, and what the EDU fan-outs
    # read of rooms, hosts and presence.
    boundary = ("federation_sender.storage.protocols",)
    allowed = {"federation_sender.storage", *boundary}
    bad: dict[str, list[str]] = {}
    for p in _modules(*THROUGH_PROTOCOLS):
        found = sorted(
            i for i in _imports(p)
            if (i.startswith("federation_sender.storage") and i not in allowed
                and not i.startswith(tuple(f"{b}." for b in boundary)))
            or i.split(".")[0] == "sqlalchemy"
        )
        if found:
            bad[_rel(p)] = found
    assert bad == {}


def test_no_sql_outside_storage() -> None:
    bad: dict[str, list[str]] = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        rel = _rel(p)
        if rel.split("/")[0] in MAY_BUILD_SQL:
            continue
        found = sorted(
            i for i in _imports(p)
            if i.startswith("federation_sender.storage.schema")
            or (i.split(".")[0] == "sqlalchemy" and not i.startswith(NOT_SQL))
        )
        if found:
            bad[rel] = found
    assert bad == {}


def _sql_strings(path: Path) -> list[int]:
    """Lines of string literals (f-string parts included, docstrings not) that read as
    SQL statements."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(n.value) for n in ast.walk(tree)
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
    }
    return sorted({
        n.lineno for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
        and id(n) not in docstrings and SQL_TEXT.search(n.value)
    })


def test_no_sql_text_outside_storage() -> None:
    bad = {
        _rel(p): lines for p in sorted(PACKAGE.rglob("*.py"))
        if _rel(p).split("/")[0] not in MAY_BUILD_SQL and (lines := _sql_strings(p))
    }
    assert bad == {}


def test_the_sql_text_check_sees_sql(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""SELECT x FROM docstrings is prose."""\n'
        'a = "select max(stream_ordering) from events"\n'
        'b = f"CREATE UNLOGGED TABLE {name} (x text)"\n'
        'c = "DROP TABLE IF EXISTS t"\n'
        'd = "selected from the list"\n'
    )
    assert _sql_strings(sample) == [2, 3, 4]


def test_no_module_asks_which_backend_it_has() -> None:
    """The backend is chosen once, in the composition root: no ``isinstance`` on a
    backend class, and no ``.name == "synapse"`` test of it, anywhere in the package."""
    bad: list[str] = []
    for p in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance" and len(node.args) == 2
                and "Backend" in ast.unparse(node.args[1])
            ) or (
                isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value in ("synapse", "native")
                    for c in node.comparators
                ) and ast.unparse(node.left).endswith(".name")
            ):
                bad.append(f"{_rel(p)}:{node.lineno}")
    assert bad == []
