"""Hostile input and hostile machines: every way a command was seen to end in a traceback, a wrong
answer or a lost result (issue 13), each tested for real: real files, real folders the kernel refuses
to write, real subprocesses.

Folders are made read-only with their permission bits. Root ignores those bits, so the commands run
in a child that first gives up the capabilities that let it (CAP_DAC_OVERRIDE and friends): then
the kernel refuses the write exactly as it does for any user (see ``_ENFORCE``).
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tuner.engine.base import Stats, median_interval

ROOT = Path(__file__).resolve().parent.parent

# Run a command with file permissions enforced, even as root: drop CAP_DAC_OVERRIDE (1),
# CAP_DAC_READ_SEARCH (2) and CAP_FOWNER (3) from the bounding set (so no child gets them back) and
# from this process. Both calls fail harmlessly for a user who never had them.
_ENFORCE = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
for cap in (1, 2, 3):
    libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
header, data = Header(0x20080522, 0), (Data * 2)()
if libc.capget(ctypes.byref(header), data) == 0:
    for d in data[:1]:
        d.effective &= ~0xE; d.permitted &= ~0xE; d.inheritable &= ~0xE
    libc.capset(ctypes.byref(header), data)
sys.path.insert(0, sys.argv[1])
"""


def run_enforced(code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python with file permissions enforced; ``sys.argv[2:]`` are ``args``."""
    return subprocess.run([sys.executable, "-c", _ENFORCE + code, str(ROOT), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def run_cli_enforced(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_enforced("from tuner.cli.main import cli\ncli(sys.argv[2:], prog_name='offload-tuner')", *args, env=env)


@pytest.fixture
def read_only(tmp_path):
    """Folders made read-only for the test, writable again at teardown (so pytest can remove them)."""
    made: list[Path] = []

    def make(path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o555)
        made.append(path)
        return path

    yield make
    for path in made:
        path.chmod(0o755)


# A machine with no GPU, and a quick study (as tests/test_study.py uses them).
_MACHINE = r"""
from tuner.machine.probe import LlamaBuild, Machine

def machine():
    return Machine(cpu_model="Test CPU", physical_cores=4, logical_cores=4, ram_total=16 << 30, ram_available=12 << 30,
                   gpu_status="no GPU", llama=LlamaBuild(llama_cpp_python="0.3.36", gpu_offload=True, rpc=True,
                                                         backends=("cpu", "rpc")))

def kwargs(**extra):
    return {**dict(min_ctx=512, n_prompt=64, n_gen=16, repetitions=2, final_repetitions=3, vram_margin=0), **extra}
"""
exec(_MACHINE)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


# -- the interval of a noisy measurement -------------------------------------------------------


def test_the_interval_is_two_of_the_samples_and_never_leaves_their_range():
    # the issue's samples: mean - t*sd/sqrt(n) was -1,120 t/s, and the profile was refused after every trial
    stats = Stats.of([1.4, 900, 929])
    assert (stats.ci_low, stats.median, stats.ci_high) == (1.4, 900.0, 929.0)
    rng = random.Random(13)
    for _ in range(2000):
        n = rng.randrange(1, 40)
        samples = [rng.choice([rng.uniform(0, 1e-3), rng.uniform(0, 2000), rng.lognormvariate(5, 3)]) for _ in range(n)]
        s = Stats.of(samples)
        assert min(samples) <= s.ci_low <= s.median <= s.ci_high <= max(samples)
        assert s.ci_low in samples and s.ci_high in samples


@pytest.mark.parametrize("n", range(1, 60))
def test_the_interval_covers_the_median_95_percent_of_the_time(n):
    # [x_(j), x_(n+1-j)] covers the median unless fewer than j samples fall on one side of it:
    # P = 1 - 2 P(Binomial(n, 1/2) < j), worked out here from the indices the interval picked
    samples = list(range(n))
    low, high = median_interval(samples)
    j = low + 1
    assert high == n - j  # symmetric
    coverage = 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2 ** n
    if n >= 6:
        assert coverage >= 0.95
        # and it is the tightest such pair: one step in would fall below 95%
        assert 1 - 2 * sum(math.comb(n, i) for i in range(j + 1)) / 2 ** n < 0.95
    else:
        assert (low, high) == (0, n - 1)  # too few samples for 95%: their whole range


def test_noisy_samples_still_end_in_a_profile(models, tuner_home):
    # a shared machine: one stalled run among the samples of every trial
    from tuner.engine.fake import ScriptedRunner
    from tuner.model.inspect import inspect
    from tuner.search.study import Tuner

    class Stalling(ScriptedRunner):
        def run(self, settings, bench, *, trial_id=None):
            result = super().run(settings, bench, trial_id=trial_id)
            if result.tg is not None:
                samples = [1.4] + [result.tg.median * (1 + 0.03 * i) for i in range(bench.repetitions - 1)] or [1.4]
                result.tg = Stats.of(samples)
            return result

    info = inspect(models["q8_0"])
    result = Tuner(models["q8_0"], trials=4, machine=machine(), engine=Stalling({info.path: info}), **kwargs(repetitions=3)).run()
    assert result.profile_error is None and result.profile_path.is_file()
    tg = result.profile.measured.tg
    assert min(tg.samples) <= tg.ci_low <= tg.median <= tg.ci_high <= max(tg.samples)


def test_a_study_written_with_the_old_interval_still_gives_a_profile():
    # a study an older version wrote holds ci_low < 0; the figures are worked out again from the samples
    from types import SimpleNamespace

    from tuner.search.remeasure import Contender

    old = {"median": 900.0, "mean": 610.1, "stddev": 527.4, "ci_low": -700.0, "ci_high": 1920.3, "samples": [1.4, 900.0, 929.0]}
    trial = SimpleNamespace(number=3, value=900.0, user_attrs={"settings": {"model_path": "m.gguf"}, "tg": old, "pp": None})
    contender = Contender.from_trial(trial)
    assert (contender.tg["ci_low"], contender.tg["ci_high"]) == (1.4, 929.0)
    assert contender.pp is None


# -- where results are written ------------------------------------------------------------------


def test_tune_refuses_a_read_only_profile_folder_before_any_trial(models, tuner_home, read_only, tmp_path):
    folder = read_only(tmp_path / "shared-profiles")
    proc = run_cli_enforced("tune", str(models["q8_0"]), "--trials", "2", "--out", str(folder) + "/",
                            env={"OFFLOAD_TUNER_HOME": str(tuner_home)})
    assert proc.returncode == 2
    assert one_error_line(proc) == f"Error: cannot write {folder}: Permission denied (this folder must be writable)"
    assert not (tuner_home / "studies" / "studies.db").exists()  # nothing ran


def test_a_read_only_data_folder(models, read_only, tmp_path):
    home = read_only(tmp_path / "home")
    env = {"OFFLOAD_TUNER_HOME": str(home)}
    proc = run_cli_enforced("tune", str(models["q8_0"]), "--trials", "2", env=env)
    assert proc.returncode == 2
    assert one_error_line(proc) == f"Error: cannot write {home / 'profiles'}: Permission denied (this folder must be writable)"
    # reading is fine: there is nothing to list
    proc = run_cli_enforced("profile", "list", "--all", env=env)
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout.startswith("no profiles in ")


def test_a_profile_folder_gone_read_only_keeps_the_study_and_the_rerun_writes_it(models, tmp_path):
    # The folder is writable when the tune starts and read-only by the time the profile is written
    # (as a disk that fills up): the winner is reported, the study keeps every trial, and the same
    # tune run again writes the profile without running a trial again.
    folder = tmp_path / "profiles"
    code = r"""
import json, sys
from pathlib import Path
from tuner.engine.fake import ScriptedRunner
from tuner.model.inspect import inspect
from tuner.search.study import Tuner
exec(sys.argv[2])
model, folder, lock = sys.argv[3], Path(sys.argv[4]), sys.argv[5] == "lock"
info = inspect(model)
engine = ScriptedRunner({info.path: info})
def on_event(event):
    if lock and event["kind"] == "remeasure":
        folder.chmod(0o555)
result = Tuner(model, trials=3, machine=machine(), engine=engine, out=folder, on_event=on_event, **kwargs()).run()
print(json.dumps({"path": str(result.profile_path) if result.profile_path else None, "error": result.profile_error,
                  "launched": len(engine.launched), "run": result.counts["run"], "best": result.best["value"]}))
"""
    env = {"OFFLOAD_TUNER_HOME": str(tmp_path / "home")}
    folder.mkdir()
    try:
        first = run_enforced(code, _MACHINE, str(models["q8_0"]), str(folder), "lock", env=env)
        assert first.returncode == 0, first.stderr[-3000:]
        got = json.loads(first.stdout.splitlines()[-1])
    finally:
        folder.chmod(0o755)
    assert got["path"] is None and got["best"] > 0 and got["run"] == 3
    assert got["error"].startswith(f"the profile was not written: cannot write {folder}/")
    assert "Permission denied" in got["error"] and "Nothing is lost" in got["error"]
    assert list(folder.iterdir()) == []  # no half-written file either
    again = run_enforced(code, _MACHINE, str(models["q8_0"]), str(folder), "open", env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    rerun = json.loads(again.stdout.splitlines()[-1])
    assert rerun["error"] is None and Path(rerun["path"]).parent == folder and Path(rerun["path"]).is_file()
    assert rerun["run"] == 3  # the study's trials, none added:
    assert rerun["launched"] == got["launched"] - 3  # the re-measure of the leaders ran again, no trial did


def test_a_write_the_disk_refuses_midway_loses_nothing(tmp_path):
    # A full disk: the kernel refuses the bytes past a limit. RLIMIT_FSIZE makes it refuse them for
    # this child alone (EFBIG instead of ENOSPC, the same failed write()).
    target = tmp_path / "profile.json"
    target.write_text("the old profile\n")
    code = r"""
import resource, signal, sys
from tuner.errors import FileWriteError
from tuner.paths import atomic_write_text
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    atomic_write_text(sys.argv[2], "x" * 100_000)
except FileWriteError as exc:
    print(exc)
"""
    proc = run_enforced(code, str(target))
    assert proc.stdout.strip() == f"cannot write {target}: File too large", proc.stderr
    assert target.read_text() == "the old profile\n"  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json"]  # no temp file left behind


def test_out_may_name_a_folder(models, tuner_home, tmp_path):
    from tuner.engine.fake import ScriptedRunner
    from tuner.model.inspect import inspect
    from tuner.search.study import Tuner

    info = inspect(models["q8_0"])
    folder = tmp_path / "team"
    folder.mkdir()
    result = Tuner(models["q8_0"], trials=2, machine=machine(), engine=ScriptedRunner({info.path: info}), out=folder, **kwargs()).run()
    assert result.profile_path.parent == folder and result.profile_path.name == result.profile.default_filename()


@pytest.mark.parametrize("args, message", [
    (["--time-budget", "0"], "Error: --time-budget: expected a number of seconds above 0, got 0.0"),
    (["--time-budget", "nan"], "Error: --time-budget: expected a number of seconds above 0, got nan"),
    (["--vram-margin", "-1"], "Error: --vram-margin: expected MiB >= 0, got -1"),
    (["--trial-timeout", "-5"], "Error: --trial-timeout: expected a number of seconds above 0, got -5.0"),
    (["--min-ctx", str(2 ** 62)], f"Error: --min-ctx: expected a context from 1 to {1 << 24} tokens, got {2 ** 62}"),
    (["-r", "0"], "Error: --repetitions: expected a count from 1 to 10000, got 0"),
])
def test_tune_refuses_absurd_options_in_one_line(models, tuner_home, args, message):
    proc = subprocess.run([sys.executable, "-m", "tuner", "tune", str(models["q8_0"]), *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "OFFLOAD_TUNER_HOME": str(tuner_home)}, timeout=300)
    assert proc.returncode == 2
    assert one_error_line(proc) == message


# -- GGUF headers that lie -------------------------------------------------------------------------


def _patched(model: Path, out: Path, key: str, value: int, vtype: int = 4) -> Path:
    """A copy of ``model`` whose metadata ``key`` holds ``value`` (a 4-byte integer, uint32 by default,
    5 for int32), written over the header in place: every other byte is the real model's."""
    import struct

    data = bytearray(model.read_bytes())
    name = key.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    assert struct.unpack_from("<I", data, at)[0] in (4, 5), "the key is not a 4-byte integer"
    struct.pack_into("<I", data, at, vtype)
    struct.pack_into("<I" if vtype == 4 else "<i", data, at + 4, value)
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("key, value, vtype, expected", [
    ("llama.block_count", 10 ** 9, 4, "llama.block_count is 1000000000; expected a whole number from 1 to 65536"),
    ("llama.block_count", 40, 4, "llama.block_count is 40; expected at most the layers the file holds: tensors for 4 layers (blk.0 to blk.3)"),
    ("llama.block_count", 0, 4, "llama.block_count is 0; expected a whole number from 1 to 65536"),
    ("llama.block_count", -4, 5, "llama.block_count is -4; expected a whole number from 1 to 65536"),
    ("llama.attention.head_count_kv", 0, 4, "llama.attention.head_count_kv is 0; expected at least 1 (a model whose layers attend has key/value heads)"),
    ("llama.embedding_length", 2 ** 32 - 1, 4, "llama.embedding_length is 4294967295; expected a whole number from 1 to 1048576"),
    ("llama.embedding_length", 512, 4, "llama.embedding_length is 512; expected the width of token_embd.weight (256)"),
    ("llama.context_length", 0, 4, "llama.context_length is 0; expected a whole number from 1 to 4294967296"),
])
def test_absurd_counts_in_a_gguf_header_are_named_not_allocated(models, tmp_path, key, value, vtype, expected):
    from tuner.errors import NotGGUFError
    from tuner.model.inspect import inspect

    path = _patched(models["f16"], tmp_path / "lying.gguf", key, value, vtype)
    with pytest.raises(NotGGUFError) as info:
        inspect(path)
    assert str(info.value) == f"{path}: corrupt GGUF header: {expected}"
    # every command that sizes the model says the same, in one line
    for command in (["inspect", str(path)], ["estimate", str(path), "-ngl", "99"], ["tune", str(path), "--trials", "1"]):
        proc = subprocess.run([sys.executable, "-m", "tuner", *command], capture_output=True, text=True, cwd=ROOT, timeout=300,
                              env={**os.environ, "OFFLOAD_TUNER_HOME": str(tmp_path / "home")})
        assert proc.returncode == 2, command
        assert one_error_line(proc) == f"Error: {path}: corrupt GGUF header: {expected}"


def test_bench_on_a_gguf_cut_in_its_data_is_one_line(models, tmp_path):
    data = models["q8_0"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) * 2 // 3])
    proc = subprocess.run([sys.executable, "-m", "tuner", "bench", str(cut), "-p", "8", "-n", "4", "-r", "1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    line = one_error_line(proc)
    assert line.startswith(f"Error: {cut}: truncated GGUF: tensor ") and "re-download or re-convert it" in line


# -- names, paths and numbers a profile or a command line can hold ---------------------------------


def test_a_model_file_name_that_is_not_utf8(models, tmp_path):
    # Linux file names are bytes; Python keeps the ones that are not UTF-8 as surrogate escapes.
    path = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/model-\xff.gguf"))
    path.write_bytes(models["q8_0"].read_bytes())
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict", "OFFLOAD_TUNER_HOME": str(tmp_path / "home")}
    for command in (["inspect", str(path)], ["bench", str(path), "-p", "8", "-n", "4", "-r", "1"]):
        proc = subprocess.run([sys.executable, "-m", "tuner", *command], capture_output=True, cwd=ROOT, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
        assert b"model-\xff.gguf" in proc.stdout  # the name as its own bytes
    assert b"outcome: ok" in proc.stdout  # llama.cpp opened it
    # a tune of it keeps its study and writes a profile the app finds
    from tuner.engine.fake import ScriptedRunner
    from tuner.model.inspect import inspect
    from tuner.profile.apps import load_profile
    from tuner.search.study import Tuner

    info = inspect(path)
    result = Tuner(path, trials=2, machine=machine(), engine=ScriptedRunner({info.path: info}), **kwargs()).run()
    assert result.profile_error is None and result.study_name.startswith("model-\ufffd-")
    assert load_profile(path, machine=machine()).path == str(result.profile_path)


def test_a_profile_nested_100000_levels_deep(models, tmp_path):
    from tuner.errors import NoMatchingProfileError, ProfileError
    from tuner.profile.apps import load_profile
    from tuner.profile.store import read_profile

    deep = tmp_path / "profiles" / "deep.json"
    deep.parent.mkdir()
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ProfileError) as info:
        read_profile(deep)
    assert str(info.value) == f"{deep}: not a profile: its JSON is nested too deeply (a profile is a few levels deep)"
    with pytest.raises(NoMatchingProfileError) as info:
        load_profile(models["q8_0"], search_path=[deep.parent], machine=machine())
    assert f"{deep}: unreadable: not a profile: its JSON is nested too deeply" in str(info.value)
    assert str(info.value).count(str(deep)) == 1  # the path once, not "X: unreadable: X: ..."
    proc = subprocess.run([sys.executable, "-m", "tuner", "profile", "show", str(deep)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and one_error_line(proc) == f"Error: {deep}: not a profile: its JSON is nested too deeply (a profile is a few levels deep)"


def _profile_of(model: Path, **settings) -> dict:
    from tests.test_profile import profile_dict
    from tuner.model.gguf import model_fingerprint

    document = profile_dict(machine(), model_fingerprint(model), **settings)
    document["settings"].update(n_gpu_layers=0, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=2, n_threads_batch=2,
                                flash_attn="on", tensor_split=None)
    document["min_ctx"] = 512
    document["memory"] = {"predicted": {"CPU": {"weights": 1, "kv": 1, "compute": 1, "total": 3}}, "actual": {}}
    return document


def test_a_bundle_with_hostile_names_imports_every_valid_profile_and_reports_the_rest(models, tmp_path):
    from tuner.profile.store import import_bundle

    good = _profile_of(models["q8_0"])
    other = _profile_of(models["q4_k_m"])
    long_name = _profile_of(models["f16"])
    long_name["model"]["file_name"] = "m" * 5000 + ".gguf"
    newline = _profile_of(models["f16"])
    newline["model"]["file_name"] = "x.gguf\ntouch pwned"
    huge = _profile_of(models["f16"])
    huge["settings"]["n_gpu_layers"] = 10 ** 400
    bundle = tmp_path / "team.json"
    bundle.write_text('{"bundle_version": "1.0", "created_at": "2026-03-01T12:00:00Z", "profiles": ['
                      + ",".join(json.dumps(d) for d in (good, long_name, newline, other)) + ","
                      + json.dumps(huge).replace('"n_gpu_layers": ' + str(10 ** 400), '"n_gpu_layers": ' + "9" * 400) + "]}")
    results = import_bundle(bundle, dest=tmp_path / "dest")
    assert [r.action for r in results] == ["imported", "invalid", "invalid", "imported", "invalid"]
    assert results[1].detail == "profiles[1].model.file_name: expected at most 4096 characters, got 5005"
    assert results[2].detail == "profiles[2].model.file_name: holds a control character (\\n); a name in a profile must be printable"
    assert results[4].detail.startswith("profiles[4].settings.n_gpu_layers: expected at most 65536, got a number of 400 digits")
    proc = subprocess.run([sys.executable, "-m", "tuner", "profile", "import", str(bundle), "--to", str(tmp_path / "dest2")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout.splitlines()[-1] == "2 imported, 3 invalid"
    assert one_error_line(proc) == f"Error: 3 profile(s) in {bundle} are invalid and were not imported"
    assert len(list((tmp_path / "dest2").glob("*.json"))) == 2


def test_an_import_into_a_read_only_folder_reports_each_profile(models, tmp_path, read_only):
    bundle = tmp_path / "team.json"
    bundle.write_text(json.dumps({"bundle_version": "1.0", "created_at": "2026-03-01T12:00:00Z",
                                  "profiles": [_profile_of(models["q8_0"]), _profile_of(models["q4_k_m"])]}))
    folder = read_only(tmp_path / "dest")
    proc = run_cli_enforced("profile", "import", str(bundle), "--to", str(folder))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("profiles[0] failed: cannot write ") and lines[0].endswith(": Permission denied")
    assert lines[1].startswith("profiles[1] failed: ") and lines[-1] == "2 failed"
    assert one_error_line(proc) == "Error: 2 profile(s) could not be written (see above)"


def test_llama_refuses_absurd_keywords_and_profiles_before_llama_cpp_sees_them(models, tmp_path):
    from tests.test_profile import write_profile
    from tuner.errors import NoMatchingProfileError, SettingsError
    from tuner.profile.apps import Llama, load_profile

    folder = tmp_path / "profiles"
    path = write_profile(folder, _profile_of(models["q8_0"]))
    with pytest.raises(SettingsError) as info:
        Llama(models["q8_0"], profile=path, machine=machine(), n_ctx=2 ** 62)
    assert str(info.value) == "n_ctx: expected at most 16777216, got 4611686018427387904 (tuner.Llama's keyword n_ctx)"
    with pytest.raises(SettingsError, match=r"^n_gpu_layers: expected at most 65536, got a number of 401 digits"):
        Llama(models["q8_0"], profile=path, machine=machine(), n_gpu_layers=10 ** 400)
    # a profile that says n_ctx 2^62 is no profile, and `profile check` does not say it fits
    absurd = _profile_of(models["q8_0"])
    absurd["settings"]["n_ctx"] = 2 ** 62
    path.write_text(json.dumps(absurd))
    with pytest.raises(NoMatchingProfileError, match=r"settings.n_ctx: expected at most 16777216, got 4611686018427387904"):
        load_profile(models["q8_0"], search_path=[folder], machine=machine())
    from click.testing import CliRunner

    from tuner.cli.profile import profile_group

    result = CliRunner().invoke(profile_group, ["check", str(models["q8_0"])], obj={"machine": machine()},
                                env={"OFFLOAD_TUNER_PROFILE_PATH": str(folder)})
    assert result.exit_code == 2 and "fits" not in result.stdout
    assert "settings.n_ctx: expected at most 16777216" in result.output


# A shared profile's tensor override that backtracks forever: llama.cpp's std::regex (and Python's
# re) take exponential time on "(a+)+$", on ".?" * 30 + ".{30}!" and on eight ".{0,40}" then "!"
# (12 repeats of ".?" took 0.9 s, 16 took 3.9 s; the eight ".{0,40}" 20 s). No list of bad shapes
# catches them all: RE2 matches every pattern in linear time, and llama.cpp only gets the names
# RE2 matched, as literals (tuner.engine.overrides.resolved_patterns).
_LLAMA_WITH_PROFILE = r"""
import sys, time, warnings
from tuner.profile.apps import Llama
exec(sys.argv[3])
warnings.simplefilter("ignore")
started = time.monotonic()
try:
    llm = Llama(sys.argv[1], profile=sys.argv[2], machine=machine(), verbose=False)
    print("loaded", round(time.monotonic() - started, 1))
except Exception as exc:
    print(type(exc).__name__, exc)
"""

_CATASTROPHIC = ["(a+)+$", ".?" * 30 + ".{30}!", ".{0,40}" * 8 + "!", r"(\w*)*\.weight_nomatch$"]


def test_catastrophic_overrides_load_quickly_through_tuner_llama(models, tmp_path):
    from tests.test_profile import write_profile

    folder = tmp_path / "profiles"
    document = _profile_of(models["q8_0"], tensor_overrides=_CATASTROPHIC)
    hostile = write_profile(folder, document, "hostile.json")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _LLAMA_WITH_PROFILE, str(models["q8_0"]), str(hostile), _MACHINE],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.stdout.startswith("loaded "), proc.stdout + proc.stderr[-2000:]
    assert time.monotonic() - started < 60


def test_catastrophic_overrides_are_validated_quickly_by_every_path_in(models, tmp_path):
    """load_profile, a bundle import and a registry pull check each pattern with RE2: fast."""
    from tests.test_profile import write_profile
    from tuner.profile.apps import load_profile
    from tuner.profile.document import Profile
    from tuner.profile.registry import publish, pull
    from tuner.profile.store import import_bundle, write_bundle

    started = time.monotonic()
    document = _profile_of(models["q8_0"], tensor_overrides=_CATASTROPHIC)
    path = write_profile(tmp_path / "profiles", document, "hostile.json")
    loaded = load_profile(models["q8_0"], search_path=[path.parent], machine=machine())
    assert loaded.settings.tensor_overrides == tuple(_CATASTROPHIC)
    profile = Profile.from_dict(document)
    bundle = write_bundle([profile], tmp_path / "bundle.json")
    assert [r.action for r in import_bundle(bundle, dest=tmp_path / "imported", search_path=[])] == ["imported"]
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    publish([profile], url)
    pulled = pull(url, dest=tmp_path / "pulled", hardware_class=profile.machine.hardware_class, search_path=[])
    assert [r.action for r in pulled] == ["imported"], pulled
    assert time.monotonic() - started < 20


def test_a_pattern_re2_cannot_express_is_one_clear_line(models, tmp_path):
    from tests.test_profile import write_profile

    document = _profile_of(models["q8_0"], tensor_overrides=[r"blk\.(\d)\.ffn_up\1"])
    path = write_profile(tmp_path / "profiles", document, "backref.json")
    proc = subprocess.run([sys.executable, "-c", _LLAMA_WITH_PROFILE, str(models["q8_0"]), str(path), _MACHINE],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.stdout.strip().splitlines() == [
        "ProfileValidationError settings.tensor_overrides[0]: RE2, which matches tensor overrides in linear time, cannot "
        "express it (invalid escape sequence: \\1); a backreference or a lookaround is never needed to name tensors: "
        "write e.g. blk\\.(1[0-9]|2[0-4])\\.ffn_.*_exps\\."], proc.stdout + proc.stderr[-2000:]
    assert "re2.cc" not in proc.stderr  # RE2's own logging is off: the line above is the only word


def test_resolved_overrides_name_exactly_the_tensors_the_patterns_match():
    import re

    from tuner.engine.tensor_match import resolved_patterns

    names = [f"blk.{i}.{t}.weight" for i in range(40) for t in ("ffn_up_exps", "ffn_down_exps", "attn_q", "ffn_norm")]
    names += ["token_embd.weight", "output.weight", "odd-name+x.weight"]
    patterns = [r"blk\.(1[0-9]|2[0-4])\.ffn_.*_exps\.", r"^output", "odd-name", ".?" * 30 + ".{30}!"]
    resolved = resolved_patterns(patterns, names)
    expected = [n for n in names if any(re.search(p, n) for p in patterns[:3])]
    # what llama.cpp's regex_search will find with the built patterns (ECMAScript ~ Python re here)
    found = [n for n in names if any(re.search(p, n) for p in resolved)]
    assert found == expected and len(expected) == 2 * 15 + 2
    assert all(len(p) < 2048 for p in resolved) and len(resolved) == -(-len(expected) // 32)
    # built from escaped literals only: no repetition an engine could backtrack on
    assert not any(ch in p for p in resolved for ch in "*+?{")

# -- RPC servers ------------------------------------------------------------------------------------


def test_rpc_serve_refuses_a_bad_port_and_fails_when_it_cannot_listen():
    import socket

    proc = subprocess.run([sys.executable, "-m", "tuner", "rpc-serve", "--port", "99999"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and one_error_line(proc) == "Error: --port: expected a port from 1 to 65535, got 99999"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "tuner", "rpc-serve", "--port", str(port)], capture_output=True,
                              text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2
    assert one_error_line(proc) == f"Error: cannot serve on 127.0.0.1:{port}: Address already in use"


def test_an_unreachable_rpc_server_is_reported_in_words(models):
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        endpoint = f"127.0.0.1:{port}"
        words = f"cannot connect to {endpoint}: Connection refused; is `offload-tuner rpc-serve` running there?"
        proc = subprocess.run([sys.executable, "-m", "tuner", "probe", "--rpc", endpoint, "--json"], capture_output=True,
                              text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["rpc_devices"] == [{"endpoint": endpoint, "error": words}]
        proc = subprocess.run([sys.executable, "-m", "tuner", "bench", str(models["q8_0"]), "--rpc", endpoint, "-ngl", "2",
                               "-p", "8", "-n", "4", "-r", "1"], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 2 and one_error_line(proc) == f"Error: {words}"


def test_a_study_database_the_disk_refuses_midway_is_one_error_and_resumes(models, tmp_path):
    # The disk fills while the study is written: RLIMIT_FSIZE stops the database file past 200 kB
    # (the kernel refuses the write, as a full disk does). One StudyError, and the same tune without
    # the limit resumes from what was committed.
    code = r"""
import json, resource, signal, sys
from tuner.engine.fake import ScriptedRunner
from tuner.errors import StudyError
from tuner.model.inspect import inspect
from tuner.search.study import Tuner
exec(sys.argv[2])
model, limit = sys.argv[3], int(sys.argv[4])
info = inspect(model)
if limit:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
engine = ScriptedRunner({info.path: info})
try:
    result = Tuner(model, trials=40, machine=machine(), engine=engine, **kwargs()).run()
    print(json.dumps({"run": result.counts["run"], "launched": len(engine.launched), "path": str(result.profile_path)}))
except StudyError as exc:
    print(json.dumps({"error": str(exc), "launched": len(engine.launched)}))
"""
    env = {"OFFLOAD_TUNER_HOME": str(tmp_path / "home")}
    full = run_enforced(code, _MACHINE, str(models["q8_0"]), str(200_000), env=env)
    got = json.loads(full.stdout.splitlines()[-1])
    assert got["error"].startswith("the study database could not be written (") and "run the same command again" in got["error"]
    assert 0 < got["launched"] < 40
    again = run_enforced(code, _MACHINE, str(models["q8_0"]), "0", env=env)
    rerun = json.loads(again.stdout.splitlines()[-1])
    assert rerun["run"] == 40 and Path(rerun["path"]).is_file()
    # the trials committed before were not run again (the one being recorded when the disk filled may
    # be), then the 3 leaders were measured again in 3 rounds
    assert rerun["launched"] <= (40 - got["launched"] + 1) + 9


# -- HTTP: one deadline per request and per command; malformed answers (second sweep) ----------------


@pytest.fixture
def served_models(tmp_path):
    from tests.range_server import ModelServer

    server = ModelServer(root=tmp_path).start()
    yield server
    server.stop()


def test_a_trickling_server_ends_at_the_timeout(served_models):
    from tests.test_remote import _one_line_error, run

    served = served_models
    # a valid-looking answer that arrives a byte every 0.2 s: 4 KB would take 15 minutes
    served.raw = b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-65535/1000000\r\n\r\n" + b"G" * 4096
    served.trickle = 0.2
    started = time.monotonic()
    line = _one_line_error(run("inspect", served.url("any.gguf"), env={"OFFLOAD_TUNER_HTTP_TIMEOUT": "2"}))
    elapsed = time.monotonic() - started
    assert "did not finish answering within 2 s" in line and "OFFLOAD_TUNER_HTTP_TIMEOUT" in line, line
    assert elapsed < 6, elapsed  # one request's deadline (not retried: the server answers, too slowly)
    assert len(served.requests) == 1


@pytest.mark.parametrize("raw, why", [
    (b"HTTP/1.1 206 Partial Content\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(150)) + b"\r\n", "more than 100 header lines"),
    (b"HTTP/9 banana\r\n\r\n", "a bad status line"),
    (b"HTTP/1.1 206 Partial Content\r\nX-Long: " + b"a" * 200_000 + b"\r\n\r\n", "a header line longer than 64 KiB"),
    (b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-65535/1000000\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc",
     "chunked encoding is broken"),
])
def test_a_malformed_http_answer_is_one_line(served_models, raw, why):
    from tests.test_remote import _one_line_error, run

    served_models.raw = raw
    line = _one_line_error(run("inspect", served_models.url("any.gguf"), env={"OFFLOAD_TUNER_HTTP_TIMEOUT": "5"}))
    assert "the server's answer is not valid HTTP" in line and why in line, line


def test_a_redirect_loop_is_one_line(served_models):
    from tests.test_remote import _one_line_error, run

    loop = "HTTP/1.1 302 Found\r\nLocation: {url}\r\nContent-Length: 0\r\n\r\n"
    served_models.raw = loop.format(url=served_models.url("any.gguf")).encode()
    line = _one_line_error(run("inspect", served_models.url("any.gguf"), env={"OFFLOAD_TUNER_HTTP_TIMEOUT": "5"}))
    assert "too many redirects (a redirect loop, or more than 10 in a row)" in line, line


# -- messages: one line, the path once (second sweep) --------------------------------------------------


def test_profile_export_and_import_of_a_folder_or_bad_json_is_one_line_with_the_path_once(tmp_path):
    folder = tmp_path / "existing"
    folder.mkdir()
    env = {**os.environ, "OFFLOAD_TUNER_HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-m", "tuner", "profile", "export", "-o", str(folder)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, env=env)
    assert proc.returncode == 2 and one_error_line(proc) == (
        f"Error: -o {folder}: is a folder; give the bundle's file name, e.g. {folder / 'profiles.json'}")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for target in (bad, folder):
        proc = subprocess.run([sys.executable, "-m", "tuner", "profile", "import", str(target)], capture_output=True,
                              text=True, cwd=ROOT, timeout=120, env=env)
        line = one_error_line(proc)
        assert proc.returncode == 2 and line.count(str(target)) == 1, line
    assert "not valid JSON (line 1, column 2" in one_error_line(
        subprocess.run([sys.executable, "-m", "tuner", "profile", "import", str(bad)], capture_output=True, text=True, cwd=ROOT,
                       timeout=120, env=env))


# -- quality reads the corpus bounded, and only text (second sweep) ------------------------------------


def test_quality_reads_only_what_the_chunks_need_and_refuses_nul_bytes(models, tmp_path):
    import resource

    from tuner.engine.scoring import MAX_BYTES_PER_TOKEN
    from tuner.errors import QualityError
    from tuner.model.inspect import inspect
    from tuner.search.quality import QualityMeter

    info = inspect(models["q8_0"])
    # 1 GB of NUL bytes (valid UTF-8): a sparse file, so the test writes nothing to disk
    nul = tmp_path / "nul.txt"
    with open(nul, "wb") as handle:
        handle.truncate(1 << 30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    with pytest.raises(QualityError) as caught:
        QualityMeter(info, corpus=nul, n_ctx=64, chunks=4)
    assert str(caught.value) == f"{nul}: the corpus is not text (byte 0 is a NUL byte); give a plain text file"
    # text first, then a 1 GB tail: only the chunks' share is read (and hashed)
    big = tmp_path / "big.txt"
    with open(big, "wb") as handle:
        handle.write(("In the beginning was the word. " * 2000).encode())
        handle.truncate(1 << 30)
    meter = QualityMeter(info, corpus=big, n_ctx=64, chunks=4)
    assert meter.corpus_bytes == 64 * 4 * MAX_BYTES_PER_TOKEN
    assert time.monotonic() - started < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: far below the 1 GB file
    # a cut in the middle of a character is not a decoding error
    cut = tmp_path / "cut.txt"
    cut.write_bytes(b"a" * (64 * 4 * MAX_BYTES_PER_TOKEN - 1) + "é".encode() + b"more text")
    assert QualityMeter(info, corpus=cut, n_ctx=64, chunks=4).corpus_bytes == 64 * 4 * MAX_BYTES_PER_TOKEN - 1


def test_report_storage_urls_with_a_query_or_an_unknown_driver_are_understood(tmp_path):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    db = tmp_path / "studies.db"
    optuna.create_study(study_name="s1", storage=f"sqlite:///{db}")
    env = {**os.environ, "OFFLOAD_TUNER_HOME": str(tmp_path / "home")}
    # the file of a sqlite URL is not "studies.db?password=x": the study is found (it has no trials)
    proc = subprocess.run([sys.executable, "-m", "tuner", "report", "--storage", f"sqlite:///{db}?password=x",
                           "-o", str(tmp_path / "r.html")], capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert proc.returncode == 2 and one_error_line(proc) == "Error: the study 's1' has no trials yet: nothing to report"
    proc = subprocess.run([sys.executable, "-m", "tuner", "report", "--storage", "postgresql+bogusdrv://u@h/db",
                           "-o", str(tmp_path / "r.html")], capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert proc.returncode == 2 and one_error_line(proc) == (
        "Error: postgresql+bogusdrv://u@h/db: unknown driver 'bogusdrv' for postgresql (SQLAlchemy has no "
        "postgresql+bogusdrv dialect); leave the driver out (postgresql://) or name an installed one")


def test_an_export_for_llama_cpp_tools_gives_the_matched_names_not_the_pattern(models, tmp_path):
    """llama-server / llama-cli / llama-bench match -ot with std::regex too: where the model file is
    at hand, an export carries the names RE2 matched, as literals (else the patterns as written)."""
    import shlex

    from tuner.profile.document import Profile
    from tuner.profile.exports import tool_args

    profile = Profile.from_dict(_profile_of(models["q8_0"], tensor_overrides=[*_CATASTROPHIC, r"blk\.0\.ffn_(up|down)"]))
    for tool, sep in (("llama-server", ","), ("llama-bench", ";")):
        args = tool_args(profile, tool, model_path=str(models["q8_0"]))
        value = args[args.index("-ot") + 1]
        assert value == "^(blk[.]0[.]ffn_down[.]weight|blk[.]0[.]ffn_up[.]weight)$=CPU", value  # the file's order
    elsewhere = tool_args(profile, "llama-server", model_path="/not/here.gguf")
    assert elsewhere[elsewhere.index("-ot") + 1].endswith(r"blk\.0\.ffn_(up|down)=CPU")
    assert shlex.split(shlex.join(elsewhere))  # (still one safe argument each)
