"""The database and Redis URLs that Synapse's ``database`` and ``redis`` sections describe.

Synapse's worker needs PostgreSQL and Redis: a SQLite database or Redis disabled is
refused with one :class:`ConfigError` line. Passwords are percent-encoded into the
URLs (they are redacted wherever a URL is logged).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote

from federation_sender.errors import ConfigError


def database_url(db: object) -> str:
    if not isinstance(db, Mapping):
        raise ConfigError("database", "a mapping with name: psycopg2 and args", db)
    name = db.get("name", "sqlite3")
    if name not in ("psycopg2", "psycopg"):
        raise ConfigError(
            "database.name", "psycopg2 (Synapse workers need PostgreSQL)", name
        )
    args = db.get("args") or {}
    if not isinstance(args, Mapping):
        raise ConfigError("database.args", "a mapping", args)
    dbname = args.get("dbname") or args.get("database")
    if not dbname:
        raise ConfigError("database.args.dbname", "a database name", None)
    user = args.get("user")
    password = args.get("password")
    auth = ""
    if user:
        auth = quote(str(user), safe="")
        if password:
            auth += ":" + quote(str(password), safe="")
        auth += "@"
    host = str(args.get("host") or "")
    port = args.get("port")
    query: list[str] = []
    if host.startswith("/"):
        query.append("host=" + quote(host, safe="/"))
        host = ""
    netloc = auth + host + (f":{port}" if port and host else "")
    if port and not host:
        query.append(f"port={port}")
    for key in ("sslmode", "sslrootcert", "sslcert", "sslkey", "application_name"):
        if args.get(key):
            query.append(f"{key}={quote(str(args[key]), safe='/')}")
    url = f"postgresql://{netloc}/{quote(str(dbname), safe='')}"
    return url + ("?" + "&".join(query) if query else "")


def redis_url(redis: object) -> str:
    if not isinstance(redis, Mapping) or not redis.get("enabled", False):
        raise ConfigError(
            "redis.enabled", "true (Synapse workers replicate over Redis)", None
        )
    dbid = redis.get("dbid")
    path = redis.get("path")
    user = redis.get("username")
    password = redis.get("password")
    if password is None and redis.get("password_path"):
        try:
            password = Path(str(redis["password_path"])).read_text().strip()
        except OSError as e:
            raise ConfigError("redis.password_path", "a readable file", e.strerror) from e
    auth = ""
    if password:
        auth = (quote(str(user), safe="") if user else "") + ":" + quote(str(password), safe="")
        auth += "@"
    if path:
        q = f"?db={int(dbid)}" if dbid is not None else ""
        return f"unix://{auth}{path}{q}"
    scheme = "rediss" if redis.get("use_tls") else "redis"
    host = redis.get("host", "localhost")
    port = int(redis.get("port", 6379))
    return f"{scheme}://{auth}{host}:{port}/{int(dbid) if dbid is not None else 0}"

