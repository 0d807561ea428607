"""One job on one rank: place the rank, load its stage, decode the replica's prompts, write results.

Data path: prompts (rank 0 loads and tokenizes, broadcasts) -> per prompt and method, driven by
``StageProcess`` (stage/process.py): reset the window header, the start gate (a non-blocking
barrier of the replica), the stage loop, the stage stats to the replica's leader (its last stage)
-> one ``Record`` (records.py) appended to ``parts/replica-<r>.jsonl`` -> at the end rank 0 merges
the parts into ``results.jsonl`` and writes ``summary.json`` (and ``benchmark.json``).

  setup.py     placement, model loading, tokenizer/vocabulary checks, channels, epochs window
  jobs.py      Job, the prompts tokenized, plan_jobs, sampler_for, what a resumed run has done
  collect.py   the start gate, the stats handoff to the leader, record assembly, the parts
  finalize.py  results.jsonl, summary.json, benchmark.json, the printed table
  runner.py    Runner(cfg, run_dir, world).run(): the above in order
"""

from pipespec_mpi.run.runner import Runner

__all__ = ["Runner"]
