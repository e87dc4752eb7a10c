"""`--pp-size 2` (and `--pp-size 2 --tp-size 2`) through a real server: concurrent requests
with shared prefixes (one with a regex) give the pp=1 greedy outputs (the session's tiny-model server; transformers
on a 4-layer Llama checkpoint), and killing a pipeline stage's process takes the server down
with a non-zero exit, the waiting client answered."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List

import torch

from conftest import ServerProcess, assert_children_gone, greedy, stream_in_background

LLAMA_4_LAYERS = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
    intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
)


def _generate_all(srv: ServerProcess, bodies: List[dict]) -> List[dict]:
    """The bodies sent at once (they batch together on the server)."""
    def post(body: dict) -> dict:
        with srv.client() as c:
            r = c.post("/generate", json=body)
            assert r.status_code == 200, r.text
            return r.json()

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(post, bodies))


def _kill_stage_and_expect_exit(srv: ServerProcess, stage_pid: int) -> None:
    """A stream in flight, then SIGKILL of a later stage: the stream ends with an error event,
    the server exits non-zero and leaves no child behind."""
    t, events = stream_in_background(srv, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}, 60)
    deadline = time.monotonic() + 30
    while len(events) < 2:
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.05)
    os.kill(stage_pid, signal.SIGKILL)
    code = srv.proc.wait(timeout=30)
    t.join(10)
    assert code != 0
    assert events[-1] == "[DONE]" and "died unexpectedly" in json.loads(events[-2])["error"]["message"]
    assert "The scheduler_pp1" in srv.read_log() and "died unexpectedly" in srv.read_log()
    assert_children_gone(srv.children)


def _stage_pid(srv: ServerProcess, pp_rank: int, tp_rank: int) -> int:
    m = re.search(rf"scheduler PP{pp_rank} TP{tp_rank}\] Pipeline stage {pp_rank} ready \(pid (\d+)\)", srv.read_log())
    assert m, srv.read_log()[-2000:]
    assert int(m.group(1)) in srv.children
    return int(m.group(1))


def test_pp2_server_matches_pp1_then_a_killed_stage_takes_it_down(http):
    prefix = "Pipeline parallelism splits the layers over stages; "
    bodies = [{"text": prefix + tail, "sampling_params": greedy(12)}
              for tail in ("one", "two words", "three more words", "and a fourth", "fifth", "the last one")]
    # structured output: the first stage fills the grammar mask, the last stage applies it
    bodies.append({"text": prefix + "answer:", "sampling_params": greedy(12, regex="(yes|no) [0-9]{3}")})
    srv = ServerProcess("--pp-size", "2", "--pp-max-micro-batch-size", "2", "--max-total-tokens", "2000")
    try:
        got = _generate_all(srv, bodies)
        ref = [http.post("/generate", json=b).json() for b in bodies]
        assert [g["output_ids"] for g in got] == [r["output_ids"] for r in ref]
        assert re.fullmatch("(yes|no) [0-9]{3}", got[-1]["text"])
        assert "scheduler PP1 TP0" in srv.read_log()
        _kill_stage_and_expect_exit(srv, _stage_pid(srv, 1, 0))
    finally:
        srv.stop(signal.SIGKILL)


def _llama_dir(path) -> str:
    """A 4-layer Llama checkpoint, weights scaled so greedy tokens are well separated."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**LLAMA_4_LAYERS)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[-1] ** -0.5 * (1.0 if "embed" in name or "lm_head" in name else 1.5))
            else:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return str(path)


@torch.no_grad()
def _hf_greedy(hf, prompt: List[int], n: int) -> List[int]:
    """Argmax n times over the whole sequence (no EOS rule: the server ignores EOS here)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_pp2_tp2_server_matches_transformers_on_a_llama_checkpoint(tmp_path):
    import transformers

    model_dir = _llama_dir(tmp_path / "llama4")
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 512, (30,), generator=g).tolist()
    prompts = [prefix[: 10 + 4 * i] + torch.randint(3, 512, (5 + i,), generator=g).tolist() for i in range(5)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref = [_hf_greedy(hf, p, 8) for p in prompts]
    srv = ServerProcess("--model-path", model_dir, "--skip-tokenizer-init", "--dtype", "float32",
                        "--pp-size", "2", "--tp-size", "2", "--pp-partition", "3,1",
                        "--pp-max-micro-batch-size", "2", "--max-total-tokens", "2000")
    try:
        got = _generate_all(srv, [{"input_ids": p, "sampling_params": greedy(8, ignore_eos=True)} for p in prompts])
        assert [r["output_ids"] for r in got] == ref
        assert "scheduler PP1 TP1" in srv.read_log()
    finally:
        assert srv.stop(signal.SIGTERM) == 0
    assert_children_gone(srv.children)
