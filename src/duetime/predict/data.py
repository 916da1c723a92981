"""Judged data: JSON Lines, one row per (prompt, model) judgement.

    {"prompt": "...", "task": "alpaca", "model": "qwen3-8b", "score": 0.8,
     "output_tokens": 212, "correct": true}

``prompt`` or ``messages`` (the OpenAI chat list; its text contents are joined with newlines)
is required, and so is ``model``; ``task`` and the labels (``score``, ``output_tokens``,
``correct``) are optional, ``null`` meaning absent. Unknown fields are ignored. Any malformed
row stops reading with a :class:`DataError` that names the file, the line and the field,
because a silently skipped row is a silently different model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A malformed data file or row: ``FILE:LINE: FIELD: reason``."""

    def __init__(self, source: str, line: int | None, field: str | None, reason: str) -> None:
        where = source if line is None else f"{source}:{line}"
        super().__init__(f"{where}: {field}: {reason}" if field else f"{where}: {reason}")
        self.source, self.line, self.field, self.reason = source, line, field, reason


@dataclass(slots=True)
class Row:
    """One judged (prompt, model) pair."""

    text: str
    model: str
    task: str | None = None
    score: float | None = None
    output_tokens: int | None = None
    correct: bool | None = None
    line: int = 0
    synthetic: bool = False


def _type_name(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null", int: "a number", float: "a number"}.get(type(v), type(v).__name__)


def message_text(messages: Any, fail: Any) -> str:
    """The joined text contents of an OpenAI chat ``messages`` list; ``fail(field, reason)``
    raises."""
    if not isinstance(messages, list) or not messages:
        fail("messages", f"must be a non-empty list of chat messages, got {_type_name(messages)}")
    parts: list[str] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            fail(f"messages[{i}]", f"must be an object with role and content, got "
                 f"{_type_name(msg)}")
        content = msg.get("content")
        if content is None:
            continue
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if not isinstance(part, dict):
                    fail(where, f"must be a content part object, got {_type_name(part)}")
                if part.get("type", "text") == "text":
                    text = part.get("text")
                    if not isinstance(text, str):
                        fail(f"{where}.text", f"must be a string, got {_type_name(text)}")
                    parts.append(text)
        else:
            fail(f"messages[{i}].content", f"must be a string, a list of parts or null, got "
                 f"{_type_name(content)}")
    return "\n".join(parts)


def parse_row(obj: Any, source: str = "<row>", line: int = 0) -> Row:
    """Validate one decoded JSON row."""

    def fail(field: str | None, reason: str) -> None:
        raise DataError(source, line, field, reason)

    if not isinstance(obj, dict):
        fail(None, f"a row must be a JSON object, got {_type_name(obj)}")
    has_prompt = obj.get("prompt") is not None
    has_messages = obj.get("messages") is not None
    if has_prompt and has_messages:
        fail("prompt", "give either prompt or messages, not both")
    if has_prompt:
        text = obj["prompt"]
        if not isinstance(text, str):
            fail("prompt", f"must be a string, got {_type_name(text)}")
    elif has_messages:
        text = message_text(obj["messages"], fail)
    else:
        fail("prompt", "missing (each row needs prompt or messages)")
    model = obj.get("model")
    if not isinstance(model, str) or not model.strip():
        fail("model", "missing" if model is None else
             f"must be a non-empty string, got {_type_name(model) if model != '' else 'empty'}")
    task = obj.get("task")
    if task is not None and (not isinstance(task, str) or not task.strip()):
        fail("task", f"must be a non-empty string or null, got {_type_name(task)}")
    score = obj.get("score")
    if score is not None:
        if isinstance(score, bool) or not isinstance(score, int | float) \
                or not math.isfinite(score):
            fail("score", f"must be a finite number or null, got {json.dumps(score)}")
        score = float(score)
    out = obj.get("output_tokens")
    if out is not None:
        if isinstance(out, bool) or not isinstance(out, int | float) or not math.isfinite(out) \
                or out != int(out) or out < 0:
            fail("output_tokens", f"must be an integer >= 0 or null, got {json.dumps(out)}")
        out = int(out)
    correct = obj.get("correct")
    if correct is not None and not isinstance(correct, bool):
        if isinstance(correct, int | float) and correct in (0, 1):
            correct = bool(correct)
        else:
            fail("correct", f"must be true, false, 0, 1 or null, got {json.dumps(correct)}")
    return Row(text=text, model=model.strip(), task=task.strip() if task else None,
               score=score, output_tokens=out, correct=correct, line=line,
               synthetic=obj.get("synthetic") is True)


def iter_rows(path: str | Path) -> Iterator[Row]:
    """The rows of a JSONL file, validated; blank lines are skipped."""
    source = str(path)
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; bytes so a bad line is named
    except OSError as e:
        raise DataError(source, None, None, f"cannot read: {e.strerror or e}") from None
    with f:
        for number, raw in enumerate(f, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(source, number, None, "not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(source, number, None,
                                f"not valid JSON ({e.msg} at column {e.colno})") from None
            yield parse_row(obj, source, number)


def read_rows(path: str | Path) -> list[Row]:
    """All rows of a JSONL file; a file with none is an error."""
    rows = list(iter_rows(path))
    if not rows:
        raise DataError(str(path), None, None,
                        "no rows (expected JSON Lines: one object per line)")
    return rows
