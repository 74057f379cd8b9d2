"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs", arXiv:2006.16236).

Softmax attention weighs key ``k_j`` for query ``q_i`` by ``exp(q_i . k_j)``. Replacing that
similarity with a kernel ``phi(q_i) . phi(k_j)``, with the feature map ``phi(x) = elu(x) + 1``
(positive, section 3.2), lets the sums be reordered (their eq. 4-5)::

    out_i = phi(q_i)^T S / phi(q_i)^T z,     S = sum_j phi(k_j) v_j^T  (d x dv),  z = sum_j phi(k_j)

so the cost is O(n d dv) instead of O(n^2 d). The denominator is the normaliser
``phi(q_i) . sum_j phi(k_j)``: the weights of a row sum to one (some tutorials divide by
something else, and their rows do not).

Causal (eq. 8-9): ``S`` and ``z`` become prefix sums over ``j <= i``. Computing them for every
position would take O(n d dv) memory; instead the sequence is cut into chunks of ``C``: within a
chunk the (small, ``C x C``) quadratic form with a causal mask, across chunks the running state
``S``, ``z`` of all earlier chunks (an exclusive cumulative sum). Time O(n C d + n d dv), memory
O(n / C * d dv). Alignment is bottom-right like ``is_causal`` elsewhere: with ``i <= j`` queries,
query ``r`` sees keys ``k <= r + (j - i)``.

This is a *different* attention, not an approximation of a softmax call: it has no scale, mask
or bias, so it is not registered as a backend for ``scaled_dot_product_attention``; call
``linear_attention`` directly. ``linear_attention_quadratic`` is its explicit O(n^2) form, the
oracle the tests compare against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit._numerics import attention_op, compute_dtype
from attnkit.masks import causal_offset

__all__ = ["feature_map", "linear_attention", "linear_attention_quadratic"]


def feature_map(x: Tensor) -> Tensor:
    """``phi(x) = elu(x) + 1``: positive, so the normaliser never vanishes (section 3.2)."""
    return F.elu(x) + 1.0


def _check(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, eps: float) -> int:
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"query, key and value must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"linear_attention needs 4-D (b, h, n, d) inputs, got query {tuple(q.shape)}, "
            f"key {tuple(k.shape)}, value {tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(
            f"shapes do not match: query {tuple(q.shape)}, key {tuple(k.shape)}, "
            f"value {tuple(v.shape)} (expected (b, h, i, d), (b, h_kv, j, d), (b, h_kv, j, dv))"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"key heads ({k.shape[1]}) must divide query heads ({q.shape[1]})")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if is_causal and q.shape[2] > k.shape[2]:
        raise ValueError(
            f"is_causal with more queries ({q.shape[2]}) than keys ({k.shape[2]}) leaves rows "
            "with no key, which linear attention cannot normalise"
        )
    return q.shape[1] // k.shape[1]


