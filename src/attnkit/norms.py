"""Normalisation layers that torch's ``nn.LayerNorm`` does not cover.

Shape vocabulary: ``e`` the normalised (last) dimension; any leading dims pass through.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit._numerics import compute_dtype

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """Root-mean-square normalisation (Zhang & Sennrich 2019, "Root Mean Square Layer
    Normalization", equation 4), as in Llama, Mistral and Gemma::

        y = x / sqrt(mean(x^2) + eps) * weight          # mean over the last dim (e)

    Unlike layer norm it neither subtracts the mean nor adds a bias: only the scale is
    normalised. The statistic is computed in float32 (float64 stays float64), so bfloat16 and
    float16 inputs do not lose it to rounding; the normalised vector is cast back to the input's
    dtype before the weight multiplies it (Llama's order, so half-precision weights give the
    same result as its reference code). ``weight`` starts at 1.

    Args:
        dim: size ``e`` of the last dimension.
        eps: added to the mean square before the square root (Llama checkpoints state theirs:
            1e-5 or 1e-6).
    """

    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
            raise ValueError(f"eps must be a positive float, got {eps!r}")
        self.dim = dim
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1:] != (self.dim,):
            raise ValueError(f"RMSNorm({self.dim}) got input of shape {tuple(x.shape)}")
        xf = x.to(compute_dtype(x.dtype))
        mean_square = xf.pow(2).mean(dim=-1, keepdim=True)  # (..., 1)
        return self.weight * (xf * torch.rsqrt(mean_square + self.eps)).to(x.dtype)
