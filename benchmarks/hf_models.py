"""Hugging Face models with ``attn_implementation="attnkit"`` against transformers' ``"sdpa"``
and ``"eager"``: forward time and peak extra memory on CPU.

Workloads (random weights, float32, inference, one sequence of ``n`` tokens, no padding):

    llama    LlamaConfig: 6 layers, hidden 512, 8 query heads / 2 key-value heads (head dim 64),
             MLP 1408; causal attention
    mistral  MistralConfig: the same sizes and a 1,024-token sliding window

for ``n`` = 2,048 .. 16,384, and a floor: the same model with an attention that returns zeros
(and attnkit's mask, so no ``n x n`` tensor), which is the memory every implementation pays for
the rest of the model (embeddings, norms, the MLP's ``n x 1408`` activations).

attnkit serves the causal model through torch's fused kernel (``is_causal``) and the windowed
one through the backend auto picks for a window declared as structure (tiled or sparse), so
key tiles outside the window are skipped; transformers' sdpa gets its dense ``(1, 1, n, n)``
window mask, eager its float mask and the full score matrix.

Method: each (model, n, implementation) runs in a fresh subprocess that builds the model, warms
it up on 128 tokens, resets the peak resident set (``echo 5 > /proc/self/clear_refs``), runs one
forward and reports its wall time and ``VmHWM`` minus the resident set before the call (the
model and the input ids already allocated). Rounds interleave the implementations, their order
rotating; times are medians over rounds. Eager is skipped where its score matrices would exceed
``--max-eager-gib`` (it holds about three ``h x n x n`` float32 tensors per layer call).

    python benchmarks/hf_models.py                 # the full grid (15-25 min on 2 cores)
    python benchmarks/hf_models.py --quick         # n = 256, 512: a smoke run, nothing written
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _report, when run from anywhere
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's attnkit
from _report import natural_float, positive_int, thread_count

from attnkit._progress import progress  # a bar when stderr is a terminal

LAYERS, HIDDEN, HEADS, KV_HEADS, MLP, WINDOW, VOCAB = 6, 512, 8, 2, 1408, 1024, 1000
IMPLEMENTATIONS = ["attnkit", "sdpa", "eager"]
FLOOR = "floor"  # zeros instead of attention: the memory the rest of the model needs
MODELS = ["llama", "mistral"]


def build(kind: str):  # a transformers model
    import torch
    import transformers

    import attnkit.integrations.transformers as akt

    akt.register()
    _register_floor()
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=32768,
    )
    if kind == "llama":
        config = transformers.LlamaConfig(**sizes)
    elif kind == "mistral":
        config = transformers.MistralConfig(**sizes, sliding_window=WINDOW)
    else:
        raise ValueError(f"unknown model {kind!r}")
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config, dtype=torch.float32).eval()


def _register_floor() -> None:
    """``attn_implementation="floor"``: zeros instead of attention, with attnkit's mask."""
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface

    from attnkit.integrations.transformers import layer_mask

    def zeros(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        b, h, i, d = query.shape
        return torch.zeros(b, i, h, d, dtype=query.dtype), None  # (b, i, h, d), no weights

    AttentionInterface.register("floor", zeros)
    AttentionMaskInterface.register("floor", layer_mask)


def worker(kind: str, n: int, implementation: str) -> dict[str, float]:
    """One forward of ``kind`` on ``n`` tokens: seconds and peak extra MiB."""
    import torch
    from _report import status_kib

    model = build(kind)
    model.set_attn_implementation(implementation)
    ids = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        model(input_ids=ids[:, :128])  # first-call costs (rotary tables, dispatch) out of the way
        before = status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
        start, cpu_start = time.perf_counter(), time.process_time()
        out = model(input_ids=ids).last_hidden_state
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    assert out.shape == (1, n, HIDDEN) and bool(torch.isfinite(out).all())
    peak = (status_kib("VmHWM") - before) / 1024
    return {"seconds": seconds, "cpu_seconds": cpu, "peak_mib": peak}


def _run_worker(kind: str, n: int, implementation: str, threads: int) -> dict[str, float]:
    job = json.dumps({"kind": kind, "n": n, "implementation": implementation})
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", job], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{job} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def eager_gib(n: int) -> float:
    """Eager's score matrices at peak: about three (h, n, n) float32 tensors."""
    return 3 * HEADS * n * n * 4 / 2**30


def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    for kind in progress(MODELS, desc="models", unit="model"):
        for n in args.n:
            chosen = [
                impl
                for impl in IMPLEMENTATIONS
                if impl != "eager" or eager_gib(n) <= args.max_eager_gib
            ]
            chosen.append(FLOOR)
            results: dict[str, list[dict[str, float]]] = {impl: [] for impl in chosen}
            for r in range(args.repeats):
                order = chosen[r % len(chosen) :] + chosen[: r % len(chosen)]
                for impl in order:
                    results[impl].append(_run_worker(kind, n, impl, args.threads))
            row: dict = {"model": kind, "n": n, "load": os.getloadavg()[0]}
            for impl, runs in results.items():
                row[impl] = {key: statistics.median(x[key] for x in runs) for key in runs[0]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def markdown(rows: list[dict], args: argparse.Namespace, load: float) -> str:
    from _report import environment

    lines = [
        "## Hugging Face models on attnkit (`benchmarks/hf_models.py`)",
        "",
        f"Forward of one sequence of n tokens, float32, random weights: `llama` ({LAYERS} layers, "
        f"hidden {HIDDEN}, {HEADS} query / {KV_HEADS} key-value heads, causal) and `mistral` (the "
        f"same with a {WINDOW:,}-token sliding window), with `attn_implementation` = `attnkit`, "
        "`sdpa` (transformers' torch SDPA path) and `eager`. Each cell: one fresh process per "
        f"call, median of {args.repeats} interleaved round(s); peak = rise of the resident set "
        "during the forward (model and ids already allocated). Times are wall seconds with the "
        "process's CPU seconds in parentheses (less sensitive to other load on the machine). "
        f"Eager is not run where its score matrices would pass {args.max_eager_gib:g} GiB. Speed "
        "= sdpa time / attnkit time (wall, and CPU in parentheses); memory = attnkit peak / sdpa "
        "peak. Floor: the peak of the same forward with an attention that returns zeros, the "
        "part no attention implementation can remove; above floor = (attnkit - floor) / (sdpa - "
        "floor), the share of sdpa's attention memory that attnkit's attention needs.",
        "",
        f"{environment()}; 1-minute load average {load:.1f} at the start, "
        f"at most {max(row['load'] for row in rows):.1f} after a cell. Command: "
        "`python benchmarks/hf_models.py`.",
        "",
        "| model | n | attnkit (s) | sdpa (s) | eager (s) | speed vs sdpa | attnkit peak (MiB) "
        "| sdpa peak (MiB) | eager peak (MiB) | memory vs sdpa | floor (MiB) | above floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ours, sdpa, eager = row["attnkit"], row["sdpa"], row.get("eager")
        eager_m = f"{eager['peak_mib']:.0f}" if eager else f"(~{eager_gib(row['n']):.0f} GiB)"
        lines.append(
            f"| {row['model']} | {row['n']:,} | {_time(ours)} | {_time(sdpa)} | {_time(eager)} "
            f"| {_speed(row)} | {ours['peak_mib']:.0f} | {sdpa['peak_mib']:.0f} | {eager_m} "
            f"| {ours['peak_mib'] / max(sdpa['peak_mib'], 1e-9):.2f} | {_floor(row)} |"
        )
    lines += ["", *verdicts(rows)]
    return "\n".join(lines)


def _floor(row: dict) -> str:
    floor = row.get("floor")
    if floor is None:
        return "not run | "
    sdpa_attention = row["sdpa"]["peak_mib"] - floor["peak_mib"]
    if sdpa_attention < 0.1 * row["sdpa"]["peak_mib"]:  # sdpa's attention adds nothing visible
        return f"{floor['peak_mib']:.0f} | —"
    above = (row["attnkit"]["peak_mib"] - floor["peak_mib"]) / sdpa_attention
    return f"{floor['peak_mib']:.0f} | {above:.3f}"


def _time(cell: dict | None) -> str:
    return "not run" if cell is None else f"{cell['seconds']:.2f} ({cell['cpu_seconds']:.1f})"


def _speed(row: dict) -> str:
    wall = row["sdpa"]["seconds"] / row["attnkit"]["seconds"]
    cpu = row["sdpa"]["cpu_seconds"] / row["attnkit"]["cpu_seconds"]
    return f"{wall:.2f}x ({cpu:.2f}x)"


def verdicts(rows: list[dict]) -> list[str]:
    """The targets, met or missed, in words."""
    out = []
    largest = max(row["n"] for row in rows)
    for row in rows:
        speed = row["sdpa"]["seconds"] / row["attnkit"]["seconds"]
        memory = row["attnkit"]["peak_mib"] / max(row["sdpa"]["peak_mib"], 1e-9)
        if row["model"] == "mistral" and row["n"] == largest:
            met = speed >= 2.0 and memory <= 0.25
            floor = ""
            if "floor" in row:
                alone = row["floor"]["peak_mib"] / max(row["sdpa"]["peak_mib"], 1e-9)
                floor = (
                    f"; above the floor {_floor(row).split(' | ')[1]} (the floor alone, the "
                    f"model without attention, is {alone:.2f} of sdpa's peak)"
                )
            out.append(
                f"- Sliding window at n = {largest:,}: target at least 2x sdpa's speed with at "
                f"most 1/4 of its peak extra memory; measured {speed:.2f}x and {memory:.2f} "
                f"({'met' if met else 'missed'}){floor}."
            )
        if row["model"] == "llama":
            verdict = "met" if speed >= 0.9 else "missed"
            out.append(
                f"- Causal, no window, n = {row['n']:,}: target at least 0.9x sdpa's speed; "
                f"measured {speed:.2f}x ({verdict})."
            )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=positive_int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=positive_int, default=1)
    parser.add_argument("--threads", type=thread_count, default=os.cpu_count() or 1)
    parser.add_argument("--max-eager-gib", type=natural_float, default=6.0)
    parser.add_argument("--quick", action="store_true", help="n = 256, 512; nothing written")
    parser.add_argument("--no-write", action="store_true", help="print, do not write the doc")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        job = json.loads(args.worker)
        print(json.dumps(worker(job["kind"], job["n"], job["implementation"])))
        return
    if args.quick:
        args.n, args.no_write = [256, 512], True
    load = os.getloadavg()[0]
    rows = measure(args)
    text = markdown(rows, args, load)
    print(text)
    if not args.no_write:
        from _report import write_section

        print(f"wrote {write_section('hf_models', text)}")
        print(f"wrote {chart(rows)}")


def chart(rows: list[dict], out_dir: Path | None = None) -> Path:
    """Draw ``hf_models.png`` from the rows ``measure`` returned: forward time and peak extra
    memory of each model and implementation against n."""
    from _report import CHARTS, write_chart

    points = [
        {"series": f"{row['model']}, {impl}", "n": row["n"], **row[impl]}
        for row in rows
        for impl in IMPLEMENTATIONS
        if row.get(impl)
    ]
    return write_chart(
        "hf_models",
        points,
        panels=[
            ("seconds", "forward", "seconds (wall)"),
            ("peak_mib", "peak extra memory, forward", "MiB"),
        ],
        title=f"transformers models with attn_implementation = attnkit, sdpa, eager ({LAYERS} "
        f"layers, hidden {HIDDEN}, float32); dashed: transformers' own",
        baselines=[p["series"] for p in points if not p["series"].endswith(", attnkit")],
        out_dir=out_dir or CHARTS,
    )


if __name__ == "__main__":
    main()
