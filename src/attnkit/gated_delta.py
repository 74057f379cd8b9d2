"""The gated delta rule and Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, arXiv:2412.06464).

Shape vocabulary (used in every comment below):

    b  batch    n  positions    h  query/key heads    h_v  value heads (a multiple of h)
    d_k  query/key head width    d_v  value head width    c  chunk size    m  chunks (n / c)
    e  embed_dim    S  the state, one (d_k, d_v) matrix per value head

Linear attention keeps a fixed-size state instead of every past key. The *delta rule* (Widrow
& Hoff 1960; Schlag et al. 2021) writes to it like an associative memory: it first reads what
the state already stores under key ``k_t``, then replaces a fraction ``beta_t`` of it by
``v_t``. The *gated* delta rule (Yang et al. 2024, equation 10) also lets the whole state decay
by ``alpha_t = exp(g_t)`` first, as Mamba2's gate does::

    S_t = alpha_t * S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T       (S: (d_k, d_v))
    o_t = S_t^T q_t

``method="recurrent"`` runs exactly that, one position at a time: the reference, and what a
decoder runs per new token. ``method="chunked"`` gives the same numbers with matmuls: inside a
chunk of ``c`` positions the product of the ``(I - beta k k^T)`` factors is written in the WY
form (Bischof & Van Loan 1987), whose coefficients come from one unit lower-triangular solve,
the UT transform (Joffrain et al. 2006; section 3.3 of the paper, and DeltaNet's section 3 by
Yang et al. 2024b, arXiv:2406.06484). Only the ``m = n / c`` chunk states are visited in
sequence; all the rest is batched over chunks. Backward is autograd through the chunked form,
except the scan, whose backward is written out. ``beta`` and the decays scale the ``(c, c)``
factors rather than ``(c, d)`` copies of ``k`` and ``v``, so what autograd keeps is mostly
``(c, c)`` per chunk besides the inputs.

``GatedDeltaNet`` is the layer around the rule as Qwen3-Next builds it (and Qwen3.5 and Kimi
Linear after it): projections to q, k, v, a short causal depthwise convolution with SiLU over
them, L2-normalised q and k, ``beta = sigmoid(.)``, the Mamba2-style decay
``g = -exp(A_log) * softplus(a + dt_bias)``, and an output norm gated by ``silu(z)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit._numerics import compute_dtype

__all__ = ["GatedDeltaCache", "GatedDeltaNet", "gated_delta_rule", "l2norm"]

METHODS = ("chunked", "recurrent")


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's and Qwen3-Next's form of it)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _check_rule_inputs(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None
) -> None:
    for name, t, ndim in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != ndim:
            want = "(b, h, n, d_k)" if name in "qk" else "(b, h_v, n, d_v)"
            want = want if ndim == 4 else "(b, h_v, n)"
            raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if q.shape != k.shape:
        raise ValueError(
            f"q and k must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    b, h, n, d_k = k.shape
    if v.shape[0] != b or v.shape[2] != n:
        raise ValueError(
            f"v {tuple(v.shape)} must share (b, n) = ({b}, {n}) with k {tuple(k.shape)}"
        )
    if n == 0 or h == 0 or d_k == 0:
        raise ValueError(
            f"the rule needs at least one position, head and key channel, got k of shape "
            f"{tuple(k.shape)}"
        )
    h_v, d_v = v.shape[1], v.shape[3]
    if h_v % h:
        raise ValueError(f"value heads h_v={h_v} must be a multiple of the key heads h={h}")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (b, h_v, n):
            raise ValueError(
                f"{name} must have shape (b, h_v, n) = {(b, h_v, n)}, got {tuple(t.shape)}"
            )
    if initial_state is not None and not isinstance(initial_state, Tensor):
        raise TypeError(
            f"initial_state must be a tensor or None, got {type(initial_state).__name__}"
        )
    if initial_state is not None and initial_state.shape != (b, h_v, d_k, d_v):
        raise ValueError(
            f"initial_state must have shape (b, h_v, d_k, d_v) = {(b, h_v, d_k, d_v)}, got "
            f"{tuple(initial_state.shape)}"
        )


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    use_qk_l2norm: bool = False,
    method: str = "chunked",
    scale: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Causal linear attention by the gated delta rule (see the module docstring for the math).

    Args:
        q, k: ``(b, h, n, d_k)``; each query/key head serves ``h_v // h`` consecutive value
            heads (grouped as in Qwen3-Next).
        v: ``(b, h_v, n, d_v)``.
        g: ``(b, h_v, n)``, the log of the decay: the state is multiplied by ``exp(g)`` before
            each write, so ``g <= 0`` keeps it bounded.
        beta: ``(b, h_v, n)``, the write strength, usually in ``(0, 1)``.
        initial_state: ``(b, h_v, d_k, d_v)`` to continue from (a prefill's final state);
            ``None``: zeros.
        output_final_state: also return the state after the last position.
        chunk_size: ``c`` for ``method="chunked"``; ``n`` need not be a multiple: the last chunk
            is padded with positions that neither decay nor write (``g = beta = 0``, ``k = 0``).
        use_qk_l2norm: L2-normalise q and k first (``l2norm``, eps 1e-6), as Qwen3-Next does.
        method: ``"chunked"`` (matmuls, for training and prefill) or ``"recurrent"`` (the
            reference, one position at a time).
        scale: multiplies q; ``None`` means ``d_k ** -0.5``.

    Returns:
        ``(out (b, h_v, n, d_v), final state (b, h_v, d_k, d_v) or None)``, in the inputs'
        dtype; the computation runs in float32 at least (``attnkit._numerics.compute_dtype``).
    """
    _check_rule_inputs(q, k, v, g, beta, initial_state)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    dtype = v.dtype
    work = compute_dtype(torch.promote_types(q.dtype, v.dtype))
    q, k, v, g, beta = (t.to(work) for t in (q, k, v, g, beta))
    h, h_v = k.shape[1], v.shape[1]
    if use_qk_l2norm:  # per row, so before the repeat: autograd keeps h heads, not h_v
        q, k = l2norm(q), l2norm(k)
    if h_v != h:  # grouped value heads: repeat each q/k head over its value heads
        q = q.repeat_interleave(h_v // h, dim=1)  # (b, h_v, n, d_k)
        k = k.repeat_interleave(h_v // h, dim=1)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    state = None if initial_state is None else initial_state.to(work)
    if method == "recurrent":
        out, state = _recurrent(q, k, v, g, beta, state)
    else:
        out, state = _chunked(q, k, v, g, beta, state, chunk_size)
    return out.to(dtype), (state.to(dtype) if output_final_state else None)


def _recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The rule as written, position by position (paper equation 10); q already scaled."""
    b, h_v, n, d_k = k.shape
    d_v = v.shape[-1]
    if state is None:
        state = v.new_zeros(b, h_v, d_k, d_v)
    outs = []
    for t in range(n):
        k_t = k[:, :, t]  # (b, h_v, d_k)
        state = state * g[:, :, t].exp()[..., None, None]  # alpha_t S_{t-1}
        read = torch.einsum("bhk,bhkv->bhv", k_t, state)  # S^T k_t: what k_t recalls now
        delta = beta[:, :, t, None] * (v[:, :, t] - read)  # (b, h_v, d_v)
        state = state + k_t[..., :, None] * delta[..., None, :]  # S + k_t delta^T
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))  # o_t = S_t^T q_t
    return torch.stack(outs, dim=2), state  # (b, h_v, n, d_v)


def _chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor | None,
    c: int,
) -> tuple[Tensor, Tensor]:
    """The same rule, a chunk of ``c`` positions at a time (paper section 3.3); q already scaled.

    Inside a chunk, with ``G_r = g_1 + ... + g_r`` (cumulative log decay from the chunk start)
    and ``S_0`` the state before the chunk, unrolling the rule gives (``s < r`` strictly)::

        A[r, s]  = beta_r exp(G_r - G_s) k_r . k_s            strictly lower triangular
        T        = (I + A)^-1                                  the UT transform
        U        = T (beta v),   W = T (beta exp(G) k)         the WY factors
        V'       = U - W S_0                                   the values the chunk writes
        O        = exp(G) q S_0 + ((q k^T) * exp(G_r - G_s), s <= r) V'
        S_c      = exp(G_c) S_0 + (exp(G_c - G) k)^T V'
    """
    b, h_v, n, d_k = k.shape
    d_v = v.shape[-1]
    pad = (-n) % c
    if pad:  # padded positions: k = 0, beta = 0 (no write), g = 0 (no decay)
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    m = (n + pad) // c
    q, k, v = (t.reshape(b, h_v, m, c, t.shape[-1]) for t in (q, k, v))  # (b, h_v, m, c, d)
    g, beta = g.reshape(b, h_v, m, c), beta.reshape(b, h_v, m, c)  # (b, h_v, m, c)
    U, W, inner, q_decayed, k_decayed, chunk_decay = _chunk_factors(q, k, v, g, beta)

    # Only this scan is sequential: the state entering each chunk.
    if state is None:
        state = v.new_zeros(b, h_v, d_k, d_v)
    S0, V_new, state = _ChunkScan.apply(U, W, k_decayed, chunk_decay, state)
    out = q_decayed @ S0 + inner @ V_new  # (b, h_v, m, c, d_v)
    out = out.reshape(b, h_v, m * c, d_v)[:, :, :n]  # (b, h_v, n, d_v)
    return out, state


def _chunk_factors(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Everything of ``_chunked`` that is independent across chunks, batched over all of them:
    ``(U, W, inner, q exp(G), k exp(G_c - G), exp(G_c))`` from ``(b, h_v, m, c, .)`` inputs."""
    c = q.shape[-2]
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()  # s <= r
    # A decay of g = -inf (exp(g) = 0) empties the state: nothing before it reaches a later
    # position. G_r - G_s would be -inf - -inf = nan there, so such positions count as g = 0 in
    # the sums and every factor that spans one is zeroed instead (resets: how many so far).
    resets = torch.isneginf(g)
    if bool(resets.any()):
        g = g.masked_fill(resets, 0.0)
        resets = resets.cumsum(-1)  # (b, h_v, m, c)
    else:
        resets = None
    G = g.cumsum(-1)  # (b, h_v, m, c)
    # exp(G_r - G_s) for s <= r; above the diagonal the difference is zeroed *before* exp so
    # it cannot overflow, then the entry itself is zeroed.
    hidden = ~lower
    if resets is not None:  # a reset in (s, r]
        hidden = hidden | (resets[..., :, None] != resets[..., None, :])
    diff = (G[..., :, None] - G[..., None, :]).masked_fill(hidden, 0.0)
    decay = diff.exp().masked_fill(hidden, 0.0)  # (b, h_v, m, c, c)
    from_start = G.exp()  # exp(G_r): from the chunk's start to r
    to_end = (G[..., -1:] - G).exp()  # exp(G_c - G_s): from s to the chunk's end
    if resets is not None:
        from_start = from_start.masked_fill(resets > 0, 0.0)
        to_end = to_end.masked_fill(resets != resets[..., -1:], 0.0)
    # beta and exp(G) scale rows of k and v in the formulas; they are applied to the (c, c)
    # factors instead (beta_r on A's rows, beta_s and exp(G_s) on T's columns), which is the
    # same product with no elementwise pass over a (c, d) tensor.
    A = (k @ k.transpose(-1, -2)) * (decay * beta[..., :, None])  # (b, h_v, m, c, c)
    T = _UnitLowerInverse.apply(A.tril(-1))  # (b, h_v, m, c, c): (I + A)^-1; diagonal ignored
    U = (T * beta[..., None, :]) @ v  # T (beta v): (b, h_v, m, c, d_v)
    W = (T * (beta * from_start)[..., None, :]) @ k  # T (beta exp(G) k): (b, h_v, m, c, d_k)
    inner = (q @ k.transpose(-1, -2)) * decay  # (b, h_v, m, c, c): attention inside a chunk
    q_decayed = q * from_start[..., None]  # reads S_0 through the decay so far
    k_decayed = k * to_end[..., None]  # writes decayed to the chunk's end
    chunk_decay = from_start[..., -1:, None]  # (b, h_v, m, 1, 1)
    return U, W, inner, q_decayed, k_decayed, chunk_decay


class _UnitLowerInverse(torch.autograd.Function):
    """``T = (I + A)^-1`` for strictly lower-triangular ``A (..., c, c)``, by one triangular solve
    against the identity; backward ``dA = -(T^T dT T^T)`` below the diagonal: two matmuls,
    where autograd of a solve against the values would solve again with the transposed system.
    """

    @staticmethod
    def forward(ctx, A):  # type: ignore[no-untyped-def,override]
        eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
        T = torch.linalg.solve_triangular(
            A + eye, eye.expand_as(A), upper=False, unitriangular=True
        )
        ctx.save_for_backward(T)
        return T

    @staticmethod
    def backward(ctx, dT):  # type: ignore[no-untyped-def,override]
        (T,) = ctx.saved_tensors
        Tt = T.transpose(-1, -2)  # (..., c, c): T^T
        return -(Tt @ dT @ Tt).tril(-1)


class _ChunkScan(torch.autograd.Function):
    """The scan over chunks, with its backward written out (autograd of a Python loop would
    record ~10 small ops per chunk; here each direction is two matmuls per chunk). Inside, the
    tensors keep their ``(b h_v, m, ...)`` layout (views of the inputs, no copies); each step
    takes the chunk's ``(b h_v, c, d)`` slice, whose matrices are contiguous, and the states
    and gradients come out in the layout the output matmul reads.

    Forward, per chunk ``i`` (``D_i = exp(G_c)``, ``K_i = exp(G_c - G) k``)::

        S0_i = S;   V'_i = U_i - W_i S;   S <- D_i S + K_i^T V'_i

    Backward, in reverse, with ``dS`` the gradient of the state leaving chunk ``i``::

        dV'_i += K_i dS;   dS <- D_i dS - W_i^T dV'_i + dS0_i

    and, batched after the loop: ``dU = dV'``, ``dW = -dV' S0^T``, ``dK = V' dS_next^T``,
    ``dD = sum(S0 * dS_next)``.
    """

    @staticmethod
    def forward(ctx, U, W, K, D, state):  # type: ignore[no-untyped-def,override]
        b, h_v, m, c, d_v = U.shape
        d_k = W.shape[-1]
        U_, W_, K_ = (t.reshape(b * h_v, m, c, t.shape[-1]) for t in (U, W, K))  # (b h_v, m, c, d)
        D_ = D.reshape(b * h_v, m, 1, 1)  # (b h_v, m, 1, 1)
        S0 = U.new_empty(b * h_v, m, d_k, d_v)
        V_new = torch.empty_like(U_)
        S = state.reshape(b * h_v, d_k, d_v)  # (b h_v, d_k, d_v)
        for i in range(m):
            S0[:, i] = S
            torch.baddbmm(U_[:, i], W_[:, i], S, alpha=-1, out=V_new[:, i])  # U_i - W_i S
            # D_i S + K_i^T V'_i: (b h_v, d_k, d_v)
            S = torch.baddbmm(S * D_[:, i], K_[:, i].transpose(-1, -2), V_new[:, i])
        ctx.save_for_backward(W_, K_, D_, S0, V_new)
        ctx.shape = (b, h_v)
        return (
            S0.view(b, h_v, m, d_k, d_v),  # the state entering each chunk
            V_new.view(b, h_v, m, c, d_v),  # the values each chunk writes
            S.view(b, h_v, d_k, d_v),  # the state leaving the last chunk
        )

    @staticmethod
    def backward(ctx, dS0, dV_new, dstate):  # type: ignore[no-untyped-def,override]
        W_, K_, D_, S0, V_new = ctx.saved_tensors
        b, h_v = ctx.shape
        m = V_new.shape[1]
        dS = dstate.reshape(b * h_v, *dstate.shape[2:]).clone()  # (b h_v, d_k, d_v)
        dV = dV_new.reshape(V_new.shape).clone()  # (b h_v, m, c, d_v)
        dS0_ = dS0.reshape(S0.shape)  # (b h_v, m, d_k, d_v)
        dS_next = torch.empty_like(S0)  # the gradient of the state leaving each chunk
        for i in reversed(range(m)):
            dS_next[:, i] = dS
            dV[:, i].baddbmm_(K_[:, i], dS)  # dV'_i += K_i dS
            dS = torch.baddbmm(  # D_i dS + dS0_i - W_i^T dV'_i: (b h_v, d_k, d_v)
                dS * D_[:, i] + dS0_[:, i], W_[:, i].transpose(-1, -2), dV[:, i], alpha=-1
            )
        dW = torch.matmul(dV, S0.transpose(-1, -2)).neg_()  # (b h_v, m, c, d_k)
        dK = V_new @ dS_next.transpose(-1, -2)  # (b h_v, m, c, d_k)
        # dD = sum(S0 * dS_next) per chunk and head, as batched dot products (no S0-sized temp)
        dD = S0.flatten(2)[..., None, :] @ dS_next.flatten(2)[..., None]  # (b h_v, m, 1, 1)
        grads = (t.view(b, h_v, *t.shape[1:]) for t in (dV, dW, dK, dD))  # (b, h_v, m, ...)
        return (*grads, dS.view(b, h_v, *dS.shape[1:]))  # dS: (b, h_v, d_k, d_v)


class GatedDeltaCache:
    """What one ``GatedDeltaNet`` layer carries from a prefill to the next tokens.

    Unlike ``attnkit.KVCache`` its size does not grow with the sequence: ``conv`` holds the last
    ``kernel_size - 1`` inputs of the short convolution, ``(b, conv_dim, kernel_size - 1)``, and
    ``state`` the delta rule's memory, ``(b, h_v, d_k, d_v)``. ``length`` counts the positions
    seen. Give each layer its own cache.
    """

    def __init__(self) -> None:
        self.conv: Tensor | None = None
        self.state: Tensor | None = None
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def reset(self) -> None:
        self.conv = self.state = None
        self.length = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.state) if t is not None)


def _check_positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class GatedRMSNorm(nn.Module):
    """``RMSNorm(x) * weight * silu(z)`` over the last dim (norm first, then the gate, as fla's
    ``FusedRMSNormGated`` and Qwen3-Next do). Statistics in float32 at least."""

    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(_check_positive("dim", dim)))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        work = compute_dtype(x.dtype)
        xf = x.to(work)
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(z.to(work))).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet token mixer over ``(b, n, e)``, as in Qwen3-Next.

    Per position: ``q, k = conv(W_q x), conv(W_k x)`` (``h`` heads of ``d_k``), ``v = conv(W_v x)``
    (``h_v`` heads of ``d_v``), where ``conv`` is a causal depthwise convolution of width
    ``kernel_size`` followed by SiLU (it lets a token see its few predecessors before the
    state does); ``beta = sigmoid(W_b x)``, ``g = -exp(A_log) * softplus(W_a x + dt_bias)``;
    ``o = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)``; then per value head
    ``RMSNorm(o) * silu(W_z x)`` and ``out_proj``.

    Args:
        embed_dim: ``e``.
        num_heads: query/key heads ``h``.
        head_dim: ``d_k``.
        num_value_heads: ``h_v`` (a multiple of ``h``); ``None``: ``h``.
        value_head_dim: ``d_v``; ``None``: ``d_k``.
        kernel_size: width of the short convolution (Qwen3-Next: 4).
        eps: the output norm's epsilon.
        chunk_size: the chunk of the chunked rule (used when more than one position is new).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        head_dim: int,
        *,
        num_value_heads: int | None = None,
        value_head_dim: int | None = None,
        kernel_size: int = 4,
        eps: float = 1e-6,
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        e = _check_positive("embed_dim", embed_dim)
        h = _check_positive("num_heads", num_heads)
        d_k = _check_positive("head_dim", head_dim)
        h_v = h if num_value_heads is None else _check_positive("num_value_heads", num_value_heads)
        d_v = d_k if value_head_dim is None else _check_positive("value_head_dim", value_head_dim)
        if h_v % h:
            raise ValueError(f"num_value_heads ({h_v}) must be a multiple of num_heads ({h})")
        self.embed_dim, self.num_heads, self.head_dim = e, h, d_k
        self.num_value_heads, self.value_head_dim = h_v, d_v
        self.kernel_size = _check_positive("kernel_size", kernel_size)
        self.chunk_size = _check_positive("chunk_size", chunk_size)
        key_dim, value_dim = h * d_k, h_v * d_v
        self.conv_dim = 2 * key_dim + value_dim
        self.q_proj = nn.Linear(e, key_dim, bias=False)
        self.k_proj = nn.Linear(e, key_dim, bias=False)
        self.v_proj = nn.Linear(e, value_dim, bias=False)
        self.z_proj = nn.Linear(e, value_dim, bias=False)  # the output gate
        self.b_proj = nn.Linear(e, h_v, bias=False)  # beta, before the sigmoid
        self.a_proj = nn.Linear(e, h_v, bias=False)  # the decay's time step, before softplus
        # depthwise over the channels [q; k; v], causal (the past only): (conv_dim, 1, kernel)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, 1, kernel_size))
        self.A_log = nn.Parameter(torch.empty(h_v))
        self.dt_bias = nn.Parameter(torch.ones(h_v))
        self.norm = GatedRMSNorm(d_v, eps=eps)
        self.out_proj = nn.Linear(value_dim, e, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Kaiming-uniform convolution (torch's Conv1d default), ``A`` uniform in [1, 16] as in
        Mamba2 (so decays start between ``exp(-16)`` and ``exp(-1)`` per unit step)."""
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.conv_weight, a=math.sqrt(5))
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
            nn.init.ones_(self.dt_bias)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"num_value_heads={self.num_value_heads}, value_head_dim={self.value_head_dim}, "
            f"kernel_size={self.kernel_size}"
        )

    def _conv(self, x: Tensor, cache: GatedDeltaCache | None) -> Tensor:
        """Causal depthwise convolution + SiLU over ``x (b, conv_dim, n)``, continuing ``cache``."""
        b = x.shape[0]
        keep = self.kernel_size - 1
        if cache is not None and cache.conv is not None:
            past = cache.conv  # (b, conv_dim, kernel - 1)
            if past.shape != (b, self.conv_dim, keep):
                raise ValueError(
                    f"cache holds convolution inputs {tuple(past.shape)} where this layer needs "
                    f"(b, conv_dim, kernel_size - 1) = {(b, self.conv_dim, keep)}: the cache "
                    "comes from another layer or batch (give each layer its own; reset())"
                )
        else:
            past = x.new_zeros(b, self.conv_dim, keep)  # before the first token: silence
        full = torch.cat([past.to(x.dtype), x], dim=-1)  # (b, conv_dim, kernel - 1 + n)
        if cache is not None:
            cache.conv = full[:, :, full.shape[-1] - keep :].detach()
        out = F.conv1d(full, self.conv_weight.to(x.dtype), groups=self.conv_dim)  # (b, c, n)
        return F.silu(out)

    def forward(
        self,
        x: Tensor,
        *,
        is_causal: bool = True,
        cache: GatedDeltaCache | None = None,
        need_weights: bool = False,
        method: str | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Mix ``x (b, n, e)`` causally; ``(out (b, n, e), None)``.

        The rule has no weight matrix to return, and no acausal form: ``is_causal`` must be
        True and ``need_weights`` False. With ``cache`` the layer continues from the cached
        convolution inputs and state and updates them, so a prefill followed by one-token calls
        equals one forward over the whole sequence. ``method``: the rule's method; ``None``
        runs ``"recurrent"`` for a single new token and ``"chunked"`` otherwise.
        """
        if not isinstance(x, Tensor) or x.ndim != 3 or x.shape[-1] != self.embed_dim:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (b, n, embed_dim={self.embed_dim}), got {shape}")
        if not is_causal:
            raise ValueError("GatedDeltaNet is a causal recurrence: is_causal must be True")
        if need_weights:
            raise ValueError("GatedDeltaNet has no attention weights to return (need_weights)")
        if cache is not None and not isinstance(cache, GatedDeltaCache):
            raise TypeError(f"cache must be a GatedDeltaCache, got {type(cache).__name__}")
        b, n, _ = x.shape
        h, h_v, d_k, d_v = self.num_heads, self.num_value_heads, self.head_dim, self.value_head_dim
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # (b, n, c)
        qkv = self._conv(qkv.transpose(1, 2), cache).transpose(1, 2)  # (b, n, conv_dim)
        q, k, v = qkv.split([h * d_k, h * d_k, h_v * d_v], dim=-1)
        q = q.view(b, n, h, d_k).transpose(1, 2)  # (b, h, n, d_k)
        k = k.view(b, n, h, d_k).transpose(1, 2)  # (b, h, n, d_k)
        v = v.view(b, n, h_v, d_v).transpose(1, 2)  # (b, h_v, n, d_v)
        work = compute_dtype(x.dtype)
        beta = self.b_proj(x).sigmoid().transpose(1, 2)  # (b, h_v, n)
        # Mamba2's discretisation: a positive step dt = softplus(.) times a negative rate -A
        dt = F.softplus(self.a_proj(x).to(work) + self.dt_bias.to(work))  # (b, n, h_v)
        g = (-self.A_log.to(work).exp() * dt).transpose(1, 2)  # (b, h_v, n)
        if method is None:
            method = "recurrent" if n == 1 else "chunked"
        state = None if cache is None else cache.state
        o, state = gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            initial_state=state,
            output_final_state=cache is not None,
            chunk_size=self.chunk_size,
            use_qk_l2norm=True,
            method=method,
        )
        if cache is not None:
            cache.state, cache.length = state, cache.length + n
        z = self.z_proj(x).view(b, n, h_v, d_v)  # (b, n, h_v, d_v)
        o = self.norm(o.transpose(1, 2), z)  # (b, n, h_v, d_v)
        return self.out_proj(o.reshape(b, n, h_v * d_v)), None  # (b, n, e)

    @classmethod
    def from_transformers(cls, module: nn.Module) -> GatedDeltaNet:
        """A ``GatedDeltaNet`` holding a copy of a ``Qwen3NextGatedDeltaNet``'s weights.

        Qwen3-Next stores q, k, v, z in one projection grouped per key head
        (``[q_h, k_h, v_group_h, z_group_h]`` for each of the ``h`` heads) and b, a likewise;
        the rows are regrouped here into the separate projections above. Same dtype and device.
        """
        if type(module).__name__ != "Qwen3NextGatedDeltaNet":
            raise TypeError(f"expected Qwen3NextGatedDeltaNet, got {type(module).__name__}")
        if getattr(module, "activation", "silu") not in ("silu", "swish"):
            raise ValueError(f"only the SiLU convolution is supported, got {module.activation!r}")
        h, h_v = module.num_k_heads, module.num_v_heads
        d_k, d_v = module.head_k_dim, module.head_v_dim
        weight = module.out_proj.weight
        new = cls(
            module.hidden_size,
            h,
            d_k,
            num_value_heads=h_v,
            value_head_dim=d_v,
            kernel_size=module.conv_kernel_size,
            eps=module.norm.variance_epsilon,
        ).to(dtype=weight.dtype, device=weight.device)
        r = h_v // h  # value heads per key head
        qkvz = module.in_proj_qkvz.weight.view(h, 2 * d_k + 2 * r * d_v, -1)  # (h, rows, e)
        q, k, v, z = qkvz.split([d_k, d_k, r * d_v, r * d_v], dim=1)  # per key head
        ba = module.in_proj_ba.weight.view(h, 2 * r, -1)  # (h, 2 r, e): [b_h, a_h] per key head
        b_rows, a_rows = ba.split([r, r], dim=1)
        with torch.no_grad():
            for lin, rows in (
                (new.q_proj, q),
                (new.k_proj, k),
                (new.v_proj, v),
                (new.z_proj, z),
                (new.b_proj, b_rows),
                (new.a_proj, a_rows),
            ):
                lin.weight.copy_(rows.reshape(lin.weight.shape))  # (h, rows, e) -> (h rows, e)
            new.conv_weight.copy_(module.conv1d.weight)
            if module.conv1d.bias is not None:
                raise ValueError("a convolution bias is not supported (Qwen3-Next has none)")
            new.A_log.copy_(module.A_log)
            new.dt_bias.copy_(module.dt_bias)
            new.norm.weight.copy_(module.norm.weight)
            new.out_proj.weight.copy_(module.out_proj.weight)
        return new
