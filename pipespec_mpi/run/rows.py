"""A job's rows, as a stream: rank 0 reads the dataset twice, once to judge it and once to deal
it out a round at a time, so that no rank ever holds the whole dataset.

1. ``scan`` (start-up, rank 0, ``prepared_rows``): every row tokenized and checked, and kept
   only as a count, or as a ``BadRow`` (errors.jsonl). What every rank must know before the
   first job comes of it (``Scan``): the job's verdict on its rows (``run.on_error``), whether
   any row samples (the channels then carry distributions), and how many prompts each replica
   will decode (its progress and ETA).
2. ``RowFeed.next`` (between rounds, collective): rank 0 reads on to the next
   ``dataset.round_rows`` prompts per replica, deals them in turn (prompt i of the job to
   replica i mod R, as a whole-list deal would) and scatters each rank its replica's share. A
   replica decodes its share of a round, then waits for the others (``Runner``), so the ranks
   hold one round's prompts at a time.

So a job's peak memory stays nearly flat in its number of rows, where rank 0 used to hold every
tokenized row and every record (bench/dataset_rss.py; docs/notebook.md, "Measurements behind the
code's choices").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from pipespec_mpi.config import AppConfig
from pipespec_mpi.data.datasets import BadRow, DatasetError
from pipespec_mpi.errors import UserError
from pipespec_mpi.run.jobs import Context, Prompt, check_rows, prepared_rows
from pipespec_mpi.topology import Placement


@dataclass
class Scan:
    """What rank 0's first pass found, the same on every rank (``bad``: on rank 0 only)."""

    n_prompts: int  # the rows that will be decoded, over all replicas
    sampled: bool  # some row samples (its temperature, or the job's)
    error: DatasetError | None  # the job stops on its rows (run.on_error, or nothing to decode)
    bad: list[BadRow] = field(default_factory=list)

    def share(self, replica: int, n_replicas: int) -> int:
        """How many prompts ``replica`` decodes (prompt i goes to replica i mod n_replicas)."""
        return len(range(replica, self.n_prompts, n_replicas))


def first_pass(cfg: AppConfig, rows: Iterator[Prompt | BadRow]) -> Scan:
    """Count the prompts, keep the bad rows, judge them (``check_rows``), in one pass."""
    n, bad = 0, []
    sampled = cfg.sampling.temperature > 0
    for got in rows:
        if isinstance(got, BadRow):
            bad.append(got)
            continue
        n += 1
        sampled = sampled or (got.settings.temperature or 0) > 0
    error = None
    try:
        check_rows(n, bad, cfg.run.on_error)
    except DatasetError as e:
        error = e
    return Scan(n, sampled, error, sorted(bad, key=lambda b: b.position))


def scan(cfg: AppConfig, comm, tokenizer, context: Context | None) -> Scan:
    """``first_pass`` on rank 0, its verdict on every rank; a dataset that cannot be read is
    raised on every rank (reported once). Collective."""
    got = err = None
    if comm.Get_rank() == 0:
        try:
            got = first_pass(cfg, prepared_rows(cfg, tokenizer, context))
        except UserError as e:
            err = e
    err = comm.bcast(err, root=0)
    if err is not None:
        err.collective = True
        raise err
    verdict = comm.bcast(Scan(got.n_prompts, got.sampled, got.error) if got is not None else None, root=0)
    return got if got is not None else verdict


class RowFeed:
    """This rank's replica's prompts, a round at a time (module docstring, step 2)."""

    def __init__(self, comm, pl: Placement, round_rows: int, rows: Iterator[Prompt | BadRow] | None) -> None:
        self.comm, self.pl, self.round_rows = comm, pl, round_rows
        self._rows = rows  # rank 0's second pass over the job's rows; None elsewhere
        self._ready: list[Prompt] | None = None
        self.exhausted = False

    def _take(self) -> list[Prompt]:
        """Rank 0: the next round's prompts (bad rows were set aside by the first pass)."""
        out: list[Prompt] = []
        want = self.round_rows * self.pl.n_replicas
        while len(out) < want:
            got = next(self._rows, None)
            if got is None:
                break
            if isinstance(got, Prompt):
                out.append(got)
        return out

    def prepare(self) -> None:
        """Rank 0 reads the next round before the others wait for it (called before the barrier
        that precedes ``next``, so that no rank waits in the scatter while it reads)."""
        if self._rows is not None and self._ready is None:
            self._ready = self._take()

    def next(self) -> list[Prompt] | None:
        """This replica's share of the next round; None when every row has been dealt (the same
        on every rank). Collective."""
        if self.exhausted:
            return None
        shares = None
        if self._rows is not None:
            self.prepare()
            got, self._ready = self._ready or [], None
            dealt = deal(got, self.pl.n_replicas, self.pl.n_stages)
            shares = [(bool(got), share) for share in dealt]
        more, mine = self.comm.scatter(shares, root=0)
        if not more:
            self.exhausted = True
            return None
        return mine


def deal(prompts: list[Prompt], n_replicas: int, n_stages: int) -> list[list[Prompt]]:
    """Each world rank's share of a round (rank r is stage r mod S of replica r // S): replica
    k gets prompts k, k + R, ... A round holds ``round_rows * R`` prompts, so over the rounds
    prompt i of the job goes to replica i mod R."""
    per_replica = [prompts[k::n_replicas] for k in range(n_replicas)]
    return [per_replica[r // n_stages] for r in range(n_replicas * n_stages)]


def feed(cfg: AppConfig, comm, pl: Placement, tokenizer, context: Context | None) -> RowFeed:
    """The feed of this rank (rank 0 opens the second pass over the rows)."""
    rows = prepared_rows(cfg, tokenizer, context) if comm.Get_rank() == 0 else None
    return RowFeed(comm, pl, cfg.dataset.round_rows, rows)
