"""Pool config: validation errors name the file, the field and the reason; resolution."""

from __future__ import annotations

import pytest

from duetime.cli import main
from duetime.engine import load_profile
from duetime.gateway import ConfigError, load_pool, pool_from_dict
from duetime.service import demo_pool
from duetime.service import pool_from_dict as service_pool_from_dict

GOOD = """\
policy: sfs-soft
lambda: 1.0e-4
delta: 2.0e-6
instances:
  - name: small
    model: qwen3-0.6b
    url: http://127.0.0.1:8101/
    profile: qwen3-0.6b
  - name: big
    model: qwen3-32b
    url: http://10.0.0.7:8000
    profile: qwen3-32b
    speed: 2
    price_usd_per_mtok: {prompt: 0.3, output: 0.7}
quality:
  workload: paper
  default_task: alpaca
ttft_target: {base_ms: 200}
"""


def write(tmp_path, text: str) -> str:
    p = tmp_path / "pool.yaml"
    p.write_text(text)
    return str(p)


def test_a_good_config_resolves(tmp_path):
    pool = load_pool(write(tmp_path, GOOD))
    assert pool.policy == "sfs-soft" and pool.lam == 1e-4 and pool.delta == 2e-6
    small, big = pool.instances
    assert small.url == "http://127.0.0.1:8101"
    assert (small.price_prompt, small.price_output) == (0.044, 0.173)  # from the workload
    assert (big.price_prompt, big.price_output) == (0.3, 0.7)
    # speed 2: the shadow replica's batch-time model is twice as fast
    assert big.batch_time.coefficients["c0"] == pytest.approx(
        load_profile("qwen3-32b").batch_time.coefficients["c0"] / 2)
    assert pool.quality["alpaca"] == {"qwen3-0.6b": 0.5349, "qwen3-32b": 0.8885}
    assert pool.default_task == "alpaca"
    assert pool.target_ms(1000) == 235.0 and pool.target_ms(10**6) == 1120.0


def test_demo_pool():
    pool = demo_pool(speed=3)
    assert [i.model for i in pool.instances] == ["qwen3-0.6b", "qwen3-8b", "qwen3-32b"]
    assert all(i.emulate is not None and i.emulate["speed"] == 3 for i in pool.instances)
    assert set(pool.quality) == {"alpaca", "hotpotqa", "govreport", "writingprompts"}


