"""Our logits against transformers' on the same weights (float32, max abs diff <= 1e-4):
plain prefill of a ragged batch, prefill after a prefix already in the pool at scattered
slots, 32 batched decode steps, and greedy generation token for token."""

from __future__ import annotations

import pytest
import torch

from hf_utils import KVDriver, hf_logits, load_hf, make_hf_model_dir, make_runner

TOL = 1e-4
MODELS = ["tiny", "llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module", params=MODELS)
def model_dir(request, tmp_path_factory):
    if request.param == "tiny":
        from radixserve.tiny_model import get_tiny_model_path

        return str(get_tiny_model_path())
    return make_hf_model_dir(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def hf_and_runner(model_dir):
    return load_hf(model_dir), make_runner(model_dir)


def _prompts(vocab: int, lens, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def test_prefill_prefix_and_decode_match_hf(hf_and_runner):
    hf, runner = hf_and_runner
    vocab = runner.model_config.vocab_size
    drv = KVDriver(runner, scatter_seed=3)
    prompts = _prompts(vocab, (5, 17, 1, 40), seed=1)
    rows = [0, 1, 2, 3]
    out = drv.extend(rows, [0] * 4, prompts)
    ref = torch.cat([hf_logits(hf, p) for p in prompts])
    assert (out.all_logits - ref).abs().max().item() <= TOL
    # The sampled-position logits are the last row of each request.
    last = torch.stack([hf_logits(hf, p)[-1] for p in prompts])
    assert (out.next_token_logits - last).abs().max().item() <= TOL

    # Extend after a cached prefix: the new tokens attend to KV written by the first call.
    more = _prompts(vocab, (3, 1, 9, 2), seed=2)
    out2 = drv.extend(rows, [len(p) for p in prompts], more)
    ref2 = torch.cat([hf_logits(hf, p + m)[len(p):] for p, m in zip(prompts, more)])
    assert (out2.all_logits - ref2).abs().max().item() <= TOL

    # 32 decode steps of the whole batch, fed with random tokens.
    seqs = [p + m for p, m in zip(prompts, more)]
    g = torch.Generator().manual_seed(4)
    for step in range(32):
        nxt = torch.randint(0, vocab, (4,), generator=g).tolist()
        out3 = drv.decode(rows, [len(s) for s in seqs], nxt)
        seqs = [s + [t] for s, t in zip(seqs, nxt)]
        if step % 8 == 7 or step == 0:
            ref3 = torch.stack([hf_logits(hf, s)[-1] for s in seqs])
            assert (out3.next_token_logits - ref3).abs().max().item() <= TOL, step


def test_greedy_generation_equals_hf_generate(hf_and_runner):
    hf, runner = hf_and_runner
    vocab = runner.model_config.vocab_size
    drv = KVDriver(runner, scatter_seed=5)
    prompts = _prompts(vocab, (7, 23, 12), seed=7)
    rows = [10, 11, 12]
    n_new = 32
    out = drv.extend(rows, [0] * 3, prompts, capture_all=False)
    seqs = [list(p) for p in prompts]
    for step in range(n_new):
        nxt = out.next_token_logits.argmax(-1).tolist()
        lens = [len(s) for s in seqs]
        seqs = [s + [t] for s, t in zip(seqs, nxt)]
        if step < n_new - 1:
            out = drv.decode(rows, lens, nxt)
    for p, s in zip(prompts, seqs):
        ref = hf.generate(
            torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0].tolist()
        assert s == ref
