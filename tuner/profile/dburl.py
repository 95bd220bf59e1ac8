"""Database URLs (SQLAlchemy's form): shown without credentials, given the PostgreSQL driver this
package installs, opened with a bounded connect time, and their failures told in one line.

    redact_url("postgresql://tuner:hunter2@db/tuning?sslpassword=x")
    -> "postgresql://tuner:***@db/tuning?sslpassword=***"

Used by the study store (``tuner.search.storage``) and the profile registry
(``tuner.profile.registry``). Light: SQLAlchemy is imported only by the functions that connect.

Credentials SQLAlchemy accepts in a URL string, all redacted wherever a URL is shown:

- the password of the authority part, ``scheme://user:PASSWORD@host`` (``scheme://:PASSPHRASE@/file``
  for pysqlcipher); everything up to the last ``@`` is hidden, so a password holding an unescaped
  ``@``, ``/`` or ``?`` is hidden whole;
- query parameters the dialects pass to their drivers: ``password``, ``passwd``, ``pwd``,
  ``sslpassword`` (libpq), ``private_key_passphrase``, tokens, secrets, API keys... (any key naming
  one of those);
- ``KEY=VALUE`` credentials inside a parameter's value (``odbc_connect=...;PWD=secret;``, a libpq
  conninfo) and in free text (an error message that quotes a connection string).

``scrub(text)`` also replaces every secret of every URL this process has opened (``remember``), so
an error message that quotes one (whatever the driver chose to print) loses it too.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Iterable
from urllib.parse import parse_qsl, quote, unquote, urlencode

from ..errors import StorageError

MASK = "***"

# A query parameter whose name says it holds a credential.
_SECRET_KEY_RE = re.compile(r"pass|pwd|secret|token|credential|api_?key|private_?key|auth", re.IGNORECASE)
# KEY=VALUE credentials inside a value or free text: ODBC (``PWD={a;b}``), libpq conninfo
# (``password='a b'``), and URL-style (``password=x&``).
_KV_SECRET_RE = re.compile(
    r"(?P<key>\b(?:[A-Za-z_]*pass(?:word|wd)?|pwd|[A-Za-z_]*secret|[A-Za-z_]*token|api_?key)\s*=\s*)"
    r"(?P<value>\{[^}]*\}?|'(?:[^'\\]|\\.)*'?|\"[^\"]*\"?|[^\s;&,)]*)",
    re.IGNORECASE,
)
# scheme://user:PASSWORD@ -- SQLAlchemy's own parse takes the username as [^:/]* and the password
# up to an @; we hide up to the last @ of the string, which is never less than SQLAlchemy reads.
_AUTHORITY_RE = re.compile(r"(?P<head>[\w+.-]+://[^:/@?#]*:)(?P<password>.*)@", re.DOTALL)
# A URL inside free text (an error message).
_URL_IN_TEXT_RE = re.compile(r"[A-Za-z][\w+.-]*://[^\s'\"<>]+")

_remembered: set[str] = set()
_remembered_lock = threading.Lock()
# Shorter secrets are not hunted in free text: replacing every "ab" in a message would garble it,
# and drivers do not print the password they were given.
_MIN_SCRUB = 4


def redact_url(url: str) -> str:
    """``url`` with every credential replaced by ``***``. Never raises; for any string."""
    text = str(url)
    text = _AUTHORITY_RE.sub(lambda m: m["head"] + MASK + "@", text, count=1)
    if "?" in text:
        base, _, query = text.partition("?")
        text = base + "?" + _redact_query(query)
    return _KV_SECRET_RE.sub(lambda m: m["key"] + MASK, text)


def _redact_query(query: str) -> str:
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=False)
    except ValueError:
        return _KV_SECRET_RE.sub(lambda m: m["key"] + MASK, query)
    if not pairs:
        return _KV_SECRET_RE.sub(lambda m: m["key"] + MASK, query)
    out = []
    for key, value in pairs:
        if _SECRET_KEY_RE.search(key):
            value = MASK
        else:
            value = _KV_SECRET_RE.sub(lambda m: m["key"] + MASK, value)
        out.append((key, value))
    return urlencode(out, safe="*/:,;{}=")


def secrets_of(url: str) -> set[str]:
    """The credential values in ``url``, as written and decoded."""
    found: set[str] = set()
    text = str(url)
    m = _AUTHORITY_RE.match(text)
    if m:
        whole = m["password"]
        found.update({whole, unquote(whole), whole.split("@", 1)[0], unquote(whole.split("@", 1)[0])})
    if "?" in text:
        query = text.split("?", 1)[1]
        for key, value in parse_qsl(query, keep_blank_values=True):
            if _SECRET_KEY_RE.search(key):
                found.update({value, quote(value, safe="")})
            for kv in _KV_SECRET_RE.finditer(value):
                found.add(kv["value"].strip("{}'\""))
    for kv in _KV_SECRET_RE.finditer(text):
        found.add(kv["value"].strip("{}'\""))
    return {s for s in found if s}


def remember(url: str) -> None:
    """Keep ``url``'s secrets, so ``scrub`` removes them from any text this process prints."""
    with _remembered_lock:
        _remembered.update(secrets_of(url))


