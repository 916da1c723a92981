"""duetime.client: the retry-until-correct contract, against a fake gateway."""

from __future__ import annotations

import json

import httpx
import pytest

from duetime.client import ask_until_correct


def fake_gateway(answers: dict[str, str], seen: list[dict]):
    """Answers with the first model (in order) not listed in x-duetime-attempted."""

    def handle(request: httpx.Request) -> httpx.Response:
        tried = [m for m in request.headers.get("x-duetime-attempted", "").split(",") if m]
        seen.append({"attempted": tried, "session": request.headers.get("x-session-id"),
                     "body": json.loads(request.content)})
        model = next((m for m in answers if m not in tried), next(iter(answers)))
        body = {"model": model, "choices": [{"message": {"role": "assistant",
                                                         "content": answers[model]}}]}
        return httpx.Response(200, json=body, headers={"x-duetime-model": model,
                                                       "x-duetime-instance": f"{model}-0"})

    return httpx.Client(transport=httpx.MockTransport(handle))


def test_retries_tell_the_router_what_was_tried() -> None:
    seen: list[dict] = []
    answers = {"granite3.1-2b": "no idea", "phi3-mini": "it is 42", "phi3-medium": "42"}
    out = ask_until_correct("http://gw/v1", [{"role": "user", "content": "Key: k?"}],
                            lambda text: "42" in text, session="s1", max_tokens=8,
                            client=fake_gateway(answers, seen))
    assert [a.model for a in out.attempts] == ["granite3.1-2b", "phi3-mini"]
    assert [a.correct for a in out.attempts] == [False, True]
    assert out.answer == "it is 42" and out.attempts[1].instance == "phi3-mini-0"
    assert [s["attempted"] for s in seen] == [[], ["granite3.1-2b"]]
    assert seen[0]["session"] == "s1" and seen[0]["body"]["max_tokens"] == 8
    assert out.ttca_s == pytest.approx(sum(a.latency_s for a in out.attempts))


def test_gives_up_after_max_attempts() -> None:
    seen: list[dict] = []
    out = ask_until_correct("http://gw/v1", [{"role": "user", "content": "q"}],
                            lambda text: False, max_attempts=3,
                            client=fake_gateway({"a": "x", "b": "y"}, seen))
    assert len(out.attempts) == 3 and out.answer is None
    assert seen[2]["attempted"] == ["a", "b"]


def test_upstream_errors_raise() -> None:
    client = httpx.Client(transport=httpx.MockTransport(
        lambda r: httpx.Response(503, json={"error": {"message": "no instance"}})))
    with pytest.raises(httpx.HTTPStatusError):
        ask_until_correct("http://gw/v1", [], lambda t: True, client=client)
