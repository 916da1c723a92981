"""Shared-prefix workloads: segments and their block hashes, the generators' statistics, the
Mooncake trace loader, reproducibility."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from duetime.workload import (
    Geometric,
    ProfileError,
    RequestSet,
    block_hashes,
    load_mooncake_trace,
    load_workload,
    multi_turn,
    prompt_hashes,
    sample_requests,
    sequence_hashes,
    shared_prefix,
    tenants,
)
from duetime.workload.profile import LogNormal

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def profile():
    return load_workload("demo")


def _tokens(segments) -> list[tuple[int, int]]:
    """The token-level truth: token j = (segment id, offset in it)."""
    return [(sid, o) for sid, length in segments for o in range(length)]


def _random_family(rng: np.random.Generator, n: int) -> list[tuple[tuple[int, int], ...]]:
    """Sequences that share prefixes of random lengths, with segment boundaries anywhere (also
    inside blocks) and zero-length segments."""
    base = tuple((int(i), int(rng.integers(0, 40))) for i in rng.integers(1, 6, 6))
    out = [base]
    for _ in range(n - 1):
        cut = int(rng.integers(0, len(base) + 1))
        head = list(base[:cut])
        if head and rng.random() < 0.5:  # keep only part of the last shared segment
            sid, length = head[-1]
            head[-1] = (sid, int(rng.integers(0, length + 1)))
        tail = [(int(rng.integers(1, 9)), int(rng.integers(0, 40)))
                for _ in range(rng.integers(0, 4))]
        out.append(tuple(head + tail))
    return out


# -- block hashes -------------------------------------------------------------------------------

@pytest.mark.parametrize("bs", [1, 7, 16, 32])
def test_hashes_equal_exactly_while_the_tokens_are(bs):
    rng = np.random.default_rng(bs)
    for _ in range(30):
        family = _random_family(rng, 6)
        toks = [_tokens(s) for s in family]
        hs = [block_hashes(s, bs) for s in family]
        for a in range(len(family)):
            assert len(hs[a]) == len(toks[a]) // bs  # a partial block gets no hash
            assert hs[a].dtype == np.int64
            for b in range(len(family)):
                for k in range(min(len(hs[a]), len(hs[b]))):
                    same = toks[a][:(k + 1) * bs] == toks[b][:(k + 1) * bs]
                    assert (hs[a][k] == hs[b][k]) == same, (family[a], family[b], k)


def test_equal_up_to_the_first_differing_block():
    a = ((1, 40), (2, 30))
    b = ((1, 40), (3, 30))
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert len(ha) == len(hb) == 4
    assert (ha[:2] == hb[:2]).all()          # tokens 0..31 equal
    assert (ha[2:] != hb[2:]).all()          # token 40 differs: block 2 and, chained, block 3
    # a boundary inside block 0: segments differ from token 10
    c, d = ((1, 10), (2, 30)), ((1, 10), (3, 30))
    assert (block_hashes(c, 16) != block_hashes(d, 16)).all()
    # a segment is a prefix of a longer one: (2, 20) is (2, 30)'s first 20 tokens
    e = ((1, 10), (2, 20))
    assert len(block_hashes(e, 16)) == 1 and block_hashes(e, 16)[0] == block_hashes(c, 16)[0]
    # the same segment restarted vs continued: same ids, different offsets
    f, g = block_hashes(((1, 16), (1, 16)), 16), block_hashes(((1, 32),), 16)
    assert f[0] == g[0] and f[1] != g[1]
    # chained: equal blocks after different ones still differ
    h, i = block_hashes(((1, 16), (9, 16)), 16), block_hashes(((2, 16), (9, 16)), 16)
    assert h[1] != i[1]


def test_partial_blocks_are_not_hashed():
    h47 = block_hashes(((5, 47),), 16)
    h48 = block_hashes(((5, 47), (6, 1)), 16)
    assert len(h47) == 2 and len(h48) == 3
    assert (h48[:2] == h47).all()
    assert len(block_hashes(((5, 15),), 16)) == 0
    assert len(block_hashes((), 16)) == 0


def test_block_size_independence():
    """Same segments at 16 and 32: a 32-block matches iff both its 16-halves (and everything
    before) match."""
    rng = np.random.default_rng(7)
    for _ in range(40):
        fam = _random_family(rng, 4)
        for a in fam:
            for b in fam:
                s16 = [block_hashes(x, 16) for x in (a, b)]
                s32 = [block_hashes(x, 32) for x in (a, b)]
                for k in range(min(len(s32[0]), len(s32[1]))):
                    halves = s16[0][2 * k + 1] == s16[1][2 * k + 1]  # chained: covers 0..2k+1
                    assert (s32[0][k] == s32[1][k]) == halves


def test_hashes_are_the_same_in_other_processes():
    segs = ((1 << 56 | 3, 300), (2 << 56 | 9, 77), (-5, 40))
    code = ("from duetime.workload import block_hashes; "
            f"print(block_hashes({segs!r}, 16).tolist())")
    outs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True)
        outs.append(json.loads(run.stdout))
    assert outs[0] == outs[1] == block_hashes(segs, 16).tolist()
    assert len(set(outs[0])) == len(outs[0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(((1, 10),), 0)
    with pytest.raises(ValueError, match="negative"):
        block_hashes(((1, -1),), 4)
    plain = sample_requests(load_workload("demo"), np.arange(3.0), np.random.default_rng(0))
    assert plain.segments is None and plain.session is None and plain.answer_segment is None
    with pytest.raises(ValueError, match="no segments"):
        prompt_hashes(plain, 0, 16)


# -- multi-turn ---------------------------------------------------------------------------------

def _by_session(r: RequestSet) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i in np.argsort(r.arrival, kind="stable"):
        out.setdefault(int(r.session[i]), []).append(int(i))
    return out


def _check_columns(r: RequestSet) -> None:
    n = len(r)
    assert len(r.segments) == n and r.session.shape == (n,) and r.answer_segment.shape == (n,)
    assert (np.diff(r.arrival) >= 0).all()
    assert [sum(length for _, length in s) for s in r.segments] == r.prompt.tolist()
    assert r.output.shape == (n, len(r.models)) and (r.output >= 1).all()
    assert ((r.target >= 0.15 - 1e-9) & (r.target <= 1.12 + 1e-9)).all()
    assert len(set(r.answer_segment.tolist())) == n  # every answer is new content


def test_multi_turn_prompts_grow_by_the_answer_and_a_question(profile):
    r = multi_turn(profile, 2.0, np.random.default_rng(1), n_sessions=4000, turns=Geometric(4),
                   think_time_s=5.0, decode_s_per_token=0.01, system_prompt_len=300,
                   system_prompts=3, max_context=10**9)
    _check_columns(r)
    assert (r.output == r.output[:, :1]).all()  # the same answer length for every model
    sessions = _by_session(r)
    assert len(sessions) == 4000
    gaps, turns = [], []
    systems = set()
    for idx in sessions.values():
        turns.append(len(idx))
        systems.add(r.segments[idx[0]][0])
        for prev, nxt in pairwise(idx):
            grown = (*r.segments[prev], (int(r.answer_segment[prev]), int(r.output[prev, 0])))
            assert r.segments[nxt][:-1] == grown
            assert len(r.segments[nxt]) == len(grown) + 1
            gaps.append(r.arrival[nxt] - r.arrival[prev] - 0.01 * r.output[prev, 0])
            # the next prompt's blocks start with this request's prompt + answer blocks
            seq = sequence_hashes(r, prev, int(r.output[prev, 0]), 16)
            assert (prompt_hashes(r, nxt, 16)[:len(seq)] == seq).all()
    assert abs(np.mean(turns) - 4.0) < 0.2
    assert abs(np.mean(gaps) - 5.0) < 0.15
    assert np.std(gaps) == pytest.approx(5.0, rel=0.05)  # exponential: std = mean
    assert {s[1] for s in systems} == {300} and len(systems) == 3
    starts = np.sort([r.arrival[idx[0]] for idx in sessions.values()])
    assert np.mean(np.diff(starts)) == pytest.approx(0.5, rel=0.05)


def test_multi_turn_context_cap_and_duration(profile):
    r = multi_turn(profile, 5.0, np.random.default_rng(2), duration=200.0, turns=10,
                   question_len=LogNormal(100, 0.5, 10, 400), answer_len=300,
                   max_context=1500)
    _check_columns(r)
    assert (r.prompt + r.output[:, 0] <= 1500).all()
    sessions = _by_session(r)
    assert abs(len(sessions) - 1000) < 4 * np.sqrt(1000)
    firsts = [r.arrival[idx[0]] for idx in sessions.values()]
    assert max(firsts) <= 200.0
    n_turns = np.array([len(idx) for idx in sessions.values()])
    assert n_turns.max() < 10 and n_turns.min() >= 1  # every session was cut by the cap
    assert all(len(r.segments[i]) == 1 for i in (idx[0] for idx in sessions.values()))
    with pytest.raises(ValueError, match="exactly one"):
        multi_turn(profile, 1.0, np.random.default_rng(0))


# -- tenants --------------------------------------------------------------------------------------

def test_tenants_popularity_and_prompts(profile):
    n, k = 30000, 8
    r = tenants(profile, 10.0, n, np.random.default_rng(3), n_tenants=k, system_len=500,
                popularity="zipf", zipf_s=1.0)
    _check_columns(r)
    w = 1.0 / np.arange(1, k + 1)
    freq = np.bincount(r.session, minlength=k) / n
    assert np.abs(freq - w / w.sum()).max() < 0.01
    sys_of = {}
    for i, s in enumerate(r.segments):
        assert len(s) == 2 and s[0][1] == 500
        assert sys_of.setdefault(int(r.session[i]), s[0]) == s[0]  # one system prompt a tenant
    assert len(set(sys_of.values())) == k
    assert len({s[1][0] for s in r.segments}) == n  # every question is unique
    # question lengths are the profile's prompt lengths of each request's task
    for ti, t in enumerate(r.tasks):
        q = r.prompt[r.task == ti] - 500
        spec = profile.tasks[t].prompt
        assert q.min() >= spec.lo and q.max() <= spec.hi
        assert np.median(q) == pytest.approx(spec.median, rel=0.1)
    u = tenants(profile, 10.0, n, np.random.default_rng(4), n_tenants=k, popularity="uniform",
                question_len=20)
    assert np.abs(np.bincount(u.session, minlength=k) / n - 1 / k).max() < 0.01
    assert (u.prompt == 1020).all()
    with pytest.raises(ValueError, match="popularity"):
        tenants(profile, 1.0, 10, np.random.default_rng(0), n_tenants=3, popularity=[1, 2])


# -- shared_prefix ---------------------------------------------------------------------------------

def test_shared_prefix_prompts_and_shared_share(profile):
    g, p = 5, 10
    r = shared_prefix(profile, 20.0, 5000, np.random.default_rng(5), num_groups=g,
                      num_prompts_per_group=p, system_prompt_len=100, question_len=50,
                      output_len=50)
    _check_columns(r)
    distinct = set(r.segments)
    assert len(distinct) == g * p  # all used at this n, and never more
    assert (r.output == 50).all() and (r.prompt == 150).all()
    # share of prompt tokens in a prefix some other prompt shares = system / (system + question)
    first = [s[0] for s in distinct]
    shared_tokens = sum(s[0][1] for s in distinct if first.count(s[0]) > 1)
    assert shared_tokens / sum(length for s in distinct for _, length in s) == pytest.approx(
        100 / 150)
    # block hashes: a group's prompts share exactly the blocks of its system prompt
    groups = {}
    for i in range(len(r)):
        groups.setdefault(int(r.session[i]), set()).add(tuple(prompt_hashes(r, i, 16)))
    for hs in groups.values():
        assert len(hs) == p
        assert len({h[:6] for h in hs}) == 1 and len({h[6] for h in hs}) == p  # 100 // 16 = 6
    freq = np.bincount(r.session, minlength=g) / len(r)
    assert np.abs(freq - 1 / g).max() < 0.03


def test_shared_prefix_cycle_order(profile):
    r = shared_prefix(profile, 1.0, 25, np.random.default_rng(6), num_groups=3,
                      num_prompts_per_group=4, order="cycle")
    first, second = r.segments[:12], r.segments[12:24]
    assert len(set(first)) == 12 and first == second and r.segments[24] == first[0]


def test_shared_prefix_few_requests_use_at_most_the_configured_prompts(profile):
    r = shared_prefix(profile, 1.0, 30, np.random.default_rng(8), num_groups=10,
                      num_prompts_per_group=10)
    assert len(set(r.segments)) <= 30
    assert len({s[0] for s in r.segments}) <= 10


# -- Mooncake ------------------------------------------------------------------------------------

def test_mooncake_trace_lengths_and_sharing(profile):
    r = load_mooncake_trace(DATA / "mooncake_sample.jsonl", profile, np.random.default_rng(0))
    _check_columns(r)
    assert r.prompt.tolist() == [1300, 1100, 700, 512, 2100]
    assert r.arrival.tolist() == [0.0, 0.0, 1.5, 2.5, 4.0]
    assert r.output[:, 0].tolist() == [20, 5, 100, 1, 64] and (r.output == r.output[:, :1]).all()
    assert [length for _, length in r.segments[0]] == [512, 512, 276]
    assert [length for _, length in r.segments[4]] == [512] * 4 + [52]
    assert (r.session == -1).all()
    h = [prompt_hashes(r, i, 64) for i in range(len(r))]
    assert len(h[1]) == 17 and (h[0][:16] == h[1][:16]).all()  # ids 0, 1 shared
    assert h[0][16] != h[1][16]  # ids 2 vs 3
    assert h[3].tolist() == h[0][:8].tolist()
    h64 = [prompt_hashes(r, i, 64) for i in (2, 4)]
    assert len(h64[0]) == 10 and (h64[0] == h64[1][:10]).all()  # row 3 is row 5's prefix
    assert h64[1][10] not in set(np.concatenate([prompt_hashes(r, i, 64) for i in range(4)]))
    # trace ids never meet generated ones
    gen = shared_prefix(profile, 1.0, 20, np.random.default_rng(0))
    ids = {sid for s in r.segments for sid, _ in s} | set(r.answer_segment.tolist())
    assert not ids & ({sid for s in gen.segments for sid, _ in s}
                      | set(gen.answer_segment.tolist()))


def test_mooncake_sessions(profile, tmp_path):
    f = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [1],
             "session_id": "a"},
            {"timestamp": 7, "input_length": 10, "output_length": 3, "hash_ids": [2],
             "session_id": "b"},
            {"timestamp": 9, "input_length": 600, "output_length": 3, "hash_ids": [1, 3],
             "session_id": "a"}]
    f.write_text("\n".join(json.dumps(x) for x in rows))
    r = load_mooncake_trace(f, profile, np.random.default_rng(0))
    assert r.session.tolist() == [0, 1, 0]
    assert r.arrival.tolist() == [0.0, 0.007, 0.009]


@pytest.mark.parametrize(("row", "field"), [
    ('{"input_length": 10, "output_length": 1, "hash_ids": [0]}', "timestamp: missing"),
    ('{"timestamp": "x", "input_length": 10, "output_length": 1, "hash_ids": [0]}', "timestamp"),
    ('{"timestamp": 1, "output_length": 1, "hash_ids": [0]}', "input_length: missing"),
    ('{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 1.5, "hash_ids": [0]}',
     "output_length"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 1}', "hash_ids: missing"),
    ('{"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [0]}',
     "hash_ids: 1 ids for input_length 600"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [-1]}', "hash_ids"),
    ('{"timestamp": 1, "input_length": 10', "not valid JSON"),
    ('[1, 2]', "JSON object"),
])
def test_mooncake_bad_rows_name_file_line_and_field(profile, tmp_path, row, field):
    f = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}'
    f.write_text(f"{good}\n\n{row}\n")
    with pytest.raises(ProfileError) as e:
        load_mooncake_trace(f, profile, np.random.default_rng(0))
    assert str(e.value).startswith(f"{f}:3: ") and field in str(e.value)


def test_mooncake_unreadable_or_empty(profile, tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        load_mooncake_trace(tmp_path / "nope.jsonl", profile, np.random.default_rng(0))
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ProfileError, match="no rows"):
        load_mooncake_trace(tmp_path / "e.jsonl", profile, np.random.default_rng(0))


# -- reproducibility -----------------------------------------------------------------------------

def _same(a: RequestSet, b: RequestSet) -> bool:
    arrays = ("arrival", "task", "prompt", "output", "quality", "target", "session",
              "answer_segment")
    return (all(np.array_equal(getattr(a, k), getattr(b, k)) for k in arrays)
            and a.segments == b.segments and a.tasks == b.tasks and a.models == b.models)


@pytest.mark.parametrize("make", [
    lambda p, rng: multi_turn(p, 1.0, rng, n_sessions=50, system_prompt_len=200),
    lambda p, rng: tenants(p, 3.0, 200, rng, n_tenants=5),
    lambda p, rng: shared_prefix(p, 3.0, 200, rng),
    lambda p, rng: load_mooncake_trace(DATA / "mooncake_sample.jsonl", p, rng),
])
def test_same_seed_same_request_set(profile, make):
    a = make(profile, np.random.default_rng(11))
    b = make(profile, np.random.default_rng(11))
    c = make(profile, np.random.default_rng(12))
    assert _same(a, b)
    assert not _same(a, c)