def scrub(text: str, urls: Iterable[str] = ()) -> str:
    """``text`` (a message, an error) with URLs redacted and every known secret replaced."""
    out = _URL_IN_TEXT_RE.sub(lambda m: redact_url(m.group(0)), str(text))
    out = _KV_SECRET_RE.sub(lambda m: m["key"] + MASK, out)
    secrets = set()
    for url in urls:
        secrets |= secrets_of(url)
    with _remembered_lock:
        secrets |= _remembered
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= _MIN_SCRUB:
            out = out.replace(secret, MASK)
    return out


# -- opening ---------------------------------------------------------------------------------------


def dialect_of(url: str) -> str:
    """``postgresql``, ``sqlite``, ``mysql``... from the URL's scheme ("" when there is none)."""
    m = re.match(r"([\w.-]+)(?:\+[\w.-]+)?://", str(url))
    name = m.group(1).lower() if m else ""
    return "postgresql" if name == "postgres" else name


def driver_of(url: str) -> str:
    """The driver a URL names after its kind (``psycopg`` of ``postgresql+psycopg://``), or ""."""
    m = re.match(r"[\w.-]+\+([\w.-]+)://", str(url))
    return m.group(1).lower() if m else ""


def normalize_url(url: str) -> str:
    """``url`` with the PostgreSQL driver made explicit: ``postgresql://`` and ``postgres://`` become
    ``postgresql+psycopg://`` when psycopg (3) is installed (``offload-tuner[postgres]``).

    SQLAlchemy 2.1 maps a bare ``postgresql://`` to psycopg 3 already; 2.0 and older map it to
    psycopg2, which this package does not install, and no SQLAlchemy accepts ``postgres://``."""
    m = re.match(r"(postgres|postgresql)://", url, re.IGNORECASE)
    if not m:
        return url
    import importlib.util

    if importlib.util.find_spec("psycopg") is not None:
        return "postgresql+psycopg://" + url[m.end():]
    return "postgresql://" + url[m.end():]


def engine_kwargs(url: str, *, connect_timeout: int = 10) -> dict[str, Any]:
    """``create_engine`` keyword arguments: a bounded connect time (an unreachable host otherwise
    hangs for minutes), a liveness check of pooled connections, SQLite's lock wait."""
    dialect = dialect_of(url)
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    query = url.split("?", 1)[1] if "?" in url else ""
    keys = {k.lower() for k, _ in parse_qsl(query, keep_blank_values=True)}
    if dialect == "postgresql" and "connect_timeout" not in keys:
        kwargs["connect_args"] = {"connect_timeout": connect_timeout}
    elif dialect == "mysql" and "connect_timeout" not in keys:
        kwargs["connect_args"] = {"connect_timeout": connect_timeout}
    elif dialect == "sqlite" and "timeout" not in keys:
        # two processes on one SQLite file wait for each other's write instead of failing at once
        kwargs["connect_args"] = {"timeout": 30}
    return kwargs


_DRIVER_HINTS = {
    "postgresql": "pip install 'offload-tuner[postgres]' (psycopg 3)",
    "mysql": "pip install mysqlclient (or use mysql+pymysql:// with pip install pymysql)",
}


