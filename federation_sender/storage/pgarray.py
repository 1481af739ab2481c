"""PostgreSQL array literals for the multi-row statements' ``CAST(:p AS text[])`` and
``CAST(:p AS bigint[])`` parameters.

A Python list is dumped by psycopg element by element (a dumper looked up and called
for each): with the 415 destinations of every event in the race against Synapse
(``bench/synapse_compare.py``), the array parameters of the ``destination_rooms``
upsert and the group commit were about 5 % of the worker's busy samples. One string in
the array input syntax is a single text parameter that PostgreSQL parses in C.

Every text element is double-quoted, with backslash and double quote escaped, so any
string (empty, ``NULL``, with commas, braces or spaces) reads back as itself
(``tests/storage/test_pgarray.py`` round-trips them through PostgreSQL).
"""

from __future__ import annotations

from collections.abc import Iterable


def text_array(values: Iterable[str]) -> str:
    return "{" + ",".join(
        ['"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values]
    ) + "}"


def bigint_array(values: Iterable[int]) -> str:
    return "{" + ",".join([str(int(v)) for v in values]) + "}"
