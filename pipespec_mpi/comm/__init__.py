"""MPI and torch.distributed plumbing: bootstrap, proposal channels, the epochs window."""
