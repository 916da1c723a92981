"""What a capacity plan is asked: a workload at a rate, the deployments it may use, the router
in the loop, and the constraints the pool must meet (``duetime plan``'s YAML or flags)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from duetime.engine.hardware import Option, gpu, gpu_names
from duetime.engine.profiles import load_profile, measured_option
from duetime.engine.spec import InstanceSpec, resolve_spec
from duetime.plan.rates import Interval, diurnal, read_rates
from duetime.policy.registry import PolicyError, check_params, policy_names
from duetime.workload import WorkloadProfile, load_workload
from duetime.workload.profile import ProfileError, builtin_profiles


class PlanError(ValueError):
    """A plan that cannot be made as asked; the message names the field."""


@dataclass(frozen=True, slots=True)
class Constraints:
    """What the pool must meet: the on-time rate of every SLO class (a task of the workload)
    at least its floor; optionally a mean quality floor and a budget (USD per hour)."""

    on_time: dict[str, float]
    quality: float | None = None
    budget: float | None = None


@dataclass(frozen=True, slots=True)
class PlanProblem:
    workload: WorkloadProfile
    rate: float                      # requests per second, Poisson
    options: tuple[Option, ...]      # the deployments a pool may use
    specs: dict[Option, InstanceSpec]
    constraints: Constraints
    router: str = "sfs"
    params: dict[str, Any] = field(default_factory=dict)
    requests: int = 4000             # per simulation (more where the decision is in the noise)
    max_requests: int = 16000
    max_replicas: int = 8            # of one deployment
    seed: int = 0
    prices: dict[str, float] = field(default_factory=dict)  # USD per GPU-hour, by GPU
    workload_source: str = "paper"   # the workload's built-in name or its file's path
    # a rate that changes (plan/schedule.py): intervals, and what adding a replica costs
    intervals: tuple[Interval, ...] = ()
    scale_up_delay_s: float = 60.0
    schedule_source: str = ""        # how the intervals were made, for the report
    objective: str = "cost"          # what the search minimises: "cost" (USD/h) or "gpus"

    @property
    def classes(self) -> list[str]:
        return self.workload.task_names

    def price(self, option: Option) -> float:
        """USD per hour of one replica of ``option``."""
        return option.price_per_hour(self.prices)

    @property
    def models(self) -> list[str]:
        """The workload's models that have at least one option, in the workload's order."""
        have = {o.model for o in self.options}
        return [m for m in self.workload.model_names if m in have]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _ConstraintsIn(_Strict):
    on_time: float | dict[str, float] = 0.95
    quality: float | None = Field(default=None, ge=0, le=1)
    budget: float | None = Field(default=None, gt=0)


class _OptionIn(_Strict):
    """A deployment with its own measurement: ``profile`` is what ``duetime calibrate --out``
    writes (a pool instance entry's ``batch_time``, ``config``, ``request_overhead_ms``)."""

    name: str
    profile: str


class _DiurnalIn(_Strict):
    peak: float = Field(gt=0)
    trough: float = Field(gt=0)
    peak_hour: float = Field(14.0, ge=0, lt=24)
    hours: float = Field(24.0, gt=0, le=24 * 31)


class _ScheduleIn(_Strict):
    diurnal: _DiurnalIn | None = None
    trace: str | None = None           # CSV: start_s, rate
    interval_min: float = Field(15.0, gt=0)
    scale_up_delay_s: float = Field(60.0, ge=0)


class _ProblemIn(_Strict):
    workload: str = "paper"
    rate: float | None = Field(default=None, gt=0)
    schedule: _ScheduleIn | None = None
    objective: Literal["cost", "gpus"] = "cost"
    options: list[str | _OptionIn] | None = None
    gpus: list[str] | None = None
    router: str | dict[str, Any] = "sfs"
    requests: int = Field(default=4000, ge=200)
    max_requests: int = Field(default=16000, ge=200)
    max_replicas: int = Field(default=8, ge=1, le=64)
    seed: int = 0
    prices: dict[str, float] = Field(default_factory=dict)
    constraints: _ConstraintsIn = Field(default_factory=_ConstraintsIn)


def longest_sequence(workload: WorkloadProfile) -> int:
    """The most tokens one of the workload's requests can hold (its prompt's and output's
    caps; outputs are drawn up to twice their distribution's max, workload/requests.py)."""
    return max(t.prompt.hi + 2 * t.output.hi for t in workload.tasks.values())


def holds(spec: InstanceSpec, tokens: int) -> bool:
    """Whether an instance of ``spec`` can serve a sequence of ``tokens`` (vLLM's 400 else)."""
    return spec.config.refusal(max(1, tokens - 1), 1) is None


def default_options(workload: WorkloadProfile, gpus: list[str] | None = None,
                    tps: tuple[int, ...] = (1, 2, 4, 8)) -> list[Option]:
    """Each model on each GPU (of ``gpus``, default the catalogue's) at the fewest GPUs that
    hold its weights and the workload's longest sequence, plus the deployment its profile was
    measured on."""
    need = longest_sequence(workload)
    out: list[Option] = []
    for m in workload.model_names:
        for g in gpus or gpu_names():
            for tp in tps:
                try:
                    spec = load_profile(Option(m, g, tp).name)
                except ValueError:
                    continue
                if holds(spec, need):
                    out.append(Option(m, g, tp))
                    break
        ref = measured_option(m)
        if ref is not None and ref not in out and (gpus is None or ref.gpu in gpus):
            out.append(ref)
    return out


def _calibrated(option: Option, path: str, base: Path | None) -> InstanceSpec:
    """A deployment's spec from ``duetime calibrate --out``'s YAML (measured: not derived);
    what it leaves out comes from the deployment's built-in (measured or derived) profile."""
    file = Path(path)
    if base is not None and not file.is_absolute():
        file = base / file
    try:
        data = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{option.name}: profile {path}: cannot read "
                         f"({' '.join(str(e).split())})") from None
    if not isinstance(data, dict) or "batch_time" not in data:
        raise ValueError(f"{option.name}: profile {path}: want duetime calibrate's output "
                         "(batch_time, and optionally config)")
    spec = resolve_spec(option.name, profile=data.get("profile", option.name),
                        batch_time=data["batch_time"], config=data.get("config"),
                        where=f"{option.name}: profile {path}")
    overhead = data.get("request_overhead_ms", 0.0)
    if isinstance(overhead, bool) or not isinstance(overhead, int | float) or overhead < 0:
        raise ValueError(f"{option.name}: profile {path}: request_overhead_ms must be a "
                         f"number >= 0, got {overhead!r}")
    return replace(spec, request_overhead_s=overhead / 1000.0)


