"""The trained-predictor directory: LightGBM text models + one JSON file, never pickle.

    DIR/predictor.json     format, format_version, vocabularies, PCA, task classifier,
                           offsets, success regressions, baselines, training summary
    DIR/quality.txt        LightGBM text models (``Booster.save_model``), one per head
    DIR/length_mean.txt
    DIR/length_median.txt
    DIR/length_p90.txt
    DIR/tokenizer.json     only when trained with a tokenizer (a copy, so DIR is whole)

Why not pickle: a model directory is data a user may download or share; loading it must not
run code, and it must still load after a library upgrade. Every loading failure is a
:class:`PredictorFormatError` whose message starts with the file's path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FORMAT = "duetime-predictor"
FORMAT_VERSION = 1
SPEC_FILE = "predictor.json"
HEAD_FILES = {"quality": "quality.txt", "length_mean": "length_mean.txt",
              "length_median": "length_median.txt", "length_p90": "length_p90.txt"}
TOKENIZER_FILE = "tokenizer.json"


class PredictorFormatError(ValueError):
    """A predictor directory that cannot be loaded; the message names the file."""


def read_spec(directory: str | Path) -> dict[str, Any]:
    """``predictor.json``, checked for its format and version."""
    d = Path(directory)
    if not d.is_dir():
        raise PredictorFormatError(f"{d}: not a directory (a trained predictor is a directory "
                                   "made by `duetime predict train`)")
    path = d / SPEC_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PredictorFormatError(f"{path}: missing (not a trained predictor directory?)"
                                   ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise PredictorFormatError(f"{path}: cannot read: {e}") from None
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise PredictorFormatError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, "
                                   f"column {e.colno})") from None
    if not isinstance(spec, dict) or spec.get("format") != FORMAT:
        raise PredictorFormatError(f"{path}: not a duetime predictor (\"format\" is not "
                                   f"{FORMAT!r})")
    version = spec.get("format_version")
    if version != FORMAT_VERSION:
        raise PredictorFormatError(f"{path}: format_version {version!r} is not supported (this "
                                   f"duetime reads {FORMAT_VERSION}); retrain with `duetime "
                                   "predict train`")
    return spec


def get(spec: dict[str, Any], key: str, path: Path, kind: type | tuple[type, ...] = object,
        optional: bool = False) -> Any:
    """``spec[a][b]...`` for ``key = "a.b..."``, or a PredictorFormatError naming it."""
    node: Any = spec
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            if optional:
                return None
            raise PredictorFormatError(f"{path}: {key}: missing")
        node = node[part]
    if node is None and optional:
        return None
    if not isinstance(node, kind):
        raise PredictorFormatError(f"{path}: {key}: has the wrong type ({type(node).__name__})")
    return node


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PredictorFormatError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PredictorFormatError(f"{path}: cannot read: {e}") from None


def write_json(path: Path, data: Any) -> None:
    """Write via a temporary file and rename, so a crash never leaves half a spec."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
