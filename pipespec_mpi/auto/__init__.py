"""``hierarchy=auto``'s measuring side: the candidate stages measured on the machine at hand
(the plan made from it: pipespec_mpi/plan/).

fingerprint.py  what the measurements depend on (CPU, ISA, GPU, core share, models, prompts),
                and the cache of measurements keyed by it
worker.py       the measuring process: forward costs of one stage while the others of a
                candidate pipeline run beside it, and agreement along the target's own output
measure.py      runs the workers: every candidate pipeline's costs, every pair's agreement
measured.py     the measurements as data: candidate pipelines, threads per rank, agreement
                rates, lookup traces
calibrate.py    measure, or read the cache and spot-check it: what a plan is computed from
"""
