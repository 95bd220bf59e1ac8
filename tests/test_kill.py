"""A tuner killed with SIGKILL mid-trial (no handler runs): its worker ends by itself, and the next
run resumes with no trial left RUNNING and no completed trial measured again. Real processes,
real llama.cpp, SQLite and a real PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tuner.engine.base import BenchSpec
from tuner.engine.python import _wire
from tuner.engine.settings import Settings

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pid: int, timeout: float) -> float | None:
    """Seconds until ``pid`` is gone (a zombie counts: it runs nothing), or None."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if _gone(pid):
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def _wait_for_a_third_trial(url: str, study: str, timeout: float = 240) -> int | None:
    """The number of a trial being measured after two measured ones, as soon as it starts (a
    plain query of Optuna's tables, polled every 20 ms: the kill must land inside the trial)."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(url)
    # launched, and no outcome recorded yet: inside the measurement
    running = sqlalchemy.text(
        "SELECT t.number FROM trials t JOIN studies s ON s.study_id = t.study_id "
        "JOIN trial_user_attributes a ON a.trial_id = t.trial_id AND a.key = 'launched' "
        "WHERE s.study_name = :name AND t.state = 'RUNNING' AND NOT EXISTS (SELECT 1 FROM trial_user_attributes o "
        "WHERE o.trial_id = t.trial_id AND o.key = 'outcome')")
    measured = sqlalchemy.text(
        "SELECT count(*) FROM trials t JOIN studies s ON s.study_id = t.study_id "
        "JOIN trial_user_attributes a ON a.trial_id = t.trial_id AND a.key = 'outcome' "
        "WHERE s.study_name = :name AND t.state <> 'RUNNING'")
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                with engine.connect() as connection:
                    if connection.execute(measured, {"name": study}).scalar() >= 2:
                        number = connection.execute(running, {"name": study}).scalar()
                        if number is not None:
                            return int(number)
            except sqlalchemy.exc.SQLAlchemyError:
                pass  # the tables are not there yet
            time.sleep(0.02)
        return None
    finally:
        engine.dispose()


def _workers(pid: int) -> list[int]:
    return [c.pid for c in psutil.Process(pid).children(recursive=True) if "tuner.engine.worker" in " ".join(c.cmdline())]


_LONG_TRIAL = """
import sys
from tuner.engine.base import BenchSpec
from tuner.engine.python import TrialRunner
from tuner.engine.settings import Settings
with TrialRunner(timeout_s=600) as runner:
    print("measuring", flush=True)
    runner.run(Settings(model_path=sys.argv[1], n_ctx=4096), BenchSpec(n_prompt=64, n_gen=2000, repetitions=100))
