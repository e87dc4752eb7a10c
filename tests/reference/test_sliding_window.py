"""Sliding-window attention (issue 42): a windowed layer's query attends to the W keys up to
itself, as in transformers, past the window too, on every path of the torch-native backend (the
C++ kernels and the torch reference; prefill, an extend after a cached prefix, decode, a mixed
batch), for a model whose every layer is windowed (Mistral) and one with windowed and full
layers (Qwen3's layer_types). The Triton backend's window is tested against this backend's in
tests/unit/test_triton_kernels.py."""

from __future__ import annotations

import pytest
import torch

from hf_utils import KVDriver, hf_logits, load_hf, make_hf_model_dir, make_runner

from radixserve import Engine
from radixserve.hf_transformers_utils import LoadError
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from radixserve.models.model_config import ModelConfig

WINDOW = 16
TOL = 1e-4


@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory):
    return make_hf_model_dir("mistral", str(tmp_path_factory.mktemp("mistral_swa")), seed=7, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def mixed_qwen3(tmp_path_factory):
    """Qwen3 with a windowed and a full layer (transformers builds layer_types from these)."""
    return make_hf_model_dir("qwen3", str(tmp_path_factory.mktemp("qwen3_swa")), seed=3, sliding_window=WINDOW,
                             use_sliding_window=True, max_window_layers=1)


@pytest.fixture(scope="module")
def mixed_qwen2(tmp_path_factory):
    """Qwen2 with use_sliding_window: layers from max_window_layers on windowed (transformers 5's
    layer_types: full, sliding)."""
    return make_hf_model_dir("qwen2", str(tmp_path_factory.mktemp("qwen2_swa")), seed=4, sliding_window=WINDOW,
                             use_sliding_window=True, max_window_layers=1)


def _config(**cfg) -> ModelConfig:
    base = dict(architectures=["Qwen2ForCausalLM"], vocab_size=8, hidden_size=8, intermediate_size=8,
                num_hidden_layers=4, num_attention_heads=2, max_position_embeddings=1024)
    return ModelConfig.from_dict({**base, **cfg})


def test_the_window_is_read_as_transformers_reads_it():
    mistral = _config(sliding_window=WINDOW, architectures=["MistralForCausalLM"])
    assert mistral.sliding_window == WINDOW and mistral.window_layers == [True] * 4
    assert _config(sliding_window=None).sliding_window is None
    # Qwen2/Qwen3 keep sliding_window in the config but use it only with use_sliding_window,
    # for the layers from max_window_layers on (transformers' layer_types).
    assert _config(sliding_window=WINDOW, use_sliding_window=False).sliding_window is None
    assert _config(sliding_window=WINDOW, model_type="qwen2").sliding_window is None  # off unless turned on
    moe = _config(sliding_window=WINDOW, model_type="qwen3_moe", use_sliding_window=True, max_window_layers=2)
    assert moe.window_layers == [True] * 4  # Qwen3-MoE windows every layer when on
    assert _config(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=4).sliding_window is None
    qwen2 = _config(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=2)
    assert qwen2.sliding_window == WINDOW and qwen2.window_layers == [False, False, True, True]
    assert [qwen2.layer_sliding_window(i) for i in range(4)] == [None, None, WINDOW, WINDOW]
    assert _config(sliding_window=WINDOW, layer_types=["full_attention"] * 4).sliding_window is None
    alternating = _config(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2)
    assert alternating.sliding_window == WINDOW and alternating.window_layers == [True, False, True, False]


def test_the_premise_past_the_window_the_answers_differ(windowed_mistral):
    """Served as if it had no window, the model would answer wrongly past it."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (WINDOW + 8,), generator=g).tolist()
    hf, hf_full = load_hf(windowed_mistral), load_hf(windowed_mistral)
    hf_full.config.sliding_window = None
    assert (hf_logits(hf, ids)[-1] - hf_logits(hf_full, ids)[-1]).abs().max() > 1e-2


# Both KV layouts: the SWA pool (a windowed model's default) and one pool for every layer
# (--disable-hybrid-swa-memory, and where the SWA pool does not run: --page-size > 1, Triton, ...).
POOLS = pytest.mark.parametrize("pool", ["swa", "one"])


@POOLS
@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpp_kernels", "torch"])
@pytest.mark.parametrize("model", ["windowed_mistral", "mixed_qwen3", "mixed_qwen2"])
def test_every_path_matches_transformers_past_the_window(model, cpu_kernels, pool, request):
    model_dir = request.getfixturevalue(model)
    runner = make_runner(model_dir, enable_hybrid_swa_memory=pool == "swa")
    assert hasattr(runner.token_to_kv_pool, "swa_kv_pool") == (pool == "swa")
    assert isinstance(runner.attn_backend, TorchNativeAttnBackend) and runner.attn_backend.sliding_window == WINDOW
    runner.attn_backend = TorchNativeAttnBackend("cpu", use_cpu_kernels=cpu_kernels, sliding_window=WINDOW)
    hf = load_hf(model_dir)
    g = torch.Generator().manual_seed(1)
    full = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (48, 20, 40)]
    drv = KVDriver(runner, scatter_seed=5)
    got = {i: [] for i in range(3)}  # per sequence: its logits at each position computed
    # a ragged prefill, beyond the window (row 0), within it (row 1), beyond with a later extend (row 2)
    out = drv.extend([0, 1, 2], [0, 0, 0], [full[0][:30], full[1][:10], full[2][:20]]).all_logits
    for i, part in zip(range(3), out.split([30, 10, 20])):
        got[i].append(part)
    # a mixed batch: one decode-like token (row 1) and an extend after a 20-token cached prefix (row 2)
    out = drv.extend([1, 2], [10, 20], [full[1][10:11], full[2][20:32]]).all_logits
    got[1].append(out[:1])
    got[2].append(out[1:])
    lens = [30, 11, 32]
    for _ in range(6):  # decode steps: rows 0 and 2 past the window, row 1 crossing it
        step = drv.decode([0, 1, 2], lens, [full[i][lens[i]] for i in range(3)]).next_token_logits
        for i in range(3):
            got[i].append(step[i : i + 1])
        lens = [n + 1 for n in lens]
    for i in range(3):
        ours = torch.cat(got[i])
        ref = hf_logits(hf, full[i][: len(ours)])
        err = (ours - ref).abs().max().item()
        assert err <= TOL, f"sequence {i}: max |logit error| {err:.2e} over {len(ours)} positions"


@pytest.mark.parametrize("swa", [None, False], ids=["default_swa_pool", "one_pool"])
def test_the_engine_serves_past_the_window(mixed_qwen3, swa):
    """Chunked prefill (chunks of 8), a prefix cache hit on the second request, greedy tokens and
    their logprobs as transformers gives them."""
    hf = load_hf(mixed_qwen3)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 512, (3 * WINDOW,), generator=g).tolist()
    engine = Engine(mixed_qwen3, dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=8,
                    enable_hybrid_swa_memory=swa)
    try:
        assert (engine.scheduler.ledger.swa_room() is not None) == (swa is None)
        assert engine.scheduler.context_len == 1024  # the model's, not its window
        for _ in range(2):  # the second one finds the first's prompt in the radix cache
            out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 6, "temperature": 0},
                                  return_logprob=True, progress=False)
            ids = out["output_ids"]
            ref = hf_logits(hf, prompt + ids)[len(prompt) - 1 : -1]
            assert ids == ref.argmax(-1).tolist()
            lp = torch.tensor([v for v, _, _ in out["meta_info"]["output_token_logprobs"]])
            ref_lp = torch.log_softmax(ref, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
            assert (lp - ref_lp).abs().max().item() <= TOL
        assert out["meta_info"]["cached_tokens"] > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("model", ["windowed_mistral", "mixed_qwen2"])
def test_the_swa_pool_serves_past_the_window(model, request):
    """--enable-hybrid-swa-memory with every layer windowed (Mistral: the full pool holds no
    layer's KV, only the slots) and with Qwen2's max_window_layers: chunked prefill, decode past
    the window, a prefix hit, greedy tokens and logprobs as transformers gives them."""
    model_dir = request.getfixturevalue(model)
    hf = load_hf(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    layer_types = getattr(hf.config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers  # Mistral
    assert config.window_layers == [t == "sliding_attention" for t in layer_types]
    prompt = torch.randint(0, 512, (4 * WINDOW,), generator=torch.Generator().manual_seed(6)).tolist()
    engine = Engine(model_dir, dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=8,
                    max_total_tokens=2048, enable_hybrid_swa_memory=True, swa_full_tokens_ratio=72 / 2048,
                    test_check_memory=True)
    try:
        for extra in ([], [5, 6, 7]):  # the second finds the first's prompt in the radix cache
            ids_in = prompt + extra
            out = engine.generate(input_ids=ids_in, sampling_params={"max_new_tokens": WINDOW + 4, "temperature": 0},
                                  return_logprob=True, progress=False)
            ids = out["output_ids"]
            ref = hf_logits(hf, ids_in + ids)[len(ids_in) - 1 : -1]
            assert ids == ref.argmax(-1).tolist()
            lp = torch.tensor([v for v, _, _ in out["meta_info"]["output_token_logprobs"]])
            ref_lp = torch.log_softmax(ref, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
            assert (lp - ref_lp).abs().max().item() <= TOL
        assert out["meta_info"]["cached_tokens"] > WINDOW
        engine.scheduler.check_memory()
    finally:
        engine.shutdown()


def test_an_attention_the_engine_does_not_have_is_refused_with_one_line():
    with pytest.raises(LoadError, match=r"layer_types \['chunked_attention'\]") as e:
        _config(sliding_window=WINDOW, layer_types=["chunked_attention", "full_attention"] * 2)
    assert "\n" not in str(e.value)


def test_a_backend_without_the_window_would_serve_up_to_it_only(windowed_mistral):
    """Both backends apply the window now (the Triton kernels: tests/unit/test_triton_kernels.py).
    The rule for one that would not stays: the context capped at the window, and a
    --context-length beyond it refused with one line."""
    config = ModelConfig.from_pretrained(windowed_mistral)
    assert config.serving_context_len(None, windowed_attention=False) == WINDOW
    assert config.serving_context_len(None, windowed_attention=True) == config.max_position_embeddings
    assert config.serving_context_len(4 * WINDOW) == 4 * WINDOW
    with pytest.raises(LoadError, match=f"sliding window of {WINDOW} tokens"):
        config.serving_context_len(4 * WINDOW, windowed_attention=False)


def test_speculative_decoding_on_a_windowed_model_is_refused(windowed_mistral):
    with pytest.raises(LoadError, match="speculative decoding with sliding-window attention"):
        Engine(windowed_mistral, dtype="float32", skip_tokenizer_init=True, speculative_algorithm="NGRAM")
