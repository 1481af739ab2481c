"""The batch computations as plain SQL: moved to :mod:`federation_sender.storage
.batch_baseline` (SQL lives under ``storage/``). This name stays for ``bench/batch.py``
until it imports from there."""

from __future__ import annotations

from federation_sender.storage.batch_baseline import QUERIES, run_query

__all__ = ["QUERIES", "run_query"]
