"""A scripted engine for testing the search logic: no llama.cpp, no processes.

It answers ``run(settings, bench)`` like ``TrialRunner`` does, from the memory arithmetic and a
speed formula: a candidate whose estimate exceeds a device's ``capacity`` ends in ``oom`` with
llama.cpp's wording, others get tokens/sec from ``speed(settings)``. It records every launch, so
tests can assert what the tuner did and did not run.

It stands in for the engine only in tests of the layers above it (space, study, profile); the
runner's own tests use the real llama.cpp.
"""

from __future__ import annotations

from typing import Callable, Mapping

from ..model.estimate import CPU, estimate
from .logparse import LoadReport
from ..model.inspect import ModelInfo
from .outcome import Outcome
from .base import BenchSpec, Stats, TrialResult
from .dimensions import offloaded_layers
from .settings import Settings


def default_speed(settings: Settings) -> tuple[float, float]:
    """More layers offloaded is faster; q4_0 KV a little slower; more threads faster."""
    ngl = offloaded_layers(settings.n_gpu_layers, 98)  # "every layer" scores as 99 layers
    tg = 10.0 + 5.0 * ngl + (settings.n_threads or 1) - (1.0 if settings.type_k == "q4_0" else 0.0)
    pp = 10 * tg + (settings.n_ubatch / 64)
    return pp, tg


class ScriptedRunner:
    def __init__(
        self,
        models: Mapping[str, ModelInfo],
        *,
        devices: tuple[str, ...] = (),
        capacity: Mapping[str, int] | None = None,
        speed: Callable[[Settings], tuple[float, float]] = default_speed,
        fail: Callable[[Settings], Outcome | None] | None = None,
        interrupt_after: int | None = None,
    ) -> None:
        self.models = dict(models)
        self.devices = devices
        self.capacity = dict(capacity or {})
        self.speed = speed
        self.fail = fail
        self.interrupt_after = interrupt_after
        self.launched: list[Settings] = []

    def close(self) -> None:
        pass

    def __enter__(self) -> "ScriptedRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, settings: Settings, bench: BenchSpec = BenchSpec(), *, trial_id: object = None) -> TrialResult:
        if self.interrupt_after is not None and len(self.launched) >= self.interrupt_after:
            raise KeyboardInterrupt
        self.launched.append(settings)
        info = self.models[settings.model_path]
        est = estimate(info, settings, devices=list(self.devices))
        report = dict(layers_offloaded=est.layers_offloaded, layers_total=info.n_layer + 1,
                      model_buffers={d: m.weights for d, m in est.devices.items() if m.weights},
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
