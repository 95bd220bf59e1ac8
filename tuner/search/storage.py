"""The study store: Optuna's RDB storage (SQLite by default, PostgreSQL for a team), opened so that
several tuners can share it and a tuner killed mid-trial leaves nothing behind.

    store = StudyStore("postgresql://tuner@db/tuning")     # None: SQLite in the data folder;
                                                           # or an Optuna storage object (in memory)
    study = store.study("model-0123abcd", sampler)        # created, or resumed and recovered
    trial = study.ask(); store.claim(trial)                # heartbeats cover it from now on
    ...
    store.close()

- **Heartbeats.** Each running trial's heartbeat is recorded every ``HEARTBEAT_INTERVAL`` seconds
  (Optuna's ``trial_heartbeats`` table, by a thread of ours: Optuna's own beats only inside
  ``Study.optimize``, and our loop is ask/tell). A trial whose heartbeat is older than
  ``GRACE_PERIOD`` belonged to a tuner that died: Optuna's ``fail_stale_trials`` marks it failed.
- **Orphans found at once.** Each trial records the host, pid and start time of its tuner (user
  attribute ``tuner``). On
  resume, a RUNNING trial of this host whose tuner process is gone is failed at once (no waiting
  for the grace period); one with no tuner recorded (written before heartbeats existed) once it
  is older than the grace period.
- **Retry.** A failed-by-death trial that had launched is queued again with the same parameters
  (``retry_of``), at most ``MAX_RETRY`` times: the next run measures it instead of forgetting it.
  (Optuna's ``RetryHeartbeatStaleTrialCallback`` copies the dead trial's user attributes into the
  retry, which would count it as launched before it runs; ours starts it clean.)
- **Creating the tables** on a fresh PostgreSQL database is serialized with an advisory lock (two
  tuners at once raced in ``CREATE TABLE``); elsewhere a retry covers the same race.
- **Errors** are one line (``StorageError``): the URL without its password, what went wrong, what
  to do; a damaged SQLite file is named with how to move it aside.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import socket
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator

from ..errors import StorageError, StudyError
from ..paths import study_storage_url
from ..profile.dburl import (
    advisory_lock,
    dialect_of,
    engine_kwargs,
    explain,
    first_line,
    normalize_url,
    redact_url,
    remember,
    scrub,
    sqlite_path,
)

HEARTBEAT_INTERVAL = 10  # seconds between a running trial's heartbeats
GRACE_PERIOD = 60  # seconds without a heartbeat after which a running trial's tuner is taken for dead
MAX_RETRY = 2  # how often a trial whose tuner died is queued again



def _quiet() -> None:
    """Our loop is ask/tell, so Optuna warns that heartbeats are meant for ``Study.optimize``; we
    beat ourselves. The heartbeat arguments and ``fail_stale_trials`` are marked experimental.
    None of it is news to a user. (Set at each use: pytest and apps reset the filters.)"""
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    warnings.filterwarnings("ignore", message=r"Argument ``(heartbeat_interval|grace_period)``")
    warnings.filterwarnings("ignore", message=r"optuna\.storages\._heartbeat\.fail_stale_trials is experimental")


def default_url() -> str:
    """The default store: one SQLite file in the data folder."""
    return study_storage_url()


# The stores open in this process: a trial of this process whose store is closed was left behind
# by a tuner that failed (its process lives on: an app, a test) and is an orphan too.
_open_stores: set[str] = set()


def this_tuner() -> dict[str, Any]:
    """Who runs trials here: host, pid and the process's start time (a pid alone can be reused),
    and which store of the process. Recorded on each trial as the user attribute ``tuner`` (one
    write: on SQLite each is a commit)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _process_started(os.getpid()),
            "store": uuid.uuid4().hex[:12]}


def _process_started(pid: int) -> float | None:
    try:
        import psutil

        return round(psutil.Process(pid).create_time(), 2)
    except Exception:
        return None


def _alive(pid: int, started: float | None) -> bool:
    """Whether the tuner process that recorded (pid, started) still runs."""
    now = _process_started(pid)
    if now is None:
        return False
    return started is None or abs(now - started) < 1.0