def problem_from_dict(data: Any, source: str = "plan", base: Path | None = None) -> PlanProblem:
    """A :class:`PlanProblem` from its YAML form; :class:`PlanError` naming the field."""
    try:
        spec = _ProblemIn.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "(top)"
        raise PlanError(f"{source}: {where}: {err['msg']}") from None
    wl_name = spec.workload
    if base is not None and not Path(wl_name).is_absolute() and (base / wl_name).exists():
        wl_name = str(base / wl_name)
    try:
        workload = load_workload(wl_name)
    except ProfileError as e:
        raise PlanError(f"{source}: workload: {e}") from None
    for g in spec.prices:
        try:
            gpu(g, spec.prices)
        except (KeyError, ValueError) as e:
            raise PlanError(f"{source}: prices.{g}: {e.args[0]}") from None
    if spec.gpus is not None:
        for g in spec.gpus:
            if g not in gpu_names():
                raise PlanError(f"{source}: gpus: unknown GPU {g!r}; the catalogue has "
                                f"{', '.join(gpu_names())}")
    if spec.options is None:
        options = default_options(workload, spec.gpus)
    else:
        options = []
        for k, item in enumerate(spec.options):
            text = item if isinstance(item, str) else item.name
            try:
                opt = Option.parse(text)
            except ValueError as e:
                raise PlanError(f"{source}: options[{k}]: {e}") from None
            if opt.model not in workload.models:
                raise PlanError(f"{source}: options[{k}]: {opt.model!r} is not a model of the "
                                f"workload ({', '.join(workload.model_names)})")
            if opt in options:
                raise PlanError(f"{source}: options[{k}]: {opt.name} is named twice")
            options.append(opt)
    calibrated = {Option.parse(i.name): i.profile for i in spec.options or ()
                  if not isinstance(i, str)}
    specs = {}
    for opt in options:
        try:
            if opt in calibrated:
                specs[opt] = _calibrated(opt, calibrated[opt], base)
            else:
                specs[opt] = load_profile(opt.name)
        except KeyError as e:
            raise PlanError(f"{source}: options: {e.args[0]}") from None
        except ValueError as e:
            raise PlanError(f"{source}: options: {e}") from None
        if not holds(specs[opt], longest_sequence(workload)):
            raise PlanError(f"{source}: options: {opt.name} holds {specs[opt].config.max_model_len}"
                            f" tokens, less than the workload's longest sequence "
                            f"({longest_sequence(workload)}): more GPUs or a larger one")
    if not options:
        raise PlanError(f"{source}: options: no deployment of the workload's models fits")
    router, params = (spec.router, {}) if isinstance(spec.router, str) else (
        spec.router.get("name"), {k: v for k, v in spec.router.items() if k != "name"})
    if router not in policy_names():
        raise PlanError(f"{source}: router: unknown policy {router!r}; known: "
                        f"{', '.join(policy_names())}")
    try:
        params = check_params(router, params)
    except PolicyError as e:
        raise PlanError(f"{source}: router: {e}") from None
    on_time = spec.constraints.on_time
    classes = workload.task_names
    if isinstance(on_time, dict):
        bad = set(on_time) - set(classes) - {"default"}
        if bad:
            raise PlanError(f"{source}: constraints.on_time: unknown class(es) {sorted(bad)}; "
                            f"the classes are the workload's tasks: {', '.join(classes)}")
        floors = {c: float(on_time.get(c, on_time.get("default", 0.0))) for c in classes}
    else:
        floors = {c: float(on_time) for c in classes}
    if any(not 0 <= v <= 1 for v in floors.values()):
        raise PlanError(f"{source}: constraints.on_time: floors must be in [0, 1]")
    if spec.max_requests < spec.requests:
        raise PlanError(f"{source}: max_requests: below requests ({spec.requests})")
    intervals, how, delay = _intervals(spec.schedule, source, base)
    rate = max(iv.rate for iv in intervals) if intervals else spec.rate
    if rate is None:
        raise PlanError(f"{source}: rate: missing (requests per second; or a schedule)")
    return PlanProblem(
        workload=workload, rate=rate, options=tuple(options), specs=specs,
        constraints=Constraints(floors, spec.constraints.quality, spec.constraints.budget),
        router=router, params=params, requests=spec.requests, max_requests=spec.max_requests,
        max_replicas=spec.max_replicas, seed=spec.seed, prices=dict(spec.prices),
        workload_source=wl_name if wl_name in builtin_profiles() else str(Path(wl_name).resolve()),
        intervals=tuple(intervals), scale_up_delay_s=delay, schedule_source=how,
        objective=spec.objective)


