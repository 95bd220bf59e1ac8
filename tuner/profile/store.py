"""Where profiles live and how they travel: the search path (the user's folder, then
``OFFLOAD_TUNER_PROFILE_PATH``), reading one file, and bundles (one file carrying several
profiles, imported without overwriting anything silently).

Files: one profile per file, ``<model stem>--<machine fingerprint>.json``. A bundle is
``{bundle_version, created_at, tool_version, profiles: [...]}``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple, Sequence, Union

from ..errors import FileWriteError, ProfileError, ProfileValidationError
from ..paths import ENV_PROFILE_PATH, atomic_write_text, profiles_dir
from .document import (
    BUNDLE_VERSION,
    MAX_BUNDLE_BYTES,
    MAX_PROFILE_BYTES,
    Profile,
    _kind,
    _message,
    _schema_version,
    tool_version,
    utc_now,
)


# -- reading and writing files -----------------------------------------------------------------


def read_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and validate one profile file. Its errors name the field, not the file: callers add it."""
    data = _read_json(path, MAX_PROFILE_BYTES, "profile")
    if isinstance(data, Mapping) and "bundle_version" in data:
        raise ProfileError(
            f"{os.fspath(path)} is a bundle of profiles, not a profile; "
            f"import it with `offload-tuner profile import {os.fspath(path)}`"
        )
    return dataclasses.replace(Profile.from_dict(data), path=os.fspath(path))


class ProfileEntry(NamedTuple):
    """One file found on the search path: its profile, or why it could not be read."""

    path: Path
    result: Union[Profile, ProfileError]
    origin: Path  # the search-path entry it was found in

    @property
    def profile(self) -> Profile | None:
        return self.result if isinstance(self.result, Profile) else None

    @property
    def error(self) -> ProfileError | None:
        return self.result if isinstance(self.result, ProfileError) else None

    @property
    def problem(self) -> str | None:
        """What is wrong with the file, without its path (for a line that names the path already)."""
        return None if self.error is None else without_path(str(self.error), self.path)


def without_path(message: str, path: str | os.PathLike[str]) -> str:
    """``message`` without a leading ``"PATH: "``: errors about a file name it, and a line that names
    the file itself must not say it twice (``X: X: not valid JSON``)."""
    prefix = f"{os.fspath(path)}: "
    return message[len(prefix):] if message.startswith(prefix) else message


SearchPath = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]], None]


def profile_search_path(search_path: SearchPath = None) -> list[Path]:
    """Folders (or single files) to look for profiles in, first wins.

    By default the user's folder, then each entry of ``OFFLOAD_TUNER_PROFILE_PATH`` (team folders: a
    shared mount, a git checkout). An explicit ``search_path`` (a list, or an ``os.pathsep``-separated
    string) is used as given, without the user's folder.
    """
    if search_path is None:
        entries: list[str | os.PathLike[str]] = [profiles_dir()]
        entries += [p for p in os.environ.get(ENV_PROFILE_PATH, "").split(os.pathsep) if p.strip()]
    elif isinstance(search_path, (str, os.PathLike)):
        entries = [p for p in os.fspath(search_path).split(os.pathsep) if p.strip()]
    else:
        entries = list(search_path)
    seen: set[Path] = set()
    out: list[Path] = []
    for entry in entries:
        path = Path(entry).expanduser()
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            out.append(path)
    return out


def list_profiles(search_path: SearchPath = None) -> list[ProfileEntry]:
    """Every ``*.json`` on the search path, in search-path order, each read (or its error)."""
    found: list[ProfileEntry] = []
    for origin in profile_search_path(search_path):
        if origin.is_file():
            files = [origin]
        elif origin.is_dir():
            files = sorted(p for p in origin.glob("*.json") if not p.name.startswith(".") and p.is_file())
        else:
            continue  # a team folder that is not mounted today is not an error
        for path in files:
            try:
                result: Profile | ProfileError = read_profile(path)
            except ProfileError as exc:
                result = exc
            found.append(ProfileEntry(path, result, origin))
    return found


