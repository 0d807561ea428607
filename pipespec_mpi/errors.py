"""Errors caused by the user's input (config, data, models on disk). They are reported as one
clear message, without a traceback, and end the job with exit code 2. The tools beside the job
(``pipespec-report``, ``-plan``, ``-simulate``, ``-shards``) say theirs as argparse says a usage
error: ``<tool>: error: <message>`` (``tool_error``)."""

import sys


class UserError(Exception):
    """``collective``: every rank raises the same error at the same point (rank 0 reports it and all
    exit together); otherwise the rank that found it aborts the job."""

    collective: bool = False


def tool_error(prog: str, err: object) -> int:
    """Print a command-line tool's error in the one form every tool uses; the exit code (2)."""
    print(f"{prog}: error: {err}", file=sys.stderr)
    return 2
