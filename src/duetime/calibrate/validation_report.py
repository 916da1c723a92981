"""What ``duetime validate`` writes: ``results.csv`` (one row per request), ``summary.json``
(the pooled and per-load errors), ``report.md`` (the tables) and two PNGs (forecast against
observed TTFT; error against load)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from duetime.calibrate.validation import Record, error_stats, errors

CSV_FIELDS = ("id", "load", "arrivals", "sent_s", "prompt_tokens", "output_tokens", "chunks",
              "ttft_s", "predicted_ttft_s", "corrected_ttft_s", "e2e_s", "predicted_e2e_s",
              "error", "itl_s", "predicted_itl_s", "live_ttft_s", "step_ttft_s", "step_itl_s",
              "lora")

# per load: {"server": vLLM's histogram means over the load's runs, "replay": the replay's}
ServerComparison = dict[float, dict[str, dict[str, float]]]


def summarize(recs: list[Record], meta: dict[str, Any],
              server: ServerComparison | None = None) -> dict[str, Any]:
    """``summary.json``: errors as fractions (0.05 is 5%), pooled over all loads and per load
    (and per load and arrival process); with ``server``, each load's engine-side means (vLLM's
    histograms against the replay's)."""
    loads = sorted({r.load for r in recs})
    out: dict[str, Any] = dict(meta)
    _errors_into(out, recs)
    out["requests"] = len(recs)
    out["failed"] = sum(not r.ok for r in recs)
    adapters = any(r.lora for r in recs)
    if adapters:
        out["by_adapter"] = _by_adapter(recs)
    per: dict[str, Any] = {}
    for load in loads:
        sub = [r for r in recs if r.load == load]
        row: dict[str, Any] = {"requests": len(sub), "failed": sum(not r.ok for r in sub)}
        _errors_into(row, sub)
        ok = [r for r in sub if r.ok]
        row["observed_ttft_median_s"] = float(np.median([r.ttft for r in ok])) if ok else None
        row["predicted_ttft_median_s"] = (float(np.median([r.predicted_ttft for r in ok]))
                                          if ok else None)
        row["by_arrivals"] = {a: error_stats(errors([r for r in sub if r.arrivals == a],
                                                    "ttft"))
                              for a in sorted({r.arrivals for r in sub})}
        if adapters:
            row["by_adapter"] = _by_adapter(sub)
        cmp = (server or {}).get(load)
        if cmp:
            row["server"] = _server_row(cmp["server"], cmp["replay"])
        per[f"{load:g}"] = row
    out["per_load"] = per
    return out


def _by_adapter(recs: list[Record]) -> dict[str, Any]:
    """TTFT errors of the requests on the base model and of those on adapters."""
    return {"base": error_stats(errors([r for r in recs if not r.lora], "ttft")),
            "lora": error_stats(errors([r for r in recs if r.lora], "ttft"))}


def _server_row(srv: dict[str, float], rep: dict[str, float]) -> dict[str, float | None]:
    """The server's means (seconds), the replay's, and the replay's relative error."""
    row: dict[str, float | None] = {}
    for k in ("ttft", "itl", "queue"):
        row[f"{k}_mean_s"] = srv.get(k)
    for k in ("ttft", "itl"):
        row[f"replay_{k}_mean_s"] = rep.get(k)
        a, b = rep.get(k), srv.get(k)
        row[f"{k}_mean_pct_error"] = a / b - 1 if a is not None and b else None
    return row


def _errors_into(out: dict[str, Any], recs: list[Record]) -> None:
    """The static model's TTFT, e2e and ITL errors, the corrected TTFT's (``corrected_*``), the
    live forecast's (``live_*``) and the step-corrected replay's TTFT and ITL (``step_*``)."""
    for prefix, what, prediction in (("", "ttft", "predicted"), ("", "e2e", "predicted"),
                                     ("corrected_", "ttft", "corrected"),
                                     ("", "itl", "predicted"), ("live_", "ttft", "live"),
                                     ("step_", "itl", "step"), ("step_", "ttft", "step")):
        s = error_stats(errors(recs, what, prediction))
        out[f"{prefix}{what}_median_abs_pct_error"] = s["median_abs"]
        out[f"{prefix}{what}_mean_abs_pct_error"] = s["mean_abs"]
        out[f"{prefix}{what}_p90_abs_pct_error"] = s["p90_abs"]
        out[f"{prefix}{what}_median_pct_error"] = s["median"]


def _pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.1%}"


