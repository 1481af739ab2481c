"""Fault profiles for fake remote homeservers, and the pure decision of which fault hits.

A :class:`FaultProfile` says how a remote misbehaves; :func:`choose_fault` picks, for
one request, at most one fault from the profile using the remote's seeded
``random.Random``, so a run with the same seed and the same request order misbehaves
identically. Faults are checked in a fixed order (size limit first, then the random
ones in the order of :class:`Fault`), each with its own probability.

The text form (for the CLI and the demo) is ``key=value`` pairs separated by ``,``::

    down=30-90+200-260, slow=0.5, errors=0.1, hang=0.02, reset=0.05,
    reset_after=0.02, garbage=0.01, max_body=65536

``down`` windows are seconds since the remote started (on its clock's monotonic
time); ``slow`` is a delay in seconds before answering; the rates are probabilities
per request; ``max_body`` answers 413 to larger request bodies.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields


class Fault(enum.Enum):
    NONE = "none"
    TOO_LARGE = "too_large"
    """413 M_TOO_LARGE before reading the body."""
    RESET = "reset"
    """Connection reset while the request body is still being read; nothing processed."""
    ERROR = "error"
    """500 M_UNKNOWN; nothing processed."""
    HANG = "hang"
    """No answer for ``hang_s`` (the sender should time out), then a reset."""
    RESET_AFTER = "reset_after"
    """The transaction is processed, then the response is cut off mid-body."""
    GARBAGE = "garbage"
    """The transaction is processed, then a 200 whose body is not JSON."""


@dataclass(frozen=True, slots=True)
class FaultProfile:
    down: tuple[tuple[float, float], ...] = ()
    slow_s: float = 0.0
    error_rate: float = 0.0
    hang_rate: float = 0.0
    hang_s: float = 3600.0
    reset_rate: float = 0.0
    reset_after_rate: float = 0.0
    garbage_rate: float = 0.0
    max_body_bytes: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name.endswith("_rate") and not 0.0 <= getattr(self, f.name) <= 1.0:
                raise ValueError(f"{f.name} must be a probability, got {getattr(self, f.name)}")
        for start, end in self.down:
            if not 0 <= start < end:
                raise ValueError(f"bad down window {start}-{end}")

    @property
    def is_healthy(self) -> bool:
        return self == FaultProfile()

    _KEYS = {
        "slow": "slow_s",
        "errors": "error_rate",
        "hang": "hang_rate",
        "hang_s": "hang_s",
        "reset": "reset_rate",
        "reset_after": "reset_after_rate",
        "garbage": "garbage_rate",
    }

    @classmethod
    def parse(cls, spec: str) -> FaultProfile:
        """Parse the text form (see the module docstring); raises ``ValueError``."""
        kwargs: dict[str, object] = {}
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep:
                raise ValueError(f"fault {part!r}: expected key=value")
            if key == "down":
                windows = []
                for w in value.split("+"):
                    start, dash, end = w.partition("-")
                    if not dash:
                        raise ValueError(f"down window {w!r}: expected start-end")
                    windows.append((float(start), float(end)))
                kwargs["down"] = tuple(windows)
            elif key == "max_body":
                kwargs["max_body_bytes"] = int(value)
            elif key in cls._KEYS:
                kwargs[cls._KEYS[key]] = float(value)
            else:
                raise ValueError(f"unknown fault {key!r}")
        return cls(**kwargs)  # type: ignore[arg-type]

    def describe(self) -> str:
        """The text form, only non-default settings; ``healthy`` if none."""
        parts: list[str] = []
        if self.down:
            parts.append("down=" + "+".join(f"{a:g}-{b:g}" for a, b in self.down))
        if self.max_body_bytes is not None:
            parts.append(f"max_body={self.max_body_bytes}")
        default = FaultProfile()
        for key, attr in self._KEYS.items():
            if key != "hang_s" and getattr(self, attr) != getattr(default, attr):
                parts.append(f"{key}={getattr(self, attr):g}")
        if self.hang_rate and self.hang_s != default.hang_s:
            parts.append(f"hang_s={self.hang_s:g}")
        return ",".join(parts) or "healthy"

    def is_down_at(self, elapsed_s: float) -> bool:
        return any(start <= elapsed_s < end for start, end in self.down)


def choose_fault(profile: FaultProfile, rng: random.Random, body_bytes: int | None) -> Fault:
    """The fault for one request (``body_bytes`` from Content-Length, if sent)."""
    if (
        profile.max_body_bytes is not None
        and body_bytes is not None
        and body_bytes > profile.max_body_bytes
    ):
        return Fault.TOO_LARGE
    candidates = (
        (Fault.RESET, profile.reset_rate),
        (Fault.ERROR, profile.error_rate),
        (Fault.HANG, profile.hang_rate),
        (Fault.RESET_AFTER, profile.reset_after_rate),
        (Fault.GARBAGE, profile.garbage_rate),
    )
    # One draw per fault kind, always, so adding a fault to a profile does not
    # reshuffle when the others hit.
    draws = [rng.random() for _ in candidates]
    for (fault, rate), draw in zip(candidates, draws, strict=True):
        if draw < rate:
            return fault
    return Fault.NONE


ARCHETYPES: tuple[FaultProfile, ...] = (
    FaultProfile(slow_s=0.5),
    FaultProfile(error_rate=0.2),
    FaultProfile(reset_rate=0.1, reset_after_rate=0.05),
    FaultProfile(hang_rate=0.05, hang_s=120.0),
    FaultProfile(max_body_bytes=64 * 1024),
    FaultProfile(garbage_rate=0.1),
    FaultProfile(slow_s=0.2, error_rate=0.05, reset_after_rate=0.05),
)
"""One of each kind of misbehaviour, for :func:`varied_profiles`."""


def varied_profiles(
    names: Sequence[str],
    *,
    rng: random.Random,
    faulty_fraction: float = 0.5,
    outage: tuple[float, float] | None = None,
) -> dict[str, FaultProfile]:
    """A demo mix: ``outage`` (a down window) for the first name, the archetypes in
    turn for a ``faulty_fraction`` of the others (chosen by ``rng``), the rest healthy.
    """
    profiles = {name: FaultProfile() for name in names}
    rest = list(names)
    if outage is not None and rest:
        profiles[rest.pop(0)] = FaultProfile(down=(outage,))
    faulty = rng.sample(rest, round(len(rest) * faulty_fraction))
    for i, name in enumerate(sorted(faulty)):
        profiles[name] = ARCHETYPES[i % len(ARCHETYPES)]
    return profiles
