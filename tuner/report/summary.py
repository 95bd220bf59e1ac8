"""The one line that says how a load went, in the same words everywhere.

``diagnose`` prints it for a log, ``tune`` for its winner and ``profile show`` for a profile:

    full offload, 33/33 layers; 1.2 GiB free on CUDA0
    partial offload, 10/33 layers; 0.3 GiB free on CUDA0
    out of memory on CUDA0 (the weights)
    CPU fallback: 33/33 layers reported offloaded, but every buffer is on the CPU
    no offload, 0/33 layers (CPU only)
"""

from __future__ import annotations

from typing import Any, Mapping

GiB = 1 << 30


def gib(n_bytes: float) -> str:
    """``'1.2 GiB'``, or ``'300 MiB'`` below a GiB."""
    return f"{n_bytes / GiB:.1f} GiB" if abs(n_bytes) >= GiB else f"{n_bytes / (1 << 20):.0f} MiB"


def offload_summary(
    layers_offloaded: int | None,
    layers_total: int | None,
    free: Mapping[str, int | None] | None = None,
    *,
    oom: bool = False,
    oom_device: str | None = None,
    oom_what: str | None = None,
    cpu_fallback: bool = False,
    cpu_only: bool | None = None,
) -> str:
    """One line. ``free`` maps accelerators to the bytes left free after the load (None: unknown);
    ``cpu_only`` is ``LoadReport.cpu_only`` where a log says it (False: no layer offloaded, yet an
    accelerator held something, such as compute buffers)."""
    if cpu_fallback:
        head = (f"CPU fallback: {layers_offloaded}/{layers_total} layers reported offloaded, "
                "but every buffer is on the CPU")
    elif oom:
        where = f" on {oom_device}" if oom_device else ""
        what = {"weights": " (the weights)", "kv": " (the KV cache)", "compute": " (the compute buffers)"}.get(oom_what or "", "")
        head = f"out of memory{where}{what}"
        if layers_offloaded is not None and layers_total:
            head += f", {layers_offloaded}/{layers_total} layers planned on the GPU"
    elif layers_offloaded is None or not layers_total:
        head = "layers offloaded: not in the log"
    elif layers_offloaded >= layers_total:
        head = f"full offload, {layers_offloaded}/{layers_total} layers"
    elif layers_offloaded == 0:
        head = f"no offload, 0/{layers_total} layers" + (
            " (weights on the CPU; an accelerator holds compute or KV buffers)" if cpu_only is False else " (CPU only)")
    else:
        head = f"partial offload, {layers_offloaded}/{layers_total} layers"
    known = {name: value for name, value in (free or {}).items() if value is not None}
    if known and not oom and not cpu_fallback:
        head += "; " + ", ".join(f"{gib(max(0, value))} free on {name}" for name, value in known.items())
    return head


def profile_summary(profile: Any) -> str:
    """The line for a profile (``tune``'s result, ``profile show``): what the profile leaves free of
    each GPU's memory (its total less what the profile needs there; devices without a recorded
    total, such as RPC servers, are left out)."""
    # llama.cpp's own totals by device name (1.3+); NVML's for older profiles. A device that shares the
    # RAM has no memory of its own to leave free.
    totals = {d.name: d.memory_total for d in profile.machine.devices if d.memory_total and not d.unified_memory}
    if not profile.machine.devices:
        totals = {f"CUDA{g.index}": g.memory_total for g in profile.machine.gpus}
    free: dict[str, int | None] = {}
    for device, predicted in profile.memory.predicted.items():
        if device in totals:
            actual = profile.memory.actual.get(device)
            need = actual.need if actual is not None else predicted.need
            free[device] = totals[device] - need
    return offload_summary(profile.layers_offloaded, profile.layers_total, free)


def workload_in_words(workload: Any) -> list[str]:
    """A profile's figures at its workload, in words: aggregate and per-user generation speed, the time
    to the first token (the tune's closing line and ``profile show`` say them alike)."""
    figures = []
    if workload.aggregate_tg:
        a = workload.aggregate_tg
        figures.append(f"aggregate tg {a.median:.1f} t/s (95% CI {a.ci_low:.1f}-{a.ci_high:.1f})")
    if workload.per_user_tg:
        figures.append(f"per user {workload.per_user_tg.median:.1f} t/s")
    if workload.ttft_s:
        figures.append(f"time to first token p50 {workload.ttft_s.p50:.3f} s, p95 {workload.ttft_s.p95:.3f} s")
    return figures
