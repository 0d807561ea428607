"""What a run's records say, after the run: read by ``pipespec-report`` and the planners.

metrics.py     per-run and per-stage aggregates over records (summary.json, benchmark.json)
report.py      the comparison table of one or more run directories (docs/report.md)
plots.py       the figures (matplotlib, installed by scripts/setup.sh)
analytical.py  the paper's analytical model: expected tokens per step, verification probability
"""
