"""Fault injection for the failure tests (and for users checking their cluster's behaviour).

``PIPESPEC_INJECT_FAULT=<kind>@<rank>[:<job>]`` makes world rank <rank> fail before its job
number <job> (default 1, counting from 0), or, when <job> is a word, as its start-up phase of that
name begins (``hang@1:rendezvous``: run/startup.py): ``raise`` raises an exception, ``kill``
sends itself SIGKILL, ``hang`` stops answering (sleeps forever without touching MPI). Unset: no
effect.
"""

from __future__ import annotations

import os
import signal
import time


class InjectedFault(RuntimeError):
    pass


def parse(spec: str) -> tuple[str, int, int | str]:
    kind, _, where = spec.partition("@")
    rank, _, job = where.partition(":")
    if kind not in ("raise", "kill", "hang") or not rank.isdigit() or (job and not job.isalnum()):
        raise ValueError(f"PIPESPEC_INJECT_FAULT={spec!r}: expected raise|kill|hang@RANK[:JOB|:PHASE]")
    return kind, int(rank), int(job) if job.isdigit() else (job or 1)


def maybe_fail(rank: int, job_index: int | str) -> None:
    """Fail here when the fault is for this rank and this job index (or start-up phase name:
    matched by its first word)."""
    spec = os.environ.get("PIPESPEC_INJECT_FAULT")
    if not spec:
        return
    kind, at_rank, at_job = parse(spec)
    if isinstance(job_index, str):
        job_index = job_index.split(" ")[0]
    if rank != at_rank or job_index != at_job:
        return
    if kind == "raise":
        raise InjectedFault(f"injected failure on rank {rank} before job {job_index}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # hang: stop answering
        time.sleep(3600)
