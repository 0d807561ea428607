"""Errors caused by the user's input (config, data, models on disk). They are reported as one
clear message, without a traceback, and end the job with exit code 2."""


class UserError(Exception):
    """``collective``: every rank raises the same error at the same point (rank 0 reports it and all
    exit together); otherwise the rank that found it aborts the job."""

    collective: bool = False
