from pipespec_mpi.plan.cli import main

raise SystemExit(main())
