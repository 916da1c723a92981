"""duetime: route each LLM request to the model instance that gives the best answer in time."""

from duetime.engine import Forecast, Forecaster, ForecastError, Snapshot, SnapshotError, forecast

__version__ = "0.1.0"

__all__ = ["Forecast", "ForecastError", "Forecaster", "Snapshot", "SnapshotError", "__version__",
           "forecast"]
