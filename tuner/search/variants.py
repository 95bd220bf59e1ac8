"""Which files are the same model: the model given plus its variants (other quantizations).

"Same model" is decided from the GGUF metadata (architecture and shapes, ``ModelInfo.same_model_as``);
a file that differs, or that cannot be read, is rejected with the reason, never silently dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from ..errors import ModelError
from ..model.inspect import ModelInfo, inspect

# the second and later parts of a split model are not models of their own
_LATER_SPLIT_PART = re.compile(r"-0000[2-9]-of-|-000[1-9]\d-of-")


def expand_variants(paths: Sequence[str | Path]) -> list[Path]:
    """Files as given; folders become the GGUF files inside them (sorted)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(x for x in p.glob("*.gguf") if not _LATER_SPLIT_PART.search(x.name)))
        else:
            out.append(p)
    return out


@dataclass(frozen=True)
class Variants:
    """The model and the variants accepted (by path, the model first), and the rejected ones with why."""

    main: ModelInfo
    models: dict[str, ModelInfo]
    rejected: dict[str, str] = field(default_factory=dict)


def vet_variants(model: str | Path, variants: Sequence[str | Path] = (),
                 known: Mapping[str, ModelInfo] | None = None) -> Variants:
    """Inspect ``model`` (its errors are the caller's: a bad model is a bad command) and each variant
    (a bad or different variant is rejected with the reason).

    ``known`` maps paths to models already described (a simulation's models have no file): those
    are taken as they are, the rest inspected."""
    known = known or {}

    def read(path: str | Path) -> ModelInfo:
        return known[str(path)] if str(path) in known else inspect(path)

    main = read(model)
    models: dict[str, ModelInfo] = {main.path: main}
    rejected: dict[str, str] = {}
    for path in expand_variants(variants):
        if str(path) == main.path or path.resolve() == Path(main.path).resolve():
            continue
        try:
            info = read(path)
        except ModelError as exc:
            rejected[str(path)] = exc.problem
            continue
        why = main.same_model_as(info)
        if why:
            rejected[str(path)] = f"not the same model: {why}"
        else:
            models[info.path] = info
    return Variants(main, models, rejected)