def resolve_profile(ref: str | os.PathLike[str], search_path: SearchPath = None) -> Profile:
    """A profile by path, or by name (a file stem from ``list_profiles``; the first one found wins)."""
    text = os.fspath(ref)
    path = Path(text).expanduser()
    if path.is_file():
        return read_profile(path)
    looks_like_path = text.endswith(".json") or "/" in text or os.sep in text
    if not looks_like_path:
        for entry in list_profiles(search_path):
            if entry.path.stem == text:
                if entry.error is not None:
                    raise ProfileError(f"{entry.path}: {entry.problem}")
                assert entry.profile is not None
                return entry.profile
    folders = ", ".join(str(p) for p in profile_search_path(search_path)) or "(nothing)"
    if looks_like_path:
        raise ProfileError(f"{text}: no such profile file")
    raise ProfileError(
        f"no profile named {text!r}; searched {folders}. `offload-tuner profile list --all` shows every profile found"
    )


# -- bundles ---------------------------------------------------------------------------------------


def write_bundle(profiles: Iterable[Profile], path: str | os.PathLike[str]) -> Path:
    """One file carrying several profiles, for a teammate's ``import_bundle``."""
    items = list(profiles)
    for profile in items:
        profile.validate()
    document = {
        "bundle_version": BUNDLE_VERSION,
        "created_at": utc_now(),
        "tool_version": tool_version(),
        "profiles": [p.to_dict() for p in items],
    }
    return atomic_write_text(path, json.dumps(document, indent=2, allow_nan=False) + "\n")


class BundleItem(NamedTuple):
    """One profile of a bundle: the parsed profile and its document as written, or why not."""

    position: int  # its index in the bundle's profiles list
    result: Union[Profile, ProfileError]
    document: Mapping[str, Any] | None


def read_bundle(path: str | os.PathLike[str]) -> list[BundleItem]:
    """Read a bundle; each profile is validated on its own (errors say ``profiles[2].settings...``)."""
    data = _read_json(path, MAX_BUNDLE_BYTES, "bundle")
    where = os.fspath(path)
    if not isinstance(data, Mapping) or "bundle_version" not in data:
        raise ProfileError(f"{where} is not a bundle of profiles (no bundle_version); read a single profile with `offload-tuner profile show`")
    _schema_version(data, "bundle_version", "bundle", expected=BUNDLE_VERSION)
    profiles = data.get("profiles")
    if not isinstance(profiles, list):
        raise ProfileValidationError("profiles", f"expected a list of profiles, got {_kind(profiles)}")
    items = []
    for i, document in enumerate(profiles):
        try:
            profile: Profile | ProfileError = Profile.from_dict(document)
        except ProfileValidationError as exc:
            profile = ProfileValidationError(f"profiles[{i}].{exc.field}" if exc.field != "profile" else f"profiles[{i}]", _message(exc))
        except ProfileError as exc:
            profile = type(exc)(f"profiles[{i}]: {exc}")
        items.append(BundleItem(i, profile, document if isinstance(profile, Profile) else None))
    return items


@dataclass(frozen=True)
class ImportResult:
    """What ``import_bundle`` did with one profile of the bundle.

    ``action`` is ``imported``, ``replaced`` (``force``), ``duplicate`` (the same model header, machine
    and settings are already there), ``conflict`` (another profile has its file name; ``force``
    replaces it), ``invalid``, or ``failed`` (valid, but it could not be written: ``detail`` says why).
    """

    index: int
    action: str
    path: Path | None
    detail: str
    profile: Profile | None = None


def import_bundle(
    bundle_path: str | os.PathLike[str],
    *,
    dest: str | os.PathLike[str] | None = None,
    force: bool = False,
    search_path: SearchPath = None,
) -> list[ImportResult]:
    """Copy a bundle's valid profiles into ``dest`` (the user's folder by default).

    Duplicates (by ``Profile.identity()``, against every profile on the search path and earlier in
    the bundle) are reported and skipped; nothing is overwritten without ``force``. The profile's
    document is written as it came (a newer minor version keeps its extra keys).
    """
    return import_items(read_bundle(bundle_path), dest=dest, force=force, search_path=search_path)


