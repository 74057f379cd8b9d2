"""Shared input checks and escaping of the viz package (viz/_common.py): JSON that an HTML
``<script>`` element cannot be broken out of, and that ``json.loads`` reads back unchanged."""

from __future__ import annotations

import json

from attnkit.viz._common import json_for_script
from hostile_html import CLOSER


def test_json_for_script_escapes_what_html_would_see() -> None:
    obj = {"t": [CLOSER, "a&b", "<!--", "x\u2028y\u2029z", "é"]}
    text = json_for_script(obj)
    for raw in ("<", ">", "&", "\u2028", "\u2029"):
        assert raw not in text
    assert "\\u003c/script\\u003e" in text
    assert json.loads(text) == obj  # the same data for JSON.parse
