"""The study store shared by a team: several tuners on one real PostgreSQL at once, trials left
RUNNING by a dead tuner recovered, credentials never shown, bad stores told in one line.

PostgreSQL is a real server the tests start (``tuner.testing.PostgresServer``); the tuners are
real processes; the engine is the scripted one where the test is about the store, not llama.cpp.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from tuner.cli.main import cli
from tuner.engine.fake import ScriptedRunner
from tuner.machine.probe import GPU, LlamaBuild, Machine
from tuner.model.inspect import inspect
from tuner.profile.dburl import redact_url, scrub, secrets_of
from tuner.search.storage import StudyStore
from tuner.search.study import Tuner

REPO = Path(__file__).resolve().parent.parent
PASSWORD = "s3cret-Pa55;word"  # tuner.testing.PostgresServer's


def machine(name: str = "Test CPU", gpu_uuid: str | None = None) -> Machine:
    gpus = (GPU(index=0, name="Simulated GPU 8GB", uuid=gpu_uuid, memory_total=8 << 30, memory_free=8 << 30, driver="0"),) if gpu_uuid else ()
    return Machine(cpu_model=name, physical_cores=4, logical_cores=4, ram_total=16 << 30, ram_available=12 << 30, gpus=gpus,
                   gpu_status="simulated", llama=LlamaBuild(llama_cpp_python="0.3.36", gpu_offload=True, rpc=True, backends=("cpu",)))


def small(**extra):
    base = dict(min_ctx=512, n_prompt=64, n_gen=16, repetitions=2, final_repetitions=2, final_rounds=1, vram_margin=0)
    base.update(extra)
    return base


# -- credentials --------------------------------------------------------------------------------


@pytest.mark.parametrize("url, secret", [
    ("postgresql://tuner:PASSWORD1@db/tuning", "PASSWORD1"),
    ("postgresql+psycopg://tuner:p%40ss%2Fw0rd@db:5432/tuning", "p%40ss%2Fw0rd"),
    ("postgresql://tuner:p@ssw0rd@db/tuning", "p@ssw0rd"),  # an unescaped @: hidden whole
    ("postgresql://tuner@db/tuning?password=PASSWORD2", "PASSWORD2"),
    ("postgresql://tuner@db/tuning?sslmode=require&sslpassword=KEYPASS3", "KEYPASS3"),
    ("mysql+pymysql://u@h/db?passwd=MYSECRET4", "MYSECRET4"),
    ("mssql+pyodbc://?odbc_connect=DRIVER%3D%7BODBC%7D%3BSERVER%3Dh%3BUID%3Du%3BPWD%3DODBCSECRET5%3B", "ODBCSECRET5"),
    ("sqlite+pysqlcipher://:PASSPHRASE6@/studies.db?cipher=aes-256-cfb", "PASSPHRASE6"),
    ("snowflake://u@acct/db?private_key_passphrase=PK7SECRET&token=TOKEN7", "TOKEN7"),
    ("postgresql://:ONLYPASS8@db/tuning", "ONLYPASS8"),
])
def test_every_credential_form_is_redacted(url, secret):
    shown = redact_url(url)
    assert "***" in shown
    assert not [part for part in [secret, *secret.split("@")] if len(part) >= 4 and part in shown], shown
    assert secret in secrets_of(url) or any(secret in s for s in secrets_of(url))
    assert secret not in scrub(f"could not connect with {url}: bad {secret}", [url])


def test_urls_without_credentials_are_shown_as_they_are():
    for url in ("sqlite:////home/me/.local/share/offload-tuner/studies/studies.db", "postgresql://tuner@db:5432/tuning",
                "postgresql://db/tuning?sslmode=require&connect_timeout=5"):
        assert redact_url(url) == url


# -- several tuners, one PostgreSQL ---------------------------------------------------------------


_TUNER_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from tuner.engine.fake import ScriptedRunner, default_speed
    from tuner.machine.probe import GPU, LlamaBuild, Machine
    from tuner.model.inspect import inspect
    from tuner.search.study import Tuner

    model, name, url, out, start_at = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
    machine = Machine(cpu_model=name, physical_cores=4, logical_cores=4, ram_total=16 << 30, ram_available=12 << 30,
                      gpus=(GPU(index=0, name="Simulated GPU 8GB", uuid="GPU-" + name, memory_total=8 << 30,
                                memory_free=8 << 30, driver="0"),),
                      gpu_status="simulated", llama=LlamaBuild(llama_cpp_python="0.3.36", gpu_offload=True))

    def speed(settings):
        time.sleep(0.05)  # a trial takes a moment: the tuners' writes interleave
        return default_speed(settings)

    engine = ScriptedRunner({model: inspect(model)}, devices=("CUDA0",), speed=speed)
    tuner = Tuner(model, trials=10, machine=machine, engine=engine, storage=url, out=out, min_ctx=512, n_prompt=64,
                  n_gen=16, repetitions=2, final_repetitions=2, final_rounds=1, vram_margin=0)
    while time.time() < start_at:  # all three open the fresh database at the same moment
        time.sleep(0.005)
    result = tuner.run()
    print(json.dumps({"study": result.study_name, "run": result.counts["run"], "profile": str(result.profile_path)}))
""")


