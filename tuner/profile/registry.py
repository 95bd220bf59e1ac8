"""The team's profile registry: profiles in a table of a shared database (the PostgreSQL that holds
the team's studies, or any SQLAlchemy URL), published by the machines that tuned, pulled by the
machines of the same hardware class, and read by apps (``OFFLOAD_TUNER_REGISTRY``).

    publish([profile], "postgresql://tuner@db/tuning")       # -> [PublishResult]
    pull("postgresql://tuner@db/tuning", hardware_class=None)  # this machine's class -> [ImportResult]

The table ``offload_tuner_profiles`` holds one profile per *slot*: one model (its header hash) on
one machine (its fingerprint). Publishing validates each profile and never overwrites a different
one silently: the same profile again (``Profile.identity()``: model header, machine, settings) is
a ``duplicate``; another profile in the slot is a ``conflict`` that ``force`` replaces. What comes
back from the database is validated again (anyone who can write the table writes what we read).

Apps: ``tuner.load_profile`` looks at the local folders first; when none has a profile for the
model on this machine and ``OFFLOAD_TUNER_REGISTRY`` is set, it asks the registry for this model's
profiles of this machine or its hardware class and keeps them in a local cache folder
(``<data>/registry/<url key>/``), so an app still starts when the database is down (with a
warning naming the cached copy's age). SQLAlchemy is imported only then: loading a profile from
files stays light.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..errors import ProfileError, StorageError
from ..paths import atomic_write_text, data_dir
from .dburl import advisory_lock, engine_kwargs, explain, normalize_url, redact_url, remember
from .document import MAX_PROFILE_BYTES, Profile, ProfileWarning
from .store import BundleItem, ImportResult, SearchPath, import_items, parse_json

TABLE = "offload_tuner_profiles"
APP_CONNECT_TIMEOUT = 5  # seconds an app waits for the registry before using its cached copy


class RegistryUnavailableWarning(ProfileWarning):
    """The registry could not be reached; a cached copy of its profiles was used."""


@dataclass(frozen=True)
class PublishResult:
    """What ``publish`` did with one profile: ``published``, ``replaced`` (``force``), ``duplicate``
    (the same profile is there), ``conflict`` (another profile holds its slot) or ``invalid``."""

    name: str
    action: str
    detail: str


# -- the table -----------------------------------------------------------------------------------


def _table(metadata: Any) -> Any:
    from sqlalchemy import BigInteger, Column, DateTime, Integer, String, Table, Text

    return Table(
        TABLE, metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("slot", String(160), nullable=False, unique=True),  # model header hash -- machine fingerprint
        Column("identity", String(64), nullable=False),
        Column("model_file_name", String(1024), nullable=False),
        Column("model_header_hash", String(128), nullable=False, index=True),
        Column("model_size", BigInteger, nullable=False),
        Column("machine_fingerprint", String(64), nullable=False),
        Column("hardware_class", String(64), nullable=False, index=True),
        Column("created_at", String(64), nullable=False),
        Column("published_at", DateTime, nullable=False),
        Column("published_from", String(255), nullable=False),
        Column("document", Text, nullable=False),
    )


class _Registry:
    """An open registry: an engine and the table (created on first use, race-free)."""

    def __init__(self, url: str, *, connect_timeout: int = 10) -> None:
        import sqlalchemy

        remember(url)
        self.url = url
        self.shown = redact_url(url)
        normalized = normalize_url(url)
        try:
            self.engine = sqlalchemy.create_engine(normalized, **engine_kwargs(normalized, connect_timeout=connect_timeout))
            self.table = _table(sqlalchemy.MetaData())
            with self.engine.connect() as connection:
                release = advisory_lock(connection, "offload-tuner: create the profile registry table")
                try:
                    self.table.create(connection, checkfirst=True)
                    connection.commit()
                finally:
                    release()
        except Exception as exc:
            self.close()
            raise explain(exc, url, what="profile registry") from None

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.dispose()

    def __enter__(self) -> "_Registry":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def rows(self, *where: Any) -> list[Any]:
        import sqlalchemy

        query = sqlalchemy.select(self.table).where(*where).order_by(self.table.c.id)
        try:
            with self.engine.connect() as connection:
                return list(connection.execute(query))
        except sqlalchemy.exc.SQLAlchemyError as exc:
            raise explain(exc, self.url, what="profile registry") from None


def _slot(profile: Profile) -> str:
    return f"{profile.model.header_hash}--{profile.machine.fingerprint}"


def _row_values(profile: Profile) -> dict[str, Any]:
    return {
        "slot": _slot(profile),
        "identity": profile.identity(),
        "model_file_name": profile.model.file_name,
        "model_header_hash": profile.model.header_hash,
        "model_size": profile.model.size,
        "machine_fingerprint": profile.machine.fingerprint,
        "hardware_class": profile.machine.hardware_class,
        "created_at": profile.created_at,
        "published_at": _dt.datetime.now(_dt.timezone.utc).replace(tzinfo=None),
        "published_from": socket.gethostname()[:255],
        "document": profile.to_json(),
    }


# -- publish -------------------------------------------------------------------------------------


def publish(profiles: Iterable[Profile], url: str, *, force: bool = False) -> list[PublishResult]:
    """Put each profile in the registry at ``url``. Nothing different is overwritten without ``force``."""
    import sqlalchemy

    results = []
    with _Registry(url) as registry:
        t = registry.table
        for profile in profiles:
            name = profile.name
            try:
                profile.validate()
                if len(profile.to_json().encode()) > MAX_PROFILE_BYTES:
                    raise ProfileError(f"larger than {MAX_PROFILE_BYTES} bytes")
            except ProfileError as exc:
                results.append(PublishResult(name, "invalid", str(exc)))
                continue
            values = _row_values(profile)
            for attempt in range(2):
                try:
                    with registry.engine.begin() as connection:
                        existing = connection.execute(
                            sqlalchemy.select(t.c.identity, t.c.created_at, t.c.published_from).where(t.c.slot == values["slot"])
                        ).first()
                        if existing is None:
                            connection.execute(t.insert().values(**values))
                            results.append(PublishResult(name, "published", f"{profile.model.file_name} on {profile.machine.describe()}"))
                        elif existing.identity == values["identity"]:
                            results.append(PublishResult(name, "duplicate", "the registry has this profile already"))
                        elif force:
                            connection.execute(t.update().where(t.c.slot == values["slot"]).values(**values))
                            results.append(PublishResult(name, "replaced", f"replaced the one tuned {existing.created_at}"))
                        else:
                            results.append(PublishResult(
                                name, "conflict",
                                f"the registry holds another profile of {profile.model.file_name} for this machine "
                                f"(tuned {existing.created_at}, published from {existing.published_from}); --force replaces it"))
                    break
                except sqlalchemy.exc.IntegrityError:
                    if attempt:  # another machine published into the slot between our read and write: read again
                        raise explain(RuntimeError("the slot keeps changing"), url, what="profile registry") from None
                except sqlalchemy.exc.SQLAlchemyError as exc:
                    raise explain(exc, url, what="profile registry") from None
    return results


# -- pull ----------------------------------------------------------------------------------------


def pull(url: str, *, hardware_class: str | None = None, machine: Any = None, dest: str | os.PathLike[str] | None = None,
         force: bool = False, search_path: SearchPath = None) -> list[ImportResult]:
    """Copy the registry's profiles of a hardware class (this machine's by default) into ``dest``
    (your profile folder), validated, duplicates skipped, nothing overwritten without ``force``."""
    if hardware_class is None:
        if machine is None:
            from ..machine.probe import app_machine

            machine = app_machine()  # llama.cpp's devices, probed once per boot (tuner.machine.devices)
        hardware_class = machine.hardware_class()
    with _Registry(url) as registry:
        rows = registry.rows(registry.table.c.hardware_class == hardware_class)
    return import_items(_items(rows), dest=dest, force=force, search_path=search_path)


def _items(rows: Sequence[Any]) -> list[BundleItem]:
    """Rows as import items: each document parsed and validated (errors name the row)."""
    items = []
    for row in rows:
        where = f"registry row {row.id}"
        try:
            if len(row.document.encode()) > MAX_PROFILE_BYTES:
                raise ProfileError(f"{where}: larger than {MAX_PROFILE_BYTES} bytes")
            document = parse_json(row.document, where)
            profile: Profile | ProfileError = Profile.from_dict(document)
        except ProfileError as exc:
            profile = exc if str(exc).startswith(where) else ProfileError(f"{where}: {exc}")
            document = None
        except (ValueError, RecursionError) as exc:
            profile = ProfileError(f"{where}: {exc}" if isinstance(exc, ValueError) else
                                   f"{where}: not a profile: it is nested too deeply")
            document = None
        items.append(BundleItem(int(row.id), profile, document))
    return items


# -- apps -----------------------------------------------------------------------------------------


def cache_dir(url: str) -> Path:
    """The local copy of one registry's profiles (keyed by the URL without its credentials)."""
    key = hashlib.sha256(redact_url(url).encode()).hexdigest()[:16]
    return data_dir() / "registry" / key


