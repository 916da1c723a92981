"""Structured logs: JSON lines on stderr for duetime's servers."""

from __future__ import annotations

import json
import logging
from typing import Any


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg`` and the record's
    ``fields`` (pass ``extra={"fields": {...}}``)."""

    def format(self, record: logging.LogRecord) -> str:
        d: dict[str, Any] = {"ts": round(record.created, 6), "level": record.levelname.lower(),
                             "logger": record.name, "msg": record.getMessage()}
        fields = getattr(record, "fields", None)
        if fields:
            d.update(fields)
        if record.exc_info and record.exc_info[1] is not None:
            d["error"] = f"{type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        return json.dumps(d, default=str)


def setup_logging(level: str = "info") -> None:
    """JSON-lines logs on stderr for duetime's and uvicorn's loggers."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    numeric = logging.getLevelNamesMapping()[level.upper()]
    for name in ("duetime", "uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler] if name != "uvicorn.error" else []
        # uvicorn's info lines (per server: started, startup complete...) are noise here
        lg.setLevel(numeric if name == "duetime" else max(numeric, logging.WARNING))
        lg.propagate = name == "uvicorn.error"
