"""The LAAR paper's long-context KV-lookup workload and its five-model pool.

A query is ``"JSON data: "`` + a JSON object of random UUID -> UUID pairs sized to a context
length in tokens, then the question for one of its keys, framed in English, Japanese or Chinese
(the paper's SCBench-style KV retrieval). An answer is correct when the key's value appears in
it (exact match). 100 queries per (context length, language), split 50 to fit predictors and
50 to evaluate.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from duetime.engine.spec import InstanceSpec, resolve_spec

FRAMES = {
    "en": ("JSON data: ", "\nKey: {key}. The value associated with the specified key is:"),
    "ja": ("JSONデータ: ", "\nキー: {key}。指定されたキーに対応する値は:"),
    "zh": ("JSON数据: ", "\n键: {key}。与指定键关联的值是:"),
}
# Characters per token of UUID-heavy JSON under common BPE vocabularies (a UUID's 36 characters
# take ~20-24 tokens): the estimate used when no tokenizer is given.
CHARS_PER_TOKEN = 1.7


def estimate_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def tokenizer_counter(path: str | Path) -> Callable[[str], int]:
    """Token counts from a HuggingFace ``tokenizer.json`` (needs the ``tokenizers`` package)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    return lambda text: len(tok.encode(text).ids)


def check_answer(answer: str, value: str) -> bool:
    """Exact match: the key's value appears in the answer."""
    return value in answer


@dataclass(frozen=True, slots=True)
class Query:
    id: str
    language: str
    context_tokens: int      # the target context length (bucket)
    prompt: str
    prompt_tokens: int       # as counted
    key: str
    value: str
    split: str               # "fit" or "eval"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "task": "kv-lookup", "language": self.language,
                "context_tokens": self.context_tokens, "prompt": self.prompt,
                "prompt_tokens": self.prompt_tokens, "key": self.key, "answer": self.value,
                "split": self.split}


def make_query(rng: np.random.Generator, context_tokens: int, language: str, qid: str,
               split: str, count: Callable[[str], int] = estimate_tokens) -> Query:
    """One query whose prompt has about ``context_tokens`` tokens."""
    if language not in FRAMES:
        raise ValueError(f"language: one of {', '.join(FRAMES)}, got {language!r}")

    def new_uuid() -> str:
        return str(uuid.UUID(bytes=rng.bytes(16), version=4))

    head, tail = FRAMES[language]
    pairs: dict[str, str] = {}
    # grow by whole pairs until the prompt reaches the target (one pair ~ 46 tokens)
    per_pair = max(1, count(json.dumps({new_uuid(): new_uuid()})) - 2)
    while True:
        need = context_tokens - count(head + json.dumps(pairs) + tail.format(key=new_uuid()))
        if need <= 0:
            break
        for _ in range(max(1, need // per_pair)):
            pairs[new_uuid()] = new_uuid()
    keys = list(pairs)
    key = keys[int(rng.integers(len(keys)))]
    prompt = head + json.dumps(pairs) + tail.format(key=key)
    return Query(qid, language, context_tokens, prompt, count(prompt), key, pairs[key], split)


def generate(n: int = 100, contexts: tuple[int, ...] = (4096, 8192, 16384, 32768, 65536),
             languages: tuple[str, ...] = ("en", "ja", "zh"), seed: int = 0,
             count: Callable[[str], int] = estimate_tokens) -> list[Query]:
    """``n`` queries per (context, language): the first half ``fit``, the rest ``eval``."""
    rng = np.random.default_rng(seed)
    out = []
    for ctx in contexts:
        for lang in languages:
            for i in range(n):
                out.append(make_query(rng, ctx, lang, f"{lang}-{ctx}-{i}",
                                      "fit" if i < n // 2 else "eval", count))
    return out


# -- the five-model pool ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PoolModel:
    """A model of the pool: its instance spec and its success rate per language and context."""

    spec: InstanceSpec
    success: dict[str, tuple[float, ...]]   # language -> per context length

    @property
    def name(self) -> str:
        return self.spec.name

    def p_success(self, language: str, context_index: int) -> float:
        return self.success[language][context_index]


@dataclass(frozen=True, slots=True)
class Pool:
    models: dict[str, PoolModel]
    contexts: tuple[int, ...]
    languages: tuple[str, ...]
    alpha: float
    retry_cap: int
    concurrency: int
    output_tokens: int


def load_pool(path: str | Path | None = None) -> Pool:
    """The five-model pool (``pool.yaml`` beside this module, or a file of that form)."""
    source = str(path) if path else "kvlookup/pool.yaml"
    text = Path(path).read_text() if path else files(__package__).joinpath(
        "pool.yaml").read_text()
    d = yaml.safe_load(text)
    contexts = tuple(int(c) for c in d["context_lengths"])
    languages = tuple(d["languages"])
    models = {}
    for name, m in d["models"].items():
        base = [float(x) for x in m["success"]["en"]]
        if len(base) != len(contexts):
            raise ValueError(f"{source}: models.{name}.success.en: one value per context length")
        scale = {"en": 1.0, **{k: float(v) for k, v in (m.get("language_scale") or {}).items()}}
        success = {lang: tuple(min(1.0, max(0.0, p * scale.get(lang, 1.0))) for p in base)
                   for lang in languages}
        spec = resolve_spec(name, batch_time=m["batch_time"], config=m["config"],
                            where=f"{source}: models.{name}")
        models[name] = PoolModel(spec, success)
    return Pool(models, contexts, languages, float(d["alpha"]), int(d["retry_cap"]),
                int(d["concurrency"]), int(d["output_tokens"]))
