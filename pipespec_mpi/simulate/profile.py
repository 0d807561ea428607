"""Forward costs of the portable engine on this machine's device, for the simulator.

    python -m pipespec_mpi.simulate.profile --out profile.json [--models 135M,1B,8B] [--compile]

For each model shape (random weights: a forward's cost does not depend on their values) it times
the engine's forwards at a fixed context: a verification of k = 1..16 rows of one sequence, and a
step of B = 1..64 sequences of one row each, eager and (``--compile``) under ``torch.compile``.
The JSON it writes is what ``pipespec-simulate --profile FILE`` reads (``profiles_from``) to
predict AR, SD and PipeSpec for the paper's hierarchy on this device. bench/gpu_check.sh runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pipespec_mpi.models.shapes import SHAPES, params, random_llama
from pipespec_mpi.simulate.inputs import LatencyProfile

__all__ = ["SHAPES", "compile_problems", "measure", "main", "params", "profiles_from"]

VERIFY_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
# a compiled forward's graphs over the profile's buckets (slots, width and attended length each a
# power of two, dims of 1 and above specialised apart): more is a recompile the buckets should
# have prevented (models/scorer.py compile_forward)
MAX_GRAPHS = 8


def random_engine(shape: str, device: str, dtype: str, slots: int, capacity: int):
    """An engine of ``shape`` with random weights on ``device``, its slots prefilled to ``capacity // 2``."""
    import torch

    from pipespec_mpi.models.engine import Weights
    from pipespec_mpi.models.scorer import Engine

    model = random_llama(shape, device, getattr(torch, dtype))
    engine = Engine(Weights.of(model.eval()))
    del model
    for _ in range(slots):
        engine.begin(engine.new_slot(), capacity)
    return engine


