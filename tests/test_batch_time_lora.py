"""The batch-time models' LoRA coefficients: priced only when fitted, written only then (the
form before them otherwise), read back, checked like the others, scaled with the rest."""

from __future__ import annotations

import pytest

from duetime.engine.batch_time import Paper4, Sfs6, model_from_dict
from duetime.engine.snapshot import Snapshot

BASE = Sfs6(c0=5e-3, cp=2e-5, cpsq=0.0, cd=3e-5, cs=1e-8, css=0.0)


def test_a_model_without_lora_coefficients_keeps_its_form() -> None:
    assert not BASE.prices_lora
    assert set(BASE.to_dict()["coefficients"]) == set(Sfs6.coefficient_names)
    assert BASE.lora_duration(10, 100) == 0.0


def test_lora_coefficients_round_trip_and_price_all_of_a_steps_tokens() -> None:
    m = BASE.with_lora(2e-3, 4e-5, 1e-4)
    assert m.prices_lora
    assert model_from_dict(m.to_dict()) == m
    assert m.lora_duration(4, 100) == pytest.approx(2e-3 + 100 * 4e-5 + 4 * 1e-4)
    assert m.scaled(2.0).lora_weights == pytest.approx((1e-3, 2e-5, 5e-5))
    p = Paper4(b0=1e-3, b1=1e-5, b2=1e-8, b3=1e-9).with_lora(1e-3, 0.0, 0.0)
    assert model_from_dict(p.to_dict()) == p


def test_lora_coefficients_are_checked_like_the_others() -> None:
    d = BASE.to_dict()
    with pytest.raises(ValueError, match=r"coefficients.lora_step: must be >= 0"):
        model_from_dict({**d, "coefficients": {**d["coefficients"], "lora_step": -1.0}})
    with pytest.raises(ValueError, match=r"optionally \['lora_step', 'lora_prefill', "
                                         r"'lora_decode'\]"):
        model_from_dict({**d, "coefficients": {**d["coefficients"], "lora_tok": 1.0}})


def test_a_snapshot_carries_the_lora_coefficients() -> None:
    from duetime.engine import Engine, SchedulerConfig

    eng = Engine(SchedulerConfig(max_loras=2), BASE.with_lora(2e-3, 4e-5, 1e-4))
    eng.add("a", 100, 5, lora=1)
    snap = Snapshot.from_dict(eng.snapshot().to_dict())
    assert snap.model == eng.model
