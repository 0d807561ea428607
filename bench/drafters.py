"""Candidate drafters against the target: how often they agree and what a step costs.

    .venv/bin/python bench/drafters.py [--prompts 8] [--seed 7] [--tokens 64] [--threads 1]

For each copy of the embedded target (torch's dynamic int8, the weight-only bf16 / int8 / q8 /
q4 copies of models/cpu/lowbit.py and its w8a8 copy) and each dataset (HumanEval code, news prose):

* agreement: the target decodes each prompt greedily (``--tokens`` new tokens); the copy then
  reads prompt + continuation in one forward and its greedy choice at every continuation
  position is compared with the target's token: the per-token acceptance a greedy verifier
  would see for a one-token proposal;
* cost: a one-token step after ``--context`` tokens, relative to the target's step, median of
  interleaved rounds (all models and the target alternate, so a drifting machine hits all alike).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from dataclasses import replace

import torch

from pipespec_mpi.auto.fingerprint import cpu_identity
from pipespec_mpi.config import HierarchyConfig, StageConfig, compose_config
from pipespec_mpi.models.loader import load_stage, load_tokenizer
from pipespec_mpi.models.scorer import EngineScorer
from pipespec_mpi.run.jobs import tokenize_prompts

COPIES = {
    "int8 dynamic (fbgemm)": {"kind": "int8_copy"},
    "bf16 weight-only": {"kind": "lowbit_copy", "weights": "bf16"},
    "int8 weight-only": {"kind": "lowbit_copy", "weights": "int8"},
    "q8 weight-only": {"kind": "lowbit_copy", "weights": "q8"},
    "q4 weight-only": {"kind": "lowbit_copy", "weights": "q4"},
    "w8a8 (int8 activations too)": {"kind": "lowbit_copy", "weights": "w8a8"},
}


@torch.inference_mode()
def greedy(model: EngineScorer, prompt: list[int], n: int) -> list[int]:
    model.prefill(prompt, room=n + 1)
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model.logits(seq, []).argmax(-1)[-1]))
    return seq[len(prompt) :]


@torch.inference_mode()
def agreement(model: EngineScorer, prompt: list[int], cont: list[int]) -> tuple[int, int]:
    """(positions where the copy's greedy token equals the target's, positions)."""
    model.prefill(prompt, room=len(cont) + 1)
    logits = model.logits(prompt, cont[:-1])  # [len(cont), V]: the choice at each position
    return int((logits.argmax(-1) == torch.tensor(cont)).sum()), len(cont)


def step_times(models: dict[str, EngineScorer], context: list[int], rounds: int) -> dict[str, float]:
    for m in models.values():
        m.prefill(context, room=4)
        m.logits(context, [])  # warm
        m.truncate(len(context) - 1)
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(rounds):
        order = list(models.items())
        random.shuffle(order)
        for name, m in order:
            t0 = time.perf_counter()
            m.logits(context, [])
            times[name].append(time.perf_counter() - t0)
            m.truncate(len(context) - 1)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--context", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    base = compose_config(["hierarchy=smollm2"]).hierarchy
    target_cfg = StageConfig(name="target", kind="smollm2")
    stages = [target_cfg] + [StageConfig(name=n, copy_of=0, **kw) for n, kw in COPIES.items()]
    hier: HierarchyConfig = replace(base, stages=tuple(stages))
    models = {s.name: load_stage(hier, i, []) for i, s in enumerate(stages)}
    tok = load_tokenizer(hier.tokenizer, hier.name)
    cpu = cpu_identity()
    print(f"{cpu['cpu']} ({platform.machine()}; {', '.join(cpu['isa'])}), {a.threads} thread(s), "
          f"torch {torch.__version__}; {a.prompts} prompts per dataset (seed {a.seed}), "
          f"{a.tokens} tokens")  # fmt: skip
    agree: dict[tuple[str, str], list[int]] = {}
    for ds in ("humaneval", "news"):
        cfg = compose_config([f"dataset={ds}", f"dataset.n_prompts={a.prompts}", f"dataset.seed={a.seed}"])
        for ids in (p.ids for p in tokenize_prompts(cfg, tok).prompts):
            cont = greedy(models["target"], ids, a.tokens)
            for name in COPIES:
                hit, n = agreement(models[name], ids, cont)
                acc = agree.setdefault((name, ds), [0, 0])
                acc[0] += hit
                acc[1] += n
    context = [(i * 7919) % 1000 + 10 for i in range(a.context)]
    t = step_times(models, context, a.rounds)
    print(f"one-token step after {a.context} tokens, median of {a.rounds} interleaved rounds; "
          f"target {1e3 * t['target']:.1f} ms")  # fmt: skip
    print("| copy | weights MB | agreement code | agreement news | step ms | step / target step |")
    print("|---|---|---|---|---|---|")
    for name in COPIES:
        mb = weight_mb(models[name])
        code, news = agree[(name, "humaneval")], agree[(name, "news")]
        print(f"| {name} | {mb:.0f} | {code[0] / code[1]:.3f} | {news[0] / news[1]:.3f} | "
              f"{1e3 * t[name]:.1f} | {t[name] / t['target']:.2f} |")  # fmt: skip


def weight_mb(scorer: EngineScorer) -> float:
    """The weights a one-token step of the scorer's engine reads: its linears (the LM head too)."""
    from weight_stream import weight_bytes  # bench/ is on sys.path when run as a script

    linears = torch.nn.ModuleList([m for m in scorer.engine.w.linears() if isinstance(m, torch.nn.Module)])
    return weight_bytes(linears) / 1e6


if __name__ == "__main__":
    main()
