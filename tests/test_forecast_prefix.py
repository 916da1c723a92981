"""Forecasts with prefix caching: exact against the future the engine really runs, and they
leave the engine's cache as they found it (they borrow it: ``duetime.engine.prefix_state``)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from duetime.engine import (
    Engine,
    EngineStuck,
    ForecastError,
    SchedulerConfig,
    forecast,
    replay,
)
from duetime.engine.block_pool_kernel import SAVED, U_OWNER, queue_of
from snapshots import PAPER4, SFS6


def _engine(seed: int, blocks: int | None = None
            ) -> tuple[Engine, list[list[int]], list[tuple[int, list[int]]]]:
    """An engine with caching, after a seeded history of shared-prefix arrivals (``blocks``:
    its KV blocks, instead of a seeded choice)."""
    rng = random.Random(seed)
    budget, seqs, bs = rng.choice([64, 512, 2048]), rng.choice([4, 16, 64]), rng.choice([4, 16])
    drawn = rng.choice([120, 400, 5000])
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=4096,
                          block_size=bs, num_gpu_blocks=drawn if blocks is None else blocks,
                          long_prefill_token_threshold=rng.choice([0, 0, 64]),
                          scheduler_reserve_full_isl=rng.choice([True, True, False]),
                          async_scheduling=rng.random() < 0.5, enable_prefix_caching=True)
    eng = Engine(cfg, rng.choice([PAPER4, SFS6]))
    bs = cfg.block_size
    systems = [[rng.getrandbits(62) for _ in range(rng.randint(2, 20))] for _ in range(3)]
    history: list[tuple[int, list[int]]] = []
    for k in range(rng.randint(5, 120)):
        for _ in range(rng.choice([0, 0, 1, 2])):
            base, keys = _shared(rng, bs, systems, history, 0.4)
            t = rng.randint(1, 40)
            # (what fits the instance: a request that never can would block the queue)
            p = min(base + rng.randint(1, 150), 3000, cfg.usable_blocks * bs - t - 1)
            keys = _continued(rng, keys, p, p + t, bs)
            history.append((p + t, keys))
            eng.add(f"q{k}.{len(history)}", p, t, hashes=keys)
        eng.step()
    return eng, systems, history


def _probes(rng: random.Random, bs: int, systems, history) -> list[tuple[int, list[int]]]:
    out = []
    for _ in range(4):
        tokens, keys = _shared(rng, bs, systems, history, 0.5)
        p = min(tokens + rng.randint(1, 100), 3500)
        out.append((p, _continued(rng, keys, p, p, bs)))
    return out


def _shared(rng: random.Random, bs: int, systems, history, p_history: float
            ) -> tuple[int, list[int]]:
    """(tokens, keys) a new sequence starts with: an earlier one (with probability
    ``p_history``), else a system prompt."""
    if history and rng.random() < p_history:
        return rng.choice(history)
    keys = rng.choice(systems)
    return len(keys) * bs, keys


def _continued(rng: random.Random, keys: list[int], shared: int, tokens: int,
               bs: int) -> list[int]:
    """The keys of a sequence of ``tokens`` that shares its first ``shared`` tokens' blocks
    with ``keys`` and goes on with new content."""
    return (keys[:shared // bs] + [rng.getrandbits(62) for _ in range(tokens // bs)])[
        :tokens // bs]


@pytest.mark.parametrize("blocks", [None, 120])
@pytest.mark.parametrize("seed", range(40))
def test_a_forecast_with_caching_is_the_future_the_engine_runs(seed: int, blocks) -> None:
    """(``blocks=120``: KV so tight that the replays preempt requests that held blocks at the
    snapshot, and admit them again.)"""
    eng, systems, history = _engine(seed, blocks)
    snap = eng.snapshot()
    pool, keys, free = eng._pool.copy(), eng._kmap.copy(), eng.free_blocks
    rng = random.Random(seed)
    for i, (p, hashes) in enumerate(_probes(rng, eng.config.block_size, systems, history)):
        try:
            got = forecast(snap, p, prompt_hashes=hashes)
        except ForecastError:
            continue
        # the engine's cache is as it was once the engine reads it (a forecaster keeps its
        # replay on it until then: block_pool_kernel.lease)
        eng.check_invariants()
        assert (eng._pool[:, :SAVED] == pool[:, :SAVED]).all()
        assert (eng._kmap[:, :2] == keys[:, :2]).all()
        assert eng.free_blocks == free
        # the same engine, really run with the probe
        twin = _engine(seed, blocks)[0]
        twin.add("probe", p, 1, hashes=hashes)
        t0 = twin.time
        if np.isinf(got.estimate_s):  # the queue ahead is blocked for good
            with pytest.raises(EngineStuck):
                twin.drain()
            continue
        while np.isnan(twin.lookup(["probe"]).first_token[0]):
            twin.step()
        want = float(twin.lookup(["probe"]).first_token[0]) - t0
        assert got.estimate_s == pytest.approx(want, rel=1e-9, abs=1e-12), f"probe {i}"


def test_the_probe_hits_what_the_instance_holds() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=4096,
                          block_size=16, num_gpu_blocks=1000, enable_prefix_caching=True)
    eng = Engine(cfg, PAPER4)
    system = list(range(1, 33))  # 512 tokens of system prompt
    eng.add("a", 600, 5, hashes=[*system, 99, 98, 97, 96, 95])
    eng.drain()
    snap = eng.snapshot()
    cold = forecast(snap, 600).estimate_s  # no keys: nothing to hit
    warm = forecast(snap, 600, prompt_hashes=[*system, 7, 7, 7, 7, 7]).estimate_s
    assert warm < cold / 3  # 512 of its 600 tokens are cached
    off = Engine(dataclasses.replace(cfg, enable_prefix_caching=False), PAPER4)
    assert forecast(off.snapshot(), 600).estimate_s == pytest.approx(cold)


def test_a_stale_snapshot_of_a_caching_engine_is_refused() -> None:
    cfg = SchedulerConfig(num_gpu_blocks=1000, enable_prefix_caching=True)
    eng = Engine(cfg, PAPER4)
    eng.add("a", 100, 50)
    eng.step()
    snap = eng.snapshot()
    eng.step()
    with pytest.raises(ForecastError, match="changed since"):
        forecast(snap, 100)
    assert forecast(eng.snapshot(), 100).estimate_s > 0
    assert queue_of(eng._pool)  # the pool is intact


EXAMPLE = {
    "version": 2, "time": 100.0,
    "config": {"max_num_batched_tokens": 2048, "max_num_seqs": 8, "max_model_len": 4096,
               "block_size": 16, "num_gpu_blocks": 100, "enable_prefix_caching": True},
    "batch_time": {"model": "paper4", "coefficients": {"b0": 0.004, "b1": 2e-5, "b2": 5e-8,
                                                       "b3": 1e-9}},
    "running": [{"id": "a", "prompt_tokens": 40, "computed_tokens": 40, "output_tokens": 1,
                 "predicted_output_tokens": 50, "block_hashes": ["s0", "s1"]}],
    "waiting": [{"id": "b", "prompt_tokens": 64, "predicted_output_tokens": 10,
                 "block_hashes": ["s0", "s1", "b2", "b3"]}],
    "prefix_cache": {"cached_free": ["t0", "t1", "t2"], "free_empty": 90},
}


def test_a_version_2_snapshot_carries_the_cache() -> None:
    from duetime.engine import Snapshot, replay

    snap = Snapshot.from_dict(EXAMPLE)
    cold = forecast(snap, 48).estimate_s
    warm = forecast(snap, 48, prompt_hashes=["t0", "t1", "t2"])  # 2 blocks hit (not the last)
    assert warm.estimate_s < cold
    # b hits a's two registered blocks: with the probe it computes 32 + 16 tokens, not 64 + 48
    trace = replay(snap, 48, prompt_hashes=["t0", "t1", "t2"])
    assert trace.estimate_s == warm.estimate_s
    out = snap.to_dict()
    assert out["version"] == 2 and out["prefix_cache"]["free_empty"] == 93  # 3 unlisted
    assert len(out["prefix_cache"]["cached_free"]) == 3
    again = Snapshot.from_dict(out)  # keys exported as integers: the same cache
    assert forecast(again, 48, prompt_hashes=out["prefix_cache"]["cached_free"]
                    ).estimate_s == warm.estimate_s


@pytest.mark.parametrize("seed", range(20))
def test_the_json_form_forecasts_as_the_live_engine(seed: int) -> None:
    import json

    from duetime.engine import Snapshot

    eng, systems, history = _engine(seed)
    snap = eng.snapshot()
    again = Snapshot.from_dict(json.loads(json.dumps(snap.to_dict())))
    for p, hashes in _probes(random.Random(seed), eng.config.block_size, systems, history):
        try:
            want = forecast(snap, p, prompt_hashes=hashes).estimate_s
        except ForecastError:
            continue
        assert forecast(again, p, prompt_hashes=hashes).estimate_s == want


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(version=1), "needs a snapshot of version 2"),
    (lambda d: d["config"].update(enable_prefix_caching=False), "need prefix caching on"),
    (lambda d: d["waiting"][0].update(block_hashes=[1.5]), r"waiting\[0\]\.block_hashes"),
    (lambda d: d["running"][0].update(block_hashes=[1 << 70]), "does not fit 64 bits"),
    (lambda d: d["prefix_cache"].update(free_empty=97), "exceed the 96 blocks"),
    (lambda d: d["prefix_cache"].update(extra=1), "prefix_cache.extra"),
    (lambda d: d["running"][0].update(block_ids=[1, 2]), r"running\[0\]\.block_ids: 2 ids"),
    (lambda d: d["running"][0].update(block_ids=["x", 1, 2]), r"running\[0\]\.block_ids"),
    (lambda d: d["running"][0].update(block_ids=[7, 7, 8]), "under two different hashes"),
    (lambda d: d["waiting"][0].update(block_ids=[1]), r"waiting\[0\]\.block_ids"),
])
def test_version_2_errors_name_the_field(change, message) -> None:
    import copy

    from duetime.engine import Snapshot, SnapshotError

    d = copy.deepcopy(EXAMPLE)
    change(d)
    with pytest.raises(SnapshotError, match=message):
        Snapshot.from_dict(d)


def test_the_cli_forecasts_a_version_2_snapshot(tmp_path) -> None:
    import json
    import subprocess
    import sys

    path = tmp_path / "snap.json"
    path.write_text(json.dumps(EXAMPLE))

    def run(*extra: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "duetime", "forecast", str(path),
                              "--prompt-tokens", "48", *extra], capture_output=True,
                             text=True, check=True)
        return json.loads(out.stdout)

    assert run("--prompt-hashes", '["t0", "t1", "t2"]')["estimate_s"] < run()["estimate_s"]


@pytest.mark.parametrize("seed", range(40))
def test_forecasters_that_keep_the_cache_take_turns(seed: int) -> None:
    """A forecaster keeps its replay on the engine's cache between calls (a lease); another
    forecaster of the same state, an exact replay, or the engine itself takes the cache back
    first. Interleaved — short probes, then longer ones that make each forecaster replay
    further — every answer is the one a fresh forecaster gives, and the engine then runs as
    a twin that was never forecast."""
    eng, systems, _ = _engine(seed, blocks=5000)  # (roomy: the probes rarely replay alone)
    rng = random.Random(seed)
    bs = eng.config.block_size
    probes = []
    for p in (bs + 1, 3 * bs, 300, 1200, 2500, 3500):
        keys = _continued(rng, rng.choice(systems), p, p, bs)
        probes += [(p, keys), (p, keys)]
    want = {}
    for i, (p, hashes) in enumerate(probes):  # each alone: a fresh snapshot, a fresh forecaster
        try:
            want[i] = forecast(eng.snapshot(time=eng.time), p, prompt_hashes=hashes).estimate_s
        except ForecastError:
            want[i] = None
    a, b = eng.snapshot(), eng.snapshot(time=eng.time)  # two forecasters of one state
    for i, (p, hashes) in enumerate(probes):
        try:
            got = forecast(a if i % 2 else b, p, prompt_hashes=hashes).estimate_s
        except ForecastError:
            got = None
        assert got == want[i], f"probe {i}"
        if i % 5 == 4 and want[i] is not None:  # an exact replay takes the cache in between
            replay(a, p, prompt_hashes=hashes)
    twin = _engine(seed, blocks=5000)[0]
    leased = 0
    for _ in range(60):  # the engine takes its cache back before it steps
        if eng.idle:
            break
        if not eng.snapshot().prefix.undo[U_OWNER]:  # a forecaster keeps its replay on it
            p = min(300, (eng.config.usable_blocks - 1) * bs)
            forecast(eng.snapshot(), p, prompt_hashes=probes[-1][1][:p // bs])
        leased += bool(eng.snapshot().prefix.undo[U_OWNER])
        got, ref = eng.step(), twin.step()
        assert (got.end, got.scheduled, got.first_token_ids, got.finished_ids, got.preempted,
                got.prefix_hits) == (ref.end, ref.scheduled, ref.first_token_ids, ref.finished_ids,
                                     ref.preempted, ref.prefix_hits)
        eng.check_invariants()
        assert eng.cached_blocks == twin.cached_blocks
    assert leased


def test_block_ids_say_which_blocks_are_shared() -> None:
    """Two running requests with the same keys: with one set of ids they share their blocks,
    with two they hold duplicates (vLLM keeps both); the free count differs by the blocks."""
    import copy

    from duetime.engine import Snapshot

    d = copy.deepcopy(EXAMPLE)
    d["running"].append({"id": "c", "prompt_tokens": 40, "computed_tokens": 40,
                         "output_tokens": 1, "predicted_output_tokens": 50,
                         "block_hashes": ["s0", "s1"]})
    d["prefix_cache"]["free_empty"] = 0
    shared = copy.deepcopy(d)
    shared["running"][0]["block_ids"] = [5, 6, 7]
    shared["running"][1]["block_ids"] = [5, 6, 11]  # (the last, partly filled: its own)
    own = copy.deepcopy(d)
    own["running"][0]["block_ids"] = [5, 6, 7]
    own["running"][1]["block_ids"] = [9, 10, 11]
    usable = d["config"]["num_gpu_blocks"] - 1
    assert Snapshot.from_dict(shared).prefix.free == usable - 4
    assert Snapshot.from_dict(own).prefix.free == usable - 6
    assert Snapshot.from_dict(d).prefix.free == usable - 4  # (without ids: read as shared)


def test_shared_blocks_count_once_in_a_forecast() -> None:
    """Running requests that share blocks may hold more blocks between them than the instance
    has; a forecast counts each block once (it was refused: "hold more KV blocks than the
    instance has")."""
    import copy

    from duetime.engine import Snapshot

    d = copy.deepcopy(EXAMPLE)
    d["config"]["num_gpu_blocks"] = 6  # 5 usable: a and c hold 3 each, 2 of them shared
    d["running"].append({"id": "c", "prompt_tokens": 40, "computed_tokens": 40,
                         "output_tokens": 1, "predicted_output_tokens": 2,
                         "block_hashes": ["s0", "s1"]})
    d["waiting"] = []
    d["prefix_cache"] = {"cached_free": [], "free_empty": 1}
    snap = Snapshot.from_dict(d)
    assert snap.prefix.free == 1
    got = forecast(snap, 16)
    assert 0 < got.estimate_s < float("inf")


@pytest.mark.parametrize("seed", range(30))
def test_a_forecast_writes_no_block_list_of_the_engine(seed: int) -> None:
    """A forecast replays on the engine's block arena (prefix_state): a running request that
    held blocks at the snapshot, preempted in the replay and admitted again, writes only in
    its own slice past the engine's, so the engine's block lists stay as they were (tight KV
    makes the replays preempt)."""
    eng, systems, history = _engine(seed, blocks=120)
    arena = eng._rb[:eng._rb_used].copy()
    rng = random.Random(seed)
    snap = eng.snapshot()
    for p, hashes in _probes(rng, eng.config.block_size, systems, history):
        try:
            forecast(snap, p, prompt_hashes=hashes)
        except ForecastError:
            continue
    assert (eng._rb[:eng._rb_used] == arena).all()
    eng.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_the_cache_follows_what_the_instance_reports(seed: int) -> None:
    """``cache_store`` / ``cache_drop`` / ``cache_clear`` (what a router's mirror of vLLM's KV
    events tells the replica): stored keys are hit by the next request and by forecasts,
    dropped ones are not, the accounting holds, and the engine runs on as before."""
    eng, systems, _ = _engine(seed)
    eng.drain()  # (idle: a probe is admitted at once, so its hits are what the cache holds)
    rng = random.Random(seed + 1000)  # (not _engine's stream: its keys would collide)
    bs = eng.config.block_size
    new = [rng.getrandbits(62) for _ in range(6)]
    placed = eng.cache_store(new)
    eng.check_invariants()
    assert placed == min(6, eng.free_blocks)  # (one free block per key, none freed)
    assert eng.cached_prefix(new) == placed and eng.cache_store(new[:placed]) == 0
    snap = eng.snapshot()
    p = placed * bs + 7
    warm = forecast(snap, p, prompt_hashes=new[:placed]).estimate_s
    cold = forecast(snap, p, prompt_hashes=[rng.getrandbits(62)]).estimate_s
    assert warm < cold
    held = list(systems[0])
    dropped = eng.cache_drop([*new[:2], *held])
    eng.check_invariants()
    assert eng.cached_prefix(new[:2]) == 0 and eng.cached_prefix(held) == 0
    assert dropped >= min(placed, 2)
    eng.add("after", 3 * bs, 4, hashes=new[2:5])
    for _ in range(400):
        if eng.idle:
            break
        eng.step()
        eng.check_invariants()
    cached = eng.cached_blocks
    assert eng.cache_clear() == cached
    assert eng.cached_blocks == 0 and eng.cached_prefix(new) == 0
    eng.check_invariants()


def test_told_keys_leave_the_queue_in_vllms_order() -> None:
    """A stored key takes the free queue's head (evicting the least recent cached block) and
    becomes the most recent; a dropped free block goes to the front, without its key."""
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=4096,
                          block_size=16, num_gpu_blocks=5, enable_prefix_caching=True)
    eng = Engine(cfg, PAPER4)
    assert eng.cache_store([11, 12, 13, 14]) == 4  # 4 usable blocks (block 0 is the null one)
    assert eng.cache_store([15]) == 1  # evicts 11, the least recent
    assert eng.cached_prefix([11]) == 0 and eng.cached_prefix([12, 13, 14, 15]) == 4
    assert eng.cache_drop([13]) == 1
    assert eng.cache_store([16]) == 1  # takes that block first (the front), not 12's
    assert eng.cached_prefix([12]) == 1 and eng.cached_blocks == 4
    eng.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_the_events_index_reads_each_keys_events_in_time_order(seed: int) -> None:
    """``events_by_key`` and ``hits_at`` against a reading of the raw log: random add /
    remove events of a few keys at rising stamps (keys repeated, groups interleaved); at every
    stamp, how many of a probe's leading keys are cached equals the brute-force answer (a key
    with events is as its last event at or before the stamp says, before its first one the
    opposite of it; one without is as the table says)."""
    from duetime.engine.block_pool_kernel import (
        U_EV,
        U_NEV,
        U_STAMP,
        key_put,
        new_key_map,
        new_pool,
        new_undo,
    )
    from duetime.engine.forecasting import events_by_key, hits_at

    rng = random.Random(seed)
    keys = [rng.getrandbits(62) for _ in range(12)]
    kmap = new_key_map(64)
    for k in keys[:6]:  # cached at the "snapshot"
        key_put(kmap, k, 1)
    undo = new_undo(new_pool(16), kmap)
    log = []
    for stamp in range(40):
        for _ in range(rng.randint(0, 3)):
            k = rng.choice(keys)
            sign = rng.choice((-1, 1))
            log.append((stamp, k, sign))
    n = len(log)
    at = int(undo[U_EV])
    undo[at:at + 3 * n] = np.array(log, dtype=np.int64).ravel()
    undo[U_NEV] = n
    undo[U_STAMP] = 40
    ev_key, ev_stamp, ev_sign, index, ok = events_by_key(undo)
    assert ok
    for k in set(keys):  # one contiguous group per key, in the log's order
        mine = [(s, g) for s, kk, g in log if kk == k]
        got = list(zip(ev_stamp[ev_key == k].tolist(), ev_sign[ev_key == k].tolist(),
                       strict=True))
        assert got == mine
        idx = np.flatnonzero(ev_key == k)
        assert not len(idx) or idx.tolist() == list(range(idx[0], idx[0] + len(idx)))

    def cached(k: int, stamp: int) -> bool:
        mine = [(s, g) for s, kk, g in log if kk == k]
        if not mine:
            return k in keys[:6]
        seen = [g for s, g in mine if s <= stamp]
        return seen[-1] > 0 if seen else mine[0][1] < 0

    for _ in range(30):
        probe = rng.sample(keys, rng.randint(1, 8))
        for stamp in range(-1, 41):
            want = next((i for i, k in enumerate(probe) if not cached(k, stamp)), len(probe))
            got = hits_at(kmap, np.array(probe, dtype=np.int64), ev_key, ev_stamp, ev_sign,
                          index, stamp)
            assert got == want, (probe, stamp)
