"""One-token step of each stage against the physical limit: streaming its weights once.

    .venv/bin/python bench/weight_stream.py [hierarchy=auto] [--threads 2] [--rounds 7]

A decoding step at batch 1 reads every weight once; at the memory bandwidth measured here (a
streaming reduction over a buffer far larger than the caches, same threads) that takes
weight bytes / bandwidth. The ratio step / stream says how far a stage is from the limit:
1.0 is all that memory allows, and framework overhead, KV reads and kernels that re-read
weights show up above it. Rounds interleave every stage and the bandwidth probe, so drift of a
shared machine hits all alike; medians are printed.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import torch

from pipespec_mpi.auto.fingerprint import cpu_identity
from pipespec_mpi.config import compose_config
from pipespec_mpi.models.loader import load_stage


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a one-token forward reads as weights: every tensor of every module except the
    input embedding table (a step reads one row of it), once even when tied (SmolLM2's output
    layer reads the tied table whole), and the packed weights of dynamically quantised linear
    layers (int8 values plus their scales)."""
    seen, total = set(), 0
    for m in model.modules():
        tensors = [] if isinstance(m, torch.nn.Embedding) else [*m.parameters(False), *m.buffers(False)]
        packed = getattr(m, "_packed_params", None)
        if packed is not None and callable(getattr(m, "weight", None)):
            w = m.weight()  # unpacked anew on each call: counted here, not by address
            total += w.numel() * w.element_size()
            if w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
                total += w.q_per_channel_scales().numel() * 8
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def bandwidth_probe(mb: int = 512):
    """Seconds to stream ``mb`` MiB once (a float32 sum: reads only)."""
    buf = torch.ones(mb * 2**20 // 4, dtype=torch.float32)
    buf.sum()  # first touch

    def probe() -> float:
        t0 = time.perf_counter()
        buf.sum()
        return time.perf_counter() - t0

    return probe, buf.numel() * 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", default=["hierarchy=auto"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--context", type=int, default=160)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    hier = compose_config(a.overrides).hierarchy
    context = [(i * 7919) % 1000 + 10 for i in range(a.context)]
    stages = []
    for i, st in enumerate(hier.stages):
        model = load_stage(hier, i, [])
        if not hasattr(model, "logits"):  # a model-free drafter
            continue
        model.prefill(context, room=4)
        model.logits(context, [])  # warm
        model.truncate(len(context) - 1)
        stages.append((st.name, model, weight_bytes(model.model)))
    probe, probe_bytes = bandwidth_probe()
    times: dict[str, list[float]] = {name: [] for name, _, _ in stages}
    bw: list[float] = []
    for _ in range(a.rounds):
        order = [*stages, None]
        random.shuffle(order)
        for item in order:
            if item is None:
                bw.append(probe_bytes / probe())
                continue
            name, model, _ = item
            t0 = time.perf_counter()
            model.logits(context, [])
            times[name].append(time.perf_counter() - t0)
            model.truncate(len(context) - 1)
    gbs = statistics.median(bw)
    cpu = cpu_identity()
    print(f"{cpu['cpu']} ({platform.machine()}; {', '.join(cpu['isa'])}), {a.threads} threads, "
          f"torch {torch.__version__}, context {a.context}, {a.rounds} rounds")  # fmt: skip
    print(f"memory bandwidth (streaming read, {probe_bytes / 2**20:.0f} MiB): {gbs / 1e9:.1f} GB/s")
    print(f"{'stage':<22} {'weights MB':>10} {'stream ms':>10} {'step ms':>9} {'step/stream':>12}")
    for name, _, nbytes in stages:
        stream = nbytes / gbs
        step = statistics.median(times[name])
        ratio = step / stream
        print(f"{name:<22} {nbytes / 1e6:>10.1f} {1e3 * stream:>10.2f} {1e3 * step:>9.2f} {ratio:>11.2f}x")


if __name__ == "__main__":
    main()