def _median_s(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(shape: str, device: str, dtype: str, context: int, repeats: int, compiled: bool,
            batches: Sequence[int] = BATCHES, backend: str = "inductor") -> dict:  # fmt: skip
    """Seconds of the engine's forwards of ``shape``: verify_s[k] (one sequence, k rows),
    batch_s[B] (B sequences of one row), each at ``context`` positions of context; compiled, as
    a job compiles it (models/scorer.py ``compile_forward``; ``backend``: a cheaper one counts
    the same graphs), with its graph count and the seconds its first calls took (compiling)."""
    import torch
    from torch._dynamo.utils import counters

    from pipespec_mpi.models import engine as eng
    from pipespec_mpi.models.scorer import Request, compile_forward

    top = max(batches)
    engine = random_engine(shape, device, dtype, top, context + 32)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    out: dict = {"params": params(shape), "context": context, "verify_s": {}, "batch_s": {}}

    def run(reqs: list[Request]) -> None:
        for req in reqs:
            engine.lengths[req.slot] = context
        engine.run(reqs)

    modes = [("eager", eng.forward)]
    if compiled:
        modes.append(("compiled", compile_forward(engine.w, backend)))
    for mode, fn in modes:
        engine.step, engine.compiled = fn, mode == "compiled"
        if engine.compiled:
            torch._dynamo.reset()
            counters.clear()
            t0 = time.perf_counter()
            for k in (1, 2):  # the first calls compile: a one-token step and a verification
                run([Request(0, [1] * k, k)])
            sync()
            out["compile_s"] = time.perf_counter() - t0

        verify = {k: _median_s(lambda k=k: run([Request(0, [1] * k, k)]), sync, repeats) for k in VERIFY_ROWS}
        batch = {
            b: _median_s(lambda b=b: run([Request(s, [1], 1) for s in range(b)]), sync, repeats)
            for b in batches
        }
        key = "" if mode == "eager" else "compiled_"
        out[key + "verify_s"] = {str(k): v for k, v in verify.items()}
        out[key + "batch_s"] = {str(b): v for b, v in batch.items()}
        if engine.compiled:
            out["compiled_graphs"] = counters["stats"]["unique_graphs"]
            out["graph_breaks"] = sum(counters["graph_break"].values())
            out["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
            out["cuda_graphs"] = engine.w.device.type == "cuda"  # reduce-overhead: captured
    return out


def compile_problems(m: dict, max_graphs: int = MAX_GRAPHS) -> list[str]:
    """How a model's compiled forward in a profile (``measure``) differs from what the engine
    says it does (models/scorer.py ``compile_forward``): whole graphs, at most ``max_graphs`` over
    the profile's buckets, and on CUDA every graph captured (no CUDA-graph skip, which runs the
    compiled code without a graph). Empty when it did what it says."""
    if "compiled_graphs" not in m:
        return ["not compiled (profile without --compile)"]
    out = []
    if m["graph_breaks"]:
        out.append(f"{m['graph_breaks']} graph breaks")
    if not 1 <= m["compiled_graphs"] <= max_graphs:
        out.append(f"{m['compiled_graphs']} graphs (expected 1..{max_graphs})")
    if m.get("cuda_graphs") and m.get("cudagraph_skips", 0):
        out.append(f"{m['cudagraph_skips']} CUDA-graph skips (ran without a captured graph)")
    return out


def profiles_from(
    doc: dict, names: Sequence[str] = ("1B", "8B", "70B")
) -> tuple[dict[str, LatencyProfile], dict]:
    """The simulator's profile of each of ``names`` from a profile document: its measured
    verification costs, and its extra cost per batched sequence (the slope of batch_s); a shape
    the document lacks is scaled from the measured shape nearest in size by weight bytes (a
    memory-bound step). Returns the profiles and, per name, where it came from."""
    key = "compiled_verify_s" if all("compiled_verify_s" in m for m in doc["models"].values()) else "verify_s"
    measured = doc["models"]
    out, source = {}, {}
    for name in names:
        if name in measured:
            base, scale = name, 1.0
        else:
            base = min(measured, key=lambda m: abs(measured[m]["params"] - params(name)))
            scale = params(name) / measured[base]["params"]
        m = measured[base]
        points = tuple((int(k), s * scale) for k, s in m[key].items())
        batch = {int(b): s for b, s in m[key.replace("verify", "batch")].items()}
        per_seq = _slope(batch) * scale
        out[name] = LatencyProfile(name, points, overhead_s=0.001, per_sequence_s=max(0.0, per_seq))
        source[name] = "measured" if scale == 1.0 else f"scaled from {base} x {scale:.2f} (weight bytes)"
    return out, source


def _slope(costs: dict[int, float]) -> float:
    """Least-squares slope of seconds by batch size."""
    xs, ys = list(costs), list(costs.values())
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(
        prog="python -m pipespec_mpi.simulate.profile", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--out", required=True, help="the profile JSON to write")
    ap.add_argument("--models", default="135M", help=f"shapes to time, of {', '.join(SHAPES)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-batch", type=int, default=max(BATCHES))
    ap.add_argument("--compile", action="store_true", help="also time the forward under torch.compile")
    ap.add_argument("--backend", default="inductor", help="torch.compile's backend (aot_eager: the same "
                    "graphs counted without inductor's compile time, for a CPU check)")  # fmt: skip
    a = ap.parse_args(argv)
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    names = [m.strip() for m in a.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in SHAPES]
    if unknown:
        ap.error(f"unknown model shapes {unknown}: choose from {', '.join(SHAPES)}")
    device_name = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else _cpu_name()
    date = time.strftime("%Y-%m-%d")
    doc = {"device": device_name, "torch": torch.__version__, "dtype": dtype, "date": date, "models": {}}
    if a.compile:
        doc["backend"] = a.backend
    batches = [b for b in BATCHES if b <= a.max_batch]
    for name in names:
        doc["models"][name] = measure(
            name, a.device, dtype, a.context, a.repeats, a.compile, batches, a.backend
        )
        _report(name, doc["models"][name])
    Path(a.out).write_text(json.dumps(doc, indent=2))
    print(f"profile written to {a.out}")
    return 0


def _report(name: str, m: dict) -> None:
    """Eager and compiled milliseconds per bucket, and the compiled forward's graphs."""
    print(f"{name}: ms per forward at {m['context']} positions (eager / compiled)")
    for kind, label in (("verify_s", "rows"), ("batch_s", "slots")):
        for n, s in m[kind].items():
            c = m.get("compiled_" + kind, {}).get(n)
            print(f"  {n:>3} {label:5} {1000 * s:8.2f}" + (f" / {1000 * c:8.2f}" if c is not None else ""))
    if "compiled_graphs" in m:
        captured = f", {m['cudagraph_skips']} CUDA-graph skips" if m["cuda_graphs"] else ""
        print(f"  compiled: {m['compiled_graphs']} graphs, {m['graph_breaks']} graph breaks{captured}, "
              f"first calls {m['compile_s']:.1f} s")  # fmt: skip
    sys.stdout.flush()


def _cpu_name() -> str:
    from pipespec_mpi.host.dispatch import cpu_model

    return cpu_model()


if __name__ == "__main__":
    raise SystemExit(main())