@attention_op
def linear_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    is_causal: bool = False,
    chunk_size: int = 64,
    eps: float = 1e-6,
) -> Tensor:
    """Linear attention ``(b, h, i, d), (b, h_kv, j, d), (b, h_kv, j, dv) -> (b, h, i, dv)``.

    ``h_kv`` may divide ``h`` (grouped queries share a key/value head, no copy). ``eps`` guards
    the denominator. Differentiable; computed in float32 (float64 stays float64).
    """
    g = _check(query, key, value, is_causal, eps)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    compute = compute_dtype(query.dtype)
    b, h, ni, d = query.shape
    hk, nj, dv = key.shape[1], key.shape[2], value.shape[-1]
    pq = feature_map(query.to(compute)).view(b, hk, g, ni, d)  # (b, h_kv, g, i, d)
    pk = feature_map(key.to(compute))  # (b, h_kv, j, d)
    v = value.to(compute)
    if not is_causal:
        state = pk.transpose(-2, -1) @ v  # S: (b, h_kv, d, dv)
        z = pk.sum(dim=2)  # (b, h_kv, d)
        num = pq @ state.unsqueeze(2)  # (b, h_kv, g, i, dv)
        den = pq @ z[:, :, None, :, None]  # (b, h_kv, g, i, 1)
        return (num / (den + eps)).reshape(b, h, ni, dv).to(query.dtype)  # (b, h, i, dv)

    # Keys before the aligned part (j - i of them) are visible to every query: an initial state.
    lead = causal_offset(ni, nj)
    state0 = pk[:, :, :lead].transpose(-2, -1) @ v[:, :, :lead]  # (b, h_kv, d, dv)
    z0 = pk[:, :, :lead].sum(dim=2)  # (b, h_kv, d)
    pk, v = pk[:, :, lead:], v[:, :, lead:]  # now aligned with the queries: (b, h_kv, i, .)
    c = max(1, min(chunk_size, ni))
    pad = (-ni) % c
    if pad:  # zero features contribute nothing to sums; padded query rows are dropped below
        pq = F.pad(pq, (0, 0, 0, pad))
        pk = F.pad(pk, (0, 0, 0, pad))
        v = F.pad(v, (0, 0, 0, pad))
    nc = (ni + pad) // c
    qc = pq.view(b, hk, g, nc, c, d)  # (b, h_kv, g, chunks, c, d)
    kc = pk.view(b, hk, nc, c, d)  # (b, h_kv, chunks, c, d)
    vc = v.view(b, hk, nc, c, dv)  # (b, h_kv, chunks, c, dv)
    chunk_state = kc.transpose(-2, -1) @ vc  # (b, h_kv, chunks, d, dv)
    chunk_z = kc.sum(dim=3)  # (b, h_kv, chunks, d)
    # Exclusive prefix sums: the state of every earlier chunk (plus the initial state).
    prev_state = chunk_state.cumsum(dim=2) - chunk_state + state0.unsqueeze(2)
    prev_z = chunk_z.cumsum(dim=2) - chunk_z + z0.unsqueeze(2)
    # Within a chunk: the quadratic form with a causal mask, (b, h_kv, g, chunks, c, c).
    tri = torch.ones(c, c, dtype=torch.bool, device=query.device).tril()
    a = (qc @ kc.unsqueeze(2).transpose(-2, -1)) * tri  # (b, h_kv, g, chunks, c, c)
    num = a @ vc.unsqueeze(2) + qc @ prev_state.unsqueeze(2)  # (b, h_kv, g, chunks, c, dv)
    den = a.sum(dim=-1, keepdim=True) + qc @ prev_z[:, :, None, :, :, None]  # (..., c, 1)
    out = (num / (den + eps)).reshape(b, hk, g, nc * c, dv)[..., :ni, :]  # (b, h_kv, g, i, dv)
    return out.reshape(b, h, ni, dv).to(query.dtype)  # (b, h, i, dv)


@attention_op
def linear_attention_quadratic(
    query: Tensor, key: Tensor, value: Tensor, *, is_causal: bool = False, eps: float = 1e-6
) -> Tensor:
    """The explicit O(n^2) form: weights ``phi(q_i) . phi(k_j)`` normalised per row (the oracle)."""
    g = _check(query, key, value, is_causal, eps)
    pq = feature_map(query)
    pk = feature_map(key).repeat_interleave(g, dim=1)  # (b, h, j, d)
    v = value.repeat_interleave(g, dim=1)  # (b, h, j, dv)
    sim = pq @ pk.transpose(-2, -1)  # (b, h, i, j)
    if is_causal:
        ni, nj = query.shape[2], key.shape[2]
        keep = torch.ones(ni, nj, dtype=torch.bool, device=query.device).tril(causal_offset(ni, nj))
        sim = sim * keep
    return (sim @ v) / (sim.sum(dim=-1, keepdim=True) + eps)
