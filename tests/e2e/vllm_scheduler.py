"""Drive vLLM's own V1 scheduler without a model, for the differential tests.

Run with the python of the vLLM venv (``scripts/vllm_cpu/setup_env.sh``); it reads cases as
JSON on stdin and writes one JSON result per case on stdout (JSON lines). It does not import
duetime. How vLLM's ``Scheduler`` is built from configs alone follows vLLM's own unit tests
(``docs/scheduling-rules.md``, "Checking the rules against vLLM").

A case::

    {"name": ..., "config": {"max_num_batched_tokens", "max_num_seqs", "max_model_len",
     "block_size", "num_gpu_blocks", "long_prefill_token_threshold", "async_scheduling",
     "watermark", "scheduler_reserve_full_isl", "enable_prefix_caching", "max_loras"?},
     "requests": [{"id", "prompt_tokens", "output_tokens", "arrival_step", "prompt_ids"?,
     "lora"?}], "max_steps"}

Prompts are ``prompt_ids`` when given, else ``prompt_tokens`` copies of token 7. With
``enable_prefix_caching`` the requests carry vLLM's block hasher (sha256) and every step also
lists ``"hits": [[id, tokens], ...]``: the prefix-cache hits of the requests it admitted.
With ``max_loras`` > 0 the scheduler has a ``LoRAConfig`` (``--enable-lora --max-loras``), and
a request's ``lora`` > 0 is the ``lora_int_id`` of its ``LoRARequest`` (named ``a<id>``, so
its block hashes carry the adapter as vLLM's hasher makes them); 0 or absent: the base model.

Every request runs to exactly ``output_tokens`` output tokens (``ignore_eos``), unless
``max_model_len`` ends it first. A fake model output samples one token for each scheduled
request whose chunk reaches the end of its sequence. The step loop is vLLM's engine core's:
``schedule``, then the model output applied with ``update_from_output`` — at once in the
synchronous mode; after the *next* schedule in the asynchronous one (``AsyncScheduler`` with
the engine core's batch queue of two). Requests arrive before the schedule numbered
``arrival_step``.

A result: ``{"name", "steps": [{"scheduled": [[id, tokens], ...], "preempted": [ids],
"first": [ids], "finished": [ids]}], "end": "done" | "stuck" | "max_steps"}``. ``first`` and
``finished`` of step k are the requests whose first token, or last token, step k produced.
"stuck": nothing was scheduled for several steps with nothing left to arrive, or a livelock —
a step that only preempted, twice for the same request with no output token in between (the
steps since then repeat for ever; that step is left out).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch
from vllm.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

STUCK_AFTER = 3  # empty schedules in a row, with work left and nothing to arrive: stuck


def _model_dir() -> str:
    """A folder with the smallest Qwen3 config.json vLLM's ModelConfig accepts (no weights)."""
    d = tempfile.mkdtemp(prefix="duetime-vllm-sched-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                   "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "head_dim": 32, "num_hidden_layers": 1,
                   "max_position_embeddings": 1 << 20, "vocab_size": 1000,
                   "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                   "torch_dtype": "float32"}, f)
    return d


MODEL_DIR = _model_dir()


def make_scheduler(cfg: dict) -> Scheduler:
    mml = cfg["max_model_len"]
    bs = cfg.get("block_size", 16)
    asynchronous = bool(cfg.get("async_scheduling", False))
    model_config = ModelConfig(model=MODEL_DIR, skip_tokenizer_init=True, dtype="float32",
                               max_model_len=mml, seed=0)
    sched_config = SchedulerConfig(
        max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=mml, is_encoder_decoder=False,
        long_prefill_token_threshold=cfg.get("long_prefill_token_threshold", 0),
        enable_chunked_prefill=True, async_scheduling=asynchronous,
        watermark=cfg.get("watermark", 0.0),
        scheduler_reserve_full_isl=cfg.get("scheduler_reserve_full_isl", True))
    caching = bool(cfg.get("enable_prefix_caching", False))
    loras = cfg.get("max_loras", 0)
    vllm_config = VllmConfig(scheduler_config=sched_config, model_config=model_config,
                             cache_config=CacheConfig(block_size=bs,
                                                      enable_prefix_caching=caching),
                             lora_config=LoRAConfig(max_loras=loras) if loras else None)
    # the CPU platform forces asynchronous scheduling off in the config: set it back
    vllm_config.scheduler_config.async_scheduling = asynchronous
    register_all_kvcache_specs(vllm_config)
    n = cfg["num_gpu_blocks"]
    kv = KVCacheConfig(num_blocks=n, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1,
                                     dtype=torch.float32))])
    vllm_config.cache_config.num_gpu_blocks = n
    vllm_config.cache_config.enable_prefix_caching = caching
    cls = AsyncScheduler if asynchronous else Scheduler
    return cls(vllm_config=vllm_config, kv_cache_config=kv,
               structured_output_manager=StructuredOutputManager(vllm_config),
               block_size=bs, hash_block_size=bs, log_stats=False)