def table(summary: dict[str, Any]) -> str:
    """The per-load table (markdown)."""
    lines = ["| load | requests | failed | TTFT obs p50 | TTFT pred p50 | TTFT abs err p50 | "
             "MAPE | p90 | bias | corrected p50 | corrected p90 | e2e abs err p50 | e2e p90 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for load, row in summary["per_load"].items():
        obs, pred = row["observed_ttft_median_s"], row["predicted_ttft_median_s"]
        lines.append(
            f"| {load} | {row['requests']} | {row['failed']} | "
            f"{'n/a' if obs is None else f'{obs * 1000:.0f} ms'} | "
            f"{'n/a' if pred is None else f'{pred * 1000:.0f} ms'} | "
            f"{_pct(row['ttft_median_abs_pct_error'])} | "
            f"{_pct(row['ttft_mean_abs_pct_error'])} | {_pct(row['ttft_p90_abs_pct_error'])} | "
            f"{_pct(row['ttft_median_pct_error'])} | "
            f"{_pct(row['corrected_ttft_median_abs_pct_error'])} | "
            f"{_pct(row['corrected_ttft_p90_abs_pct_error'])} | "
            f"{_pct(row['e2e_median_abs_pct_error'])} | {_pct(row['e2e_p90_abs_pct_error'])} |")
    s = summary
    lines.append(f"| all | {s['requests']} | {s['failed']} | | | "
                 f"{_pct(s['ttft_median_abs_pct_error'])} | {_pct(s['ttft_mean_abs_pct_error'])}"
                 f" | {_pct(s['ttft_p90_abs_pct_error'])} | {_pct(s['ttft_median_pct_error'])} "
                 f"| {_pct(s['corrected_ttft_median_abs_pct_error'])} | "
                 f"{_pct(s['corrected_ttft_p90_abs_pct_error'])} "
                 f"| {_pct(s['e2e_median_abs_pct_error'])} | {_pct(s['e2e_p90_abs_pct_error'])} |")
    return "\n".join(lines)


def adapter_table(summary: dict[str, Any]) -> str:
    """With LoRA adapters in the mix: the TTFT error on the base model and on adapters, per
    load and pooled (a paragraph and a table; "" without adapters)."""
    if "by_adapter" not in summary:
        return ""
    lines = ["## LoRA adapters\n",
             f"{summary['mix'].get('lora_share', 0):.0%} of the requests on the adapters "
             f"{', '.join(summary['mix'].get('loras', []))} (drawn uniformly), the rest on the "
             "base model; the replay runs them with the profile's `max_loras` and LoRA "
             "terms.\n",
             "| load | base TTFT abs err p50 | p90 | adapters TTFT abs err p50 | p90 | "
             "adapters bias |", "|---|---|---|---|---|---|"]
    rows = [*((k, v["by_adapter"]) for k, v in summary["per_load"].items()),
            ("all", summary["by_adapter"])]
    for load, b in rows:
        lines.append(f"| {load} | {_pct(b['base']['median_abs'])} | "
                     f"{_pct(b['base']['p90_abs'])} | {_pct(b['lora']['median_abs'])} | "
                     f"{_pct(b['lora']['p90_abs'])} | {_pct(b['lora']['median'])} |")
    return "\n".join(lines) + "\n\n"


def _ms(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x * 1000:.1f} ms"


def step_table(summary: dict[str, Any]) -> str:
    """Per load: the batch-time error (each request's mean inter-token latency), vLLM's own
    engine-side means against the replay's where the server exports them, and a gateway's live
    forecasts where the URL is one (markdown)."""
    lines = ["| load | ITL abs err p50 | ITL p90 | step-corrected ITL p50 | p90 | server ITL mean "
             "| replay ITL mean | ITL mean err | server TTFT mean (engine) | replay TTFT mean "
             "(engine) | TTFT mean err | server queue mean | step-corrected TTFT p50 | p90 | "
             "live forecast abs err p50 | live p90 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = [*summary["per_load"].items(), ("all", summary)]
    for load, row in rows:
        srv = row.get("server") or {}
        lines.append(
            f"| {load} | {_pct(row['itl_median_abs_pct_error'])} | "
            f"{_pct(row['itl_p90_abs_pct_error'])} | {_pct(row['step_itl_median_abs_pct_error'])} | "
            f"{_pct(row['step_itl_p90_abs_pct_error'])} | {_ms(srv.get('itl_mean_s'))} | "
            f"{_ms(srv.get('replay_itl_mean_s'))} | {_pct(srv.get('itl_mean_pct_error'))} | "
            f"{_ms(srv.get('ttft_mean_s'))} | {_ms(srv.get('replay_ttft_mean_s'))} | "
            f"{_pct(srv.get('ttft_mean_pct_error'))} | {_ms(srv.get('queue_mean_s'))} | "
            f"{_pct(row['step_ttft_median_abs_pct_error'])} | "
            f"{_pct(row['step_ttft_p90_abs_pct_error'])} | "
            f"{_pct(row['live_ttft_median_abs_pct_error'])} | "
            f"{_pct(row['live_ttft_p90_abs_pct_error'])} |")
    return "\n".join(lines)


def write(out: Path, recs: list[Record], summary: dict[str, Any], command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in recs:
            w.writerow([r.id, r.load, r.arrivals, f"{r.sent:.6f}", r.prompt_tokens,
                        r.output_tokens, r.chunks, f"{r.ttft:.6f}", f"{r.predicted_ttft:.6f}",
                        f"{r.corrected_ttft:.6f}", f"{r.e2e:.6f}", f"{r.predicted_e2e:.6f}",
                        r.error or "", f"{r.itl:.6f}", f"{r.predicted_itl:.6f}",
                        f"{r.live_ttft:.6f}", f"{r.step_ttft:.6f}", f"{r.step_itl:.6f}",
                        r.lora])
    (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=True) + "\n")
    _plots(out, recs)
    m = summary
    text = (f"# duetime validate: {m['url']} ({m['model']})\n\n"
            f"`{command}`\n\n"
            f"Profile {m['profile']}; "
            + ("a recorded trace replayed (`--trace`)" if not math.isfinite(m["capacity_rps"])
               else f"capacity {m['capacity_rps']:.2f} requests/s (closed loop of "
                    f"{m['capacity_clients']} clients)") + f"; prompts {m['mix']['min_prompt']}-"
            f"{m['mix']['max_prompt']} tokens (log-uniform), outputs {m['mix']['min_output']}-"
            f"{m['mix']['max_output']} (`ignore_eos`); arrivals {', '.join(m['arrivals'])}; "
            f"{m['requests_per_run']} requests per load and arrival process.\n\n"
            "Errors are per request, predicted / observed - 1 (the engine replaying the "
            "observed trace with the profile); `bias` is the median signed error (negative: "
            "the model predicts low); `corrected`: with the gateway's online correction, each "
            "prediction scaled by what the requests answered before it was sent taught.\n\n" + table(summary) + "\n\n"
            + adapter_table(summary) +
            "## Batch time, the engine and the gateway\n\n"
            "`ITL`: each request's mean inter-token latency (its decode steps), replayed against "
            "observed. `step-corrected`: a second replay whose step time is scaled at each send by "
            "the gateway's online step-time correction learnt from the requests ended by then "
            "(TTFT from that replay too, without the TTFT correction). `server`: vLLM's own histograms on `/metrics` over each load's runs "
            "(engine side, from the server's arrival stamp: no client or HTTP), against the "
            "replay's means without the request overhead. `live`: the forecast a duetime gateway "
            "routed on (`x-duetime-forecast-ttft-ms`; only when URL is a gateway). n/a: not "
            "exported by this server, or not in a recorded trace.\n\n"
            + step_table(summary) + "\n\n"
            "![forecast vs observed](ttft_scatter.png)\n![error vs load](error_vs_load.png)\n")
    (out / "report.md").write_text(text)


def _plots(out: Path, recs: list[Record]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in recs if r.ok and math.isfinite(r.predicted_ttft)]
    loads = sorted({r.load for r in ok})
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for load in loads:
        sub = [r for r in ok if r.load == load]
        ax.scatter([r.ttft * 1000 for r in sub], [r.predicted_ttft * 1000 for r in sub], s=10,
                   label=f"load {load:g}", alpha=0.7)
    if ok:
        lo = min(min(r.ttft, r.predicted_ttft) for r in ok) * 1000
        hi = max(max(r.ttft, r.predicted_ttft) for r in ok) * 1000
        ax.plot([lo, hi], [lo, hi], color="gray", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("observed TTFT (ms)")
    ax.set_ylabel("predicted TTFT (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_scatter.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    stats = [error_stats(errors([r for r in ok if r.load == x], "ttft")) for x in loads]
    med = [st["median_abs"] for st in stats]
    p90 = [st["p90_abs"] for st in stats]
    ax.plot(loads, [m * 100 for m in med], marker="o", label="median |error|")
    ax.plot(loads, [p * 100 for p in p90], marker="s", label="p90 |error|")
    ax.set_xlabel("load (fraction of measured capacity)")
    ax.set_ylabel("TTFT error (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "error_vs_load.png", dpi=110)
    plt.close(fig)
