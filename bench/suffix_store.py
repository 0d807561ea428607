"""The suffix drafter's job store on a long job: memory stays within its bound.

    .venv/bin/python bench/suffix_store.py [--prompts 10000 100000] [--tokens 64] [--store-tokens 200000]

For each prompt count, one fresh process drives a ``SuffixDrafter`` as the stage loop does over a
job of that many synthetic prompts (``dataset=synthetic``'s generator: seeded word salad over a
fixed vocabulary, tokenized by the byte tokenizer): prefill, a proposal after every committed
chunk of 1-4 tokens with everything so far confirmed, ``end_sequence`` with the output. The
"output" of each prompt is a continuation of the same generator (new text, as a model's output
would be). Reports the peak RSS of the process, the store's size and the time per proposal. The
store is bounded by ``store_tokens``, so the peak RSS of 10,000 and 100,000 prompts must agree.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time

from pipespec_mpi.models.suffix import SuffixDrafter

COMMON = "the of and to in is for on that by with as at from it this be are was an or which"
WORDS = COMMON.split(" ") + [f"w{i}" for i in range(400)]


def text(rng: random.Random, n_words: int) -> list[int]:
    return list(" ".join(rng.choice(WORDS) for _ in range(n_words)).encode())


def run(prompts: int, tokens: int, store_tokens: int) -> dict:
    rng = random.Random(0)
    d = SuffixDrafter("suffix", store_tokens=store_tokens)
    calls, spent, proposed = 0, 0.0, 0
    t_start = time.perf_counter()
    for _ in range(prompts):
        prompt = text(rng, 20)
        out = text(rng, tokens)[:tokens]
        d.prefill(prompt, store_key="pipespec")
        n = 0
        while n < len(out):
            n = min(len(out), n + rng.randint(1, 4))
            seq = prompt + out[:n]
            t0 = time.perf_counter()
            proposed += len(d.propose(seq, 8, confirmed=len(seq)))
            spent += time.perf_counter() - t0
            calls += 1
        d.end_sequence(out)
    return {
        "prompts": prompts,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "store_tokens": d.store.tokens,
        "store_bound": store_tokens,
        "us_per_proposal": 1e6 * spent / calls,
        "proposed_per_call": proposed / calls,
        "seconds": time.perf_counter() - t_start,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--store-tokens", type=int, default=200_000)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: one prompt count
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(run(a.one, a.tokens, a.store_tokens)))
        return
    print("prompts  peak RSS MB  store tokens (bound)  us/proposal  tokens/proposal  seconds")
    for n in a.prompts:
        cmd = [sys.executable, __file__, "--one", str(n), "--tokens", str(a.tokens),
               "--store-tokens", str(a.store_tokens)]  # fmt: skip
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        print(
            f"{r['prompts']:>7}  {r['peak_rss_mb']:>11.1f}  {r['store_tokens']:>12} ({r['store_bound']})"
            f"  {r['us_per_proposal']:>11.1f}  {r['proposed_per_call']:>15.2f}  {r['seconds']:>7.1f}"
        )


if __name__ == "__main__":
    main()
