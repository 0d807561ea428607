"""pipespec_mpi: hierarchical, pipelined speculative decoding (PipeSpec) over MPI."""

__version__ = "0.1.0"