class StudyStore:
    """One tuner's connection to a study store. See the module docstring."""

    def __init__(self, url: Any = None, *, heartbeat_interval: int = HEARTBEAT_INTERVAL,
                 grace_period: int = GRACE_PERIOD) -> None:
        # A SQLAlchemy URL; or an Optuna storage object (simulations keep their studies in memory:
        # no heartbeats there, nothing outlives the process)
        self._given = url if url is not None and not isinstance(url, str) else None
        self.url: str = (url or default_url()) if self._given is None else f"{type(url).__name__} (not saved)"
        remember(self.url)  # any message this process prints loses the password
        self.shown = redact_url(self.url)
        self.heartbeat_interval = heartbeat_interval
        self.grace_period = grace_period
        self.me = this_tuner()
        _open_stores.add(self.me["store"])
        self.recovered: list[int] = []  # trial numbers failed here because their tuner died
        self._storage: Any = None
        self._current: int | None = None  # trial id whose heartbeat we keep
        self._beating = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.heartbeat_error: str | None = None
        self._last_sweep = -1e9

    # -- opening ---------------------------------------------------------------------------------

    def check(self) -> None:
        """Fail now (one line) on a URL that cannot work whatever the server does: not a URL, an
        unknown database kind, a driver that is not installed. Nothing connects yet."""
        import sqlalchemy

        if self._given is not None:
            return
        try:
            sqlalchemy.create_engine(normalize_url(self.url), **engine_kwargs(normalize_url(self.url))).dispose()
        except Exception as exc:
            raise explain(exc, self.url, what="study database") from None

    def storage(self) -> Any:
        """Optuna's ``RDBStorage`` for this URL (created once), tables created if needed."""
        if self._storage is None:
            self._storage = self._given if self._given is not None else self._open()
        return self._storage

    def _open(self) -> Any:
        import optuna
        import sqlalchemy

        _quiet()
        url = normalize_url(self.url)
        kwargs = engine_kwargs(url)
        if dialect_of(url) == "sqlite" and sqlite_path(url) != ":memory:":
            # SQLite makes the file, not its folder; a new folder for studies is what a user means
            with contextlib.suppress(OSError):
                Path(sqlite_path(url)).expanduser().parent.mkdir(parents=True, exist_ok=True)

        def create() -> Any:
            return optuna.storages.RDBStorage(
                url, engine_kwargs=kwargs, heartbeat_interval=self.heartbeat_interval,
                grace_period=self.grace_period, **_callback_argument(self._retry_stale),
            )

        try:
            lock_engine = sqlalchemy.create_engine(url, **kwargs)
        except Exception as exc:
            raise explain(exc, self.url, what="study database") from None
        try:
            for attempt in range(3):
                try:
                    with lock_engine.connect() as connection:
                        release = advisory_lock(connection, "offload-tuner: create Optuna's tables")
                        try:
                            return create()
                        finally:
                            release()
                except sqlalchemy.exc.IntegrityError:
                    # the same race where no advisory lock exists (MySQL...): the other one won
                    if attempt == 2:
                        raise
                    time.sleep(0.2 * (attempt + 1))
        except RuntimeError as exc:  # Optuna: the tables were made by an incompatible version
            raise StorageError(f"{self.shown}: {exc}") from None
        except Exception as exc:
            raise explain(exc, self.url, what="study database") from None
        finally:
            lock_engine.dispose()
        raise AssertionError("unreachable")

    def study(self, name: str, sampler: Any) -> Any:
        """Create the study, or load it and recover trials left RUNNING by a tuner that died."""
        import optuna

        with self.guard():
            study = optuna.create_study(storage=self.storage(), study_name=name, direction="maximize",
                                        load_if_exists=True, sampler=sampler)
            self.recover(study)
        self._start_heartbeats()
        return study

    # -- while running --------------------------------------------------------------------------

    def claim(self, trial: Any) -> None:
        """Mark ``trial`` as ours (host, pid) and keep its heartbeat from now until the next claim."""
        _quiet()  # before the next ask
        trial.set_user_attr("tuner", self.me)
        if self._given is None:
            self._current = trial._trial_id
            self.storage().record_heartbeat(trial._trial_id)

    def sweep(self, study: Any) -> None:
        """Fail trials whose heartbeat stopped (their tuner died elsewhere) and queue them again;
        at most once per heartbeat interval."""
        import optuna

        now = time.monotonic()
        if now - self._last_sweep < self.heartbeat_interval:
            return
        self._last_sweep = now
        _quiet()
        optuna.storages.fail_stale_trials(study)

    @contextlib.contextmanager
    def guard(self, study_name: str = "") -> Iterator[None]:
        """The database failing inside (a full disk, a server gone, a damaged file) becomes one
        ``StudyError``: what failed, where, and that the same command resumes the study."""
        import sqlalchemy
        from optuna.exceptions import StorageInternalError

        try:
            yield
        except (sqlalchemy.exc.SQLAlchemyError, StorageInternalError) as exc:
            raise self.failed(exc, study_name) from None

    def failed(self, exc: BaseException, study_name: str = "") -> StudyError:
        root = exc
        while root.__cause__ is not None:  # Optuna wraps a failed commit; the database's own words are inside
            root = root.__cause__
        why = scrub(first_line(root), [self.url])
        verb = "could not be written" if isinstance(exc, _storage_internal_error()) else "failed"
        resume = f" to resume study {study_name}" if study_name else " to resume"
        if dialect_of(self.url) == "sqlite":
            path = sqlite_path(self.url)
            return StudyError(f"the study database {verb} ({why}); the trials recorded before are kept in {path}: "
                              f"free the space (or fix the folder) and run the same command again{resume}")
        return StudyError(f"the study database at {self.shown} {verb} ({why}); the trials recorded before are kept "
                          f"there: check that the server is running and reachable, and run the same command again{resume}")

    def close(self) -> None:
        _open_stores.discard(self.me["store"])
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._storage is not None and self._given is None:
            with contextlib.suppress(Exception):
                self._storage.engine.dispose()

    # -- recovery -------------------------------------------------------------------------------

    def recover(self, study: Any) -> list[int]:
        """Fail the trials left RUNNING by a tuner that is gone, queue the launched ones again."""
        from optuna.exceptions import UpdateFinishedTrialError
        from optuna.trial import TrialState

        storage = self.storage()
        now = _dt.datetime.now()
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            tuner = t.user_attrs.get("tuner")
            if isinstance(tuner, dict):
                orphan = tuner.get("host") == self.me["host"] and isinstance(tuner.get("pid"), int) and (
                    not _alive(tuner["pid"], tuner.get("started"))
                    or (tuner["pid"] == os.getpid() and tuner.get("store") not in _open_stores))
            else:  # from before trials recorded their tuner: only when surely stale
                orphan = t.datetime_start is not None and (now - t.datetime_start).total_seconds() > self.grace_period
            if not orphan:
                continue
            try:
                storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
            except UpdateFinishedTrialError:
                continue  # another tuner got there first
            self._retry(study, t)
        self.sweep(study)
        return self.recovered

    def _retry_stale(self, study: Any, trial: Any) -> None:
        self._retry(study, trial)

    def _retry(self, study: Any, trial: Any) -> None:
        self.recovered.append(trial.number)
        if not trial.user_attrs.get("launched") or not trial.params:
            return  # nothing was running: the search proposes it again if it is worth it
        if trial.user_attrs.get("outcome") not in (None, "ok"):
            return  # it had ended (out of memory, a crash...): measuring it again would end the same
        retries = int(trial.user_attrs.get("retries", 0)) + 1
        if retries > MAX_RETRY:
            return
        study.enqueue_trial(dict(trial.params), user_attrs={"retry_of": trial.user_attrs.get("retry_of", trial.number),
                                                            "retries": retries})

    # -- heartbeats -------------------------------------------------------------------------------

    def _start_heartbeats(self) -> None:
        if self._thread is None and self._given is None:
            self._thread = threading.Thread(target=self._beat, name="offload-tuner-heartbeat", daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            trial_id = self._current
            if trial_id is None:
                continue
            try:
                self._storage.record_heartbeat(trial_id)
                self.heartbeat_error = None
            except Exception as exc:  # the database is away: keep trying, the trial goes on
                self.heartbeat_error = f"{type(exc).__name__}"


def _storage_internal_error() -> type:
    from optuna.exceptions import StorageInternalError

    return StorageInternalError


def _callback_argument(callback: Any) -> dict[str, Any]:
    """The stale-trial callback under the name this Optuna takes (renamed in 4.9)."""
    import inspect

    import optuna

    names = inspect.signature(optuna.storages.RDBStorage.__init__).parameters
    if "heartbeat_stale_trial_callback" in names:
        return {"heartbeat_stale_trial_callback": callback}
    return {"failed_trial_callback": callback}


__all__ = ["StudyStore", "default_url", "HEARTBEAT_INTERVAL", "GRACE_PERIOD", "MAX_RETRY"]
