"""Shared input checks and escaping of the viz package (viz/_common.py): JSON that an HTML
``<script>`` element cannot be broken out of, and that ``json.loads`` reads back unchanged."""

from __future__ import annotations

import json
import re

import pytest
import torch

from attnkit.viz._common import as_attention4d, json_for_script
from hostile_html import CLOSER


def test_json_for_script_escapes_what_html_would_see() -> None:
    obj = {"t": [CLOSER, "a&b", "<!--", "x\u2028y\u2029z", "é"]}
    text = json_for_script(obj)
    for raw in ("<", ">", "&", "\u2028", "\u2029"):
        assert raw not in text
    assert "\\u003c/script\\u003e" in text
    assert json.loads(text) == obj  # the same data for JSON.parse


@pytest.mark.parametrize("given", ["tensor", "tuple", "list"])
def test_the_hint_for_a_batch_of_maps_runs_on_what_was_given(given: str) -> None:
    # transformers' output_attentions: one (b, h, i, j) tensor per layer, in a tuple.
    layers = tuple(torch.softmax(torch.randn(2, 3, 4, 4), dim=-1) for _ in range(5))
    attentions = {"tensor": torch.stack(layers), "tuple": layers, "list": list(layers)}[given]
    tokens = ["a", "b", "c", "d"]
    with pytest.raises(ValueError, match=r"\(layers, batch, heads, i, j\)") as caught:
        as_attention4d(attentions, tokens)
    hint = re.search(r"e\.g\. (.+?)(?: \(|$)", str(caught.value)).group(1)
    picked = eval(hint, {"attentions": attentions})  # the hint's own expression
    arr, _, _ = as_attention4d(picked, tokens)
    assert arr.shape == (5, 3, 4, 4)
    assert torch.equal(torch.from_numpy(arr), torch.stack(layers)[:, 0].double())