def explain(exc: BaseException, url: str, *, what: str = "database") -> StorageError:
    """One line for a failure to open or use ``url``: what went wrong and what to do."""
    shown = redact_url(url)
    dialect = dialect_of(url)
    name = type(exc).__name__
    cause = exc.__cause__ or exc.__context__
    detail = first_line(exc)
    if name == "ArgumentError" and "parse" in str(exc).lower() or (not dialect and name in ("ArgumentError", "ValueError")):
        return StorageError(
            f"{shown!r} is not a database URL; give one like sqlite:////path/to/studies.db or "
            "postgresql://user@host/dbname (omit --storage for the default SQLite store)"
        )
    if name == "NoSuchModuleError":
        driver = driver_of(url)
        if driver:  # "postgresql+bogusdrv://": the kind is known, its driver is not
            return StorageError(f"{shown}: unknown driver {driver!r} for {dialect} (SQLAlchemy has no {dialect}+{driver} "
                                f"dialect); leave the driver out ({dialect}://) or name an installed one")
        return StorageError(f"{shown}: unknown database kind {dialect!r} (SQLAlchemy has no dialect for it); "
                                "use sqlite:// or postgresql://")
    if isinstance(exc, ImportError) or isinstance(cause, ImportError):
        missing = getattr(cause, "name", None) or getattr(exc, "name", None) or "its driver"
        hint = _DRIVER_HINTS.get(dialect, f"install the Python package that provides {missing}")
        return StorageError(f"{shown}: the {dialect or 'database'} driver is not installed ({missing}); {hint}")
    if dialect == "sqlite":
        path = sqlite_path(url)
        if "not a database" in detail or "malformed" in detail or "file is encrypted" in detail:
            return StorageError(
                f"{path}: the {what} file is damaged ({detail}). Move it aside (mv '{path}' '{path}.broken') and "
                "run again: a new one is made (the trials in the old one are lost; profiles are separate files)"
            )
        if "unable to open" in detail or "readonly" in detail or "read-only" in detail:
            return StorageError(f"{path}: cannot open the {what} file for writing ({detail}); check the folder exists "
                                    "and is writable, or pass --storage elsewhere")
        return StorageError(f"{path}: {what} error: {detail}")
    if name in ("OperationalError", "InterfaceError") and _looks_like_connect_failure(detail):
        return StorageError(
            f"cannot reach the {what} at {shown}: {scrub(detail, [url])}. Check the host, port, user and password "
            "(~/.pgpass or PGPASSWORD keep it off the command line), and that the server is running"
        )
    return StorageError(f"{what} at {shown}: {name}: {scrub(detail, [url])}")


def _looks_like_connect_failure(detail: str) -> bool:
    words = ("connection", "connect", "could not translate host", "timeout", "password authentication",
             "does not exist", "refused", "no route", "name or service", "server closed")
    return any(w in detail.lower() for w in words)


def first_line(exc: BaseException) -> str:
    """The driver's own message: SQLAlchemy wraps it as ``(module.Error) message`` plus SQL and a
    link; keep the message."""
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).strip()
    text = re.sub(r"^\([\w.]+\)\s*", "", text)
    text = text.split("\n[SQL:", 1)[0].split("\n(Background", 1)[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(lines[:2]) if lines else type(exc).__name__


def sqlite_path(url: str) -> str:
    """The file of a ``sqlite:///`` URL (``:memory:`` when none)."""
    m = re.match(r"sqlite(?:\+\w+)?:///(.*?)(?:\?.*)?$", url)
    return (m.group(1) or ":memory:") if m else url


def advisory_lock(connection: Any, name: str) -> Any:
    """Hold a PostgreSQL session advisory lock named ``name`` on ``connection`` until the
    returned callable is called. Elsewhere (SQLite...) a no-op: those serialize DDL themselves.

    Two tuners creating Optuna's tables in a fresh database at once raced in ``CREATE TABLE``
    (``duplicate key value violates unique constraint "pg_type_typname_nsp_index"``: PostgreSQL
    checks ``IF NOT EXISTS`` before, not under, its catalog insert), so creation is serialized."""
    if connection.dialect.name != "postgresql":
        return lambda: None
    import hashlib

    from sqlalchemy import text

    key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)
    connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": key})
    connection.commit()

    def release() -> None:
        connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
        connection.commit()

    return release


__all__ = [
    "redact_url",
    "secrets_of",
    "remember",
    "scrub",
    "normalize_url",
    "engine_kwargs",
    "explain",
    "dialect_of",
    "sqlite_path",
    "advisory_lock",
    "first_line",
]
