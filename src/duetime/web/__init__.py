"""What every OpenAI-compatible server here shares: request parsing and OpenAI-style errors
(:mod:`.requests`, :mod:`.errors`), the prompt-token estimate (:mod:`.tokens`) and the exact
count through the model's tokenizer and chat template (:mod:`.prompt_tokens`), prompts' block
keys for prefix caching (:mod:`.prefix_keys`), server-sent events and their token count
(:mod:`.sse`), the raw-ASGI completion endpoint and fast routes (:mod:`.asgi`), uvicorn
in-process (:mod:`.server`) and JSON-lines logs (:mod:`.logs`).

The gateway and the emulator both build on it and never import each other; the service that
runs the gateway with embedded emulators (:mod:`duetime.service`) sits above both.
"""
