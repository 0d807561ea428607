"""``hierarchy=auto``: measure the candidate stages on the machine at hand, plan, run the best.

fingerprint.py  what the measurements depend on (CPU, ISA, GPU, core share, models, prompts),
                and the cache of measurements keyed by it
worker.py       the measuring process: forward costs of one stage while the others of a
                candidate pipeline run beside it, and agreement along the target's own output
measure.py      runs the workers: every candidate pipeline's costs, every pair's agreement
choose.py       pure: candidates, the simulator's prediction for each, the choice (AR unless
                speculation is predicted to pay by ``auto.margin``), the config that runs it
"""
