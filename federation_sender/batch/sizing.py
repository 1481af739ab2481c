"""A run sized from its data: the partitions, and the memory a local run's driver gets,
from the row counts of the big tables (PostgreSQL's estimates, read before Spark starts,
in milliseconds) and the memory the machine has.

Spark's own defaults are sized for no data in particular. With this command's earlier
defaults (a 1 GB driver, two partitions per core in local mode) the audit of 10,000,000
``destination_rooms`` rows ran out of heap (issue #47); on a cluster Spark's 200 shuffle
partitions ran 2,021 tasks of milliseconds each for 200,000 rows. The rule here:

* **partitions**: two per executor core, so that both cores stay busy and one slow task
  does not hold a stage, and at least one per :data:`ROWS_PER_PARTITION` rows of the big
  tables together, so a task's share of a shuffle stays bounded whatever the size; at
  most :data:`MAX_PARTITIONS`. The same number splits the JDBC reads (one range scan per
  partition; only as many run at once as there are cores).
* **driver memory** (local mode only: the driver is the executor there, and its heap can
  only be chosen before its JVM starts): :data:`DRIVER_BASE_MB` and
  :data:`DRIVER_MB_PER_MILLION_ROWS` per million rows, at most
  :data:`DRIVER_SHARE_OF_AVAILABLE` of the memory the machine has available. When the
  machine has less than the rule wants the run goes ahead with what there is, and one
  line says what it would need.

An explicit ``--partitions`` or ``--conf spark.driver.memory=`` always wins; a cluster's
executors are sized by the cluster's own configuration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from federation_sender.storage.synapse.batch_reads import TXN_LOG

BIG_TABLES: dict[str, list[str]] = {
    "native": ["events", "room_memberships", "destination_rooms",
               "federation_transaction_log"],
    "synapse": ["events", "current_state_events", "destination_rooms", TXN_LOG],
}
"""The tables whose rows a run's size is counted in, per schema."""

ROWS_PER_PARTITION = 1_500_000
MAX_PARTITIONS = 64
DRIVER_BASE_MB = 1024
DRIVER_MB_PER_MILLION_ROWS = 100
DRIVER_SHARE_OF_AVAILABLE = 0.5
DRIVER_MEMORY_KEY = "spark.driver.memory"


@dataclass(frozen=True)
class Sizing:
    rows: int
    """The big tables' rows together (estimates)."""
    partitions: int
    driver_mb: int | None
    """What a local run's driver gets; None when it is not this command's to set."""
    wanted_mb: int | None = None
    """What the rule wanted, when the machine had less."""
    available_mb: int | None = None

    def shortfall(self) -> str | None:
        """One line when the driver gets less than the rule wants, else None."""
        if self.wanted_mb is None or self.driver_mb is None:
            return None
        return (f"{self.rows:,} rows want a driver of about {_gb(self.wanted_mb)}; this "
                f"machine has {_gb(self.available_mb or 0)} available, so the driver gets "
                f"{_gb(self.driver_mb)} (more --partitions lower what each task holds; "
                f"a cluster spreads it)")

    def describe(self) -> str:
        memory = f", driver {_gb(self.driver_mb)}" if self.driver_mb else ""
        return f"sized for {self.rows:,} rows: {self.partitions} partitions{memory}"


def _gb(mb: int) -> str:
    return f"{mb / 1024:.1f} GB"


def partitions_for(rows: int, cores: int) -> int:
    return max(2 * max(1, cores), min(MAX_PARTITIONS, math.ceil(rows / ROWS_PER_PARTITION)))


def driver_mb_for(rows: int) -> int:
    """The rule's driver memory for ``rows``, to the nearest 256 MB."""
    mb = DRIVER_BASE_MB + DRIVER_MB_PER_MILLION_ROWS * rows / 1_000_000
    return int(round(mb / 256) * 256)


def available_mb(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` in MB (Linux), None when it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def size_run(rows: int, cores: int, *, local: bool, driver_memory_given: bool,
             available: int | None) -> Sizing:
    """The sizing of a run over ``rows`` on ``cores`` executor cores."""
    partitions = partitions_for(rows, cores)
    if not local or driver_memory_given:
        return Sizing(rows, partitions, None)
    wanted = driver_mb_for(rows)
    if available is None or wanted <= available * DRIVER_SHARE_OF_AVAILABLE:
        return Sizing(rows, partitions, wanted)
    got = max(DRIVER_BASE_MB, int(available * DRIVER_SHARE_OF_AVAILABLE) // 256 * 256)
    return Sizing(rows, partitions, min(got, wanted), wanted_mb=wanted,
                  available_mb=available)
