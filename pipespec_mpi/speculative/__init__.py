"""The algorithm: pure acceptance math, pure buffer bookkeeping, and the stage loop."""