def _intervals(sched: _ScheduleIn | None, source: str,
               base: Path | None) -> tuple[list[Interval], str, float]:
    """A schedule's intervals, how they were made, and its scale-up delay."""
    if sched is None:
        return [], "", 60.0
    if (sched.diurnal is None) == (sched.trace is None):
        raise PlanError(f"{source}: schedule: give exactly one of diurnal and trace")
    try:
        if sched.diurnal is not None:
            d = sched.diurnal
            ivs = diurnal(d.peak, d.trough, hours=d.hours, interval_s=sched.interval_min * 60,
                          peak_hour=d.peak_hour)
            how = (f"diurnal: {d.trough:g} to {d.peak:g} q/s (peak at {d.peak_hour:g} h) over "
                   f"{d.hours:g} h in {sched.interval_min:g}-minute intervals")
        else:
            path = Path(sched.trace)
            if base is not None and not path.is_absolute():
                path = base / path
            ivs = read_rates(path)
            how = f"trace {sched.trace}: {len(ivs)} intervals"
    except ValueError as e:
        raise PlanError(f"{source}: schedule: {e}") from None
    return ivs, how, sched.scale_up_delay_s


def load_problem(path: str | Path) -> PlanProblem:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise PlanError(f"{path}: cannot read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise PlanError(f"{path}: not valid YAML: {e}") from None
    return problem_from_dict(data, str(path), path.parent)
