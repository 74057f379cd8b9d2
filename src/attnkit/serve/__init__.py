"""Serving a Llama model: a paged KV cache, prefix caching, continuous batching, an HTTP API.

* ``paged``: the block pool and ``paged_attention`` over block tables (the reference math);
* ``prefix``: full blocks found again by the hash of their prefix;
* ``forward``: the model's forward over packed tokens of many sequences and the pool;
* ``engine``: the scheduler thread (continuous batching, chunked prefill, preemption);
* ``text``: incremental detokenisation with stop strings;
* ``app``: the OpenAI-compatible FastAPI application (``attnkit serve`` runs it).

FastAPI and uvicorn (the ``serve`` extra) are imported by ``app`` only.
"""
