"""attnkit.serve.forward: the forward over packed tokens and a paged cache gives
``LlamaModel.forward``'s logits, for a ragged batch computed in chunks."""

from __future__ import annotations

import random

import pytest
import torch

from attnkit.serve.forward import PagedBatch, paged_forward
from attnkit.serve.paged import BlockPool
from llama_oracles import bundled as bundled
from serve_oracles import one_thread as one_thread
from serve_oracles import tiny_model


def chunked_logits(model, prompts, cuts, block_size, dtype):
    """Every position's logits, computed in two steps: the prompts' first ``cuts`` tokens, then
    the rest (sequences whose first chunk was all of them sit the second step out)."""
    c = model.config
    pool = BlockPool(
        256,
        block_size,
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=dtype,
    )
    free = list(range(256))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(-(-len(p) // block_size))] for p in prompts]
    out = [[] for _ in prompts]
    with torch.no_grad():
        first = PagedBatch.build(
            [p[:k] for p, k in zip(prompts, cuts, strict=True)],
            [0] * len(prompts),
            tables,
            block_size,
        )
        logits = paged_forward(model, first, pool, all_logits=True)
        for n, rows in enumerate(logits.split(list(first.query_lengths))):
            out[n].append(rows)
        rest = [n for n, (p, k) in enumerate(zip(prompts, cuts, strict=True)) if len(p) > k]
        second = PagedBatch.build(
            [prompts[n][cuts[n] :] for n in rest],
            [cuts[n] for n in rest],
            [tables[n] for n in rest],
            block_size,
        )
        logits = paged_forward(model, second, pool, all_logits=True)
        for n, rows in zip(rest, logits.split(list(second.query_lengths)), strict=True):
            out[n].append(rows)
    return [torch.cat(rows) for rows in out]


def test_the_paged_forward_equals_the_model_in_float64() -> None:
    model = tiny_model(dtype=torch.float64)
    rng = random.Random(1)
    prompts = [[rng.randrange(97) for _ in range(n)] for n in (1, 7, 13, 29, 64, 3)]
    cuts = [1, 3, 13, 10, 33, 2]
    got = chunked_logits(model, prompts, cuts, block_size=5, dtype=torch.float64)
    for prompt, logits in zip(prompts, got, strict=True):
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)


def test_last_token_logits_are_the_rows_of_each_sequence_end() -> None:
    model = tiny_model(dtype=torch.float64)
    c = model.config
    pool = BlockPool(
        8,
        4,
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=torch.float64,
    )
    batch = PagedBatch.build([[1, 2, 3], [4, 5, 6, 7, 8]], [0, 0], [[0], [1, 2]], 4)
    with torch.no_grad():
        every = paged_forward(model, batch, pool, all_logits=True)
        last = paged_forward(model, batch, pool)
    torch.testing.assert_close(last, every[[2, 7]], rtol=0, atol=1e-12)


def test_the_paged_forward_equals_smollm2_in_float32(bundled) -> None:
    model = bundled.model
    prompts = [
        bundled.encode(t) for t in ("Once upon a time", "What is 2 + 2? Think step by step.", "Hi")
    ]
    cuts = [2, 9, 1]
    got = chunked_logits(model, prompts, cuts, block_size=4, dtype=torch.float32)
    for prompt, logits in zip(prompts, got, strict=True):
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


pytestmark = pytest.mark.usefixtures("one_thread")
