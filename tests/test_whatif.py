"""What-if machines for ``estimate``: ``--device NAME=SIZE``, ``--ram``, ``--machine FILE``, ``--table``,
and the older ``--devices``/``--free`` folded into the same answer."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tuner.cli.main import cli
from tuner.engine.base import BenchSpec
from tuner.engine.python import run_trial
from tuner.engine.settings import Settings
from tuner.errors import MachineSpecError
from tuner.machine import whatif
from tuner.model.inspect import inspect
from tuner.model.quant import quantized_size
from tuner.testing import ModelShape, make_model, quantize

from .test_profile import make_machine

MiB = 1 << 20
GiB = 1 << 30
QUICK = BenchSpec(n_prompt=16, n_gen=2, repetitions=1, warmup=False)


def run(args, **kwargs):
    return CliRunner().invoke(cli, args, **kwargs)


def test_sizes_and_devices_parse_as_people_write_them():
    assert whatif.parse_size("24GiB") == 24 * GiB
    assert whatif.parse_size("12000MiB") == 12000 * MiB
    assert whatif.parse_size("24GB") == 24 * 10**9
    assert whatif.parse_size("1.5T") == int(1.5 * (1 << 40))
    assert whatif.parse_size("8000", default_unit="MiB") == 8000 * MiB
    assert whatif.parse_device("CUDA1=12GiB") == ("CUDA1", 12 * GiB)
    assert whatif.parse_device("RPC0[127.0.0.1:50052]=200MiB") == ("RPC0[127.0.0.1:50052]", 200 * MiB)
    for bad, message in (("CUDA0", "expected NAME=SIZE"), ("CUDA0=lots", "expected a size"), ("CUDA0=0GiB", "not a size"),
                         ("CUDA0=24QB", "unknown unit"), ("CPU=8GiB", "--ram"), ("$(rm -rf)=1GiB", "not an accelerator name"),
                         ("CUDA0=1e400GiB", "expected a size")):
        with pytest.raises(MachineSpecError, match=message):
            whatif.parse_device(bad)


def test_device_and_the_older_free_flags_give_the_same_answer(models):
    new = json.loads(run(["estimate", str(models["q8_0"]), "--device", "GPU0=20MiB", "--margin", "1", "--ctx", "1024", "--json"]).output)
    old = json.loads(run(["estimate", str(models["q8_0"]), "--free", "20", "--margin", "1", "--ctx", "1024", "--json"]).output)
    named = json.loads(run(["estimate", str(models["q8_0"]), "--devices", "GPU0", "--free", "20", "--margin", "1", "--ctx", "1024",
                            "--json"]).output)
    assert new["max_gpu_layers"] == old["max_gpu_layers"] == named["max_gpu_layers"]
    assert new["devices"] == old["devices"] == named["devices"]
    assert {"fit", "full_offload", "largest_quantization", "machine"} <= set(new)


def test_the_answer_is_per_context_and_kv_type_with_full_offload_and_quantization(models):
    info = inspect(models["f16"])
    out = run(["estimate", str(models["f16"]), "--device", "CUDA0=14MiB", "--margin", "0", "--ctx", "2048", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    cells = {(f["n_ctx"], f["type_k"]): f for f in data["fit"]}
    assert set(cells) == {(c, k) for c in (2048, 4096) for k in ("f16", "q8_0", "q4_0")}
    for (ctx, kv), cell in cells.items():
        from tuner.engine.settings import Settings
        from tuner.machine.whatif import MachineSpec
        from tuner.report.fit import estimate_on, over

        spec = MachineSpec({"CUDA0": 14 * MiB})
        layout = Settings(model_path=info.path, n_ctx=ctx, type_k=kv, type_v=kv)
        # the most that fit, fits; one more does not
        assert not over(estimate_on(info, spec, cell["layers"], layout), spec, 0)
        if cell["layers"] < info.n_layer + 1:
            assert over(estimate_on(info, spec, cell["layers"] + 1, layout), spec, 0)
    # smaller KV, more layers
    assert cells[(4096, "q4_0")]["layers"] >= cells[(4096, "f16")]["layers"]
    text = run(["estimate", str(models["f16"]), "--device", "CUDA0=14MiB", "--margin", "0", "--ctx", "2048"]).output
    assert "most layers that fit (of 5; 'full' = every layer), by context and KV cache type:" in text
    assert "largest standard quantization fully offloaded at n_ctx 2048" in text or "no standard quantization" in text


def test_device_size_predicts_the_real_boundary_on_a_capped_rpc_device(tmp_path, rpc_servers):
    """The most layers ``--device RPC0=SIZE`` predicts is within one layer of where llama.cpp itself
    runs out of memory on an RPC device capped at SIZE."""
    model = make_model(tmp_path / "m.gguf", ModelShape(n_layer=6, n_embd=512, n_head=8, n_head_kv=8, n_ff=2048, n_vocab=4096,
                                                       n_ctx_train=8192))
    for cap, ctx in ((60 * MiB, 1024), (90 * MiB, 4096)):
        (server,) = rpc_servers(1, memory_limits=[cap])
        out = run(["estimate", str(model), "--device", f"RPC0={cap // MiB}MiB", "--margin", "0", "--ctx", str(ctx), "--json"])
        assert out.exit_code == 0, out.output
        predicted = json.loads(out.output)["max_gpu_layers"]

        def loads(ngl: int) -> bool:
            s = Settings(model_path=str(model), n_gpu_layers=ngl, n_ctx=ctx, n_threads=2, flash_attn="on",
                         rpc_servers=(server.endpoint,))
            return run_trial(s, QUICK).ok

        # the real boundary is at least predicted - 1 and at most predicted + 1
        assert predicted - 1 <= 0 or loads(predicted - 1), (cap, ctx, predicted)
        assert predicted + 2 > 7 or not loads(predicted + 2), (cap, ctx, predicted)
        server.stop()


def _probe_file(tmp_path, machine) -> str:
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(machine.to_dict()))
    return str(path)


def test_machine_file_is_another_machines_probe(models, tmp_path):
    # a colleague's machine, written by `offload-tuner probe --json` (Machine.to_dict is what it prints)
    colleague = make_machine(gpus=(("NVIDIA GeForce RTX 3060", 12 * GiB), ("NVIDIA GeForce RTX 3060", 12 * GiB)),
                             free=(30 * MiB, 10 * MiB))
    path = _probe_file(tmp_path, colleague)
    by_file = json.loads(run(["estimate", str(models["q8_0"]), "--machine", path, "--margin", "0", "--json"]).output)
    by_flags = json.loads(run(["estimate", str(models["q8_0"]), "--device", "CUDA0=30MiB", "--device", "CUDA1=10MiB",
                               "--ram", "64GiB", "--margin", "0", "--json"]).output)
    assert by_file["fit"] == by_flags["fit"] and by_file["max_gpu_layers"] == by_flags["max_gpu_layers"]
    assert set(by_file["devices"]) == {"CPU", "CUDA0", "CUDA1"}
    assert by_file["machine"]["ram"] == colleague.ram_total
    # layers spread in proportion to each GPU's memory (llama.cpp's default split)
    layers = by_file["layers"]
    assert layers["CUDA0"] >= layers["CUDA1"]


def test_machine_file_from_this_machines_real_probe(models, tmp_path, rpc_servers):
    (server,) = rpc_servers(1)
    probed = run(["probe", "--json", "--rpc", server.endpoint])
    assert probed.exit_code == 0, probed.output
    path = tmp_path / "here.json"
    path.write_text(probed.output)
    out = run(["estimate", str(models["q8_0"]), "--machine", str(path), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert f"RPC0[{server.endpoint}]" in data["devices"] and data["full_offload"] is True


@pytest.mark.parametrize("content, message", [
    ("not json", "not JSON"),
    ("[1, 2]", "expected the JSON object"),
    ('{"gpus": [{"index": 0, "memory_total": "lots"}]}', "gpus[0].memory_total: expected a byte count"),
    ('{"gpus": [{"index": -3, "memory_total": 100}]}', "gpus[0].index"),
    ('{"gpus": "many"}', "gpus: expected a list"),
    ('{"gpus": [], "ram_total": -1}', "ram_total"),
    ("[" * 100000 + "]" * 100000, "not JSON"),
])
def test_a_bad_machine_file_is_one_line(models, tmp_path, content, message):
    path = tmp_path / "m.json"
    path.write_text(content)
    out = run(["estimate", str(models["q8_0"]), "--machine", str(path)])
    assert out.exit_code == 2 and out.output.count("\n") == 1 and message in out.output, out.output


def test_one_machine_at_a_time(models):
    out = run(["estimate", str(models["q8_0"]), "--device", "CUDA0=8GiB", "--free", "8000"])
    assert out.exit_code == 2 and "give the machine one way" in out.output


def test_ram_is_checked_for_the_host_part(models):
    data = json.loads(run(["estimate", str(models["q8_0"]), "--device", "CUDA0=1MiB", "--ram", "1MiB", "--margin", "0",
                           "--json"]).output)
    assert data["machine"]["ram"] == MiB and all(f["ram_ok"] is False for f in data["fit"])


def test_table_rows_match_real_quantized_files(models, tmp_path):
    f16 = models["f16"]
    real = {"Q8_0": models["q8_0"], "Q4_K_M": models["q4_k_m"], "Q2_K": quantize(f16, tmp_path / "q2k.gguf", "Q2_K")}
    out = run(["estimate", str(f16), "--device", "CUDA0=12MiB", "--margin", "0", "--table", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    rows = {r["quantization"]: r for r in data["rows"]}
    assert data["contexts"] == [4096]  # the model's training context is 4096: 4k, and nothing larger
    assert [r["size"] for r in data["rows"]] == sorted((r["size"] for r in data["rows"]), reverse=True)
    for quant, path in real.items():
        info = inspect(path)
        assert rows[quant]["size"] == sum(t.n_bytes for t in info.tensors), quant
        # the row's answer is the answer for the real file
        same = json.loads(run(["estimate", str(path), "--device", "CUDA0=12MiB", "--margin", "0", "--ctx", "4096",
                               "--json"]).output)
        cell = rows[quant]["contexts"]["4096"]
        assert cell == ("yes" if same["max_gpu_layers"] == info.n_layer + 1 else same["max_gpu_layers"]), quant
    assert rows["F16"]["size"] == quantized_size(inspect(f16), "F16").n_bytes
    text = run(["estimate", str(f16), "--device", "CUDA0=12MiB", "--margin", "0", "--table"]).output
    assert "Q4_K_M" in text and "train 4k" in text


def test_table_without_a_machine_uses_this_one(models):
    out = run(["estimate", str(models["q8_0"]), "--table", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["machine"]["source"] == "this machine"
