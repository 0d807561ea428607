"""``pipespec-simulate``: see cli.py."""

import sys

from pipespec_mpi.simulate.cli import main

sys.exit(main())
