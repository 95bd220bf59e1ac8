"""The team's profile registry on a real PostgreSQL: publish and pull round trip, nothing
overwritten silently, hostile rows refused, and apps that read it (OFFLOAD_TUNER_REGISTRY) keep
working from a cached copy when the database is down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from tuner.cli.main import cli
from tuner.errors import NoMatchingProfileError
from tuner.model.gguf import model_fingerprint
from tuner.profile.apps import load_profile
from tuner.profile.document import Profile
from tuner.profile.registry import RegistryUnavailableWarning, cache_dir
from tests.test_profile import make_gguf, make_machine, profile_dict, write_profile

REPO = Path(__file__).resolve().parent.parent
PASSWORD = "s3cret-Pa55;word"

# two machines of one hardware class (same GPU model and memory), and one of another
TUNED_ON = make_machine(uuid_prefix="GPU-aaaa")
SAME_CLASS = make_machine(cpu_model="Intel Xeon w5-3435X", uuid_prefix="GPU-bbbb")
OTHER_CLASS = make_machine(gpus=(("NVIDIA GeForce RTX 3060", 12 << 30),), uuid_prefix="GPU-cccc")


def _invoke(*args: str, machine=None):
    return CliRunner().invoke(cli, list(args), obj={"machine": machine} if machine else {})


def _published(tmp_path: Path, url: str, document: dict) -> Path:
    path = write_profile(tmp_path / "mine", document)
    result = _invoke("profile", "publish", str(path), "--to", url)
    assert result.exit_code == 0, result.output
    return path


def test_publish_and_pull_round_trip(tmp_path, tuner_home, pg_url, monkeypatch):
    model = make_gguf(tmp_path / "Qwen3-8B-Q4_K_M.gguf")
    document = profile_dict(machine=TUNED_ON, fingerprint=model_fingerprint(model))
    path = write_profile(tuner_home / "profiles", document)

    published = _invoke("profile", "publish", "--to", pg_url)  # no PROFILES: all of mine
    assert published.exit_code == 0, published.output
    assert f"{path.stem}: published: Qwen3-8B-Q4_K_M.gguf on" in published.output
    assert PASSWORD not in published.output

    again = _invoke("profile", "publish", str(path), "--to", pg_url)
    assert again.exit_code == 0 and "duplicate: the registry has this profile already" in again.output

    # the same model on the same machine, other settings: a conflict, replaced only with --force
    other = write_profile(tmp_path / "other", profile_dict(machine=TUNED_ON, fingerprint=model_fingerprint(model), n_ctx=16384))
    conflict = _invoke("profile", "publish", str(other), "--to", pg_url)
    assert conflict.exit_code == 0 and "conflict: the registry holds another profile of Qwen3-8B-Q4_K_M.gguf" in conflict.output
    assert "--force replaces it" in conflict.output

    # another machine of the same class pulls: it has the team's profile without tuning
    monkeypatch.setenv("OFFLOAD_TUNER_HOME", str(tmp_path / "other-machine"))
    pulled = _invoke("profile", "pull", "--from", pg_url, machine=SAME_CLASS)
    assert pulled.exit_code == 0, pulled.output
    assert "registry #1 imported ->" in pulled.output and "1 imported" in pulled.output
    (file,) = (tmp_path / "other-machine" / "profiles").glob("*.json")
    assert Profile.from_dict(json.loads(file.read_text())) == Profile.from_dict(document)
    assert load_profile(model, machine=SAME_CLASS).settings.n_ctx == 32768

    assert "1 duplicate" in _invoke("profile", "pull", "--from", pg_url, machine=SAME_CLASS).output
    nothing = _invoke("profile", "pull", "--from", pg_url, machine=OTHER_CLASS)
    assert nothing.exit_code == 0 and "the registry has no profile for this hardware class" in nothing.output

    # --force replaces the registry's; a pull with --force brings the new one
    assert "replaced" in _invoke("profile", "publish", str(other), "--to", pg_url, "--force").output
    assert "replaced" in _invoke("profile", "pull", "--from", pg_url, "--force", machine=SAME_CLASS).output
    assert json.loads(file.read_text())["settings"]["n_ctx"] == 16384


def test_pull_by_class_and_from_the_environment(tmp_path, tuner_home, pg_url, monkeypatch):
    model = make_gguf(tmp_path / "m.gguf")
    _published(tmp_path, pg_url, profile_dict(machine=OTHER_CLASS, fingerprint=model_fingerprint(model)))
    monkeypatch.setenv("OFFLOAD_TUNER_REGISTRY", pg_url)
    pulled = _invoke("profile", "pull", "--class", OTHER_CLASS.hardware_class())
    assert pulled.exit_code == 0 and "1 imported" in pulled.output, pulled.output
    monkeypatch.delenv("OFFLOAD_TUNER_REGISTRY")
    missing = _invoke("profile", "pull")
    assert missing.exit_code == 2 and "give --from URL" in missing.output and "OFFLOAD_TUNER_REGISTRY" in missing.output


def test_a_hostile_row_is_refused_and_the_rest_pulled(tmp_path, tuner_home, pg_url, postgres):
    import sqlalchemy

    from tuner.profile.dburl import normalize_url

    model = make_gguf(tmp_path / "m.gguf")
    _published(tmp_path, pg_url, profile_dict(machine=TUNED_ON, fingerprint=model_fingerprint(model)))
    bad = profile_dict(machine=make_machine(uuid_prefix="GPU-dddd"), fingerprint=model_fingerprint(model))
    bad["settings"]["n_gpu_layers"] = "99; rm -rf ~"
    engine = sqlalchemy.create_engine(normalize_url(pg_url))
    with engine.begin() as connection:
        connection.execute(sqlalchemy.text(
            "INSERT INTO offload_tuner_profiles (slot, identity, model_file_name, model_header_hash, model_size, "
            "machine_fingerprint, hardware_class, created_at, published_at, published_from, document) VALUES "
            "('x', 'y', 'm.gguf', 'h', 1, 'f', :cls, 'now', now(), 'somewhere', :doc)"),
            {"cls": TUNED_ON.hardware_class(), "doc": json.dumps(bad)})
    engine.dispose()
    pulled = _invoke("profile", "pull", "--from", pg_url, machine=SAME_CLASS)
    assert pulled.exit_code == 2
    assert "registry #2 invalid: registry row 2: settings.n_gpu_layers:" in pulled.output
    assert "1 imported, 1 invalid" in pulled.output
    assert len(list((tuner_home / "profiles").glob("*.json"))) == 1


def test_a_legacy_profile_with_a_password_is_published_without_it(tmp_path, pg_url):
    import sqlalchemy

    from tuner.profile.dburl import normalize_url

    document = profile_dict(machine=TUNED_ON)
    document["study"] = {"name": "s", "storage": "postgresql://tuner:Le4kedPass@db/tuning?sslpassword=Le4kedKey"}
    _published(tmp_path, pg_url, document)
    engine = sqlalchemy.create_engine(normalize_url(pg_url))
    with engine.connect() as connection:
        (stored,) = connection.execute(sqlalchemy.text("SELECT document FROM offload_tuner_profiles")).scalars()
    engine.dispose()
    assert "Le4ked" not in stored and json.loads(stored)["study"]["storage"] == "postgresql://tuner:***@db/tuning?sslpassword=***"


def test_apps_read_the_registry_and_keep_working_when_it_is_down(tmp_path, tuner_home, monkeypatch):
    from tuner.testing import PostgresServer, postgres_bindir

    if postgres_bindir() is None:
        pytest.skip("PostgreSQL is not installed") if not os.environ.get("CI") else pytest.fail("PostgreSQL is not installed")
    server = PostgresServer()  # its own: this test stops it
    try:
        url = server.create_database("team")
        model = make_gguf(tmp_path / "Qwen3-8B-Q4_K_M.gguf")
        _published(tmp_path, url, profile_dict(machine=TUNED_ON, fingerprint=model_fingerprint(model)))
        monkeypatch.setenv("OFFLOAD_TUNER_REGISTRY", url)

        # no local profile: the app gets the team's, and it is cached
        with warnings.catch_warnings():
            warnings.simplefilter("error", RegistryUnavailableWarning)
            profile = load_profile(model, machine=SAME_CLASS)
        assert profile.settings.n_ctx == 32768 and Path(profile.path).parent == cache_dir(url)

        # the database goes down: the app still starts, from the cached copy, and says so
        server.stop()
        with pytest.warns(RegistryUnavailableWarning) as caught:
            again = load_profile(model, machine=SAME_CLASS)
        assert again.settings == profile.settings
        message = str(caught[0].message)
        assert "cannot reach the profile registry at postgresql://tuner:***@127.0.0.1:" in message
        assert f"using the registry's profiles cached at {cache_dir(url)} (fetched 20" in message
        assert PASSWORD not in message

        # a model nobody tuned: a clear error, and the warning about the registry
        stranger = make_gguf(tmp_path / "other.gguf", rows=8)
        with pytest.warns(RegistryUnavailableWarning), pytest.raises(NoMatchingProfileError):
            load_profile(stranger, machine=SAME_CLASS)

        # a local profile comes first: the registry is not asked (no warning while it is down)
        write_profile(tuner_home / "profiles", profile_dict(machine=SAME_CLASS, fingerprint=model_fingerprint(model)))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RegistryUnavailableWarning)
            assert load_profile(model, machine=SAME_CLASS).machine.fingerprint == SAME_CLASS.fingerprint()
    finally:
        server.close()


def test_loading_profiles_stays_light(tmp_path):
    # without a registry nothing database-related is imported; with one, SQLAlchemy only (never optuna)
    model = make_gguf(tmp_path / "m.gguf")
    folder = tmp_path / "profiles"
    write_profile(folder, profile_dict(machine=TUNED_ON, fingerprint=model_fingerprint(model)))
    code = (
        "import sys, tuner\n"
        "from tests.test_profile import make_machine\n"
        f"p = tuner.load_profile({str(model)!r}, search_path=[{str(folder)!r}], machine=make_machine(uuid_prefix='GPU-aaaa'))\n"
        "print(','.join(sorted(m for m in ('optuna', 'sqlalchemy', 'psycopg', 'gguf', 'llama_cpp') if m in sys.modules)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OFFLOAD_TUNER_HOME": str(tmp_path / "home")}
    env.pop("OFFLOAD_TUNER_REGISTRY", None)
    plain = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() == ""
    # a model without a local profile, with a registry that is down: SQLAlchemy, no optuna
    other = make_gguf(tmp_path / "other.gguf", rows=8)
    code = code.replace(str(model), str(other)).replace("p = tuner", "import warnings; warnings.simplefilter('ignore')\ntry:\n    p = tuner") \
        .replace("\nprint(", "\nexcept tuner.NoMatchingProfileError:\n    pass\nprint(")
    env["OFFLOAD_TUNER_REGISTRY"] = "postgresql://tuner:pw@127.0.0.1:1/team"
    down = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert down.returncode == 0, down.stderr
    assert "optuna" not in down.stdout and "sqlalchemy" in down.stdout


def test_a_row_nested_100000_deep_is_one_clear_error_everywhere(tmp_path, tuner_home, monkeypatch):
    """json's parser recurses per level: a deep row raised RecursionError in pull, check and every
    app; the registry goes through the bound the profile folder uses (store.parse_json)."""
    import sqlalchemy

    url = f"sqlite:///{tmp_path / 'registry.db'}"
    model = make_gguf(tmp_path / "m.gguf")
    _published(tmp_path, url, profile_dict(machine=TUNED_ON, fingerprint=model_fingerprint(model)))
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as connection:
        connection.execute(sqlalchemy.text("UPDATE offload_tuner_profiles SET document = :doc"),
                           {"doc": "[" * 100_000 + "]" * 100_000})
    engine.dispose()
    deep = "registry row 1: not a profile: its JSON is nested too deeply (a profile is a few levels deep)"
    pulled = _invoke("profile", "pull", "--from", url, machine=SAME_CLASS)
    assert pulled.exit_code == 2 and "Traceback" not in pulled.output and "RecursionError" not in pulled.output
    assert f"registry #1 invalid: {deep}" in pulled.output
    monkeypatch.setenv("OFFLOAD_TUNER_REGISTRY", url)
    with pytest.raises(NoMatchingProfileError):
        load_profile(model, machine=SAME_CLASS)
    checked = _invoke("profile", "check", str(model), machine=SAME_CLASS)
    assert checked.exit_code == 2 and "Traceback" not in checked.output and "RecursionError" not in checked.output
    assert checked.output.startswith("Error: ") and checked.output.count("\n") == 1, checked.output
