"""Padding and causal masks together, and what a fully masked row gives.

Run: python examples/masks_and_causal.py
"""

import torch

from attnkit import masks, scaled_dot_product_attention


def main() -> None:
    torch.manual_seed(0)
    b, h, n, d = 2, 2, 5, 8
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    lengths = torch.tensor([5, 3])
    mask = masks.padding_mask(lengths, max_len=n)  # (b, 1, 1, j): True on real tokens
    out, weights = scaled_dot_product_attention(q, k, v, mask, is_causal=True, return_weights=True)
    print("output shape:", tuple(out.shape))
    print("weights of batch 1, head 0 (keys 3 and 4 are padding):")
    print(weights[1, 0].round(decimals=3))
    print("rows sum to:", weights[1, 0].sum(-1).round(decimals=3).tolist())

    # A query with no allowed key returns zeros, not NaN.
    nothing = torch.zeros(1, 1, 1, n, dtype=torch.bool)
    empty = scaled_dot_product_attention(q[:1], k[:1], v[:1], nothing)
    print("fully masked rows give zeros:", bool((empty == 0).all()))


if __name__ == "__main__":
    main()
