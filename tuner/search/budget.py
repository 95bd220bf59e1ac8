"""Speed within a quality budget, or the best quality at a target speed.

- **A budget** (``max_kl``: the mean KL divergence per token; ``max_ppl_increase``: perplexity's rise
  over the reference, in percent): a variant over it is not launched for speed, and the tune says
  which and why (``QualityBudget.over``).
- **A target** (``min_tg`` / ``min_pp``, tokens per second): among the configurations that reach it,
  the highest-quality variant wins (lowest mean KL), then the one needing the least accelerator
  memory, then the fastest (``rank_for_target``). When none reaches it, the tune says so with the
  best speed it found.
- **The trade** (``trade``): for each variant, the best speed found and its quality: what a tune
  with no budget prints at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import SettingsError
from .quality import QualityReport, VariantQuality


@dataclass(frozen=True)
class QualityBudget:
    max_kl: float | None = None
    max_ppl_increase: float | None = None  # percent
    min_tg: float | None = None
    min_pp: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_kl", "max_ppl_increase", "min_tg", "min_pp"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not math.isfinite(value) or value < 0):
                raise SettingsError(name, f"expected a number >= 0, got {value!r}")

    @property
    def has_limit(self) -> bool:
        return self.max_kl is not None or self.max_ppl_increase is not None

    @property
    def has_target(self) -> bool:
        return self.min_tg is not None or self.min_pp is not None

    def over(self, quality: VariantQuality) -> str | None:
        """Why this variant is over the budget, or None."""
        reasons = []
        if self.max_kl is not None and quality.kl_mean > self.max_kl:
            reasons.append(f"mean KL {quality.kl_mean:.6f} > --max-kl {self.max_kl:g}")
        if self.max_ppl_increase is not None and quality.ppl_increase > self.max_ppl_increase:
            reasons.append(f"perplexity +{quality.ppl_increase:.2f}% > --max-ppl-increase {self.max_ppl_increase:g}%")
        return "over the quality budget: " + "; ".join(reasons) if reasons else None

    def reaches(self, pp: float | None, tg: float | None) -> bool:
        """Whether these speeds (medians, tokens/sec) reach the target."""
        if self.min_tg is not None and (tg is None or tg < self.min_tg):
            return False
        if self.min_pp is not None and (pp is None or pp < self.min_pp):
            return False
        return True

    def describe_target(self) -> str:
        parts = []
        if self.min_tg is not None:
            parts.append(f"--min-tg {self.min_tg:g} t/s")
        if self.min_pp is not None:
            parts.append(f"--min-pp {self.min_pp:g} t/s")
        return " and ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"max_kl": self.max_kl, "max_ppl_increase": self.max_ppl_increase, "min_tg": self.min_tg, "min_pp": self.min_pp}


def median(stats: Mapping[str, Any] | None) -> float | None:
    return stats.get("median") if stats else None


def accelerator_memory(predicted: Mapping[str, Any]) -> int:
    """Bytes a candidate needs on the accelerators (every device but the host), as predicted."""
    return sum(int(m.get("total") or 0) for device, m in predicted.items() if device != "CPU")


def quality_rank(report: QualityReport | None, model_path: str) -> tuple[float, float]:
    """Sort key of a variant's quality: lower is better (mean KL, then perplexity ratio)."""
    v = report.by_path(model_path) if report is not None else None
    return (v.kl_mean, v.ppl_ratio) if v is not None else (0.0, 1.0)


def rank_for_target(candidates: Sequence[Any], report: QualityReport | None, objective_value: str = "value") -> list[Any]:
    """Candidates (with ``settings``, ``predicted`` and a speed in ``objective_value``) that reach
    the target, best first: highest quality, then least accelerator memory, then fastest."""
    return sorted(candidates, key=lambda c: (quality_rank(report, c.settings.model_path), accelerator_memory(c.predicted),
                                             -getattr(c, objective_value)))


def trade(report: QualityReport | None, best_by_variant: Mapping[str, Mapping[str, Any]],
          excluded: Mapping[str, str], variants: Sequence[str]) -> list[dict[str, Any]]:
    """Per variant: its best speed found (``{"value", "pp", "tg", "number"}`` or None) and its
    quality; excluded variants carry why they were not launched. Best quality first."""
    rows = []
    for path in list(variants) + [p for p in excluded if p not in variants]:
        v = report.by_path(path) if report is not None else None
        best = best_by_variant.get(path)
        rows.append({
            "variant": Path(path).name,
            "path": path,
            "quantization": v.quantization if v else None,
            "bits_per_weight": v.bits_per_weight if v else None,
            "best": dict(best) if best else None,
            "quality": v.summary() if v else None,
            "excluded": excluded.get(path),
        })
    rows.sort(key=lambda r: (r["quality"]["kl_mean"] if r["quality"] else math.inf, r["variant"]))
    return rows


__all__ = ["QualityBudget", "accelerator_memory", "quality_rank", "rank_for_target", "trade"]
