"""Multi-LoRA against transformers (issue 28): on a small Llama config with random weights, three
PEFT adapters (ranks 4, 8, 16, different target modules) served in one batch with base-model
requests, 2 LoRA slots for 3 adapters; each request's greedy tokens and logprobs must be those of
transformers running the checkpoint with that adapter merged (W + lora_alpha / r * B @ A)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from safetensors.torch import load_file

from hf_utils import load_hf, make_hf_model_dir
from lora_utils import hf_greedy, merged_weights, write_adapter
from radixserve.engine import Engine

ADAPTERS = {  # name -> (rank, lora_alpha, target modules)
    "r4": (4, 4.0, ["q_proj", "k_proj", "up_proj"]),
    "r8": (8, 16.0, ["v_proj", "o_proj"]),
    "r16": (16, 16.0, ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]),
}
N_NEW = 6


def test_mixed_adapters_match_transformers_on_merged_weights(tmp_path: Path):
    model_dir = make_hf_model_dir("llama", str(tmp_path / "llama"), seed=3)
    base = load_file(str(Path(model_dir) / "model.safetensors"))
    adapters = {name: write_adapter(tmp_path / name, r, alpha, targets, base, seed=10 + i)
                for i, (name, (r, alpha, targets)) in enumerate(ADAPTERS.items())}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 9)]
    pairs: List[Tuple[List[int], Optional[str]]] = [(p, name) for p in prompts for name in [None, *ADAPTERS]]

    engine = Engine(model_dir, device="cpu", dtype="float32", skip_tokenizer_init=True, max_total_tokens=4096,
                    lora_paths=[f"{n}={p}" for n, p in adapters.items()], max_loras_per_batch=2,
                    disable_radix_cache=True, test_check_memory=True)
    try:
        outs = engine.generate(input_ids=[p for p, _ in pairs], lora_path=[n for _, n in pairs], return_logprob=True,
                               sampling_params={"max_new_tokens": N_NEW, "temperature": 0, "ignore_eos": True},
                               progress=False)
    finally:
        engine.shutdown()

    hf = load_hf(model_dir)
    expected: Dict[Tuple[int, Optional[str]], Tuple[List[int], List[float]]] = {}
    for name in [None, *ADAPTERS]:
        hf.load_state_dict(base if name is None else merged_weights(base, adapters[name]), strict=False)
        for i, p in enumerate(prompts):
            expected[(i, name)] = hf_greedy(hf, p, N_NEW)
    assert len({tuple(expected[(0, n)][0]) for n in [None, *ADAPTERS]}) > 1  # the adapters matter

    for (p, name), out in zip(pairs, outs):
        want_ids, want_lps = expected[(prompts.index(p), name)]
        assert out["output_ids"] == want_ids, name
        got_lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert torch.allclose(torch.tensor(got_lps), torch.tensor(want_lps), atol=1e-4, rtol=0), (name, got_lps, want_lps)
