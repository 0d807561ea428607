"""The measuring process: ``python -m pipespec_mpi.auto.worker``, one per candidate stage.

A separate process per stage, so that a candidate pipeline's stages load the node together as its
ranks will (each with its own torch threads, all at once), and so that the MPI rank that starts
them holds no model. It never imports MPI. It loads its stage once, says ``{"ready": seconds}``,
then answers commands, one JSON line each:

  cost     set ``threads`` and bind to ``cpus`` (null: the CPUs it started with); time the
           prefill of ``context`` and forwards over each of ``token_counts`` new tokens after it
           (median of ``repeats``), and what each more sequence adds to a batched forward; say
           ``{"points": [[n, s], ...], "prefill_s": s, "context": n, "per_sequence_s": s}``; then
           keep the node as busy as a drafting stage keeps it (one-token forwards) until the line ``stop``
           arrives, and say ``{"stopped": true}`` (so every stage of a pipeline is timed while the
           others run)
  path     greedy continuation of each prompt by this stage alone: ``{"paths": [[ids], ...]}``
  propose  along each given path, what this stage proposes at each position with the path so far
           as context: ``{"proposals": [[[ids], ...], ...]}`` per prompt and position (a model:
           its argmax; a lookup stage: its whole continuation, empty where it finds none)
  exit
"""

from __future__ import annotations

import json
import os
import select
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from pipespec_mpi.config import HierarchyConfig, StageConfig, TinyBaseConfig, TokenizerConfig
from pipespec_mpi.host.wait import Backoff


def hierarchy_from(node: dict) -> HierarchyConfig:
    """A HierarchyConfig from ``dataclasses.asdict`` of one (sent as JSON)."""
    return HierarchyConfig(
        name=node["name"],
        stages=tuple(StageConfig(**s) for s in node["stages"]),
        tokenizer=TokenizerConfig(**node["tokenizer"]),
        tiny=TinyBaseConfig(**node["tiny"]),
    )


def say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def stop_requested() -> bool:
    """The parent's ``stop`` line has arrived (never waits)."""
    ready, _, _ = select.select([sys.stdin], [], [], 0.0)
    return bool(ready) and sys.stdin.readline().strip() == "stop"


def is_drafter(model) -> bool:
    """A model-free stage (``Proposer``: prompt lookup, suffix drafting)."""
    return not hasattr(model, "logits")


def time_forwards(model, context: Sequence[int], token_counts: Sequence[int], repeats: int) -> dict:
    """``points``: median seconds of one forward over n new tokens after ``context``, for each n (a
    lookup stage: one proposal); ``prefill_s``: encoding the ``context`` tokens before."""
    if is_drafter(model):
        seq = list(context)
        model.prefill(seq)
        t0 = time.perf_counter()
        for _ in range(repeats * 20):
            model.propose(seq, model.max_proposal)
        return {"points": [[1, (time.perf_counter() - t0) / (repeats * 20)]], "prefill_s": 0.0, "context": 0}
    base, most = len(context), max(token_counts)
    tokens = [int(context[i % base]) for i in range(most)]  # any ids: the cost is what counts
    t0 = time.perf_counter()
    model.prefill(context, room=most + 1)
    prefill_s = time.perf_counter() - t0
    model.logits(context, tokens[:1])  # warm: first-call allocations
    model.truncate(base - 1)
    points = []
    for n in token_counts:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.logits(context, tokens[: n - 1])
            times.append(time.perf_counter() - t0)
            model.truncate(base - 1)
        points.append([n, statistics.median(times)])
    return {"points": points, "prefill_s": prefill_s, "context": base,
            "per_sequence_s": per_sequence_s(model, context, repeats)}  # fmt: skip


BATCH = 4  # sequences of the batched forward ``per_sequence_s`` times


