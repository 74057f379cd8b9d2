"""Grouped-query attention, a KV cache, greedy generation, and a look at the attention weights.

Run: python examples/kv_cache_generation.py
"""

import torch

from attnkit import (
    KVCache,
    MultiHeadAttention,
    TransformerConfig,
    TransformerDecoder,
    inspect_attention,
)


def main() -> None:
    torch.manual_seed(0)

    # 1. One attention layer: decoding token by token with a cache equals one causal pass.
    mha = MultiHeadAttention(32, num_heads=8, num_kv_heads=2).eval()
    x = torch.randn(1, 6, 32)  # (b, i, embed_dim)
    full, _ = mha(x, is_causal=True)
    cache = KVCache()
    steps = [mha(x[:, t : t + 1], is_causal=True, cache=cache)[0] for t in range(6)]
    err = (torch.cat(steps, dim=1) - full).abs().max().item()
    print(f"cached keys {tuple(cache.key.shape)} (b, h_kv, j, d); max |cached - full| = {err:.1e}")

    # 2. A small decoder (untrained, so it soon repeats itself): greedy generation with one
    # KV cache per layer.
    config = TransformerConfig(
        embed_dim=32, num_heads=4, num_layers=2, vocab_size=50, positional="rope", num_kv_heads=2
    )
    decoder = TransformerDecoder(config).eval()
    prompt = torch.tensor([[1, 2, 3]])
    print("generated:", decoder.generate(prompt, max_new_tokens=6).tolist())

    # 3. What the heads look at: causal rows, each summing to one.
    print(inspect_attention(decoder, prompt))


if __name__ == "__main__":
    main()
