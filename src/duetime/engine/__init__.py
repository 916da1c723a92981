"""The continuous-batching scheduler model (vLLM V1 rules), batch-time models and forecasts.

One implementation, used three ways: inside the SFS estimator (forecast TTFT from a snapshot),
as the ground-truth instance of the cluster simulator, and as the clock of the emulated server
(and the gateway's shadow replica of a live one).
"""

from duetime.engine.batch_time import MODELS, BatchTimeModel, Paper4, Sfs6, model_from_dict
from duetime.engine.config import SchedulerConfig
from duetime.engine.engine import Engine, RequestColumns, StepEvents
from duetime.engine.forecasting import (
    Forecast,
    Forecaster,
    ForecastError,
    forecast,
    forecaster,
    replay,
)
from duetime.engine.kv import KVLedger, blocks_for, held_blocks
from duetime.engine.profiles import load_profile, profile_names
from duetime.engine.remaining import stop_length
from duetime.engine.request import Request
from duetime.engine.scheduler import EngineStuck, ReferenceEngine, StepRecord
from duetime.engine.snapshot import ResidentRequest, Snapshot, SnapshotError
from duetime.engine.spec import InstanceSpec, resolve_spec
from duetime.engine.warmup import warm_up

__all__ = [
    "MODELS",
    "BatchTimeModel",
    "Engine",
    "EngineStuck",
    "Forecast",
    "ForecastError",
    "Forecaster",
    "InstanceSpec",
    "KVLedger",
    "Paper4",
    "ReferenceEngine",
    "Request",
    "RequestColumns",
    "ResidentRequest",
    "SchedulerConfig",
    "Sfs6",
    "Snapshot",
    "SnapshotError",
    "StepEvents",
    "StepRecord",
    "blocks_for",
    "forecast",
    "forecaster",
    "held_blocks",
    "load_profile",
    "model_from_dict",
    "profile_names",
    "replay",
    "resolve_spec",
    "stop_length",
    "warm_up",
]