@pytest.mark.parametrize(("edit", "message"), [
    ({"instances": []}, "pool.yaml: instances: List should have at least 1 item"),
    ({"policy": "fastest"}, "pool.yaml: policy: unknown policy 'fastest'"),
    ({"lambda": -1}, "pool.yaml: lambda: Input should be greater than or equal to 0"),
    ({"retries": "many"}, "pool.yaml: retries: Input should be a valid integer"),
    ({"colour": "blue"}, "pool.yaml: colour: unknown field"),
    ({"state": {"source": "psychic"}}, "pool.yaml: state.source: Input should be"),
    ({"instances": [{"name": "x", "model": "qwen3-8b", "url": "ftp://x",
                     "profile": "qwen3-8b"}]},
     "pool.yaml: instances[0].url: must be an http(s) URL, got 'ftp://x'"),
    ({"instances": [{"name": "x", "model": "qwen3-8b", "url": "http://h",
                     "profile": "qwen9"}]},
     "pool.yaml: instances[0].profile: unknown engine profile 'qwen9'"),
    ({"instances": [{"name": "x", "model": "qwen3-8b", "profile": "qwen3-8b"}]},
     "pool.yaml: instances[0]: needs exactly one of url"),
    ({"instances": [{"name": "x", "model": "qwen3-8b", "url": "http://h"}]},
     "pool.yaml: instances[0]: needs profile"),
    ({"instances": [{"name": "x", "model": "qwen3-8b", "url": "http://h",
                     "profile": "qwen3-8b"},
                    {"name": "x", "model": "qwen3-8b", "url": "http://g",
                     "profile": "qwen3-8b"}]},
     "pool.yaml: instances[1].name: duplicate instance name 'x'"),
    ({"instances": [{"name": "x", "model": "mine", "url": "http://h",
                     "profile": "qwen3-8b"}]},
     "pool.yaml: instances[0].price_usd_per_mtok: missing"),
    ({"instances": [{"name": "x", "model": "mine", "url": "http://h", "profile": "qwen3-8b",
                     "price_usd_per_mtok": {"prompt": 1, "output": 1}}]},
     "pool.yaml: quality.tasks.alpaca: no accuracy for model(s) ['mine']"),
    ({"instances": [{"name": "x", "model": "qwen3-8b", "url": "http://h",
                     "batch_time": {"model": "sfs6", "coefficients": {"c0": 1}},
                     "config": {"max_num_seqs": 8}}]},
     "pool.yaml: instances[0].batch_time.coefficients: missing"),
    ({"quality": {"default_task": "chess"}}, "pool.yaml: quality.default_task: unknown task"),
    ({"quality": {"workload": "nowhere.yaml"}}, "pool.yaml: quality.workload: nowhere.yaml"),
    ({"quality": {"tasks": {"chat": {"qwen3-8b": 1.5}}}}, "pool.yaml: quality.tasks:"),
    ({"aliases": ["qwen3-8b"]}, "pool.yaml: aliases: ['qwen3-8b'] are also model names"),
    ({"ttft_target": {"min_ms": 500, "max_ms": 100}}, "pool.yaml: ttft_target: min_ms"),
    ({"ttft_target": {"tasks": {"chess": {"base_ms": 50}}}},
     "pool.yaml: ttft_target.tasks.chess: unknown task"),
    ({"ttft_target": {"tasks": {"alpaca": {"min_ms": 2000}}}},
     "pool.yaml: ttft_target.tasks.alpaca: min_ms 2000.0 > max_ms 1120.0"),
    ({"ttft_target": {"tasks": {"alpaca": {"base": 50}}}},
     "pool.yaml: ttft_target.tasks.alpaca.base: unknown field"),
    ({"tokenizer": "no/such/tokenizer.json"}, "pool.yaml: tokenizer: "),
    ({"instances": [{"name": "x", "model": "qwen3-8b", "url": "http://h",
                     "profile": "qwen3-8b", "request_overhead_ms": -1}]},
     "pool.yaml: instances[0].request_overhead_ms: Input should be greater than or equal"),
    ({"instances": [{"name": "x", "model": "qwen3-8b", "url": "http://h",
                     "profile": "qwen3-8b", "frontend": {"request_ms": 1, "chunks_ms": 1}}]},
     "pool.yaml: instances[0].frontend: unknown key(s) ['chunks_ms']"),
    ({"instances": [{"name": "x", "model": "qwen3-8b", "url": "http://h",
                     "profile": "qwen3-8b", "frontend": {"request_ms": -1}}]},
     "pool.yaml: instances[0].frontend: request_ms and chunk_ms must be >= 0"),
    ({"instances": [{"name": "x", "model": "qwen3-8b",
                     "emulate": {"fail_kinds": ["gremlins"]}}]},
     "pool.yaml: instances[0].emulate.fail_kinds: must be among"),
])
def test_config_errors_name_file_field_and_reason(edit, message):
    base = {"instances": [{"name": "x", "model": "qwen3-8b", "url": "http://h",
                           "profile": "qwen3-8b"}]}
    with pytest.raises(ConfigError) as e:
        service_pool_from_dict({**base, **edit}, "pool.yaml")
    assert str(e.value).startswith(message), str(e.value)


def test_a_task_s_own_ttft_target_overrides_the_pool_s_field_by_field():
    pool = pool_from_dict({
        "instances": [{"name": "x", "model": "qwen3-8b", "url": "http://h",
                       "profile": "qwen3-8b"}],
        "ttft_target": {"base_ms": 200, "per_prompt_token_ms": 0.1,
                        "tasks": {"alpaca": {"base_ms": 60, "min_ms": 50},
                                  "govreport": {"max_ms": 3000}}}}, "pool.yaml")
    assert pool.target_ms(100) == 210                  # the pool's rule
    assert pool.target_ms(100, "hotpotqa") == 210      # a task without its own
    assert pool.target_ms(100, "alpaca") == 70         # base and min overridden
    assert pool.target_ms(20000, "govreport") == 2200  # the higher cap
    assert pool.target_ms(20000) == 1120


