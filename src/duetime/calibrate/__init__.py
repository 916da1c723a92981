"""Calibration: fit an instance's batch-time model (live profiling of an endpoint)."""

from duetime.calibrate.endpoint import (
    Calibration,
    CalibrationError,
    Sample,
    cache_facts,
    calibrate,
    decode_row,
    fit,
    prefill_row,
)

__all__ = ["Calibration", "CalibrationError", "Sample", "cache_facts", "calibrate", "decode_row",
           "fit", "prefill_row"]
