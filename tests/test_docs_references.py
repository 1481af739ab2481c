"""The docs name only what exists (issue #45.5: at least ten references had gone
stale): every file path of ours, every ``federation_sender.`` module, every
configuration key and every ``federation-sender`` command written in backticks in
README.md and docs/*.md.

What counts as ours: a path that starts with one of the repository's folders
(``federation_sender/``, ``tests/``, ``bench/``, ``scripts/``, ``deploy/``, ``docs/``) or
with one of the package's own folders (``queue/``, ``storage/``, ...: read from
``federation_sender/``), and ``core/`` for the queue's pure core. A ``synapse/`` path is
ours (``federation_sender/synapse/``, ``storage/synapse/``) or Synapse's own source,
which the suite installs (checked there when it is installed).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from federation_sender.cli import build_parser
from federation_sender.config.loading import iter_keys
from federation_sender.testing.synapse_install import venv_dir

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "federation_sender"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The package's own docstrings and comments name modules and paths too (two of the ten
# stale references were there: ``storage/synapse/schema.py`` named a
# ``federation_sender.synapse.migrate``, ``storage/capabilities.py`` an ``app.py``).
SOURCES = sorted(PACKAGE.rglob("*.py"))
TOP = ("federation_sender/", "tests/", "bench/", "scripts/", "deploy/", "docs/", ".ci/")
SUBPACKAGES = tuple(f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
TICKED = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)+/?$")
MODULE = re.compile(r"^~?federation_sender(\.[A-Za-z_][A-Za-z0-9_]*)+$")
# Our sections whose names Synapse's configuration, span names and logger names do not
# share (``federation.`` and ``replication.`` are also Synapse keys and our span names).
SECTIONS = ("admin", "database", "queue", "sharding", "telemetry")
KEY = re.compile(r"^(" + "|".join(SECTIONS) + r")\.[a-z_]+(\.[a-z_]+)*$")
MODULES = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}


def _ticked(files: list[Path] = DOCS) -> list[tuple[str, int, str]]:
    return [(doc.relative_to(ROOT).as_posix(), n, token)
            for doc in files
            for n, line in enumerate(doc.read_text().splitlines(), 1)
            for token in TICKED.findall(line)]


def _synapse_source() -> Path | None:
    found = sorted(venv_dir().glob("lib/python3*/site-packages"))
    return found[0] if found and (found[0] / "synapse").is_dir() else None


def _our_path(token: str) -> Path | None:
    """Where ``token`` points in the tree, if it is a path of ours; None if not ours."""
    path = re.sub(r"\.[A-Z]\w*$", ".py", token.split("::", 1)[0].split(":", 1)[0])
    path = path.rstrip("/")
    if not PATH.match(path):
        return None
    if path.startswith("synapse/"):
        # Ours (the Synapse backend, ``federation_sender/synapse/`` or
        # ``storage/synapse/``), else Synapse's own source.
        theirs = _synapse_source()
        places = [PACKAGE, PACKAGE / "storage", *([theirs] if theirs is not None else [])]
        found = [place / path for place in places if (place / path).exists()]
        if found:
            return found[0]
        return None if theirs is None else theirs / path
    if path.startswith(TOP):
        return ROOT / path
    if path.startswith("core/"):
        return PACKAGE / "queue" / path
    if path.startswith(SUBPACKAGES):
        return PACKAGE / path
    return None


@pytest.mark.parametrize("files", [DOCS, SOURCES], ids=["docs", "package"])
def test_every_path_of_ours_exists(files: list[Path]) -> None:
    missing = [f"{doc}:{n}: {token}" for doc, n, token in _ticked(files)
               if (p := _our_path(token)) is not None and not p.exists()
               and not any(ch in token for ch in "*<>{}")]
    assert missing == []


def _module_exists(dotted: str) -> bool:
    """A module, or a name inside one (``federation_sender.queue.core.states.TRANSITIONS``)."""
    parts = dotted.lstrip("~").split(".")
    for i in range(len(parts), 1, -1):
        try:
            if importlib.util.find_spec(".".join(parts[:i])) is not None:
                return True
        except ModuleNotFoundError:
            continue
    return False


@pytest.mark.parametrize("files", [DOCS, SOURCES], ids=["docs", "package"])
def test_every_module_of_ours_exists(files: list[Path]) -> None:
    # A module of ours, not a logger name or a table of our schema (``federation_sender.
    # federation_transaction_log``): the name after the package is one of its modules.
    missing = [f"{doc}:{n}: {token}" for doc, n, token in _ticked(files)
               if MODULE.match(token) and token.lstrip("~").split(".")[1] in MODULES
               and not _module_exists(token)]
    assert missing == []


def test_every_configuration_key_exists() -> None:
    keys = set(iter_keys())
    prefixes = {".".join(k.split(".")[:i]) for k in keys for i in range(1, k.count(".") + 1)}
    unknown = [f"{doc}:{n}: {token}" for doc, n, token in _ticked()
               if KEY.match(token) and not token.endswith(".py") and token not in keys
               and token not in prefixes]
    assert unknown == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_command_exists(doc: Path) -> None:
    parser = build_parser()
    commands = {a.dest: a for a in parser._actions if a.dest == "command"}
    choices = set(commands["command"].choices or ()) if commands else set()
    unknown = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for token in TICKED.findall(line):
            m = re.match(r"^federation-sender ([a-z][a-z-]*)\b", token)
            if m and m[1] not in choices:
                unknown.append(f"{n}: {token}")
    assert unknown == []