def test_the_gateway_leaves_an_embedded_instances_options_to_the_service():
    """The gateway reads an emulate block's speed (its timing); the emulator's own options are
    checked by the service that starts it (duetime.service), also at Service()."""
    from duetime.service import Service

    cfg = {"instances": [{"name": "x", "model": "qwen3-8b",
                          "emulate": {"speed": 2, "fail_kinds": ["gremlins"]}}]}
    pool = pool_from_dict(cfg, "pool.yaml")
    assert pool.instances[0].batch_time == load_profile("qwen3-8b").batch_time.scaled(2)
    with pytest.raises(ConfigError, match=r"instances\[0\]\.emulate\.fail_kinds: must be"):
        Service(pool)
    with pytest.raises(ConfigError, match=r"instances\[0\]\.emulate\.speed: Input should be"):
        pool_from_dict({"instances": [{"name": "x", "model": "qwen3-8b",
                                       "emulate": {"speed": 0}}]}, "pool.yaml")


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"^.*missing\.yaml: cannot read"):
        load_pool(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"pool\.yaml: not valid YAML"):
        load_pool(write(tmp_path, "instances: [\n"))
    with pytest.raises(ConfigError, match=r"pool\.yaml: must be a mapping"):
        load_pool(write(tmp_path, "- 1\n"))


