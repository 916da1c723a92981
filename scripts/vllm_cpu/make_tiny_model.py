"""Build a tiny random-weight Qwen3 model that a real vLLM (CPU build) can serve offline.

    <vllm-venv>/bin/python scripts/vllm_cpu/make_tiny_model.py OUT_DIR --size small|large [--seed N]

No weights are downloaded: the model is a seeded random ``Qwen3ForCausalLM`` and its tokenizer
a byte-level BPE trained here on generated text, saved as a ``PreTrainedTokenizerFast`` with a
ChatML chat template (so ``/v1/chat/completions`` works). The two sizes differ in compute per
token, so their prefill and decode times differ measurably on a CPU.

Idempotent: when OUT_DIR already holds a model built by this script with the same size, seed and
recipe version, nothing is rebuilt. Runs under the vLLM venv's python (needs torch, transformers,
tokenizers); the project's own venv has none of them.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

RECIPE_VERSION = 1
STAMP = "duetime_tiny_model.json"

# head_dim 64 everywhere: a head size every vLLM CPU attention backend accepts.
SIZES: dict[str, dict[str, int]] = {
    "small": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 64,
    },
    "large": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
    },
}
VOCAB_SIZE = 2048
MAX_POSITIONS = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SYLLABLES = [
    "ka", "lo", "mi", "ne", "ru", "ta", "po", "si", "de", "fa", "gu", "ho", "ji", "ve", "zo",
    "an", "er", "in", "on", "us", "th", "st", "qu", "ch", "sh", "ar", "el", "or", "ix", "um",
]  # fmt: skip
_COMMON = [
    "the", "a", "an", "of", "to", "and", "in", "is", "it", "that", "for", "on", "with", "as",
    "was", "be", "by", "this", "are", "or", "from", "at", "which", "what", "who", "how", "why",
    "when", "where", "please", "answer", "question", "tell", "me", "about", "write", "explain",
    "hello", "world", "model", "request", "token", "time", "answer", "correct", "value", "key",
    "lookup", "route", "fast", "slow", "one", "two", "three", "four", "five", "six", "seven",
    "eight", "nine", "ten", "zero", "number", "list", "item", "name", "user", "system",
]  # fmt: skip


def corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """Seeded pseudo-text: common English words, made-up words, digits and punctuation."""
    rng = random.Random(seed)
    made_up = [
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(600)
    ]
    words = _COMMON + made_up
    lines = []
    for _ in range(n_lines):
        n = rng.randint(5, 30)
        toks = []
        for _ in range(n):
            r = rng.random()
            if r < 0.08:
                toks.append(str(rng.randint(0, 9999)))
            elif r < 0.12:
                toks.append(rng.choice([",", ".", "?", ":", "!", "-", "(", ")", '"']))
            else:
                w = rng.choice(words)
                toks.append(w.capitalize() if rng.random() < 0.1 else w)
        lines.append(" ".join(toks))
    return lines


def build_tokenizer(seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(out_dir: Path, size: str, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tokenizer = build_tokenizer(seed)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
        **SIZES[size],
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    n_params = sum(p.numel() for p in model.parameters())
    (tmp / STAMP).write_text(
        json.dumps(
            {"size": size, "seed": seed, "recipe": RECIPE_VERSION, "params": n_params}, indent=1
        )
        + "\n"
    )
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def is_built(out_dir: Path, size: str, seed: int) -> bool:
    try:
        stamp = json.loads((out_dir / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return (out_dir / "config.json").exists() and (
        stamp.get("size"),
        stamp.get("seed"),
        stamp.get("recipe"),
    ) == (size, seed, RECIPE_VERSION)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out_dir = args.out_dir.resolve()
    if is_built(out_dir, args.size, args.seed):
        print(f"make_tiny_model: {args.size} model already in {out_dir}")
        return 0
    t0 = time.perf_counter()
    build(out_dir, args.size, args.seed)
    dt = time.perf_counter() - t0
    print(f"make_tiny_model: built {args.size} model in {out_dir} ({dt:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
