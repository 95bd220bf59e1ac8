"""One machine, two tuners: they never measure at the same time. The second waits with a message,
or with --no-wait stops with one line and exit code 2. Two tunes of the same model in the same
data folder at once: the second waits, then resumes the first one's study."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tuner.engine.fake import ScriptedRunner, default_speed
from tuner.errors import MachineBusyError
from tuner.machine.lock import MachineLock
from tuner.machine.probe import LlamaBuild, Machine
from tuner.model.inspect import inspect
from tuner.search.study import Tuner

REPO = Path(__file__).resolve().parent.parent


def machine(name: str = "Test CPU") -> Machine:
    return Machine(cpu_model=name, physical_cores=4, logical_cores=4, ram_total=16 << 30, ram_available=12 << 30,
                   gpu_status="no GPU", llama=LlamaBuild(llama_cpp_python="0.3.36", backends=("cpu",)))


class _Timed(ScriptedRunner):
    """The scripted engine, taking a moment per trial and noting when each measurement ran."""

    def __init__(self, *args, spans: list, who: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.spans, self.who = spans, who

    def run(self, settings, bench, *, trial_id=None):
        start = time.monotonic()
        time.sleep(0.03)
        result = super().run(settings, bench, trial_id=trial_id)
        self.spans.append((start, time.monotonic(), self.who))
        return result


def _tune_in_thread(path: str, m: Machine, spans: list, who: str, events: list, errors: list) -> threading.Thread:
    def work() -> None:
        try:
            engine = _Timed({path: inspect(path)}, spans=spans, who=who)
            Tuner(path, trials=5, machine=m, engine=engine, on_event=events.append, min_ctx=512, n_prompt=64, n_gen=16,
                  repetitions=2, final_repetitions=2, final_rounds=1, vram_margin=0).run()
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    return thread


def test_two_tuners_on_one_machine_take_turns(models):
    path = str(models["q8_0"])
    spans: list = []
    first_events: list = []
    second_events: list = []
    errors: list = []
    first = _tune_in_thread(path, machine(), spans, "first", first_events, errors)
    while not any(e["kind"] == "start" for e in first_events) and first.is_alive():
        time.sleep(0.01)
    second = _tune_in_thread(path, machine(), spans, "second", second_events, errors)
    first.join(120)
    second.join(120)
    assert not errors, errors
    waiting = [e for e in second_events if e["kind"] == "waiting"]
    assert len(waiting) == 1 and "another tuner is measuring on this machine" in waiting[0]["message"]
    assert f"pid {os.getpid()}" in waiting[0]["message"] and "tune tiny-Q8_0.gguf" in waiting[0]["message"]
    # every measurement of the first ended before the second's first began
    first_spans = [s for s in spans if s[2] == "first"]
    second_spans = [s for s in spans if s[2] == "second"]
    assert first_spans and second_spans
    assert max(end for _, end, _ in first_spans) <= min(start for start, _, _ in second_spans)


def test_tuners_of_different_machines_do_not_wait(models):
    path = str(models["q8_0"])
    held = MachineLock.for_machine(machine("Machine A"))
    held.acquire(wait=False)
    try:
        events: list = []
        engine = ScriptedRunner({path: inspect(path)})
        Tuner(path, trials=2, machine=machine("Machine B"), engine=engine, on_event=events.append, min_ctx=512, n_prompt=64,
              n_gen=16, repetitions=2, final_repetitions=2, final_rounds=1, vram_margin=0).run()
        assert not [e for e in events if e["kind"] == "waiting"]
        with pytest.raises(MachineBusyError, match=r"another tuner is measuring on this machine \(pid \d+.*not waiting \(--no-wait\)"):
            Tuner(path, trials=2, machine=machine("Machine A"), engine=engine, wait=False, min_ctx=512, n_prompt=64, n_gen=16)
    finally:
        held.release()


def test_a_lock_dies_with_its_holder(tmp_path):
    # a holder killed with SIGKILL releases the lock: the kernel drops it with the process
    code = ("import time; from tuner.machine.lock import MachineLock; l = MachineLock('k', folder='%s'); "
            "l.acquire(wait=False); print('held', flush=True); time.sleep(600)") % tmp_path
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    lock = MachineLock("k", folder=tmp_path)
    with pytest.raises(MachineBusyError):
        lock.acquire(wait=False)
    proc.kill()
    proc.wait()
    lock.acquire(wait=False)
    lock.release()


def _tune_cmd(model: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tuner", "tune", str(model), "--trials", "2", "--min-ctx", "512", "--n-prompt", "64",
            "--n-gen", "32", "-r", "3", *extra]


@pytest.mark.slow
def test_two_tunes_of_one_model_in_one_data_folder_at_once(models, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(_tune_cmd(models["q8_0"], "--out", str(tmp_path / "first.json")), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = first.stderr.readline()  # "study ... in ...": it holds the machine and measures
        assert line.startswith("study "), line + first.stderr.read()
        refused = subprocess.run(_tune_cmd(models["q8_0"], "--no-wait"), capture_output=True, text=True, env=env, timeout=120)
        assert refused.returncode == 2
        (message,) = refused.stderr.strip().splitlines()
        assert message.startswith(f"Error: another tuner is measuring on this machine (pid {first.pid}")
        assert "tune tiny-Q8_0.gguf" in message and "not waiting (--no-wait)" in message
        second = subprocess.Popen(_tune_cmd(models["q8_0"], "--out", str(tmp_path / "second.json"), "--json"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        out1, err1 = first.communicate(timeout=600)
        out2, err2 = second.communicate(timeout=600)
    finally:
        first.kill()
    assert first.returncode == 0, err1
    assert second.returncode == 0, err2
    # the second said it waits, and after the first finished resumed its study: nothing measured twice
    assert err2.startswith("another tuner is measuring on this machine") and "waiting for it to finish" in err2
    result = json.loads(out2)
    assert result["trials"]["run"] == 2
    assert json.loads((tmp_path / "first.json").read_text())["study"]["name"] == result["study"]["name"]


def test_the_lock_file_is_0644_and_its_record_is_printed_escaped(tmp_path):
    """Another local user could write terminal escapes and fake lines into a 0666 record, and tune
    printed them raw. The file is 0644 (only its creator writes it), the user named is the file's
    owner as the OS says, and every field is escaped."""
    import pwd
    import stat

    lock = MachineLock("k", folder=tmp_path)
    lock.acquire(wait=False)
    try:
        assert stat.S_IMODE(os.stat(lock.path).st_mode) == 0o644
    finally:
        lock.release()
    # an old 0666 file, and a record someone wrote into it
    os.chmod(lock.path, 0o666)
    lock.path.write_text(json.dumps({"pid": "1\n2", "user": "root", "what": "tune \x1b[2J\x1b[31mFAKE\nError: x",
                                     "since": "\x07now"}))
    message = MachineLock("k", folder=tmp_path).describe_holder()
    me = pwd.getpwuid(os.getuid()).pw_name
    assert message == (f"another tuner is measuring on this machine (pid ?, user {me}, tune \\x1b[2J\\x1b[31mFAKE\\nError: x, "
                       "since \\x07now)")
    assert "\x1b" not in message and "\n" not in message
    again = MachineLock("k", folder=tmp_path)
    again.acquire(wait=False)  # taking it makes the old file 0644 again
    again.release()
    assert stat.S_IMODE(os.stat(lock.path).st_mode) == 0o644
