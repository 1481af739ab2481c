"""Missing prerequisites skip a developer's run and fail a CI run."""

from __future__ import annotations

import pytest

from federation_sender.testing.prereq import in_ci, missing, require_module, unavailable


@pytest.mark.parametrize("value, ci", [("", False), ("0", False), ("false", False),
                                       ("1", True), ("true", True)])
def test_ci_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch, value: str,
                                         ci: bool) -> None:
    monkeypatch.setenv("CI", value)
    assert in_ci() is ci


def test_locally_a_missing_prerequisite_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"bootstrap\.sh"):
        missing("/usr/bin/nothing")
    with pytest.raises(pytest.skip.Exception, match="no_such_module"):
        require_module("no_such_module", "nowhere")
    with pytest.raises(pytest.skip.Exception, match="did not start"):
        unavailable("server did not start")


def test_in_ci_a_missing_prerequisite_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="prerequisite missing in CI"):
        missing("/usr/bin/nothing")
    with pytest.raises(pytest.fail.Exception, match="did not start"):
        unavailable("server did not start")
    assert require_module("json", "stdlib") is not None
