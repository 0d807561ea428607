"""scripts/setup.sh chooses torch's build and the MPI as a cluster needs (its --dry-run prints the
install commands without running them)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def dry_run(*args: str, path_prefix: Path | None = None, env: dict | None = None) -> str:
    full = {**os.environ, **(env or {})}
    if path_prefix is not None:
        full["PATH"] = f"{path_prefix}:{full['PATH']}"
    proc = subprocess.run(["bash", "scripts/setup.sh", "--dry-run", *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def site_mpi(tmp_path) -> Path:
    """A directory whose mpicc stands for a cluster's loaded MPI."""
    (tmp_path / "mpicc").write_text("#!/bin/sh\necho site mpicc\n")
    (tmp_path / "mpicc").chmod(0o755)
    return tmp_path


def test_cuda_build_and_the_sites_mpi(site_mpi):
    out = dry_run("--cuda", path_prefix=site_mpi, env={"TORCH_INDEX_URL": "https://example/whl/cu126"})
    assert "torch: cuda build; MPI: site" in out
    assert "--index-url https://example/whl/cu126 torch==2.13.0" in out
    assert f"MPICC={site_mpi}/mpicc" in out and "--no-binary mpi4py" in out
    assert "-e .[test,plots]" in out and "mpich" not in out.split("MPI:")[1]


def test_the_default_off_a_cluster_is_the_cpu_build_and_the_mpich_wheel():
    out = dry_run("--cpu", "--mpich")
    assert "torch: cpu build; MPI: MPICH wheel" in out
    assert "--disable-pip-version-check -c scripts/pins.txt torch==2.13.0" in out and "--index-url" not in out
    assert "-e .[test,plots,mpich]" in out


def test_ci_installs_the_exact_pins_where_the_package_accepts_a_range():
    """pyproject.toml accepts a site's torch from 2.11 on and the transformers of its time; every
    install of setup.sh is constrained to scripts/pins.txt's exact versions (what CI runs)."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch>=2.11" in deps and "transformers>=5.17,<6" in deps
    pins = (ROOT / "scripts" / "pins.txt").read_text().split()
    assert {"torch==2.13.0", "transformers==5.24.0"} <= set(pins)
    installs = [line for line in dry_run("--cpu", "--mpich").splitlines() if " install " in line]
    assert installs and all("-c scripts/pins.txt" in line for line in installs)


@pytest.mark.skipif(shutil.which("mpicc", path="/usr/bin:/bin") is not None, reason="a system mpicc")
def test_site_mpi_without_an_mpicc_is_an_error():
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    cmd = ["bash", "scripts/setup.sh", "--dry-run", "--site-mpi"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "needs the site's mpicc" in proc.stderr
