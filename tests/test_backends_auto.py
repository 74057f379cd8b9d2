"""``explain``: auto's choice and one sentence per candidate, the same choice the call makes."""

from __future__ import annotations

import pytest
import torch

from attnkit import masks
from attnkit.backends import explain, get_backend, memory_budget, rates, use
from attnkit.functional import make_call
from attnkit.registry import _COSTS, select_backend

F64 = torch.float64


def _qkv(n: int, h: int = 2, d: int = 8):
    g = torch.Generator().manual_seed(n)
    return tuple(torch.randn(1, h, n, d, dtype=F64, generator=g) for _ in range(3))


def test_one_sentence_per_candidate_and_the_same_choice_as_the_call() -> None:
    q, k, v = _qkv(64)
    e = explain(q, k, v, masks.window_fn(7))
    call = make_call(q, k, v, masks.window_fn(7))
    assert e.backend == select_backend("auto", call).name
    assert [v.backend for v in e.verdicts if v.chosen] == [e.backend]
    assert sorted(v.backend for v in e.verdicts) == sorted(_COSTS)  # every candidate, once
    lines = str(e).splitlines()
    assert lines[0] == (
        f"auto takes {e.backend} for query (1, 2, 64, 8), key (1, 2, 64, 8), float64, forward, "
        "mask: function, band (left 7, right 0, offset 0); memory budget 1.0 GiB"
    )
    # where the numbers come from: the tests pin the reference table
    assert lines[1] == f"  (numbers {rates.reference()['float32'].source})"
    assert len(lines) == 2 + len(e.verdicts) and repr(e) == str(e)
    best = e.verdicts[0].estimate.seconds
    assert lines[2].startswith(f"  {e.backend}: chosen, the cheapest estimate: about ")
    for line, verdict in zip(lines[3:], e.verdicts[1:], strict=True):
        if verdict.estimate is None:  # its own why_not, word for word
            reason = get_backend(verdict.backend).why_not(call)
            assert line == f"  {verdict.backend}: cannot serve this call: {reason}"
        else:
            ratio = verdict.estimate.seconds / best
            assert line.startswith(f"  {verdict.backend}: not chosen: {ratio:.2f}x the chosen")
            assert ratio >= 1.0
            assert verdict.estimate.how in line


def test_sentences_for_refusals_and_the_budget() -> None:
    q, k, v = _qkv(96)
    e = explain(q, k, v, bias=masks.relative(lambda b, h, i, j: -0.5 * (i - j).abs().double()))
    sentences = {v.backend: v.sentence() for v in e.verdicts}
    assert sentences["sparse"].startswith("sparse: cannot serve this call: the sparse backend")
    assert "builds the bias function as a (1, 1, 96, 96) tensor" in sentences["torch"]
    with memory_budget(100):
        e = explain(q, k, v, bias=masks.relative(lambda b, h, i, j: -0.5 * (i - j).abs()))
    assert e.backend == "tiled"
    torch_line = next(line for line in str(e).splitlines() if line.startswith("  torch:"))
    assert torch_line.startswith("  torch: left out: it would build ")
    assert "over the memory budget of 100 bytes (about " in torch_line
    assert str(e).splitlines()[0].endswith("memory budget 100 bytes")


def test_what_it_weighed_is_said_in_the_first_line() -> None:
    q, k, v = (t.requires_grad_() for t in _qkv(16))
    mask = torch.ones(16, 16, dtype=torch.bool)
    first = str(explain(q, k, v, mask, is_causal=True, return_weights=True)).splitlines()[0]
    assert first.startswith("auto takes math for ")
    assert "float64, forward and backward, mask: tensor (16, 16), causal, weights returned" in first
    with torch.no_grad():
        assert "float64, forward; memory budget" in str(explain(q, k, v)).splitlines()[0]


def test_nothing_fits_says_so() -> None:
    q, k, v = _qkv(16)
    with memory_budget(0):
        e = explain(q, k, v, bias=lambda b, h, i, j: (i - j).double(), return_weights=True)
    assert e.backend is None
    assert str(e).splitlines()[0].startswith("no backend can serve for query (1, 2, 16, 8)")


def test_inside_use_it_says_which_backend_runs_instead() -> None:
    q, k, v = _qkv(16)
    with use("math"):
        e = explain(q, k, v)
    assert e.forced == "math" and str(e).endswith("(inside use('math'): calls here run on math)")
    with use("auto"):
        assert explain(q, k, v).forced is None


def test_bad_arguments_fail_as_the_call_would() -> None:
    q, k, v = _qkv(8)
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        explain(q, k, v, torch.ones(8, 8))
    with pytest.raises(ValueError, match="query and key must have the same last dim"):
        explain(q, k[..., :4], v)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")  # torch's own
def test_auto_takes_torch_for_nested_inputs() -> None:
    """auto itself (select_backend, explain) on a jagged NestedTensor call: torch's kernel, the
    one backend that takes nested inputs, with no estimate needed from the others."""
    offsets = torch.tensor([0, 5, 14])
    q, k, v = (
        torch.nested.nested_tensor_from_jagged(torch.randn(14, 2, 8), offsets).transpose(1, 2)
        for _ in range(3)
    )  # (b, h, j, d), two sequences of 5 and 9
    call = make_call(q, k, v)
    assert select_backend("auto", call).name == "torch"
    assert explain(q, k, v).backend == "torch"
