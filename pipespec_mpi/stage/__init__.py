"""The stage loop over injected ports, and the driver that runs it over a list of jobs."""
