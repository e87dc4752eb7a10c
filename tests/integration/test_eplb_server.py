"""EPLB through the served runtime: `--tp-size 2 --ep-size 2 --ep-num-redundant-experts 2
--enable-eplb` on a small random Qwen3-MoE, the experts re-placed every 3 forward passes while
serving and once more by POST /eplb_rebalance; greedy tokens and logprobs equal transformers'
(float32) throughout. A server without EPLB answers /eplb_rebalance 400 with the reason."""

from __future__ import annotations

import signal

import torch
import transformers

from conftest import ServerProcess, assert_children_gone

PROMPTS = [[5, 17, 200, 3, 99, 41, 7, 300, 12], [450, 2, 2, 61, 88, 130, 7, 9, 10, 11, 500, 42, 1, 77]]


def make_moe_dir(out_dir: str) -> str:
    cfg = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=8, num_experts_per_tok=2, max_position_embeddings=512, norm_topk_prob=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # a sharper router: well-separated expert choices
                p.normal_(0, p.shape[-1] ** -0.5 * (2.0 if name.endswith("mlp.gate.weight") else 1.0))
    model.save_pretrained(out_dir)
    return out_dir


def _check_against_transformers(c, hf) -> None:
    for prompt in PROMPTS:
        out = c.post("/generate", json={"input_ids": prompt, "return_logprob": True,
                                        "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
        ids = out["output_ids"]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
        assert ids == ref.argmax(-1).tolist()
        lp = torch.tensor([v for v, _, _ in out["meta_info"]["output_token_logprobs"]])
        want = torch.log_softmax(ref, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        assert (lp - want).abs().max() <= 1e-4


def test_eplb_rebalances_while_serving_and_on_request(tmp_path):
    model_dir = make_moe_dir(str(tmp_path / "qwen3_moe"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    srv = ServerProcess("--model-path", model_dir, "--dtype", "float32", "--skip-tokenizer-init", "--max-total-tokens", "2000",
                        "--tp-size", "2", "--ep-size", "2", "--ep-num-redundant-experts", "2",
                        "--enable-eplb", "--eplb-rebalance-num-iterations", "3")
    try:
        with srv.client() as c:
            _check_against_transformers(c, hf)  # 2 prompts x 6 tokens: several periodic rebalances
            r = c.post("/eplb_rebalance")
            assert r.status_code == 200, r.text
            stats = r.json()
            assert stats["num_rebalances"] >= 3 and stats["forward_passes"] >= 9, stats
            assert stats["max_over_mean_after"] <= stats["max_over_mean_before"] + 1e-9
            _check_against_transformers(c, hf)
        assert "EPLB rebalance" in srv.read_log()
    finally:
        assert srv.stop(signal.SIGTERM) == 0
    assert_children_gone(srv.children)


def test_eplb_rebalance_without_eplb_is_a_400(http):
    r = http.post("/eplb_rebalance")
    assert r.status_code == 400 and "EPLB is off" in r.text