def _fingerprints(machine: Any) -> list[str]:
    """This machine's fingerprint, and the one offload-tuner wrote before identity v2 (older profiles)."""
    from ..machine.identity import legacy_identities

    return list(dict.fromkeys([machine.fingerprint(), legacy_identities(machine)[0]]))


def _classes(machine: Any) -> list[str]:
    from ..machine.identity import legacy_identities

    return list(dict.fromkeys([machine.hardware_class(), legacy_identities(machine)[1]]))


def refresh_for_model(url: str, fingerprint: dict, machine: Any) -> Path:
    """Fetch the registry's profiles of this model for this machine or its hardware class into the
    cache folder and return the folder. When the registry cannot be reached, warn and return the
    folder as it is (what an earlier fetch left there)."""
    folder = cache_dir(url)
    stamp = folder / ".fetched-at"
    try:
        with _Registry(url, connect_timeout=APP_CONNECT_TIMEOUT) as registry:
            t = registry.table
            from sqlalchemy import or_

            rows = registry.rows(t.c.model_header_hash == fingerprint["header_hash"], t.c.model_size == fingerprint["size"],
                                 or_(t.c.machine_fingerprint.in_(_fingerprints(machine)),
                                     t.c.hardware_class.in_(_classes(machine))))
    except StorageError as exc:  # unreachable, no driver, not a database...
        cached = [p for p in folder.glob("*.json")] if folder.is_dir() else []
        when = stamp.read_text(encoding="utf-8").strip() if stamp.is_file() else "an unknown time"
        if cached:
            warnings.warn(f"{exc}; using the registry's profiles cached at {folder} (fetched {when})",
                          RegistryUnavailableWarning, stacklevel=3)
        else:
            warnings.warn(f"{exc}; no cached copy of the registry's profiles either", RegistryUnavailableWarning, stacklevel=3)
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for item in _items(rows):
        if isinstance(item.result, Profile):
            atomic_write_text(folder / item.result.default_filename(), item.result.to_json())
    atomic_write_text(stamp, _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") + "\n")
    return folder


__all__ = ["publish", "pull", "PublishResult", "RegistryUnavailableWarning", "refresh_for_model", "cache_dir", "TABLE"]
