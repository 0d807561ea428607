"""Unit tests, mirroring the package tree: tests/unit/<package>/test_<module>.py tests
pipespec_mpi/<package>/<module>.py (top-level modules: tests/unit/test_<module>.py; a second file
for one module: test_<module>_<topic>.py). test_layout.py and test_setup_script.py check the
repository as a whole.

Every folder here is a package, so that names may repeat (models/test_engine.py and
simulate/test_engine.py; run/test_drain.py and tests/mpi/test_drain.py) under pytest's default
import mode, which also keeps tests/ on sys.path for ``from conftest import`` and the shared
helpers (tests/dispatch_levels.py, sampling_stats.py, user_rows.py). A test that uses another test
file's helpers imports it relatively (``from ..models.cpu.test_plugins import model_for``)."""
