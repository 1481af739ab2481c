"""The batch jobs' prerequisites, checked in-process: which Java runs, and its version
read from ``java -version`` as old and new JVMs print it."""

from __future__ import annotations

from pathlib import Path

import pytest

from federation_sender.batch.requirements import (
    MissingPrerequisite,
    check_java,
    check_sqlite_jdbc,
    java_command,
)


def _java_home(tmp_path: Path, version_line: str) -> Path:
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text(f"#!/bin/sh\necho '{version_line}' >&2\n")
    java.chmod(0o755)
    return home


def test_java_home_wins_over_the_path(tmp_path: Path) -> None:
    assert java_command({"JAVA_HOME": "/opt/jdk", "PATH": "/usr/bin"}) == "/opt/jdk/bin/java"
    assert java_command({"PATH": str(tmp_path)}) is None


@pytest.mark.parametrize(("line", "too_old"), [
    ('java version "1.8.0_292"', "Java 8"),
    ('openjdk version "11.0.2" 2019-01-15', "Java 11"),
    ('openjdk version "17.0.9" 2023-10-17', None),
    ('openjdk version "21" 2023-09-19', None),
])
def test_java_older_than_17_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: str, too_old: str | None
) -> None:
    monkeypatch.setenv("JAVA_HOME", str(_java_home(tmp_path, line)))
    if too_old is None:
        check_java()
        return
    with pytest.raises(MissingPrerequisite, match=rf"^{too_old} \(JAVA_HOME=.*\) is too old "
                                                  r"for Spark 4: install a Java 17"):
        check_java()


def test_a_missing_jdbc_jar_names_the_package(tmp_path: Path) -> None:
    with pytest.raises(MissingPrerequisite, match="libxerial-sqlite-jdbc-java"):
        check_sqlite_jdbc(str(tmp_path / "sqlite-jdbc.jar"))
