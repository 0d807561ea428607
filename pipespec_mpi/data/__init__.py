"""Prompt datasets (offline) and deterministic sharding across replicas and array tasks."""
