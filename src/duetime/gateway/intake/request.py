"""The one intake path: a completion request's bytes and headers become a
:class:`RequestContext` — its key checked, its body parsed, its prompt counted, its controls
read, its policy chosen, its candidates found and what its policy consumes predicted.

Three callers take this path and differ only by explicit arguments:

==================  ============================  =========================================
caller              ``keys``                      ``allowed``
==================  ============================  =========================================
the relay           :attr:`KeyCheck.ADMIT`        every candidate
(``duetime serve``) (401, 403, 429)
the dry run         :attr:`KeyCheck.IDENTIFY`     every candidate
(``/duetime/route``) (401; nothing spent)
the picker          :attr:`KeyCheck.NONE`         the data plane's subset hint
(``duetime epp``)   (Envoy's side authenticates)
==================  ============================  =========================================

Every step raises :class:`~duetime.web.errors.ApiError` on bad input (OpenAI's error body).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from duetime.estimate.base import KeysByBlockSize
from duetime.gateway.config import Pool
from duetime.gateway.intake.auth import NO_GRANT, Auth, Grant
from duetime.gateway.intake.controls import Controls, read_controls
from duetime.gateway.intake.policies import PolicyBook
from duetime.gateway.intake.predictions import PerModel, Predictions
from duetime.gateway.keys import ApiKey
from duetime.gateway.state.instance import InstanceState
from duetime.gateway.state.membership import Membership
from duetime.policy.base import Policy
from duetime.web.asgi import Scope
from duetime.web.errors import ApiError
from duetime.web.prefix_keys import adapter_block_keys, prompt_block_keys
from duetime.web.prompt_tokens import PromptTokenizer
from duetime.web.requests import CompletionRequest, parse_completion, prompt_texts

# Prompts estimated at this many tokens or more are tokenized on a worker thread, the event
# loop going on meanwhile: a new 3,700-token conversation took 2.3-2.4 ms to render and encode
# here (benchmarks/gateway_overhead.py's tokenizer table), a hand-off to a thread ~0.1 ms.
OFF_LOOP_TOKENS = 2048


class KeyCheck(enum.Enum):
    """How much of the API-key checks a caller applies."""

    ADMIT = "admit"        # identify the key (401), then admit it: its models (403), limits (429)
    IDENTIFY = "identify"  # identify it only (401): nothing is spent of its limits
    NONE = "none"          # no checks (the data plane in front authenticates)


@dataclass(frozen=True, slots=True)
class Allowed:
    """The instances a caller allows (the picker: its data plane's subset hint), and the 503's
    message when none of a request's candidates is allowed."""

    test: Callable[[InstanceState], bool]
    refusal: str


@dataclass(slots=True)
class RequestContext:
    """One request as every stage after the intake sees it."""

    rid: str                    # the gateway's id of the request (its attempts: rid-1, rid-2, ...)
    req: CompletionRequest      # the parsed body (``prompt_tokens``: counted)
    controls: Controls          # the client's headers
    arrival: float              # when it arrived (monotonic): TTFT and targets count from it
    key: ApiKey | None          # the client's key, where checked
    grant: Grant                # what admitting it gave (the limit headers of the response)
    policy: Policy              # the policy that routes it (the pool's, or one it asked for)
    candidates: list[InstanceState]  # the instances that may serve it
    predicted: int              # output tokens predicted (the default, capped by max_tokens)
    cap: int                    # no predicted length past this (max_tokens; else none)
    quality: PerModel           # per model, what the policy consumes (None: not consumed)
    success: PerModel
    lengths: PerModel
    keys: KeysByBlockSize       # the prompt's block keys per block size (computed when asked)
    lora: int = 0               # the LoRA adapter its model names (the pool's id; 0: none)
    adapter: str | None = None  # that adapter's name (what upstream is asked for)
    length_p90: PerModel = None  # per model, the output length's p90, where predicted

    @property
    def chat(self) -> bool:
        return self.req.chat


class Intake:
    """The intake of one gateway: its pool, instances, key checks, policies and predictors."""

    def __init__(self, pool: Pool, members: Membership, auth: Auth,
                 policies: PolicyBook) -> None:
        self.pool = pool
        self.members = members
        self.auth = auth
        self.policies = policies
        self.predictions = Predictions(pool)
        self.tokenizer: PromptTokenizer | None = None
        if pool.tokenizer is not None:
            self.tokenizer = PromptTokenizer(pool.tokenizer, pool.chat_template)
        self._ids = itertools.count(1)
        self._prefix = secrets.token_hex(3)

    @property
    def instances(self) -> list[InstanceState]:
        """The serving instances (the membership's, as of now)."""
        return self.members.serving

    @property
    def adapter_ids(self) -> dict[str, int]:
        """The LoRA adapters the members serve, with the gateway's ids of them."""
        return self.members.adapter_ids

    @property
    def by_model(self) -> dict[str, list[InstanceState]]:
        """Each model's serving instances."""
        return self.members.by_model

    def reconfigure(self, pool: Pool) -> None:
        """The pool's config changed (its instances and their models' quality: the fields
        that apply while serving, :mod:`duetime.gateway.changes`)."""
        self.pool = pool
        self.predictions = Predictions(pool)

    async def take(self, raw: bytes, scope: Scope, *, arrival: float, chat: bool | None,
                   keys: KeyCheck, allowed: Allowed | None = None) -> RequestContext:
        """The request's context. ``chat``: the route's kind (None: a chat if the body has
        ``messages``, as the dry run takes either); ``keys``: which key checks apply;
        ``allowed``: which instances the caller allows (None: all)."""
        key = self.auth.identify(scope) if keys is not KeyCheck.NONE else None
        req = parse_completion(raw, chat=_is_chat(raw) if chat is None else chat)
        if self.tokenizer is not None and req.prompt_tokens >= OFF_LOOP_TOKENS:
            req.prompt_tokens = await asyncio.to_thread(self.count_tokens, req, release=True)
        else:
            req.prompt_tokens = self.count_tokens(req)
        grant = NO_GRANT
        if keys is KeyCheck.ADMIT:
            grant = await self.auth.admit(key, req.model, req.prompt_tokens)
        try:
            client = (f"key:{key.name}" if key is not None
                      else str((scope.get("client") or ("",))[0]))
            ctl = read_controls(scope, self.pool, req.prompt_tokens, client=client,
                                output_tokens=req.max_tokens)
            policy = self.policies.get(ctl.policy, ctl.lam)
            adapter = self.task_adapter(req.model, ctl.task)
            if adapter is None and req.model in self.adapter_ids:
                adapter = req.model
            cands = self.candidates(req, adapter or req.model)
            if allowed is not None:
                cands = [s for s in cands if allowed.test(s)]
                if not cands:
                    raise ApiError(503, allowed.refusal, code="no_healthy_instance")
            return self._context(req, ctl, arrival, key, grant, policy, cands, adapter)
        except ApiError as e:  # (refused once admitted: the answer still carries its limits)
            e.headers += grant.headers
            raise

    def task_adapter(self, model: str | None, task: str) -> str | None:
        """The LoRA adapter a request for base model ``model`` runs on for ``task``: of the
        adapters its instances serve, the one the quality table rates highest for the task,
        where it rates it above the model itself (ties: the first by name); None otherwise
        (no task given, an alias or an adapter named, no adapter rated for the task)."""
        row = self.pool.quality.get(task)
        insts = self.by_model.get(model) if model is not None else None
        if not row or not insts:
            return None
        best, best_q = None, row.get(model, -1.0)  # type: ignore[arg-type]
        for name in sorted({a for s in insts for a in s.adapters}):
            q = row.get(name)
            if q is not None and q > best_q:
                best, best_q = name, q
        return best

    def _adapter_quality(self, adapter: str, task: str) -> float | None:
        """The quality table's accuracy of ``adapter`` for ``task`` (no task given: its mean
        over the tasks it is rated for); None where it is not rated."""
        if task in self.pool.quality:
            return self.pool.quality[task].get(adapter)
        rated = [row[adapter] for row in self.pool.quality.values() if adapter in row]
        return sum(rated) / len(rated) if rated else None

    def _context(self, req: CompletionRequest, ctl: Controls, arrival: float,
                 key: ApiKey | None, grant: Grant, policy: Policy,
                 cands: list[InstanceState], adapter: str | None) -> RequestContext:
        """What every attempt of ``req`` shares: its id, predicted output length, the policy's
        predictions (on an adapter the quality table rates, its accuracy for every candidate:
        each serves it) and its prompt's block keys."""
        default = self.pool.default_output_tokens
        predicted = min(req.max_tokens, default) if req.max_tokens else default
        quality, success, lengths, p90 = self.predictions.predict(req, ctl.task,
                                                                  policy.consumes)
        lora = self.adapter_ids[adapter] if adapter is not None else 0
        if adapter is not None:
            q = self._adapter_quality(adapter, ctl.task)
            if q is not None:
                rated = {s.model: q for s in cands}
                quality = None if quality is None else {**quality, **rated}
                success = None if success is None else {**success, **rated}
        keys = (KeysByBlockSize(lambda block_size: prompt_block_keys(req, block_size))
                if adapter is None else  # (on an adapter: its keys carry it, as vLLM's)
                KeysByBlockSize(lambda block_size: adapter_block_keys(
                    prompt_block_keys(req, block_size), adapter)))
        return RequestContext(
            f"dt-{self._prefix}-{next(self._ids):x}", req, ctl, arrival, key, grant, policy,
            cands, predicted, predicted if req.max_tokens else 1 << 30, quality, success,
            lengths, keys, lora, adapter, p90)

    def count_tokens(self, req: CompletionRequest, *, release: bool = False) -> int:
        """Prompt tokens: with the pool's tokenizer, the token ids vLLM will see (kept in
        ``req.token_ids`` for the block keys; :class:`PromptTokenizer`), where it can make
        them; else the estimate (:mod:`duetime.web.tokens`). ``release``: on a worker
        thread, letting the event loop run while the text is encoded."""
        tok = self.tokenizer
        if tok is None:
            return req.prompt_tokens
        ids = tok.ids(req, release=release)
        if ids is None:  # (no template, or one the request defeats): contents counted, the
            if req.chat:  # template's markers estimated as in the emulator
                return 3 + sum(4 + (len(tok.encode(t, special=False)) if t else 0)
                               for t in prompt_texts(req))
            return req.prompt_tokens
        req.token_ids = ids
        return max(1, len(ids))

    def candidates(self, req: CompletionRequest, model: str | None = None
                   ) -> list[InstanceState]:
        """The instances a request for ``model`` (default its own) may go to (an alias: all;
        an adapter: those serving it; 404 if unknown) that can hold it
        (:meth:`SchedulerConfig.refusal`: within ``max_model_len`` and, up to ``max_tokens``,
        within the KV cache; else it would block that instance's queue for good). None can:
        400, with the reason of the one with the largest cache."""
        model = req.model if model is None else model
        prompt_tokens, max_tokens = req.prompt_tokens, req.max_tokens
        if model is None or model in self.pool.aliases:
            insts = self.instances
        elif model in self.adapter_ids:  # a LoRA adapter: the instances that serve it
            insts = [s for s in self.instances if model in s.adapters]
        else:
            found = self.by_model.get(model)
            if found is None:
                raise ApiError(404, f"The model `{model}` does not exist. Models: "
                               f"{', '.join([*self.pool.aliases, *self.by_model])}"
                               + (f"; LoRA adapters: {', '.join(self.adapter_ids)}"
                                  if self.adapter_ids else ""),
                               param="model", code="model_not_found")
            insts = found
        if not insts:  # (its instances are joining or draining)
            what = "any model" if model is None or model in self.pool.aliases else \
                f"model `{model}`"
            raise ApiError(503, f"no healthy instance serves {what}", code="no_healthy_instance")
        fit = [s for s in insts if s.instance.config.refusal(prompt_tokens, max_tokens) is None]
        if not fit:
            big = max(insts, key=lambda s: (s.instance.config.kv_capacity_tokens,
                                            s.instance.config.max_model_len))
            why = big.instance.config.refusal(prompt_tokens, max_tokens)
            where = f"instance {big.name}" if len(insts) == 1 else (
                f"none of the {len(insts)} instances can hold it; the largest: {big.name}")
            raise ApiError(400, f"{why} ({where})", param="messages" if req.chat else "prompt",
                           code="context_length_exceeded")
        return fit


def _is_chat(raw: bytes) -> bool:
    """Whether a body of either kind is a chat (it has ``messages``); a body that is not JSON
    is left to :func:`parse_completion` to refuse."""
    try:
        return "messages" in json.loads(raw)
    except (ValueError, TypeError):
        return False