def per_sequence_s(model, context: Sequence[int], repeats: int) -> float:
    """What each more sequence adds to a batched forward (``score_many``): BATCH sequences of
    one token each against one sequence of BATCH tokens (the same rows through the linear
    layers), over BATCH - 1; 0 where the model does not batch (one forward per sequence)."""
    if not getattr(model, "batchable", False):
        return 0.0
    base = len(context)
    slots = [model] + [model.for_slot() for _ in range(BATCH - 1)]
    for s in slots[1:]:
        s.prefill(context, room=2)
    one, many = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.logits(context, [int(context[0])] * (BATCH - 1))
        one.append(time.perf_counter() - t0)
        model.truncate(base - 1)
        t0 = time.perf_counter()
        model.score_many([(s, context, []) for s in slots])
        many.append(time.perf_counter() - t0)
        for s in slots:
            s.truncate(base - 1)
    return max(0.0, (statistics.median(many) - statistics.median(one)) / (BATCH - 1))


def keep_busy(model, context: Sequence[int]) -> None:
    """Until the parent says stop: one-token forwards, as a drafting model stage runs; a lookup
    stage's proposals and wake-ups, as its loop waits for its verifier (on 2 cores shared by 3
    ranks those wake-ups are what a lookup stage costs its neighbours)."""
    if is_drafter(model):  # as the stage loop waits: propose, poll with backoff
        backoff = Backoff()
        while not stop_requested():
            model.propose(context, model.max_proposal)
            for _ in range(8):
                backoff.sleep()
            backoff.reset()
        return
    model.prefill(context, room=2)
    while not stop_requested():
        model.logits(context, [])
        model.truncate(len(context) - 1)


def greedy_path(model, prompt: Sequence[int], tokens: int, eos: int | None) -> list[int]:
    model.prefill(prompt, room=tokens + 2)
    seq = list(prompt)
    for _ in range(tokens):
        tok = int(model.logits(seq, []).argmax(-1)[0])
        seq.append(tok)
        if tok == eos:
            break
    return seq[len(prompt) :]


def proposals_along(model, prompt: Sequence[int], path: Sequence[int]) -> list[list[int]]:
    """At each position i of ``path``, with prompt + path[:i] as context, what ``model`` proposes:
    a model its argmax (one token), a lookup stage its whole continuation (maybe none)."""
    if is_drafter(model):  # every path token committed as it comes; the path then joins the
        seq = list(prompt) + list(path)  # drafter's job store, as a finished sequence does
        model.prefill(prompt, room=len(path) + 2, store_key="pipespec")
        n = len(prompt)
        got = [model.propose(seq[: n + i], model.max_proposal, confirmed=n + i) for i in range(len(path))]
        model.end_sequence(path)
        return got
    model.prefill(prompt, room=len(path) + 2)
    rows = model.logits(list(prompt), list(path[:-1]))  # [len(path), V]: one teacher-forced forward
    return [[int(t)] for t in rows.argmax(-1)]


def main() -> None:
    from pipespec_mpi.models.loader import load_stage

    start = json.loads(sys.stdin.readline())
    t0 = time.perf_counter()
    model = load_stage(hierarchy_from(start["hierarchy"]), start["stage"], [])
    say({"ready": time.perf_counter() - t0})
    home = os.sched_getaffinity(0)
    for line in sys.stdin:
        cmd = json.loads(line)
        os.sched_setaffinity(0, cmd.get("cpus") or home)
        torch.set_num_threads(int(cmd.get("threads", 1)))
        if cmd["do"] == "cost":
            say(time_forwards(model, cmd["context"], cmd["token_counts"], cmd["repeats"]))
            keep_busy(model, cmd["context"])
            say({"stopped": True})
        elif cmd["do"] == "path":
            say({"paths": [greedy_path(model, p, cmd["tokens"], cmd["eos"]) for p in cmd["prompts"]]})
        elif cmd["do"] == "propose":
            got = [proposals_along(model, p, path) for p, path in zip(cmd["prompts"], cmd["paths"])]
            say({"proposals": got})
        elif cmd["do"] == "exit":
            return


if __name__ == "__main__":
    main()