"""


def test_the_worker_ends_when_its_tuner_is_killed(models):
    proc = subprocess.Popen([sys.executable, "-c", _LONG_TRIAL, str(models["q8_0"])], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert proc.stdout.readline().strip() == "measuring"
        deadline = time.monotonic() + 120
        while not _workers(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        (worker,) = _workers(proc.pid)
        time.sleep(2)  # llama.cpp loaded and measuring
        assert not _gone(worker)
    finally:
        proc.kill()  # SIGKILL: the runner gets no chance to kill its worker
        proc.wait()
    took = _wait_gone(worker, 20)
    if took is None:
        os.killpg(worker, signal.SIGKILL)
    assert took is not None and took < 5, "the worker outlived its tuner"


def test_the_worker_enforces_its_time_limit_itself(models, tmp_path):
    # A worker whose runner cannot act (stuck, or gone with the parent-pid check not applying):
    # nobody kills it, and it stops at the limit the request carried.
    log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen([sys.executable, "-m", "tuner.engine.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=log, env={**_env(), "OFFLOAD_TUNER_PARENT_PID": str(os.getpid())}, start_new_session=True)
    request = {"trial_id": 1, "settings": _wire(Settings(model_path=str(models["q8_0"]), n_ctx=4096)),
               "bench": BenchSpec(n_prompt=64, n_gen=4000, repetitions=100).to_dict(), "timeout_s": 4}
    worker.stdin.write((json.dumps(request) + "\n").encode())
    worker.stdin.flush()
    started = time.monotonic()
    try:
        worker.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        pytest.fail("the worker ran on past its limit")
    finally:
        log.close()
    assert worker.returncode == -signal.SIGKILL
    assert 4 <= time.monotonic() - started < 60
    assert "offload-tuner: the trial ran past its 4 s limit: the worker ends itself" in (tmp_path / "worker.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_tune_killed_mid_trial_resumes_with_nothing_left_running(backend, models, tmp_path, tuner_home, request):
    import optuna
    from optuna.trial import TrialState

    from tuner.profile.dburl import normalize_url

    url = request.getfixturevalue("pg_url") if backend == "postgresql" else f"sqlite:///{tuner_home / 'studies' / 'studies.db'}"
    cmd = [sys.executable, "-m", "tuner", "tune", str(models["q8_0"]), "--trials", "40", "--min-ctx", "512",
           "--n-prompt", "64", "--n-gen", "256", "-r", "3", "--storage", url, "--out", str(tmp_path / "p.json")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        first_line = proc.stderr.readline()
        assert first_line.startswith("study "), first_line + proc.stderr.read()
        name = first_line.split()[1]
        storage = optuna.storages.RDBStorage(normalize_url(url))
        running = _wait_for_a_third_trial(normalize_url(url), name)
        assert running is not None, "no third trial started"
        workers = _workers(proc.pid)
    finally:
        proc.kill()  # SIGKILL mid-trial
        proc.wait()
    assert workers
    running = optuna.load_study(study_name=name, storage=storage).trials[running]
    for worker in workers:
        assert _wait_gone(worker, 20) is not None, "a worker outlived its tuner"
    study = optuna.load_study(study_name=name, storage=storage)
    left = study.get_trials(states=(TrialState.RUNNING,))
    assert [t.number for t in left] == [running.number], [(t.number, t.state.name, sorted(t.user_attrs)) for t in study.trials]
    assert left[0].user_attrs["tuner"]["pid"] == proc.pid
    measured_before = {t.user_attrs["settings_key"] for t in study.trials if "outcome" in t.user_attrs and t.state != TrialState.RUNNING}
    # the retry queues behind the seeds still waiting: run enough trials to reach it
    total = len(measured_before) + len(study.get_trials(states=(TrialState.WAITING,))) + 1

    # The next run on this machine (in-process through the API, with a short final re-measure: the
    # resume is what is tested; the CLI prints the same events).
    from tuner.search.study import Tuner

    events: list[dict] = []
    result = Tuner(str(models["q8_0"]), trials=total, min_ctx=512, n_prompt=64, n_gen=256, repetitions=3, storage=url,
                   out=tmp_path / "p.json", final_candidates=1, final_repetitions=6, final_rounds=2,
                   on_event=events.append).run()
    assert result.study_name == name
    start = next(e for e in events if e["kind"] == "start")
    assert start["resumed"] and start["done"] == len(measured_before) and start["recovered"] == [running.number]
    assert result.counts["run"] == total
    study = optuna.load_study(study_name=name, storage=storage)
    assert not study.get_trials(states=(TrialState.RUNNING,))
    assert study.trials[running.number].state == TrialState.FAIL
    measured = [t for t in study.trials if "outcome" in t.user_attrs]
    keys = [t.user_attrs["settings_key"] for t in measured]
    assert len(keys) == len(set(keys)) == total  # no completed trial measured twice
    assert measured_before < set(keys)
    retried = [t for t in measured if t.user_attrs.get("retry_of") == running.number]
    assert len(retried) == 1 and retried[0].user_attrs["settings_key"] == running.user_attrs["settings_key"], (
        [(t.number, t.state.name, t.user_attrs.get("retry_of"), t.user_attrs.get("duplicate_of"), t.user_attrs.get("outcome"),
          t.system_attrs.get("fixed_params") is not None) for t in study.trials], total)
