"""Metrics over a simulation's requests: TTFT statistics, on-time rate, utility,
OnTimeUtility, AUC over load, routing shares, forecast error."""

from duetime.metrics.summary import auc, forecast_mape, routing_share, summarize

__all__ = ["auc", "forecast_mape", "routing_share", "summarize"]
