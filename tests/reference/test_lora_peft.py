"""Multi-LoRA against peft itself (issue 28): three adapters made by `peft.get_peft_model`
(LoraConfig ranks 4, 8, 16 on q/k/v/o/gate/up/down, A and B set to random non-zero values: peft
initialises B to zero) and written by peft's `save_pretrained`, on the tiny model's HF copy and on
a small random Llama config. One batch mixes base-model requests and all three adapters, radix
cache on; each request's greedy tokens and logprobs must be those of transformers running the
model with that adapter merged by peft (`merge_and_unload`). With 2 LoRA slots for 3 adapters
every request still completes with its own output, and a second round of the same requests hits
each adapter's own cached prefixes and gives the same outputs again."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from hf_utils import load_hf, make_hf_model_dir
from lora_utils import hf_greedy
from radixserve.engine import Engine
from radixserve.tiny_model import get_tiny_model_path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"r4": (4, 8.0), "r8": (8, 8.0), "r16": (16, 32.0)}  # name -> (rank, lora_alpha)
N_NEW = 5
PROMPT_LENS = (7, 12)
Expected = Dict[Tuple[int, Optional[str]], Tuple[List[int], List[float]]]


def _model_dir(which: str, root: Path) -> str:
    if which == "tiny":
        return str(get_tiny_model_path())
    return make_hf_model_dir("llama", str(root / "llama"), seed=5)


def _peft_adapter(model_dir: str, out: Path, rank: int, alpha: float, seed: int) -> Path:
    """An adapter made and saved by peft, with random non-zero A and B."""
    import peft  # the [test] extra; imported here: it imports triton, which must not happen at
    # collection, before the Triton test modules turn on the interpreter (TRITON_INTERPRET=1)

    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0, bias="none",
                             task_type="CAUSAL_LM")
    model = peft.get_peft_model(load_hf(model_dir), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name:  # (rank, in): unit-scale rows
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif ".lora_B." in name:  # (out, rank): a delta comparable to the base weights' scale
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / p.shape[1] ** 0.5)
    model.save_pretrained(str(out))
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    return out


def _expected(model_dir: str, adapters: Dict[str, Path], prompts: List[List[int]]) -> Expected:
    """Per (prompt, adapter): transformers on the base model, or with the adapter merged by peft."""
    expected: Expected = {}
    for name in [None, *adapters]:
        model = load_hf(model_dir)
        if name is not None:
            import peft

            model = peft.PeftModel.from_pretrained(model, str(adapters[name])).merge_and_unload()
        for i, p in enumerate(prompts):
            expected[(i, name)] = hf_greedy(model, p, N_NEW)
    return expected


@pytest.fixture(scope="module", params=["tiny", "llama"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"peft_{request.param}")
    model_dir = _model_dir(request.param, root)
    adapters = {name: _peft_adapter(model_dir, root / name, r, alpha, seed=20 + i)
                for i, (name, (r, alpha)) in enumerate(ADAPTERS.items())}
    vocab = load_hf(model_dir).config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, min(vocab, 512), (n,), generator=gen).tolist() for n in PROMPT_LENS]
    expected = _expected(model_dir, adapters, prompts)
    # Without this the comparisons could pass with the deltas never applied.
    for i in range(len(prompts)):
        assert len({tuple(expected[(i, n)][0]) for n in [None, *ADAPTERS]}) == len(ADAPTERS) + 1
    return model_dir, adapters, prompts, expected


@pytest.mark.parametrize("max_loras_per_batch", [3, 2])
def test_mixed_batch_matches_peft_merged(setup, max_loras_per_batch):
    model_dir, adapters, prompts, expected = setup
    pairs = [(i, name) for i in range(len(prompts)) for name in [None, *ADAPTERS]]
    engine = Engine(model_dir, device="cpu", dtype="float32", skip_tokenizer_init=True, max_total_tokens=4096,
                    lora_paths=[f"{n}={p}" for n, p in adapters.items()], max_loras_per_batch=max_loras_per_batch,
                    test_check_memory=True)
    try:
        assert not engine.server_args.disable_radix_cache
        rounds = []
        for _ in range(2):  # the second round finds each adapter's prompts in the radix cache
            rounds.append(engine.generate(
                input_ids=[prompts[i] for i, _ in pairs], lora_path=[n for _, n in pairs], return_logprob=True,
                sampling_params={"max_new_tokens": N_NEW, "temperature": 0, "ignore_eos": True}, progress=False))
    finally:
        engine.shutdown()

    for k, outs in enumerate(rounds):
        for (i, name), out in zip(pairs, outs):
            want_ids, want_lps = expected[(i, name)]
            what = f"round {k}, prompt {i}, adapter {name}"
            assert out["meta_info"]["finish_reason"]["type"] == "length", what
            assert out["output_ids"] == want_ids, what
            got_lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
            assert torch.allclose(torch.tensor(got_lps), torch.tensor(want_lps), atol=1e-4, rtol=0), (what, got_lps)
            # Round 0: the same prompt finished under other adapters (or the base) is no hit.
            # Round 1: its own prefix (the prompt but its last token), under its own adapter.
            assert out["meta_info"]["cached_tokens"] == (len(prompts[i]) - 1 if k else 0), what
