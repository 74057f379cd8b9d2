"""Shared pieces of the serve tests (tests/test_serve_*.py, tests/test_commands_serve.py).

* ``tiny_model(...)``: a small random ``LlamaModel`` (float32 or float64) for engine tests.
* ``tiny_llm()``: that kind of model with the bundled SmolLM2 tokenizer (its chat template, its
  end-of-sequence token), so the HTTP layer sees real text while each step stays cheap.
* ``LiveServer``: uvicorn in a thread on a free port of 127.0.0.1, always stopped.
* ``one_thread``: a fixture running a test on one torch thread. The serve tests run small
  models whose every operation is tiny: a second thread only adds a barrier per operation,
  which costs milliseconds when the machine is busy.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from typing import Any

import pytest
import torch

from attnkit.models.llama import LlamaConfig, LlamaModel, PretrainedLlama, bundled_model_path


def tiny_config(**overrides: Any) -> LlamaConfig:
    settings: dict[str, Any] = dict(
        vocab_size=97,
        embed_dim=48,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        ffn_dim=64,
        rope_base=500.0,
        max_len=512,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(tiny_config(**overrides)).to(dtype).eval()
    with torch.no_grad():  # larger weights than the initialiser's: peaked, distinct logits
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.2)
    return model


@functools.cache
def _tokenizer() -> Any:
    from attnkit.models.llama_loading import read_checkpoint
    from attnkit.models.llama_tokenizer import LlamaTokenizer

    ckpt = read_checkpoint(bundled_model_path())
    return ckpt.config, LlamaTokenizer.from_gguf_metadata(ckpt.tokenizer["metadata"])


def tiny_llm(max_len: int = 512) -> PretrainedLlama:
    """A 2-layer random model that speaks through SmolLM2's tokenizer."""
    config, tokenizer = _tokenizer()
    model = tiny_model(
        vocab_size=config.vocab_size,
        embed_dim=32,
        num_heads=4,
        num_kv_heads=2,
        ffn_dim=48,
        max_len=max_len,
        eos_id=config.eos_id,
    )
    return PretrainedLlama(model, tokenizer)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """``with LiveServer(app) as url:`` uvicorn serving ``app`` in a thread until the block ends."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
