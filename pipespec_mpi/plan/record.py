"""plan.json, typed: what a ``hierarchy=auto`` job planned, from what, and how the run went.

One writer (``write_plan``) and one reader (``read_plan``); the job, ``pipespec-plan RUN_DIR``
and the tests go through them. The file's layout is flat (the plan's fields, the calibration's,
then what the job adds), as it was before it had a type, so older files still read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from pipespec_mpi.auto.calibrate import CalibrationSummary
from pipespec_mpi.auto.measured import Measured
from pipespec_mpi.config import DecodeConfig
from pipespec_mpi.plan.options import Option, Plan
from pipespec_mpi.plan.refit import Refit

PLAN = "plan.json"


@dataclass(frozen=True)
class SearchInputs:
    """Everything a plan from measurements is computed from; plan.json keeps it (``inputs``), so
    that ``pipespec-plan RUN_DIR`` plans again from exactly what the job planned from."""

    measured: Measured
    decode: DecodeConfig
    max_stages: int
    margin: float
    batch_sizes: tuple[int, ...]
    refit: Refit = Refit()  # what earlier jobs here measured against their predictions (plan/refit.py)

    def to_json(self) -> dict:
        return {
            "measured": self.measured.to_json(),
            "decode": asdict(self.decode),
            "max_stages": self.max_stages,
            "margin": self.margin,
            "batch_sizes": list(self.batch_sizes),
            "refit": self.refit.to_json(),
        }

    @classmethod
    def from_json(cls, node: dict) -> SearchInputs:
        measured, decode = Measured.from_json(node["measured"]), DecodeConfig(**node["decode"])
        return cls(
            measured,
            decode,
            int(node["max_stages"]),
            float(node["margin"]),
            tuple(node["batch_sizes"]),
            Refit.from_json(node.get("refit")),
        )


@dataclass(frozen=True)
class RunsAs:
    """What the job runs: the realized hierarchy and the decode settings the choice set."""

    hierarchy: str
    method: str  # the app's ``method`` (run.mode=single: the chosen one)
    lookahead: int
    sd_window: int | None
    max_run_ahead: int
    # the methods it decodes: the chosen one, or in run.mode=benchmark every one of run.methods on
    # the best speculative option's stages (the choice itself is ``chosen``)
    methods: tuple[str, ...] = ()


@dataclass(frozen=True)
class Machine:
    cores: int
    ranks_on_node: int
    bound: bool  # the launcher binds each rank to cores of its own


@dataclass(frozen=True)
class PlanRecord:
    plan: Plan
    calibration: CalibrationSummary
    candidates: str  # the hierarchy whose stages were the candidates
    runs: RunsAs | None
    machine: Machine | None
    inputs: SearchInputs | None
    # after the run (rank 0, add_measured): ms/token per summary.json entry, the chosen one over
    # its prediction, its speedup over AR, and a line when it was further off than auto.off_factor
    measured_ms_per_token: dict[str, float] = field(default_factory=dict)
    measured_vs_predicted: float | None = None
    measured_speedup: float | None = None
    prediction_off: str | None = None
    ar_measured_vs_predicted: float | None = None  # AR at batch 1, where the run decoded it
    # method=online: each plan it measured (its name, run/online.py), measured and predicted ms/token
    online_vs_predicted: dict[str, dict[str, float | None]] = field(default_factory=dict)
    # the ratios the next job on this node plans with, this run's measurements included
    refit_next: Refit | None = None

    def to_json(self) -> dict:
        out = {**self.plan.to_json(), **asdict(self.calibration), "candidates": self.candidates,
               "runs": asdict(self.runs) if self.runs else None,
               "machine": asdict(self.machine) if self.machine else None,
               "inputs": self.inputs.to_json() if self.inputs else None}  # fmt: skip
        if self.measured_ms_per_token:
            out["measured_ms_per_token"] = self.measured_ms_per_token
        if self.online_vs_predicted:
            out["online_vs_predicted"] = self.online_vs_predicted
        if self.refit_next is not None:
            out["refit_next"] = self.refit_next.to_json()
        for k in ("measured_vs_predicted", "measured_speedup", "prediction_off", "ar_measured_vs_predicted"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out

    @classmethod
    def from_json(cls, node: dict) -> PlanRecord:
        def option(d: dict | None) -> Option | None:
            return None if d is None else Option(**{**d, "pipeline": tuple(d["pipeline"])})

        plan = Plan(
            chosen=option(node["chosen"]),
            best_speculative=option(node.get("best_speculative")),
            ar=option(node["ar"]),
            margin=float(node["margin"]),
            reason=node["reason"],
            options=tuple(option(o) for o in node.get("options", ())),
            threads={int(k): v for k, v in node.get("threads", {}).items()},
        )
        cal = {f.name: node.get(f.name) for f in fields(CalibrationSummary)}
        inputs = node.get("inputs")
        return cls(
            plan=plan, calibration=CalibrationSummary(**cal), candidates=node.get("candidates", ""),
            runs=RunsAs(**{**node["runs"], "methods": tuple(node["runs"].get("methods", ()))})
            if node.get("runs")
            else None,
            machine=Machine(**node["machine"]) if node.get("machine") else None,
            inputs=SearchInputs.from_json(inputs) if inputs else None,
            measured_ms_per_token=node.get("measured_ms_per_token", {}),
            measured_vs_predicted=node.get("measured_vs_predicted"),
            measured_speedup=node.get("measured_speedup"), prediction_off=node.get("prediction_off"),
            ar_measured_vs_predicted=node.get("ar_measured_vs_predicted"),
            online_vs_predicted=node.get("online_vs_predicted", {}),
            refit_next=Refit.from_json(node["refit_next"]) if "refit_next" in node else None,
        )  # fmt: skip


def write_plan(run_dir: Path, record: PlanRecord) -> None:
    (Path(run_dir) / PLAN).write_text(json.dumps(record.to_json(), indent=1, default=str) + "\n")


def read_plan(run_dir: Path) -> PlanRecord | None:
    """The run's plan.json, or None where the run is not a ``hierarchy=auto`` one."""
    path = Path(run_dir) / PLAN
    return PlanRecord.from_json(json.loads(path.read_text())) if path.is_file() else None
