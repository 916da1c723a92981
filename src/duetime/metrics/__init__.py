"""Metrics over a simulation's requests: TTFT statistics, on-time rate, utility,
OnTimeUtility, AUC over load, routing shares, forecast error, completion deadlines and TPOT
targets."""

from duetime.metrics.summary import (
    auc,
    deadline_met,
    forecast_mape,
    routing_share,
    summarize,
    tpot_met,
)

__all__ = ["auc", "deadline_met", "forecast_mape", "routing_share", "summarize", "tpot_met"]