def test_three_machines_tune_into_one_fresh_postgres_at_once(models, pg_url, tmp_path):
    import time

    import optuna
    from optuna.trial import TrialState

    script = tmp_path / "tuner_script.py"
    script.write_text(_TUNER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start_at = time.time() + 6  # after the three have imported everything
    procs = [subprocess.Popen([sys.executable, str(script), str(models["q8_0"]), f"machine-{i}", pg_url,
                               str(tmp_path / f"profile-{i}.json"), str(start_at)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(3)]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err
        assert PASSWORD not in out + err
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert len({r["study"] for r in results}) == 3  # each machine its own study
    storage = optuna.storages.RDBStorage(pg_url.replace("postgresql://", "postgresql+psycopg://"))
    for i, r in enumerate(results):
        assert r["run"] == 10
        study = optuna.load_study(study_name=r["study"], storage=storage)
        trials = study.get_trials(deepcopy=False)
        # intact: nothing left running or half-written; every trial is this tuner's
        assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
        measured = [t for t in trials if "outcome" in t.user_attrs]
        assert len(measured) == 10 and all(t.state == TrialState.COMPLETE and t.value > 0 for t in measured)
        assert len({t.user_attrs["settings_key"] for t in measured}) == 10  # nothing measured twice
        assert len({t.user_attrs["tuner"]["pid"] for t in trials}) == 1
        profile = json.loads((tmp_path / f"profile-{i}.json").read_text())
        assert profile["machine"]["cpu_model"] == f"machine-{i}"
        assert profile["study"]["name"] == r["study"] and PASSWORD not in json.dumps(profile)
        assert profile["study"]["storage"].startswith("postgresql://tuner:***@127.0.0.1:")


_CREATE_SCRIPT = textwrap.dedent("""
    import sys, time
    from tuner.search.storage import StudyStore
    url, start_at = sys.argv[1], float(sys.argv[2])
    import optuna, sqlalchemy, psycopg  # imported before the start line
    while time.time() < start_at:
        time.sleep(0.002)
    StudyStore(url).storage()
    print("ok")
""")


def test_tuners_creating_the_tables_of_a_fresh_database_at_once_do_not_collide(pg_url, tmp_path):
    # Seen: two tuners started at once on a fresh database, one died with `duplicate key value
    # violates unique constraint "pg_type_typname_nsp_index"` while both created Optuna's tables.
    import time

    script = tmp_path / "create.py"
    script.write_text(_CREATE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start_at = time.time() + 5
    procs = [subprocess.Popen([sys.executable, str(script), pg_url, str(start_at)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(6)]
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0 and out.strip() == "ok", err


# -- a tuner that died ------------------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_trial_left_running_by_a_dead_tuner_is_failed_and_measured_again(backend, models, tmp_path, request):
    import optuna
    from optuna.trial import TrialState

    url = request.getfixturevalue("pg_url") if backend == "postgresql" else f"sqlite:///{tmp_path / 'studies.db'}"
    path = str(models["q8_0"])
    engine = ScriptedRunner({path: inspect(path)})
    first = Tuner(path, trials=3, machine=machine(), engine=engine, storage=url, **small())
    first.run()
    measured = {json.dumps(s.to_dict(), sort_keys=True) for s in engine.launched[:3]}
    # a fourth trial, launched by a tuner that then died (SIGKILL: no tell, no cleanup)
    store = StudyStore(url)
    study = optuna.load_study(study_name=first.study_name, storage=store.storage())
    sp = first.space
    dead = next(c for c in (sp.settings(variant=path, kv="f16", flash_attn=fa, threads=t, n_ctx=sp.n_ctx[0], n_ubatch=ub,
                                        n_batch=sp.n_batch[-1]) for fa in sp.flash_attn for t in sp.threads for ub in sp.n_ubatch)
                if json.dumps(c.to_dict(), sort_keys=True) not in measured)
    study.enqueue_trial(first.space.params_for(dead))
    trial = study.ask()
    assert first.space.suggest(trial) == dead
    store.claim(trial)  # as the loop does: this host, a pid, a heartbeat
    trial.set_user_attr("launched", True)
    trial.set_user_attr("tuner", {**store.me, "pid": _dead_pid()})
    store.close()
    assert study.get_trials(states=(TrialState.RUNNING,))

    events = []
    engine2 = ScriptedRunner({path: inspect(path)})
    second = Tuner(path, trials=4, machine=machine(), engine=engine2, storage=url, on_event=events.append, **small())
    result = second.run()
    start = next(e for e in events if e["kind"] == "start")
    assert start["resumed"] and start["recovered"] == [trial.number]
    study = optuna.load_study(study_name=first.study_name, storage=StudyStore(url).storage())
    assert not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))
    assert study.trials[trial.number].state == TrialState.FAIL
    retried = [t for t in study.trials if t.user_attrs.get("retry_of") == trial.number]
    assert len(retried) == 1 and retried[0].state == TrialState.COMPLETE
    # the second run measured the dead trial's candidate, and nothing the first run had measured
    assert [json.dumps(s.to_dict(), sort_keys=True) for s in engine2.launched[:1]] == [json.dumps(dead.to_dict(), sort_keys=True)]
    assert result.counts["run"] == 4


def test_a_trial_whose_heartbeat_stopped_on_another_host_is_failed(pg_url):
    import time

    import optuna
    from optuna.trial import TrialState

    store = StudyStore(pg_url, heartbeat_interval=1, grace_period=2)
    study = optuna.create_study(study_name="elsewhere", storage=store.storage(), direction="maximize")
    trial = study.ask()
    trial.suggest_int("x", 0, 3)
    store.claim(trial)
    trial.set_user_attr("tuner", {**store.me, "host": "another-machine"})  # not ours: only its heartbeat can tell
    trial.set_user_attr("launched", True)
    store.recover(study)
    assert study.trials[0].state == TrialState.RUNNING  # its heartbeat is fresh: alive
    time.sleep(3.5)
    store._last_sweep = -1e9
    store.recover(study)
    assert study.trials[0].state == TrialState.FAIL
    (retry,) = study.get_trials(states=(TrialState.WAITING,))  # queued again, with the same parameters
    assert retry.system_attrs["fixed_params"] == {"x": trial.params["x"]} and retry.user_attrs["retry_of"] == 0
    store.close()


# -- bad stores: one line, no traceback, no password ---------------------------------------------------


def _tune(model: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tuner", "tune", str(model), "--trials", "1", "--min-ctx", "512", "--n-prompt", "64",
           "--n-gen", "16", "-r", "1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("storage, expected", [
    ("foo", "is not a database URL"),
    ("nosuchdb://u:PASSWORD1@h/db", "unknown database kind 'nosuchdb'"),
    ("mysql://u:PASSWORD1@127.0.0.1/db", "the mysql driver is not installed (MySQLdb)"),
    ("postgresql+asyncpg://u:PASSWORD1@127.0.0.1/db", "driver is not installed (asyncpg)"),
    ("postgresql://u:PASSWORD1@127.0.0.1:1/db", "cannot reach the study database at postgresql://u:***@127.0.0.1:1/db"),
])
def test_a_storage_that_cannot_work_is_one_line(models, storage, expected):
    proc = _tune(models["q8_0"], "--storage", storage)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and expected in lines[0], proc.stderr
    assert "PASSWORD1" not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr


def test_a_wrong_password_is_one_line_without_it(models, postgres, pg_url):
    wrong = pg_url.replace(PASSWORD.replace(";", "%3B"), "Wr0ng-Passw0rd")
    assert wrong != pg_url
    proc = _tune(models["q8_0"], "--storage", wrong, "--json")
    assert proc.returncode == 2
    assert "password authentication failed" in proc.stderr and "Wr0ng-Passw0rd" not in proc.stderr + proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_damaged_study_database_is_named_with_what_to_do(models, tuner_home):
    db = tuner_home / "studies" / "studies.db"
    db.parent.mkdir(parents=True)
    db.write_bytes(b"this is not SQLite " * 500)
    proc = _tune(models["q8_0"])
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"Error: {db}: the study database file is damaged")
    assert f"mv '{db}' '{db}.broken'" in line
    assert db.read_bytes().startswith(b"this is not SQLite")  # nothing was overwritten


def test_tune_json_and_its_profile_carry_no_password(models, pg_url, tmp_path):
    out = tmp_path / "p.json"
    proc = _tune(models["q8_0"], "--storage", pg_url, "--json", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["study"]["storage"].startswith("postgresql://tuner:***@127.0.0.1:")
    for text in (proc.stdout, proc.stderr, out.read_text()):
        assert PASSWORD not in text and PASSWORD.replace(";", "%3B") not in text
    # and the profile's own commands show it redacted too
    shown = CliRunner().invoke(cli, ["profile", "show", str(out)])
    assert shown.exit_code == 0 and "postgresql://tuner:***@" in shown.output and "Pa55" not in shown.output


def test_a_profile_written_with_a_password_never_passes_it_on(tmp_path, tuner_home):
    # profiles written before redaction covered the query form carried the password
    from tests.test_profile import profile_dict

    doc = profile_dict()
    doc["study"] = {"name": "s", "storage": "postgresql://tuner@db/tuning?password=Le4kedPass&sslpassword=Le4kedKey"}
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps(doc))
    runner = CliRunner()
    shown = runner.invoke(cli, ["profile", "show", str(legacy), "--json"])
    assert shown.exit_code == 0 and "Le4ked" not in shown.output
    bundle = tmp_path / "bundle.json"
    assert runner.invoke(cli, ["profile", "export", str(legacy), "-o", str(bundle)]).exit_code == 0
    assert "Le4ked" not in bundle.read_text()
    # a bundle made elsewhere with the password in it: imported without it
    raw = {"bundle_version": "1.0", "created_at": "2026-01-01T00:00:00Z", "tool_version": "0.1.0", "profiles": [doc]}
    (tmp_path / "raw.json").write_text(json.dumps(raw))
    imported = runner.invoke(cli, ["profile", "import", str(tmp_path / "raw.json")])
    assert imported.exit_code == 0, imported.output
    written = list((tuner_home / "profiles").glob("*.json"))
    assert len(written) == 1 and "Le4ked" not in written[0].read_text()


def test_the_postgresql_driver_is_psycopg_3_whatever_sqlalchemy_defaults_to():
    from tuner.profile.dburl import normalize_url

    # SQLAlchemy 2.1 maps postgresql:// to psycopg 3, 2.0 to psycopg2 (not installed by the extra),
    # and none accepts postgres://
    assert normalize_url("postgresql://tuner@db/tuning") == "postgresql+psycopg://tuner@db/tuning"
    assert normalize_url("postgres://tuner:pw@db/tuning") == "postgresql+psycopg://tuner:pw@db/tuning"
    assert normalize_url("postgresql+psycopg2://tuner@db/tuning") == "postgresql+psycopg2://tuner@db/tuning"
    assert normalize_url("sqlite:////x/studies.db") == "sqlite:////x/studies.db"


def test_the_database_going_away_mid_tune_is_one_line_and_the_study_resumes(models, tmp_path):
    from tuner.errors import StudyError
    from tuner.testing import PostgresServer, postgres_bindir

    if postgres_bindir() is None:
        pytest.skip("PostgreSQL is not installed") if not os.environ.get("CI") else pytest.fail("PostgreSQL is not installed")
    server = PostgresServer()  # its own: this test stops it
    try:
        url = server.create_database("team")
        path = str(models["q8_0"])
        calls = []

        def speed(settings):
            calls.append(settings)
            if len(calls) == 3:
                server.stop()  # the database goes away during the third trial
            return (100.0, 10.0 + len(calls))

        engine = ScriptedRunner({path: inspect(path)}, speed=speed)
        with pytest.raises(StudyError) as caught:
            Tuner(path, trials=6, machine=machine(), engine=engine, storage=url, **small()).run()
        message = str(caught.value)
        assert message.startswith("the study database at postgresql://tuner:***@127.0.0.1:")
        assert "(connection failed: connection to server at" in message
        assert "the trials recorded before are kept there: check that the server is running and reachable, and " \
               "run the same command again to resume study tiny-Q8_0-" in message
        assert PASSWORD not in message and "\n" not in message

        server.start()
        events = []
        engine = ScriptedRunner({path: inspect(path)})
        result = Tuner(path, trials=6, machine=machine(), engine=engine, storage=url, on_event=events.append, **small()).run()
        start = next(e for e in events if e["kind"] == "start")
        assert start["resumed"] and start["done"] == 2 and len(start["recovered"]) == 1  # the third: left running
        assert result.counts["run"] == 6 and len(engine.launched) == 4 + 3  # 4 more trials, then the final 3
    finally:
        server.close()
