"""``GET /openapi.json``: an OpenAPI 3.0 description of the gateway's routes.

Built from the routes the app actually has (:func:`openapi_document`), so that the document
and the server cannot drift apart: a route described here but not installed is left out, a
route installed but not described here gets a minimal entry. The completion routes' schemas
describe what :func:`duetime.web.requests.parse_completion` accepts (other fields are
passed on to the instance as they are) and the answers' outline; every error is the OpenAI
shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import re
from typing import Any

import duetime
from duetime.policy import policy_names

_JSON = "application/json"
_ERROR_REF = {"$ref": "#/components/schemas/Error"}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {_JSON: {"schema": _ERROR_REF}}}


def _ok(description: str, schema: dict[str, Any], media: str = _JSON) -> dict[str, Any]:
    return {"description": description, "content": {media: {"schema": schema}}}


_INT1 = {"type": "integer", "minimum": 1, "nullable": True}
_BOOL = {"type": "boolean", "nullable": True}
_COMMON_BODY = {
    "model": {"type": "string", "nullable": True,
              "description": "a model name of the pool, or an alias (\"auto\": the policy "
                             "chooses among all models); absent: any"},
    "max_tokens": _INT1,
    "n": {"type": "integer", "minimum": 1, "maximum": 1, "nullable": True,
          "description": "only 1 is supported"},
    "stream": _BOOL,
    "stream_options": {"type": "object", "nullable": True,
                       "properties": {"include_usage": _BOOL,
                                      "continuous_usage_stats": _BOOL}},
    "ignore_eos": _BOOL,
}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string"},
    "content": {"nullable": True, "oneOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "object"}}]}}}
_USAGE = {"type": "object", "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"}}}

SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": "string", "nullable": True},
            "code": {"type": "string", "nullable": True}}}}},
    "ChatCompletionRequest": {
        "type": "object", "required": ["messages"], "additionalProperties": True,
        "properties": {**_COMMON_BODY, "max_completion_tokens": _INT1,
                       "messages": {"type": "array", "minItems": 1, "items": _MESSAGE}}},
    "CompletionRequest": {
        "type": "object", "required": ["prompt"], "additionalProperties": True,
        "properties": {**_COMMON_BODY, "prompt": {"oneOf": [
            {"type": "string"},
            {"type": "array", "minItems": 1, "items": {"type": "integer"}},
            {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string"}}]}}},
    "Completion": {"type": "object", "required": ["id", "object", "choices"],
                       "properties": {
                           "id": {"type": "string"}, "object": {"type": "string"},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "choices": {"type": "array", "items": {"type": "object"}},
                           "usage": _USAGE}},
    "Explanation": {"type": "object", "required": ["policy", "chosen", "candidates"],
                    "properties": {
                        "policy": {"type": "string"}, "chosen": {"type": "string"},
                        "rule": {"type": "string"}, "admission": {"type": "string"},
                        "candidates": {"type": "array", "items": {
                            "type": "object", "required": ["instance", "model", "chosen"],
                            "properties": {"instance": {"type": "string"},
                                           "model": {"type": "string"},
                                           "chosen": {"type": "boolean"}}}}}},
    "Model": {"type": "object", "required": ["id", "object"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string"},
        "created": {"type": "integer"}, "owned_by": {"type": "string"},
        "instances": {"type": "array", "items": {"type": "string"}}}},
}

_MS = {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 3600000}


def _headers(tasks: list[str]) -> list[dict[str, Any]]:
    """The completion routes' control headers (``tasks``: the pool's, what
    ``x-duetime-task`` may name)."""
    task = {"type": "string", "enum": tasks} if tasks else {"type": "string"}
    return [
        {"name": "x-duetime-ttft-ms", "in": "header", "required": False,
         "description": "the request's TTFT target in ms, in (0, 3600000]", "schema": _MS},
        {"name": "x-slo-ttft-ms", "in": "header", "required": False,
         "description": "llm-d's TTFT target in ms (when x-duetime-ttft-ms is absent)",
         "schema": _MS},
        {"name": "x-slo-tpot-ms", "in": "header", "required": False,
         "description": "llm-d's time-per-output-token target in ms (counted)", "schema": _MS},
        {"name": "x-duetime-priority", "in": "header", "required": False,
         "description": "what happens when no instance can meet the target",
         "schema": {"type": "string", "enum": ["critical", "standard", "sheddable"]}},
        {"name": "x-duetime-attempted", "in": "header", "required": False,
         "description": "comma-separated models the client already tried (at most 100)",
         "schema": {"type": "string", "pattern": r"^[A-Za-z0-9._:/-]+(,[A-Za-z0-9._:/-]+)*$"}},
        {"name": "x-duetime-task", "in": "header", "required": False,
         "description": "the request's task (a task of the quality table)", "schema": task},
        {"name": "x-session-id", "in": "header", "required": False,
         "schema": {"type": "string"}},
        {"name": "x-duetime-explain", "in": "header", "required": False,
         "description": "1: the decision's explanation in the x-duetime-explain response "
                        "header (JSON)", "schema": {"type": "string", "enum": ["0", "1"]}},
        {"name": "x-duetime-policy", "in": "header", "required": False,
         "description": "route this request with another registered policy",
         "schema": {"type": "string", "enum": list(policy_names())}},
        {"name": "x-duetime-lambda", "in": "header", "required": False,
         "description": "the utility's cost weight for this request, in [0, 1e6]",
         "schema": {"type": "number", "minimum": 0, "maximum": 1e6}},
    ]


_COMPLETION_ERRORS = {
    "400": _error("invalid request (JSON, fields, headers), or a prompt no instance can hold"),
    "401": _error("no API key, or an unknown one (when the pool has keys)"),
    "403": _error("the key may not call the model"),
    "404": _error("the model does not exist"),
    "408": _error("the request's headers or body did not arrive in time"),
    "413": _error("the request body is too large"),
    "429": _error("past the key's rate limits, or shed (x-duetime-priority: sheddable) when "
                  "no instance can meet its target"),
    "500": _error("internal error of the gateway"),
    "502": _error("every attempt failed upstream"),
    "503": _error("no healthy instance serves the model, or too many connections"),
    "default": _error("an error (an instance's own 4xx answers are relayed as they are)"),
}


def _completion(summary: str, request: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary, "parameters": [],  # (the headers: openapi_document)
        "requestBody": {"required": True, "content": {_JSON: {
            "schema": {"$ref": f"#/components/schemas/{request}"}}}},
        "responses": {"200": {"description": "the completion: one JSON body, or server-sent "
                                             "events (`stream: true`) ending with "
                                             "`data: [DONE]` or a `data: {\"error\": ...}` "
                                             "event",
                              "content": {
                                  _JSON: {"schema": {"$ref": "#/components/schemas/"
                                                             "Completion"}},
                                  "text/event-stream": {"schema": {"type": "string"}}}},
                      **_COMPLETION_ERRORS}}}


def _get(summary: str, responses: dict[str, Any]) -> dict[str, Any]:
    """A GET operation; any route may also answer a protocol error (408, 431, 503, 500)."""
    return {"get": {"summary": summary, "responses": {
        **responses, "default": _error("an error (a protocol limit, an internal error)")}}}


_HEALTH = {"type": "object", "properties": {
    "status": {"type": "string", "enum": ["ok", "unavailable"]},
    "healthy_instances": {"type": "integer"}, "instances": {"type": "integer"}}}

PATHS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": _completion("a chat completion, routed to an instance",
                                        "ChatCompletionRequest"),
    "/v1/completions": _completion("a text completion, routed to an instance",
                                   "CompletionRequest"),
    "/v1/models": _get("the pool's models and aliases", {"200": _ok("the models", {
        "type": "object", "properties": {"object": {"type": "string"}, "data": {
            "type": "array", "items": {"$ref": "#/components/schemas/Model"}}}})}),
    "/v1/models/{model}": _get("one model or alias", {
        "200": _ok("the model", {"$ref": "#/components/schemas/Model"}),
        "404": _error("no such model")}),
    "/health": _get("the gateway's health", {
        "200": _ok("at least one instance is healthy", _HEALTH),
        "503": _ok("no instance is healthy", _HEALTH)}),
    "/metrics": _get("Prometheus metrics", {
        "200": _ok("the metrics in Prometheus' text format", {"type": "string"},
                   "text/plain")}),
    "/duetime/instances": _get("each instance's live state", {
        "200": _ok("the policy, the membership and the instances", {
            "type": "object", "properties": {
                "policy": {"type": "string"},
                "membership": {"type": "object", "description": "members by phase (joining, "
                               "serving, draining) and the latest joins, drains and leaves"},
                "instances": {"type": "array", "items": {"type": "object"}}}})}),
    "/duetime/route": {"post": {
        "summary": "a dry run: the choice the policy would make for this chat or text "
                   "completion (chat if the body has messages), explained; nothing is sent",
        "parameters": [],
        "requestBody": {"required": True, "content": {_JSON: {"schema": {"oneOf": [
            {"$ref": "#/components/schemas/ChatCompletionRequest"},
            {"$ref": "#/components/schemas/CompletionRequest"}]}}}},
        "responses": {"200": _ok("the explanation", {"$ref": "#/components/schemas/"
                                                             "Explanation"}),
                      **{k: v for k, v in _COMPLETION_ERRORS.items()
                         if k in ("400", "401", "404", "413", "500", "503", "default")}}}},
    "/duetime/policies": _get("what a request may ask for: the policies, lambda, tasks", {
        "200": _ok("the choices", {"type": "object"})}),
    "/duetime/dashboard": _get("the dashboard's state now (its page: /dashboard)", {
        "200": _ok("instances, per-second series, the latest decisions",
                   {"type": "object", "required": ["instances", "series", "decisions"]})}),
    "/openapi.json": _get("this document", {
        "200": _ok("an OpenAPI 3.0 document", {"type": "object"})}),
}

COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions", "/duetime/route")
_PARAM = re.compile(r"{([^}:]+)(?::[^}]*)?}")  # a Starlette path parameter, {name:convertor}


def openapi_document(routes: list[Any], tasks: list[str] | None = None) -> dict[str, Any]:
    """The OpenAPI document of the routes (Starlette routes: ``path`` and ``methods``);
    ``tasks``: the pool's tasks (what ``x-duetime-task`` may name)."""
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        path = getattr(route, "path", None)
        if path is None or not getattr(route, "include_in_schema", False):
            continue  # (pages and event streams: docs/gateway.md describes them)
        path = _PARAM.sub(r"{\1}", path)
        described = PATHS.get(path)
        methods = sorted(m.lower() for m in getattr(route, "methods", None) or ["GET"]
                         if m != "HEAD")
        item = paths.setdefault(path, {})
        for m in methods:
            op = (described or {}).get(m) or {"summary": path, "responses": {
                "200": {"description": "OK"}, "default": _error("an error")}}
            if path in COMPLETION_PATHS:
                op = {**op, "parameters": _headers(list(tasks or []))}
            names = _PARAM.findall(path)
            if names:
                op = {**op, "parameters": [*op.get("parameters", []), *[
                    {"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                    for n in names]]}
            item[m] = op
    return {"openapi": "3.0.3",
            "info": {"title": "duetime gateway", "version": duetime.__version__,
                     "description": "An OpenAI-compatible gateway in front of a pool of "
                                    "model instances (docs/gateway.md)."},
            "paths": paths, "components": {"schemas": SCHEMAS}}
