from pipespec_mpi.simulate.explore.cli import main

raise SystemExit(main())
