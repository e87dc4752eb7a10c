"""Shared by the reference tests: small HF model directories and a direct driver of
ModelRunner that fills the KV pool the way the scheduler would."""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch
import transformers

from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.models.model_config import ModelConfig
from radixserve.server_args import ServerArgs

SMALL_CONFIGS: Dict[str, dict] = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=128,
        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=512, hidden_size=128,
        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=512, hidden_size=128,
        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=48, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    "mistral": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=512, hidden_size=128,
        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        sliding_window=None,
    ),
}


def make_hf_model_dir(name: str, out_dir: str, seed: int = 0, **overrides) -> str:
    """An HF checkpoint with random weights scaled so logits are well separated; `overrides`
    change the config's entries."""
    cfg = transformers.AutoConfig.for_model(**{**SMALL_CONFIGS[name], **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[-1] ** -0.5 * (1.0 if "embed" in pname or "lm_head" in pname else 1.5))
            elif "bias" in pname:
                p.normal_(0, 0.1)
            else:
                p.copy_(1 + 0.1 * torch.randn_like(p))
        if True:  # embeddings: unit scale (smaller when tied, as they are the LM head too)
            model.get_input_embeddings().weight.normal_(0, 0.3 if cfg.tie_word_embeddings else 1.0)
    model.save_pretrained(out_dir)
    return out_dir


def load_hf(model_dir: str):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_runner(model_dir: str, **kw) -> ModelRunner:
    args = ServerArgs(model_path=model_dir, dtype=kw.pop("dtype", "float32"), device="cpu", max_total_tokens=kw.pop("max_total_tokens", 8192), max_running_requests=kw.pop("max_running_requests", 64), **kw)
    return ModelRunner(ModelConfig.from_pretrained(model_dir), args)


class KVDriver:
    """Runs sequences through a ModelRunner with explicit slot management, like the scheduler:
    each sequence owns a req_to_token row; slots come from the allocator (scattered on purpose)."""

    def __init__(self, runner: ModelRunner, scatter_seed: int = 0):
        self.r = runner
        self.rows: List[int] = []
        self.lens: List[int] = []
        # Hand out slots in a shuffled order so a request's KV is non-contiguous.
        g = torch.Generator().manual_seed(scatter_seed)
        alloc = runner.token_to_kv_pool_allocator
        # (a windowed model's SWA pool, its default: both of its free lists)
        for a in (alloc.full, alloc.swa) if hasattr(alloc, "free_swa") else (alloc,):
            a.free_pages = a.free_pages[torch.randperm(len(a.free_pages), generator=g)]

    def _alloc(self, n: int) -> torch.Tensor:
        out = self.r.token_to_kv_pool_allocator.alloc(n)
        assert out is not None
        return out

    def extend(self, rows: Sequence[int], prefix_lens: Sequence[int], tokens: Sequence[Sequence[int]],
               capture_all: bool = True):
        """Run new tokens for the given rows, after `prefix_lens` tokens already in the pool."""
        locs = [self._alloc(len(t)) for t in tokens]
        req_to_token = self.r.req_to_token_pool.req_to_token
        for row, p, loc in zip(rows, prefix_lens, locs):
            req_to_token[row, p : p + len(loc)] = loc.to(torch.int32)
        seq_lens = [p + len(t) for p, t in zip(prefix_lens, tokens)]
        mode = ForwardMode.EXTEND
        batch = ModelWorkerBatch(
            forward_mode=mode,
            input_ids=torch.tensor([x for t in tokens for x in t], dtype=torch.int64),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=torch.cat(locs),
            seq_lens_cpu=seq_lens,
            extend_seq_lens=[len(t) for t in tokens],
            extend_prefix_lens=list(prefix_lens),
            capture_all_logits=capture_all,
        )
        return self.r.forward(ForwardBatch.init_new(batch, self.r))

    def decode(self, rows: Sequence[int], seq_lens_before: Sequence[int], tokens: Sequence[int]):
        loc = self._alloc(len(rows))
        req_to_token = self.r.req_to_token_pool.req_to_token
        for row, s, slot in zip(rows, seq_lens_before, loc):
            req_to_token[row, s] = int(slot)
        seq_lens = [s + 1 for s in seq_lens_before]
        batch = ModelWorkerBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=torch.tensor(list(tokens), dtype=torch.int64),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=loc,
            seq_lens_cpu=seq_lens,
        )
        return self.r.forward(ForwardBatch.init_new(batch, self.r))


def hf_logits(hf_model, ids: List[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()