def test_serve_reports_config_errors_on_one_line(tmp_path, capsys):
    path = write(tmp_path, "policy: sfs\ninstances: []\n")
    assert main(["serve", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"duetime: error: {path}: instances:") and err.count("\n") == 1
    assert main(["serve", "--config", path, "--speed", "2"]) == 2
    assert "--speed applies to the demo pool" in capsys.readouterr().err


def test_overhead_and_tokenizer_resolve(tmp_path):
    """request_overhead_ms reaches the instance (in seconds) and is added to SFS's forecast;
    a tokenizer.json path is resolved against the config file's folder."""
    import time

    from tokenizers import Tokenizer, models, pre_tokenizers

    from duetime.estimate import SfsEstimator
    from duetime.gateway.backends.memory import MemoryStore
    from duetime.gateway.prometheus import GatewayMetrics
    from duetime.gateway.state.instance import InstanceState

    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    text = GOOD.replace("    profile: qwen3-0.6b\n", "    profile: qwen3-0.6b\n"
                        "    request_overhead_ms: 12.5\n") + "tokenizer: tokenizer.json\n"
    pool = load_pool(write(tmp_path, text))
    assert pool.tokenizer == str(tmp_path / "tokenizer.json")
    small, big = pool.instances
    assert small.request_overhead_s == 0.0125 and big.request_overhead_s == 0.0
    plain = pool_from_dict({"instances": [{"name": "s", "model": "qwen3-0.6b",
                                           "url": "http://h", "profile": "qwen3-0.6b"}]})
    now = time.monotonic()
    with_overhead = InstanceState(small, pool, GatewayMetrics(), MemoryStore(), now)
    without = InstanceState(plain.instances[0], plain, GatewayMetrics(), MemoryStore(), now)
    est = SfsEstimator()
    est.ttft(without, 100, now)  # (compiles the forecast on a first run)
    # both asked as of the instants their replicas were made (µs apart): however long the
    # first call took, neither forecast is past its instance's clock
    got = est.ttft(with_overhead, 100, now) - est.ttft(without, 100, now)
    assert got == pytest.approx(0.0125, abs=1e-3)


def test_the_frontend_s_queue_enters_sfs_s_forecast(tmp_path):
    """An instance's ``frontend`` (the API server's costs from `duetime calibrate`) reaches
    its spec and adds its chunks' queue to SFS's forecast: nothing on an idle instance (its
    own work is in the request overhead), a chunk per stream ahead of a request on a busy
    one."""
    import time

    from duetime.engine.frontend import FrontendModel
    from duetime.estimate import SfsEstimator
    from duetime.gateway.backends.memory import MemoryStore
    from duetime.gateway.prometheus import GatewayMetrics
    from duetime.gateway.state.instance import InstanceState

    entry = {"name": "s", "model": "qwen3-0.6b", "url": "http://h", "profile": "qwen3-0.6b"}
    fe = pool_from_dict({"instances": [{**entry, "frontend": {"request_ms": 2, "chunk_ms": 5}}]})
    plain = pool_from_dict({"instances": [entry]})
    assert fe.instances[0].frontend == FrontendModel(0.002, 0.005)
    assert plain.instances[0].frontend is None
    now = time.monotonic()
    states = [InstanceState(p.instances[0], p, GatewayMetrics(), MemoryStore(), now)
              for p in (fe, plain)]
    est = SfsEstimator()

    est.ttft(states[1], 100, now)  # (compiles the forecast on a first run)
    now = time.monotonic()
    assert est.ttft(states[0], 100, now) == pytest.approx(est.ttft(states[1], 100, now),
                                                          abs=1e-3)
    for st in states:
        for k in range(3):
            st.shadow.engine.add(f"r{k}", 50, 100, arrival=now)
    now = time.monotonic()
    got = est.ttft(states[0], 100, now) - est.ttft(states[1], 100, now)
    assert got == pytest.approx(3 * 0.005, abs=1e-3)


def test_the_gateway_follows_an_api_server_s_hand_offs():
    """Requests sent to an instance with a ``frontend`` queue at its API server: the gateway
    counts the hand-offs it sent (from their dispatch times) and a request sent after k of
    them waits k hand-offs more in its forecast; ended requests no longer count once the
    queue has passed them."""
    from duetime.gateway.backends.memory import MemoryStore
    from duetime.gateway.prometheus import GatewayMetrics
    from duetime.gateway.state.flight import Flight
    from duetime.gateway.state.instance import InstanceState
    from duetime.gateway.state.lifecycle import Attempt, Lifecycle

    pool = pool_from_dict({"instances": [{"name": "s", "model": "qwen3-0.6b", "url": "http://h",
                                          "profile": "qwen3-0.6b",
                                          "frontend": {"request_ms": 20, "chunk_ms": 0}}]})
    t0 = 1000.0
    st = InstanceState(pool.instances[0], pool, GatewayMetrics(), MemoryStore(), t0)
    lifecycle = Lifecycle([])
    assert st.frontend_wait_s(t0) == 0.0
    for k in range(3):
        lifecycle.dispatch(Attempt(Flight(f"r{k}", 10, 5, t0, None), st, 1, t0, 1.0, "test",
                                   "shadow"))
    assert st.frontend_wait_s(t0) == pytest.approx(0.060)
    assert st.frontend_wait_s(t0 + 0.05) == pytest.approx(0.010)
    assert st.frontend_wait_s(t0 + 0.1) == 0.0


def test_the_gateway_counts_prompt_tokens_with_the_pools_tokenizer(tmp_path):
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from duetime.gateway.app import Gateway
    from duetime.web.requests import parse_completion

    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    gw = Gateway(load_pool(write(tmp_path, GOOD + "tokenizer: tokenizer.json\n")))

    def count(body: dict, chat: bool) -> int:
        return gw.intake.count_tokens(parse_completion(json.dumps(body).encode(), chat=chat))

    words = "hello world " * 50  # 100 words, 100 tokens; the estimate would say ~30
    assert count({"prompt": words}, False) == 100
    assert count({"prompt": [words]}, False) == 100
    assert count({"prompt": [5, 6, 7]}, False) == 3
    assert count({"messages": [{"role": "user", "content": words},
                               {"role": "user", "content": [{"type": "text",
                                                             "text": "hello"}]}]}, True) \
        == 3 + (4 + 100) + (4 + 1)


def test_long_prompts_are_tokenized_off_the_event_loop(tmp_path, monkeypatch):
    """A prompt estimated at OFF_LOOP_TOKENS or more is counted on a worker thread (the event
    loop goes on), a short one inline; both as count_tokens says."""
    import asyncio
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from duetime.gateway.app import Gateway
    from duetime.gateway.intake import request as intake
    from duetime.gateway.intake.request import KeyCheck
    from duetime.web.requests import parse_completion

    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    gw = Gateway(load_pool(write(tmp_path, GOOD + "tokenizer: tokenizer.json\n")))
    threads: list[bool] = []
    real = asyncio.to_thread

    async def to_thread(fn, *args, **kw):
        threads.append(kw.get("release", False))
        return await real(fn, *args, **kw)

    monkeypatch.setattr(intake.asyncio, "to_thread", to_thread)
    for words, off in (("hello world " * 20, False),
                       ("hello world " * (2 * intake.OFF_LOOP_TOKENS), True)):
        body = json.dumps({"model": "auto", "prompt": words, "max_tokens": 4}).encode()
        want = gw.intake.count_tokens(parse_completion(body, chat=False))
        ctx = asyncio.run(gw.intake.take(body, {"type": "http", "headers": []}, arrival=0.0,
                                         chat=False, keys=KeyCheck.NONE))
        assert ctx.req.prompt_tokens == want == len(words.split())
        assert threads == ([True] if off else [])

