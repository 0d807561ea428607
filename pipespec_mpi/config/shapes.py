"""The Llama shapes a ``random`` stage may name (``hierarchy.stages[i].shape``): the paper's models,
SmolLM2-135M's, and ``toy``, small enough for CI. Plain data, so that config validation can name
them; models/shapes.py builds random-weight models of them, simulate/profile.py times them.
"""

from __future__ import annotations

SHAPES: dict[str, dict] = {
    "toy": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
    "135M": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256),
    # the 70B's proportions (GQA 8, head_dim and intermediate/hidden as the 70B's) at a CI size whose
    # linears int4 can take (inputs multiples of 128)
    "70B-mini": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=1, vocab_size=512, tie_word_embeddings=False),
}  # fmt: skip


def params(shape: str) -> int:
    """Weights of a shape (what a memory-bound step reads)."""
    s = SHAPES[shape]
    h, i, n, v = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    d = h // s["num_attention_heads"]
    attn = h * d * (2 * s["num_attention_heads"] + 2 * s["num_key_value_heads"])
    return n * (attn + 3 * h * i) + v * h * (1 if s.get("tie_word_embeddings") else 2)
