"""What a report shows, read from an Optuna study (and the profile that names it, if any).

``open_source(source, storage)`` finds the study: a profile (file or name: it names its study), a
model file (the most recent study of that model in the storage), a study name, or nothing (the
most recent study in the storage). ``read_report_data(study, profile)`` turns its trials into rows,
from the user attributes the tune loop records (``tuner.search.study``): ``settings``, ``outcome``,
``message``, ``pp``, ``tg``, ``predicted``, ``actual``, ``layers``, ``reason``, ``duplicate_of``, ``superseded``,
``interrupted``; and the variants' quality from the study attribute ``quality`` that a tune with a
quality budget stores (``tuner.search.quality``: ``variants: {FILE_NAME: {kl: {mean, ci_low,
ci_high}, ppl_ratio, ...}}``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ProfileError, ReportError
from ..paths import study_storage_url
from ..profile.dburl import redact_url

OK = "ok"
PRUNED = "pruned"  # not launched: predicted not to fit, or past a learned out-of-memory limit
INVALID = "invalid"  # not launched: an invalid combination
INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class TrialRow:
    number: int
    outcome: str  # ok, oom, crash, timeout, load_error, bad_settings, pruned, invalid, interrupted
    settings: dict[str, Any] | None
    value: float | None  # the objective (t/s) for ok trials
    tg: dict[str, Any] | None  # Stats: median, ci_low, ci_high, samples...
    pp: dict[str, Any] | None
    predicted: dict[str, dict[str, int]]
    actual: dict[str, dict[str, int]]
    layers: tuple[int | None, int | None]
    reason: str  # why it was not launched, or llama.cpp's message when it failed

    @property
    def variant(self) -> str:
        return Path(self.settings["model_path"]).name if self.settings else ""

    @property
    def n_gpu_layers(self) -> int | None:
        return self.settings.get("n_gpu_layers") if self.settings else None


@dataclass
class Pick:
    """The winner or the runner-up, with the figures it was chosen on."""

    settings: dict[str, Any]
    tg: dict[str, Any] | None
    pp: dict[str, Any] | None
    number: int | None  # its trial, when one matches


@dataclass
class ReportData:
    study_name: str
    storage: str  # password removed
    objective: str
    rows: list[TrialRow]
    winner: Pick | None
    runner_up: Pick | None
    quality: dict[str, dict[str, Any]]  # variant file name -> its quality (tuner.search.quality)
    profile_path: str | None = None
    study: Any = field(default=None, repr=False)  # the optuna Study, for parameter importances
    workload: Any = None  # the profile's (tuner.profile.document.Workload): users, figures, the knee
    time: dict[str, float] | None = None  # where the last tune's wall time went (tuner.search.timing)

    @property
    def launched(self) -> list[TrialRow]:
        return [r for r in self.rows if r.outcome not in (PRUNED, INVALID)]

    @property
    def ok(self) -> list[TrialRow]:
        return [r for r in self.rows if r.outcome == OK and r.value is not None]


def redact(url: str) -> str:
    """A storage URL without its credentials (every form: ``tuner.profile.dburl``)."""
    return redact_url(url)


def _study_names(storage: str) -> list[str]:
    import optuna

    from ..profile.dburl import dialect_of, explain, sqlite_path

    # (the file of a sqlite URL is sqlite_path's: a query such as "?password=x" is not part of it)
    if dialect_of(storage) == "sqlite" and sqlite_path(storage) != ":memory:" and not Path(sqlite_path(storage)).exists():
        return []  # do not create an empty database just to look
    try:
        return optuna.study.get_all_study_names(storage=storage)
    except Exception as exc:  # noqa: BLE001 (any storage failure is one line for the user)
        raise ReportError(str(explain(exc, storage, what="study storage"))) from None


def _latest(storage: str, names: list[str]) -> str:
    """Of these studies, the one whose last trial started most recently."""
    import optuna

    def last_start(name: str) -> float:
        trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
        times = [t.datetime_start.timestamp() for t in trials if t.datetime_start is not None]
        return max(times, default=0.0)

    return max(names, key=last_start)


def open_source(source: str | None, storage: str | None = None) -> tuple[Any, Any, str]:
    """The optuna Study that ``source`` names, the Profile when ``source`` is one, and the storage URL."""
    import warnings

    with warnings.catch_warnings():
        # SQLAlchemy warns on stderr about URL arguments its driver ignores (sqlite's "?password=x"):
        # the study is read all the same, and the command's output stays its own
        warnings.filterwarnings("ignore", message=r"Query string argument")
        return _open_source(source, storage)


def _open_source(source: str | None, storage: str | None = None) -> tuple[Any, Any, str]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    profile = None
    name = None
    path = Path(source).expanduser() if source else None
    if path is not None and path.is_file() and path.suffix.lower() == ".gguf":
        storage = storage or study_storage_url()
        stem = path.stem
        names = [n for n in _study_names(storage) if re.fullmatch(re.escape(stem) + r"-[0-9a-f]{12}", n)]
        if not names:
            raise ReportError(f"no study of {path.name} in {redact(storage)}: tune it first, or give --storage")
        name = _latest(storage, names)
    elif source is not None and (path is not None and path.is_file() or source.endswith(".json")):
        profile = _profile(source)
    elif source is not None:
        storage_url = storage or study_storage_url()
        if source in _study_names(storage_url):
            name, storage = source, storage_url
        else:
            try:
                profile = _profile(source)
            except ReportError:
                names = _study_names(storage_url)
                known = f"studies there: {', '.join(names[:8])}" + (", ..." if len(names) > 8 else "") if names else "it holds no study"
                raise ReportError(f"no study or profile named {source!r} (studies searched in {redact(storage_url)}; {known})") from None
    if profile is not None:
        if profile.study is None:
            raise ReportError(f"the profile {profile.path or source} names no study, so there is nothing to plot")
        name = profile.study.name
        if storage is None:
            storage = profile.study.storage or study_storage_url()
            if "***" in storage:
                raise ReportError(f"the profile's study storage {storage} has its password removed: give it with --storage")
        if name not in _study_names(storage):
            raise ReportError(f"the profile's study {name!r} is not in {redact(storage)} (give the storage with --storage)")
    if name is None:
        storage = storage or study_storage_url()
        names = _study_names(storage)
        if not names:
            raise ReportError(f"no study in {redact(storage)}: run `offload-tuner tune` first, or name a study or profile")
        name = _latest(storage, names)
    return optuna.load_study(study_name=name, storage=storage), profile, storage


def _profile(ref: str) -> Any:
    from ..profile.store import resolve_profile

    try:
        return resolve_profile(ref)
    except ProfileError as exc:
        raise ReportError(str(exc)) from None


def _row(t: Any) -> TrialRow | None:
    from optuna.trial import TrialState

    attrs = t.user_attrs
    if "duplicate_of" in attrs or "superseded" in attrs or t.state in (TrialState.RUNNING, TrialState.WAITING):
        return None
    reason = attrs.get("reason") or attrs.get("message") or ""
    if attrs.get("interrupted"):
        outcome = INTERRUPTED
    elif attrs.get("launched"):
        outcome = attrs.get("outcome") or ("ok" if t.state == TrialState.COMPLETE else "failed")
    elif t.state == TrialState.PRUNED:
        outcome = INVALID if str(reason).startswith("invalid candidate") else PRUNED
    else:
        return None
    layers = attrs.get("layers") or [None, None]
    return TrialRow(number=t.number, outcome=outcome, settings=attrs.get("settings"),
                    value=t.value if t.state == TrialState.COMPLETE else None, tg=attrs.get("tg"), pp=attrs.get("pp"),
                    predicted=attrs.get("predicted") or {}, actual=attrs.get("actual") or {},
                    layers=(layers[0], layers[1]) if len(layers) == 2 else (None, None), reason=str(reason))


def _matching(rows: list[TrialRow], settings: dict[str, Any]) -> int | None:
    for r in rows:
        if r.settings == settings:
            return r.number
    return None


def read_report_data(study: Any, profile: Any = None, storage: str = "") -> ReportData:
    rows = [r for r in (_row(t) for t in study.get_trials(deepcopy=False)) if r is not None]
    ok = sorted((r for r in rows if r.outcome == OK and r.value is not None), key=lambda r: r.value, reverse=True)
    winner = runner_up = None
    objective = "tg"
    if profile is not None:
        objective = profile.objective
        settings = profile.settings.to_dict()
        winner = Pick(settings=settings, tg=_stats(profile.measured.tg), pp=_stats(profile.measured.pp), number=_matching(rows, settings))
        if profile.runner_up is not None:
            second = profile.runner_up.settings.to_dict()
            runner_up = Pick(settings=second, tg=_stats(profile.runner_up.tg), pp=_stats(profile.runner_up.pp),
                             number=_matching(rows, second))
    else:
        if ok:
            winner = Pick(settings=ok[0].settings or {}, tg=ok[0].tg, pp=ok[0].pp, number=ok[0].number)
        if len(ok) > 1:
            runner_up = Pick(settings=ok[1].settings or {}, tg=ok[1].tg, pp=ok[1].pp, number=ok[1].number)
    return ReportData(study_name=study.study_name, storage=redact(storage), objective=objective, rows=rows,
                      winner=winner, runner_up=runner_up, quality=_quality(study), study=study,
                      profile_path=getattr(profile, "path", None), workload=getattr(profile, "workload", None),
                      time=_time(study))


def _time(study: Any) -> dict[str, float] | None:
    """The time split the last tune of this study recorded, when it has numbers only."""
    split = study.user_attrs.get("time")
    if not isinstance(split, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in split.values()):
        return None
    return {str(k): float(v) for k, v in split.items()}


def _stats(stats: Any) -> dict[str, Any] | None:
    if stats is None:
        return None
    return {"median": stats.median, "mean": stats.mean, "stddev": stats.stddev, "ci_low": stats.ci_low,
            "ci_high": stats.ci_high, "samples": list(stats.samples)}


def _quality(study: Any) -> dict[str, dict[str, Any]]:
    """Per variant file name: ``kl_mean``, ``kl_ci`` (low, high) and ``ppl_ratio`` where measured."""
    report = study.user_attrs.get("quality")
    out: dict[str, dict[str, Any]] = {}
    if isinstance(report, dict) and isinstance(report.get("variants"), dict):
        for name, v in report["variants"].items():
            kl = v.get("kl") if isinstance(v, dict) else None
            if isinstance(kl, dict) and isinstance(kl.get("mean"), (int, float)):
                out[Path(str(name)).name] = {"kl_mean": float(kl["mean"]),
                                             "kl_ci": (kl.get("ci_low"), kl.get("ci_high")),
                                             "ppl_ratio": v.get("ppl_ratio")}
    # a trial's own attribute (its variant's figures) fills in what the study attribute lacks
    for t in study.get_trials(deepcopy=False):
        q = t.user_attrs.get("quality")
        if isinstance(q, dict) and q.get("file_name") and isinstance(q.get("kl_mean"), (int, float)):
            out.setdefault(Path(str(q["file_name"])).name, {"kl_mean": float(q["kl_mean"]), "kl_ci": (None, None),
                                                            "ppl_ratio": q.get("ppl_ratio")})
    return out
