"""Stage models: what a rank computes with (a causal LM with a rollback-able KV cache, or a
model-free drafter), how it is loaded, and the tokenizers the hierarchy shares."""
