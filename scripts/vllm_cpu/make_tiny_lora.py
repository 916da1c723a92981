"""Build tiny random-weight PEFT LoRA adapters for a model made by make_tiny_model.py, offline.

    <vllm-venv>/bin/python scripts/vllm_cpu/make_tiny_lora.py MODEL_DIR OUT_DIR \\
        [--count N] [--rank R] [--seed S] [--targets q_proj,k_proj,...]

Writes OUT_DIR/lora-1 ... OUT_DIR/lora-N, each a PEFT-format adapter as ``peft``'s
``save_pretrained`` writes it: ``adapter_config.json`` (peft_type LORA, task_type CAUSAL_LM, r,
lora_alpha, target_modules, base_model_name_or_path, ...) and ``adapter_model.safetensors`` with
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`` (r, in) and
``...lora_B.weight`` (out, r). The values are small seeded random numbers, different for each
adapter (``lora_B`` is not zero as in a fresh PEFT init, so that each adapter changes the model's
output). The files are written directly with ``safetensors`` and ``json``: ``peft`` is not part
of the vLLM venv and an adapter needs nothing from it.

Idempotent: an adapter whose stamp matches the base model, rank, seed, targets and recipe is not
rebuilt, so raising --count only builds the new ones. Prints one ``name=path`` line per adapter,
ready for vLLM's ``--lora-modules``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

RECIPE_VERSION = 1
STAMP = "duetime_tiny_lora.json"
MODEL_STAMP = "duetime_tiny_model.json"  # make_tiny_model.py's stamp
# The attention and MLP projections of a Qwen3 decoder layer: vLLM's Qwen3 LoRA support packs
# q/k/v into qkv_proj and gate/up into gate_up_proj, and accepts each of them as a target.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INIT_STD = 0.02


def module_shapes(config: dict[str, Any]) -> dict[str, tuple[str, int, int]]:
    """target module -> (its parent in the layer, in_features, out_features) for this config."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    return {
        "q_proj": ("self_attn", hidden, q),
        "k_proj": ("self_attn", hidden, kv),
        "v_proj": ("self_attn", hidden, kv),
        "o_proj": ("self_attn", q, hidden),
        "gate_proj": ("mlp", hidden, inter),
        "up_proj": ("mlp", hidden, inter),
        "down_proj": ("mlp", inter, hidden),
    }


def adapter_tensors(config: dict[str, Any], targets: list[str], rank: int,
                    seed: int, index: int) -> dict[str, Any]:
    """The adapter's tensors, named as PEFT saves them; seeded by (seed, index) so that every
    adapter differs and a rebuild gives the same bytes."""
    import numpy as np

    rng = np.random.default_rng([seed, index])
    shapes = module_shapes(config)
    out: dict[str, Any] = {}
    for layer in range(config["num_hidden_layers"]):
        for name in targets:
            parent, n_in, n_out = shapes[name]
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            out[f"{prefix}.lora_A.weight"] = (
                rng.standard_normal((rank, n_in)) * INIT_STD).astype(np.float32)
            out[f"{prefix}.lora_B.weight"] = (
                rng.standard_normal((n_out, rank)) * INIT_STD).astype(np.float32)
    return out


def adapter_config(model_dir: Path, targets: list[str], rank: int) -> dict[str, Any]:
    """adapter_config.json as peft writes it for a plain LoRA (the fields vLLM reads, and the
    usual rest)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "revision": None,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_rslora": False,
        "use_dora": False,
    }


def stamp_for(model_dir: Path, targets: list[str], rank: int, seed: int,
              index: int) -> dict[str, Any]:
    """What an adapter was built from: a rebuilt base model (another stamp) invalidates it."""
    try:
        model = json.loads((model_dir / MODEL_STAMP).read_text())
    except (OSError, ValueError):
        model = json.loads((model_dir / "config.json").read_text())
    return {"recipe": RECIPE_VERSION, "rank": rank, "seed": seed, "index": index,
            "targets": sorted(targets), "model_dir": str(model_dir), "model": model}


def is_built(adapter_dir: Path, stamp: dict[str, Any]) -> bool:
    try:
        have = json.loads((adapter_dir / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return have == stamp and (adapter_dir / "adapter_model.safetensors").exists()


def build(adapter_dir: Path, model_dir: Path, config: dict[str, Any], targets: list[str],
          rank: int, seed: int, index: int, stamp: dict[str, Any]) -> None:
    """Write one adapter into a temporary folder and move it in place (no half-built one)."""
    from safetensors.numpy import save_file

    tmp = adapter_dir.with_name(adapter_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(adapter_tensors(config, targets, rank, seed, index),
              str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(
        json.dumps(adapter_config(model_dir, targets, rank), indent=2) + "\n")
    (tmp / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
    shutil.rmtree(adapter_dir, ignore_errors=True)
    (tmp / "adapter_model.safetensors").chmod(0o644)  # (safetensors writes it 0600)
    tmp.rename(adapter_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path, help="a model made by make_tiny_model.py")
    ap.add_argument("out_dir", type=Path, help="adapters go to OUT_DIR/lora-1 ... lora-N")
    ap.add_argument("--count", type=int, default=1)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                    help="comma-separated modules (default: %(default)s)")
    args = ap.parse_args(argv)
    model_dir, out_dir = args.model_dir.resolve(), args.out_dir.resolve()
    config = json.loads((model_dir / "config.json").read_text())
    targets = [t for t in args.targets.split(",") if t]
    unknown = sorted(set(targets) - set(DEFAULT_TARGETS))
    if unknown or not targets or args.count < 1 or args.rank < 1:
        ap.error(f"need --count >= 1, --rank >= 1 and targets among {DEFAULT_TARGETS} "
                 f"(unknown: {unknown})")
    t0 = time.perf_counter()
    built = 0
    for index in range(1, args.count + 1):
        adapter_dir = out_dir / f"lora-{index}"
        stamp = stamp_for(model_dir, targets, args.rank, args.seed, index)
        if not is_built(adapter_dir, stamp):
            build(adapter_dir, model_dir, config, targets, args.rank, args.seed, index, stamp)
            built += 1
        print(f"lora-{index}={adapter_dir}")
    print(f"make_tiny_lora: {built} built, {args.count - built} already in {out_dir} "
          f"({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