def import_items(
    items: Iterable[BundleItem],
    *,
    dest: str | os.PathLike[str] | None = None,
    force: bool = False,
    search_path: SearchPath = None,
) -> list[ImportResult]:
    """``import_bundle`` for profiles from anywhere (a bundle, the team's registry)."""
    dest_dir = Path(dest) if dest is not None else profiles_dir()
    existing: dict[str, Path] = {}
    for entry in list_profiles([dest_dir, *profile_search_path(search_path)]):
        if entry.profile is not None:
            existing.setdefault(entry.profile.identity(), entry.path)
    seen_in_bundle: dict[str, int] = {}
    results = []
    for item in items:
        if isinstance(item.result, ProfileError):
            results.append(ImportResult(item.position, "invalid", None, str(item.result)))
            continue
        profile, identity = item.result, item.result.identity()
        target = dest_dir / profile.default_filename()
        if identity in seen_in_bundle:
            results.append(
                ImportResult(item.position, "duplicate", None, f"same as profiles[{seen_in_bundle[identity]}] in this bundle", profile)
            )
            continue
        seen_in_bundle[identity] = item.position
        if identity in existing and not force:
            results.append(
                ImportResult(item.position, "duplicate", existing[identity], f"already present as {existing[identity]}", profile)
            )
            continue
        replaced = target.exists()
        if replaced and not force:
            other = _describe_existing(target)
            results.append(
                ImportResult(item.position, "conflict", target, f"{target} exists with other settings ({other}); --force replaces it", profile)
            )
            continue
        try:
            atomic_write_text(target, json.dumps(_without_credentials(item.document, profile), indent=2, allow_nan=False) + "\n")
        except FileWriteError as exc:
            # one profile that cannot be written (a full disk, a read-only folder) is reported; the
            # others are still imported
            results.append(ImportResult(item.position, "failed", target, str(exc), profile))
            continue
        results.append(
            ImportResult(item.position, "replaced" if replaced else "imported", target, f"{profile.model.file_name} on {profile.machine.describe()}", profile)
        )
    return results


def _without_credentials(document: Mapping[str, Any] | None, profile: Profile) -> Mapping[str, Any]:
    """The document as it came, but with the study's storage URL as parsed (its password removed:
    profiles written before redaction covered every form could carry one)."""
    if document is None:
        return profile.to_dict()
    study = document.get("study")
    if isinstance(study, Mapping) and profile.study is not None and study.get("storage") != profile.study.storage:
        return {**document, "study": {**study, "storage": profile.study.storage}}
    return document


def _describe_existing(path: Path) -> str:
    try:
        profile = read_profile(path)
    except ProfileError as exc:
        return f"unreadable: {without_path(str(exc), path)}"
    return f"tuned {profile.created_at}"


def _read_json(path: str | os.PathLike[str], limit: int, what: str) -> Any:
    where = os.fspath(path)
    try:
        size = os.stat(where).st_size
        if size > limit:
            raise ProfileError(f"{where}: {size} bytes is too large for a {what} (at most {limit}); is it the right file?")
        with open(where, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise ProfileError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise ProfileError(f"{where}: is a folder, not a {what} file") from None
    except UnicodeDecodeError:
        raise ProfileError(f"{where}: not a {what} (not UTF-8 text)") from None
    except OSError as exc:
        raise ProfileError(f"{where}: cannot read it: {exc.strerror}") from None
    return parse_json(text, where, what)


def parse_json(text: str, where: str, what: str = "profile") -> Any:
    """``text`` parsed as the JSON of a ``what`` that came from ``where`` (a file, a registry row, a
    bundle member), or one ``ProfileError`` naming ``where`` once: every document someone else
    wrote goes through here, so each source has the same bounds."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{where}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except ValueError as exc:
        raise ProfileError(f"{where}: {exc}") from None
    except RecursionError:
        # json's parser recurses per level: 100,000 nested brackets raised RecursionError here
        raise ProfileError(f"{where}: not a {what}: its JSON is nested too deeply (a {what} is a few levels deep)") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"not valid JSON ({name} is not a number JSON allows)")


__all__ = [
    "ProfileEntry",
    "BundleItem",
    "ImportResult",
    "read_profile",
    "list_profiles",
    "profile_search_path",
    "resolve_profile",
    "write_bundle",
    "read_bundle",
    "import_bundle",
    "import_items",
]
