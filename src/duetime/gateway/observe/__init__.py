"""Observation: the dashboard's history (:mod:`.observatory`) and feed (:mod:`.dashboard`), the
admin routes (:mod:`.admin`), the pages (:mod:`.pages`, ``static/``), the OpenAPI document
(:mod:`.openapi`) and the attempts' Prometheus series (:mod:`.attempt_metrics`); what they read
of the gateway: :mod:`.view`."""
