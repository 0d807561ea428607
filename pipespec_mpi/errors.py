"""Errors caused by the user's input (config, data, models on disk). They are reported as one
clear message, without a traceback, and end the job with exit code 2."""


class UserError(Exception):
    pass