HASH_FN = get_hash_fn_by_name("sha256")
init_none_hash(HASH_FN)


def run_case(case: dict) -> dict:
    cfg = case["config"]
    sched = make_scheduler(cfg)
    asynchronous = bool(cfg.get("async_scheduling", False))
    caching = bool(cfg.get("enable_prefix_caching", False))
    hasher = get_request_block_hasher(cfg.get("block_size", 16), HASH_FN) if caching else None
    victims: list[str] = []
    original = sched._preempt_request

    def preempt(request, *args, **kwargs):  # record victims in the order vLLM picks them
        victims.append(request.request_id)
        return original(request, *args, **kwargs)

    sched._preempt_request = preempt
    arrivals: dict[int, list[dict]] = {}
    for r in case["requests"]:
        arrivals.setdefault(r["arrival_step"], []).append(r)
    last_arrival = max(arrivals, default=0)
    reqs: dict[str, Request] = {}
    steps: list[dict] = []
    pending: tuple[int, object, ModelRunnerOutput] | None = None
    empty_run = 0
    lone: tuple[str, int] | None = None  # the livelock watch: (request, outputs so far)
    end = "max_steps"

    def apply(k: int, out, mro: ModelRunnerOutput) -> None:
        before = {rid: reqs[rid].num_output_tokens for rid in mro.req_ids}
        sched.update_from_output(out, mro)
        rec = steps[k]
        for rid in mro.req_ids:
            r = reqs[rid]
            if before[rid] == 0 and r.num_output_tokens > 0:
                rec["first"].append(rid)
            if r.is_finished() and r.num_output_tokens > before[rid]:
                rec["finished"].append(rid)

    for k in range(case.get("max_steps", 5000)):
        for r in arrivals.get(k, ()):
            ids = r.get("prompt_ids") or [7] * r["prompt_tokens"]
            req = Request(request_id=r["id"], prompt_token_ids=list(ids),
                          sampling_params=SamplingParams(max_tokens=r["output_tokens"],
                                                         ignore_eos=True, temperature=0.0),
                          pooling_params=None, arrival_time=float(k), block_hasher=hasher,
                          lora_request=(LoRARequest(f"a{r['lora']}", r["lora"],
                                                    f"/adapters/a{r['lora']}")
                                        if r.get("lora") else None))
            reqs[r["id"]] = req
            sched.add_request(req)
            lone = None
        if not sched.has_requests():  # the engine core does not schedule; it drains
            if pending is not None:
                apply(*pending)
                pending = None
            if k > last_arrival:
                end = "done"
                break
            steps.append({"scheduled": [], "preempted": [], "first": [], "finished": [],
                          **({"hits": []} if caching else {})})
            continue
        victims.clear()
        waiting = {rid for rid, q in reqs.items() if not q.is_finished()
                   and q.num_computed_tokens == 0}
        out = sched.schedule()
        scheduled = list(out.num_scheduled_tokens.items())
        steps.append({"scheduled": [[rid, n] for rid, n in scheduled],
                      "preempted": list(victims), "first": [], "finished": []})
        if caching:  # prefix-cache hits of the requests admitted in this step, in order
            steps[-1]["hits"] = [[rid, reqs[rid].num_computed_tokens - n]
                                 for rid, n in scheduled if rid in waiting
                                 and reqs[rid].num_computed_tokens - n > 0]
        ids = [rid for rid, _ in scheduled]
        sampled = [[11] if not reqs[rid].is_prefill_chunk else [] for rid in ids]
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled)
        if asynchronous:
            if pending is not None:
                apply(*pending)
            pending = (k, out, mro)
        else:
            apply(k, out, mro)
        if not scheduled and victims:  # the last victim preempted itself, alone
            watch = (victims[-1], sum(r.num_output_tokens for r in reqs.values()))
            if watch == lone and k >= last_arrival:
                # Twice, with no output token in between: every request waits with nothing
                # computed, in the same order, with the same outputs; the steps since repeat
                # for ever (a livelock; vLLM refuses to start with a cache this small).
                end = "stuck"
                steps.pop()
                break
            lone = watch
        empty_run = empty_run + 1 if not scheduled and not victims else 0
        if empty_run >= STUCK_AFTER and k >= last_arrival and (
                pending is None or not pending[2].req_ids):
            end = "stuck"
            steps = steps[:len(steps) - empty_run]
            break
    if pending is not None and end != "stuck":
        apply(*pending)
    while steps and not any(steps[-1].values()):
        steps.pop()
    return {"name": case.get("name", ""), "steps": steps, "end": end}


def main() -> None:
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(run_case(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
