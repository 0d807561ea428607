"""The bitwise tests under every CPU dispatch level this machine can run (tests/dispatch_levels.py):
one thread against every count, a verification's rows against one-token steps, batched rows
against a row alone, for the kernels' builds, torch's dispatch and MKL's path another machine
would take. Each level is a fresh process: torch reads ATEN_CPU_CAPABILITY when it loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT
from dispatch_levels import levels

pytestmark = pytest.mark.slow

BITWISE = [
    "tests/unit/models/cpu/test_kernel_threads.py",
    "tests/unit/models/cpu/test_plugins.py::test_exact_rows_verification_equals_one_token_steps",
    "tests/unit/models/cpu/test_plugins.py::test_batched_rows_equal_one_token_steps",
]


@pytest.mark.parametrize("level", [name for name in levels() if name != "native"])  # native: CI itself
def test_bitwise_under_dispatch_level(level):
    env = {**os.environ, **levels()[level]}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *BITWISE]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{level}: {levels()[level]}\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout
