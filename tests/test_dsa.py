"""DeepSeek sparse attention against transformers' DeepseekV32Attention with its indexer (a
float64 copy of its math, see ``hf_float64``), the sparse gather kernel against the masked
reference (outputs and every gradient) and against a brute-force top-k, cached decoding against
the full forward, and bad input.

The indexer's ReLU makes exact ties possible (every head at zero for two keys), and ``topk``
may break a tie either way; 16 indexer heads make such a tie a 2^-16 event per key."""

from __future__ import annotations

import pytest
import torch

from attnkit import (
    DeepSeekSparseAttention,
    LightningIndexer,
    MultiHeadLatentAttention,
    scaled_dot_product_attention,
)
from attnkit.dsa import SparseLatentCache, gather_attention

pytest.importorskip("transformers")
from hf_float64 import float64_module
from modern_oracles import (
    D_C,
    D_N,
    D_Q,
    D_R,
    D_V,
    F64,
    TOP_K,
    E,
    H,
    assert_equal_with_input_gradients,
    assert_same_model,
    deepseek_attention,
    deepseek_forward,
    deepseek_pair,
    mla_module,
)

V32 = "deepseek_v32.modeling_deepseek_v32"


@pytest.mark.parametrize("method", ["sparse", "masked"])
def test_equals_transformers_in_float64_with_input_gradients(method):
    hf, rotary = deepseek_attention(float64_module(V32), sparse=True)
    ours = DeepSeekSparseAttention.from_transformers(hf, backend="math")
    x = torch.randn(2, 15, E, dtype=F64, requires_grad=True)
    ref = deepseek_forward(hf, rotary, x)
    out, weights = ours(x, method=method)
    assert weights is None
    assert_equal_with_input_gradients(out, ref, x)


def test_matches_the_float32_transformers_module():
    from transformers.models.deepseek_v32 import modeling_deepseek_v32

    hf, rotary = deepseek_attention(modeling_deepseek_v32, sparse=True, dtype=torch.float32)
    ours = DeepSeekSparseAttention.from_transformers(hf)
    x = torch.randn(2, 11, E)
    torch.testing.assert_close(ours(x)[0], deepseek_forward(hf, rotary, x), rtol=0, atol=2e-5)


def _module(top_k=TOP_K, block=4):
    torch.manual_seed(2)
    mla = mla_module()
    indexer = LightningIndexer(E, D_Q, 16, 8, rope_dim=D_R, top_k=top_k)
    return DeepSeekSparseAttention(mla, indexer, block=block).double()


def test_sparse_equals_masked_with_all_gradients():
    m = _module()
    x = torch.randn(2, 21, E, dtype=F64, requires_grad=True)
    params = [x, *m.attention.parameters()]
    results = []
    for method in ("masked", "sparse"):
        out, _ = m(x, method=method)
        results.append((out, torch.autograd.grad(out.pow(2).sum(), params)))
    (o1, g1), (o2, g2) = results
    torch.testing.assert_close(o2, o1, rtol=0, atol=1e-10)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


def test_indexer_keeps_the_top_k_visible_keys():
    m = _module()
    x = torch.randn(2, 12, E, dtype=F64)
    idx = m.indexer
    c_q = m.attention.query_latent(x)
    keys = idx.keys(x, 0)
    indices, valid = idx.select(x, c_q, keys, block=5)
    scores = idx.scores(idx.queries(c_q, 0), idx.head_weights(x), keys)  # (b, i, j), all of it
    for b in range(2):
        for i in range(12):
            picked = set(indices[b, i][valid[b, i]].tolist())
            visible = scores[b, i, : i + 1]
            want = set(visible.topk(min(TOP_K, i + 1)).indices.tolist())
            assert picked == want, (b, i)


def test_gather_attention_equals_masked_softmax_and_gradcheck():
    gen = torch.Generator().manual_seed(3)
    b, h, i, j, d, dv, t = 2, 3, 9, 11, 5, 4, 4
    q = torch.randn(b, h, i, d, generator=gen, dtype=F64, requires_grad=True)
    k = torch.randn(b, j, d, generator=gen, dtype=F64, requires_grad=True)
    v = torch.randn(b, j, dv, generator=gen, dtype=F64, requires_grad=True)
    indices = torch.stack([torch.randperm(j, generator=gen)[:t] for _ in range(b * i)])
    indices = indices.view(b, i, t)
    valid = torch.rand(b, i, t, generator=gen) > 0.3
    valid[..., 0] = True
    out = gather_attention(q, k, v, indices, valid, block=4)
    keep = torch.zeros(b, i, j, dtype=torch.bool).scatter_(-1, indices, valid)[:, None]
    scores = (q @ k[:, None].transpose(-1, -2)) * d**-0.5
    ref = scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v[:, None]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda q, k, v: gather_attention(q, k, v, indices, valid, block=4), (q, k, v)
    )


def test_cached_decoding_equals_the_full_forward():
    m = _module()
    x = torch.randn(2, 14, E, dtype=F64)
    full, _ = m(x)
    cache = SparseLatentCache()
    steps = [m(x[:, :6], cache=cache)[0]]
    for t in range(6, 14):
        steps.append(m(x[:, t : t + 1], cache=cache)[0])
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)
    assert cache.index_key.shape == (2, 14, 8)
    assert cache.nbytes() == 2 * 14 * (D_C + D_R + 8) * 8


def test_with_top_k_above_the_length_it_is_dense_causal_mla():
    m = _module(top_k=64)
    x = torch.randn(1, 10, E, dtype=F64)
    torch.testing.assert_close(m(x)[0], m.attention(x)[0], rtol=0, atol=1e-10)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="top_k"):
        LightningIndexer(E, D_Q, 4, 8, rope_dim=D_R, top_k=0)
    with pytest.raises(ValueError, match="rope_dim must be even and at most head_dim"):
        LightningIndexer(E, D_Q, 4, 8, rope_dim=10, top_k=4)
    mla = MultiHeadLatentAttention(E, H, kv_rank=D_C, nope_dim=D_N, rope_dim=D_R, v_dim=D_V)
    with pytest.raises(ValueError, match="q_rank"):
        DeepSeekSparseAttention(mla, LightningIndexer(E, D_Q, 4, 8, rope_dim=D_R, top_k=4))
    m = _module()
    with pytest.raises(ValueError, match="method"):
        m(torch.randn(1, 3, E, dtype=F64), method="dense")
    with pytest.raises(TypeError, match="SparseLatentCache"):
        m(torch.randn(1, 3, E, dtype=F64), cache=[])
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 5, 4), torch.randn(1, 5, 4)
    with pytest.raises(ValueError, match="top-k of 6 keys per query out of j=5"):
        gather_attention(q, k, v, torch.zeros(1, 3, 6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"indices must lie in \[0, j=5\)"):
        gather_attention(q, k, v, torch.full((1, 3, 2), 5))
    with pytest.raises(ValueError, match="indices must be integers"):
        gather_attention(q, k, v, torch.zeros(1, 3, 2))
    with pytest.raises(TypeError, match="DeepseekV32Attention"):
        DeepSeekSparseAttention.from_transformers(torch.nn.Linear(2, 2))


def test_a_small_deepseek_v32_model_equals_transformers_and_generates_the_same():
    """Two layers of DSA (top-5 of up to 17 keys) + SwiGLU: logits in float64 against
    DeepseekV32ForCausalLM with the same weights, and greedy decoding through
    SparseLatentCaches against its generate()."""
    assert_same_model(*deepseek_pair(sparse=True))


class _LargestTensor:
    """A dispatch mode that records the largest dense tensor any operation returns (sparse
    outputs hold only their nonzeros and are skipped), and the ops that returned it."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        record = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, tuple | list) else (out,):
                    dense = isinstance(t, torch.Tensor) and t.layout == torch.strided
                    if dense and t.numel() > record.numel:
                        record.numel, record.op = t.numel(), str(func)
                return out

        self.numel, self.op, self.mode = 0, None, Mode()


def test_indexer_never_holds_more_than_one_strip_of_scores():
    """The largest tensor ``select`` allocates is its one ``(b, block, H, j)`` strip of per-head
    products, far below the ``(b, i, j)`` score matrix; rows that see at most ``top_k`` keys
    are not scored at all."""
    b, n, block, heads = 2, 301, 8, 16
    m = _module(top_k=TOP_K)
    x = torch.randn(b, n, E, dtype=F64)
    idx = m.indexer
    c_q = m.attention.query_latent(x)
    keys = idx.keys(x, 0)
    largest = _LargestTensor()
    with largest.mode:
        indices, valid = idx.select(x, c_q, keys, block=block)
    assert largest.numel == b * block * heads * n, largest.op
    assert largest.numel < b * n * n
    assert torch.equal(indices[:, :TOP_K], torch.arange(TOP_K).expand(b, TOP_K, TOP_K))
    assert torch.equal(valid[:, :TOP_K], torch.ones(TOP_K, TOP_K).tril().bool().expand(b, -1, -1))
    assert bool(valid[:, TOP_K:].all())


def test_gather_attention_never_builds_query_by_key_tensors():
    """Forward and backward allocate nothing larger than the queries (dQ, the absorbed query
    copy): no ``(i, j)`` scores, and gathers of ``block * t`` rows."""
    gen = torch.Generator().manual_seed(4)
    b, h, n, d, t, block = 2, 4, 211, 16, 8, 16
    q = torch.randn(b, h, n, d, generator=gen, dtype=F64, requires_grad=True)
    k = torch.randn(b, n, d, generator=gen, dtype=F64, requires_grad=True)
    indices = torch.randint(0, n, (b, n, t), generator=gen)
    largest = _LargestTensor()
    with largest.mode:
        out = gather_attention(q, k, k[..., :12], indices, block=block)
        out.pow(2).sum().backward()
    assert largest.numel <= q.numel(), largest.op
    assert largest.numel < b * n * n


@pytest.mark.parametrize("shared", [False, True])
def test_gather_attention_row_with_no_valid_index_is_zero_and_hidden_nan_stays_out(shared):
    """A row whose indices are all invalid sees no key: zeros and no gradient (as a fully
    masked row of the reference); a NaN at a key only invalid indices name reaches no row."""
    gen = torch.Generator().manual_seed(4)
    b, h, i, j, d, dv, t = 1, 2, 6, 8, 6, 4, 4
    indices = torch.stack([torch.randperm(j - 1, generator=gen)[:t] for _ in range(i)])[None]
    valid = torch.rand(b, i, t, generator=gen) > 0.4
    valid[0, :, 0] = True
    valid[0, 2] = False  # row 2: nothing
    indices[0, 2, 0] = j - 1  # key j - 1: named by an invalid index only
    k = torch.randn(b, j, d, generator=gen, dtype=F64)
    k[0, j - 1] = float("nan")
    v = k[..., :dv] if shared else torch.randn(b, j, dv, generator=gen, dtype=F64)
    if not shared:
        v[0, j - 1] = float("nan")
    q = torch.randn(b, h, i, d, generator=gen, dtype=F64, requires_grad=True)
    out = gather_attention(q, k, v, indices, valid, block=4)
    keep = torch.zeros(b, i, j, dtype=torch.bool).scatter_(-1, indices, valid)[:, None]
    ref = scaled_dot_product_attention(q, k[:, None], v[:, None], keep, backend="math")
    assert not out.isnan().any()
    assert out[0, :, 2].abs().max() == 0
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    # gradients (the reference's own reach NaN through 0 * nan, so compared on finite keys)
    k = k.nan_to_num(0.5).requires_grad_()
    v = k[..., :dv] if shared else v.nan_to_num(0.5).requires_grad_()
    out = gather_attention(q, k, v, indices, valid, block=4)
    ref = scaled_dot_product_attention(q, k[:, None], v[:, None], keep, backend="math")
    leaves = (q, k) if shared else (q, k, v)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    for grad, grad_ref in zip(grads, torch.autograd.grad(ref.square().sum(), leaves), strict=True):
        torch.testing.assert_close(grad, grad_ref, rtol=0, atol=1e-12)
    assert grads[0][0, :, 2].abs().max() == 0


def test_gather_attention_names_an_argument_that_is_not_a_tensor():
    q, k, v = torch.randn(1, 1, 2, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 3)
    indices = torch.zeros(1, 2, 2, dtype=torch.long)
    with pytest.raises(TypeError, match=r"gather_attention: q must be a torch\.Tensor, got list"):
        gather_attention([[1.0]], k, v, indices)
    with pytest.raises(TypeError, match=r"gather_attention: valid must be a torch\.Tensor"):
        gather_attention(q, k, v, indices, [[[True, True], [True, True]]])
