"""transformers' modeling files with their float32 islands kept in float64, for 1e-10 oracles.

Several transformers modules compute part of their math in float32 whatever the input dtype
(RoPE angles, RMS norms, Qwen3-Next's gated delta rule casts q, k, v to float32). A float64
comparison against them would stop at float32's ~1e-7. ``float64_module(name)`` loads a copy of
``transformers.models.<name>`` from its source with every ``torch.float32`` (and ``torch.float``)
read as ``torch.float64`` and every ``.float()`` as ``.double()``: the same math, kept in
float64. The copy lives beside the original (``<name>_float64``), so its relative imports
resolve, and the original module is untouched. Tests compare against both: the copy to 1e-10,
the original to float32's precision.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import re
import sys
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@functools.cache
def float64_module(name: str) -> types.ModuleType:
    """``transformers.models.<name>`` (e.g. ``"qwen3_next.modeling_qwen3_next"``) in float64."""
    original = importlib.import_module(f"transformers.models.{name}")
    source = inspect.getsource(original)
    source = re.sub(r"torch\.float(32)?(?![0-9A-Za-z_])", "torch.float64", source)
    source = source.replace(".float()", ".double()")
    copy_name = f"{original.__name__}_float64"
    module = types.ModuleType(copy_name)
    module.__file__ = original.__file__
    module.__package__ = original.__package__
    sys.modules[copy_name] = module
    exec(compile(source, f"{original.__file__} (float64)", "exec"), module.__dict__)
    return module
