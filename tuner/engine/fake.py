"""A scripted engine for testing the search logic: no llama.cpp, no processes.

It answers ``run(settings, bench)`` like ``TrialRunner`` does, from the memory arithmetic and a
speed formula: a candidate whose estimate exceeds a device's ``capacity`` ends in ``oom`` with
llama.cpp's wording, others get tokens/sec from ``speed(settings)``. It records every launch, so
tests can assert what the tuner did and did not run.

It stands in for the engine only in tests of the layers above it (space, study, profile); the
runner's own tests use the real llama.cpp.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from ..model.estimate import CPU, estimate
from ..model.repack import CpuFeatures
from .logparse import LoadReport
from ..model.inspect import ModelInfo
from .outcome import Outcome
from .base import BenchSpec, Engine, EngineBuild, Stats, TrialResult
from .devices import DeviceInfo, rpc_label
from .dimensions import offloaded_layers
from .settings import Settings


def default_speed(settings: Settings) -> tuple[float, float]:
    """More layers offloaded is faster; q4_0 KV a little slower; more threads faster."""
    ngl = offloaded_layers(settings.n_gpu_layers, 98)  # "every layer" scores as 99 layers
    tg = 10.0 + 5.0 * ngl + (settings.n_threads or 1) - (1.0 if settings.type_k == "q4_0" else 0.0)
    pp = 10 * tg + (settings.n_ubatch / 64)
    return pp, tg


class ScriptedRunner(Engine):
    """The scripted engine (``fake``)."""

    name = "fake"
    loads_candidates_together = False

    def __init__(
        self,
        models: Mapping[str, ModelInfo],
        *,
        devices: tuple[str, ...] = (),
        capacity: Mapping[str, int] | None = None,
        speed: Callable[[Settings], tuple[float, float]] = default_speed,
        fail: Callable[[Settings], Outcome | None] | None = None,
        interrupt_after: int | None = None,
        crash_when: Callable[[Settings], bool] | None = None,
        cpu: "CpuFeatures | None" = None,
    ) -> None:
        self.models = dict(models)
        self.devices_named = tuple(devices)
        self.capacity = dict(capacity or {})
        self.speed = speed
        self.fail = fail
        self.interrupt_after = interrupt_after
        # a candidate it crashes on as llama.cpp does (killed by SIGSEGV after the load; e.g. with
        # repacking on, as on AMX CPUs), and the CPU features its memory arithmetic repacks for
        self.crash_when = crash_when
        self.cpu = cpu
        self.launched: list[Settings] = []

    def close(self) -> None:
        pass

    def __enter__(self) -> "ScriptedRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build(self) -> EngineBuild:
        return EngineBuild(engine=self.name, build_number=0, commit="scripted", backends=("CPU",), detail="no llama.cpp")

    def devices(self, rpc_servers: Sequence[str] = ()) -> list[DeviceInfo]:
        """The CPU, the scripted devices (with their capacity as memory), and an RPC device per server."""
        out = [DeviceInfo("CPU", "scripted CPU", "cpu", 16 << 30, 16 << 30, "CPU")]
        for name in self.devices_named:
            if not name.startswith("RPC"):
                memory = self.capacity.get(name, 8 << 30)
                out.append(DeviceInfo(name, "scripted device", "gpu", memory, memory, "scripted"))
        for endpoint in rpc_servers:
            label = rpc_label(0, endpoint)
            memory = self.capacity.get(label, 8 << 30)
            out.append(DeviceInfo(label, endpoint, "gpu", memory, memory, "RPC", ggml_name="RPC0", rpc_endpoint=endpoint))
        return out

    def run_paired(self, candidates: list[Settings], bench: BenchSpec = BenchSpec(), *, rounds: int = 5) -> list[TrialResult]:
        """Rounds of one run per candidate (in the same order each round), samples merged."""
        merged: list[list[TrialResult]] = [[] for _ in candidates]
        for _ in range(max(1, rounds)):
            for i, s in enumerate(candidates):
                result = self.run(s, bench)
                if not result.ok:
                    return [TrialResult(result.outcome, result.message, c, bench, load=result.load) for c in candidates]
                merged[i].append(result)
        out = []
        for runs, s in zip(merged, candidates):
            pp = [x for r in runs if r.pp for x in r.pp.samples]
            tg = [x for r in runs if r.tg for x in r.tg.samples]
            out.append(TrialResult(Outcome.OK, "ok", s, bench, pp=Stats.of(pp), tg=Stats.of(tg), load=runs[-1].load,
                                   peak_rss=runs[-1].peak_rss))
        return out

    def run(self, settings: Settings, bench: BenchSpec = BenchSpec(), *, trial_id: object = None) -> TrialResult:
        if self.interrupt_after is not None and len(self.launched) >= self.interrupt_after:
            raise KeyboardInterrupt
        from pathlib import Path

        from .outcome import classify

        # the same checks before launch as the real engines
        rejected = None
        if settings.model_path not in self.models and not Path(settings.model_path).is_file():
            rejected = f"model file not found: {settings.model_path}"
        elif settings.n_ctx and bench.depth + max(bench.n_prompt, bench.n_gen) > settings.n_ctx:
            rejected = (f"n_ctx {settings.n_ctx} is smaller than depth {bench.depth} + "
                        f"{max(bench.n_prompt, bench.n_gen)} test tokens")
        if rejected:
            c = classify(rejected=rejected)
            return TrialResult(c.outcome, c.message, settings, bench)
        self.launched.append(settings)
        info = self.models[settings.model_path]
        est = estimate(info, settings, devices=list(self.devices_named), cpu=self.cpu)
        report = dict(layers_offloaded=est.layers_offloaded, layers_total=info.n_layer + 1,
                      model_buffers={b: size for held in est.buffers.values() for b, size in held.items() if size},
                      kv_buffers={d: m.kv for d, m in est.devices.items() if m.kv},
                      compute_buffers={d: m.compute for d, m in est.devices.items() if m.compute},
                      n_ctx=est.n_ctx, type_k=settings.type_k, type_v=settings.type_v)
        forced = self.fail(settings) if self.fail else None
        for device, limit in self.capacity.items():
            need = est.devices.get(device)
            if need is not None and need.total > limit:
                line = f"alloc_tensor_range: failed to allocate {device} buffer of size {need.weights}"
                load = LoadReport(oom=True, errors=(line, "llama_model_load: error loading model: unable to allocate buffer"),
                                  **{k: v for k, v in report.items() if k in ("layers_offloaded", "layers_total")})
                return TrialResult(Outcome.OOM, f"out of memory: {line}", settings, bench, load=load)
        if self.crash_when is not None and self.crash_when(settings):
            import signal

            line = "ggml_compute_forward_mul_mat: scripted fault in a matrix kernel"
            c = classify(returncode=-int(signal.SIGSEGV), error_lines=(line,))
            load = LoadReport(errors=(line,), **{k: v for k, v in report.items() if k in ("layers_offloaded", "layers_total", "model_buffers")})
            return TrialResult(c.outcome, c.message, settings, bench, load=load, signal=c.signal_name, returncode=-int(signal.SIGSEGV))
        if forced is not None and forced is not Outcome.OK:
            return TrialResult(forced, f"scripted {forced.value}", settings, bench, load=LoadReport())
        pp, tg = self.speed(settings)
        reps = bench.repetitions
        return TrialResult(
            Outcome.OK, "ok", settings, bench,
            pp=Stats.of([pp] * reps) if bench.n_prompt else None,
            tg=Stats.of([tg] * reps) if bench.n_gen else None,
            load=LoadReport(**report),
            peak_rss=est.devices[CPU].total,
        )
