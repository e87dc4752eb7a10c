"""Issue 41 item 4: MTP (multi-token prediction) as the speculative draft of Qwen3-Next and Qwen3.5
(--speculative-algorithm NEXTN: EAGLE's worker with the checkpoint's own mtp.* layers,
models/qwen3_next_mtp.py), and the linear-attention states under speculation
(speculative/linear_state.py: a verify reads them, the accepted tokens advance them).

The models are the random float32 configs of test_qwen3_next.py / test_qwen3_5.py with one MTP
layer written into the checkpoint (transformers drops mtp.* on load; it is the reference for the
target only). "Agreeing": the target is nearly a bigram model (its layers' output projections
scaled down, unit-RMS embeddings, the final norm's scale 1) and its MTP layer passes the next
token's embedding through fc, so the MTP draft is that bigram: most drafts are accepted, some are
not. "Random": an MTP layer of random weights, whose drafts are nearly all rejected. Either way
the greedy tokens and logprobs must be transformers' (and speculation off's), alone and batched,
under both event loops; the layers' small outputs still move the logprobs far beyond the
tolerance when a state is wrong (a rejected draft folded into it, or an accepted one missing)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from eagle_head import make_random_eagle_head
from hf_utils import load_hf, make_runner
from test_qwen3_5 import FAMILIES as QWEN3_5_FAMILIES
from test_qwen3_next import CONFIG, LONG, MID, SHORT, TOL, make_next_dir

from radixserve import Engine
from radixserve.hf_transformers_utils import LoadError
from radixserve.models.model_config import ModelConfig
from radixserve.models.qwen3_next_mtp import Qwen3NextForCausalLMMTP, mtp_config
from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs

FAMILIES = {"qwen3_next": (transformers.Qwen3NextConfig, CONFIG), "qwen3_5": QWEN3_5_FAMILIES["qwen3_5"]}
CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
SMALL = 0.05  # the layers' output projections: the target is a bigram model plus this much of them


def _bigram_like_(model: torch.nn.Module) -> None:
    """The target's layers whisper: its next token is mostly lm_head(embed(current token))."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("o_proj", "out_proj", "down_proj")):
                p.mul_(SMALL)
        emb = model.get_input_embeddings().weight
        emb.copy_(emb / emb.pow(2).mean(-1, keepdim=True).sqrt())
        model.model.norm.weight.zero_()  # zero-centered: scale 1
        model.lm_head.weight.mul_(3.0)  # well-separated bigram choices


def make_mtp_dir(out_dir: str, family: str, agree: bool, seed: int = 0) -> str:
    """A saved random target of `family` (a bigram-like one when `agree`) whose checkpoint holds one
    MTP layer: the target's full-attention layer, fc passing the embedding through (agree) or random."""
    config_class, config = FAMILIES[family]
    make_next_dir(out_dir, seed, config_class=config_class, config=config, mtp_num_hidden_layers=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    if agree:
        _bigram_like_(model)
        model.save_pretrained(out_dir)
    h = config["hidden_size"]
    full = config["layer_types"].index("full_attention")
    gen = torch.Generator().manual_seed(seed + 1)
    path = Path(out_dir) / "model.safetensors"
    saved = load_file(str(path))  # the checkpoint's names (transformers saves each expert apart)
    mtp: Dict[str, torch.Tensor] = {
        f"mtp.layers.0.{name[len(f'model.layers.{full}.'):]}": t.clone().contiguous()
        for name, t in saved.items() if name.startswith(f"model.layers.{full}.")
    }
    fc = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1) if agree else torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5
    mtp.update({"mtp.fc.weight": fc, "mtp.norm.weight": torch.zeros(h),
                "mtp.pre_fc_norm_embedding.weight": torch.zeros(h), "mtp.pre_fc_norm_hidden.weight": torch.zeros(h)})
    save_file({**saved, **mtp}, str(path), metadata={"format": "pt"})
    assert json.loads((Path(out_dir) / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    return out_dir


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def agreeing(family, tmp_path_factory):
    d = make_mtp_dir(str(tmp_path_factory.mktemp(f"mtp_agree_{family}")), family, agree=True)
    return d, load_hf(d)


@pytest.fixture(scope="module")
def disagreeing(family, tmp_path_factory):
    d = make_mtp_dir(str(tmp_path_factory.mktemp(f"mtp_random_{family}")), family, agree=False)
    return d, load_hf(d)


_rng = random.Random(5)
PROMPTS = [LONG, SHORT, MID] + [[_rng.randrange(512) for _ in range(_rng.randint(3, 20))] for _ in range(2)]
PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def _engine(model_dir: str, overlap: bool = False, **kw) -> Engine:
    return Engine(model_dir, dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=32, max_total_tokens=4096,
                  test_check_memory=True, disable_overlap_schedule=not overlap, **kw)


def _check_against_transformers(hf, prompts: List[List[int]], outs: List[dict]) -> None:
    """Greedy tokens are transformers' argmax, logprobs within TOL of its log-softmax."""
    for prompt, out in zip(prompts, outs):
        ids = out["output_ids"]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
        assert ids == ref.argmax(-1).tolist()
        lp = torch.tensor([v for v, _, _ in out["meta_info"]["output_token_logprobs"]])
        want = torch.log_softmax(ref, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        assert (lp - want).abs().max().item() <= TOL


def _generate(engine: Engine, prompts: List[List[int]]) -> List[dict]:
    return engine.generate(input_ids=prompts, sampling_params=PARAMS, return_logprob=True, progress=False)


LOOPS = {"normal": dict(overlap=False), "overlap": dict(overlap=True),
         "normal_forced_retract": dict(overlap=False, test_retract_interval=3)}


@pytest.mark.parametrize("loop", list(LOOPS))
def test_an_agreeing_mtp_layer_gets_drafts_accepted_and_outputs_stay_exact(agreeing, loop):
    """Batched and alone (radix hits of the batched prompts in the normal loop): transformers'
    tokens and logprobs, most drafts accepted, some rejected (the states' rollback is exercised:
    a rejected draft folded into them moves the logprobs); retracted requests restart exact."""
    model_dir, hf = agreeing
    engine = _engine(model_dir, speculative_algorithm="NEXTN", **LOOPS[loop], **CHAIN)
    try:
        assert isinstance(engine.scheduler.spec_worker.draft_runner.model, Qwen3NextForCausalLMMTP)
        batched = _generate(engine, PROMPTS)
        alone = [_generate(engine, [p])[0] for p in PROMPTS[:2]]
        engine.scheduler.check_memory()
        state = engine.scheduler.internal_state()
    finally:
        engine.shutdown()
    if "retract" in loop:
        assert state["num_retractions"] > 0
    _check_against_transformers(hf, PROMPTS, batched)
    _check_against_transformers(hf, PROMPTS[:2], alone)
    metas = [o["meta_info"] for o in batched + alone]
    assert sum(m["spec_accept_length"] for m in metas) / len(metas) > 1.5  # drafts accepted
    assert 0 < state["spec_num_correct_drafts"] < state["spec_num_proposed_drafts"]  # and some rejected


def test_a_next_turn_after_speculation_in_the_overlap_loop_is_exact(agreeing):
    """Speculation in the overlap loop: the step launched before a finish is seen advances the
    request's linear states past its committed KV (its last token and drafts), and a second turn
    (prompt + answer + more) that hit the hybrid cache restored states ahead of their key (logprobs
    off by 7e-3). There the prefix cache is off (one log line): the second turn equals transformers."""
    model_dir, hf = agreeing
    engine = _engine(model_dir, speculative_algorithm="NEXTN", overlap=True, **CHAIN)
    try:
        first = _generate(engine, PROMPTS[:3])
        turns = [p + o["output_ids"] + [7, 8, 9] for p, o in zip(PROMPTS[:3], first)]
        second = [_generate(engine, [t])[0] for t in turns]
        engine.scheduler.check_memory()
    finally:
        engine.shutdown()
    _check_against_transformers(hf, PROMPTS[:3], first)
    _check_against_transformers(hf, turns, second)
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in second)  # no prefix cache in this combination


def test_a_random_mtp_layer_is_rejected_and_outputs_equal_speculation_off(disagreeing):
    """Drafts nearly all rejected: every step rolls the states back; the outputs are speculation
    off's (and transformers')."""
    model_dir, hf = disagreeing
    engine = _engine(model_dir, speculative_algorithm="NEXTN", **CHAIN)
    try:
        spec = _generate(engine, PROMPTS)
        state = engine.scheduler.internal_state()
    finally:
        engine.shutdown()
    engine = _engine(model_dir)
    try:
        plain = _generate(engine, PROMPTS)
    finally:
        engine.shutdown()
    assert state["spec_num_correct_drafts"] < state["spec_num_proposed_drafts"] / 2
    for s, p in zip(spec, plain):
        assert s["output_ids"] == p["output_ids"]
        for (lp, tok, _), (rlp, rtok, _) in zip(s["meta_info"]["output_token_logprobs"], p["meta_info"]["output_token_logprobs"]):
            assert tok == rtok and lp == pytest.approx(rlp, abs=TOL)
    _check_against_transformers(hf, PROMPTS, spec)


def test_an_eagle_head_drafts_for_a_hybrid_target_too(disagreeing, tmp_path):
    """The states' handling is the verify step's, not the MTP draft's: a (random) EAGLE head on a
    hybrid target gives transformers' outputs as well."""
    model_dir, hf = disagreeing
    head = make_random_eagle_head(ModelConfig.from_pretrained(model_dir).hf_config, str(tmp_path / "head"))
    engine = _engine(model_dir, speculative_algorithm="EAGLE", speculative_draft_model_path=head, **CHAIN)
    try:
        outs = _generate(engine, PROMPTS[:3])
        assert engine.scheduler.internal_state()["spec_num_proposed_drafts"] > 0
    finally:
        engine.shutdown()
    _check_against_transformers(hf, PROMPTS[:3], outs)


def test_the_mtp_layer_computes_what_its_modules_do(agreeing, family):
    """The draft's logits at each position against the MTP forward written with transformers'
    own modules (its decoder layer, its zero-centered norms) on the checkpoint's mtp.* tensors
    (transformers itself does not run the MTP layer)."""
    model_dir, hf = agreeing
    cfg = hf.config
    mod = transformers.models.qwen3_next.modeling_qwen3_next if family == "qwen3_next" else \
        transformers.models.qwen3_5.modeling_qwen3_5
    prefix = "Qwen3Next" if family == "qwen3_next" else "Qwen3_5"
    # mtp.layers.0 is a copy of the target's full-attention layer (make_mtp_dir): transformers' own
    full = FAMILIES[family][1]["layer_types"].index("full_attention")
    layer = hf.model.layers[full]
    norm = lambda: getattr(mod, f"{prefix}RMSNorm")(cfg.hidden_size, eps=cfg.rms_norm_eps)  # noqa: E731
    norms = {n: norm() for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    tensors = {k[len("mtp."):]: v for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()
               if k.startswith("mtp.")}
    assert torch.equal(tensors["layers.0.self_attn.q_proj.weight"], layer.self_attn.q_proj.weight)
    for n, m in norms.items():
        m.load_state_dict({"weight": tensors[f"{n}.weight"]})
    # A different MTP than the test's "agreeing" one: random fc, so every input matters.
    fc = torch.randn(cfg.hidden_size, 2 * cfg.hidden_size, generator=torch.Generator().manual_seed(3)) * 0.1
    ids = torch.tensor([SHORT[:12]])
    with torch.no_grad():
        out = hf(ids[:, :-1], output_hidden_states=True)
        h = out.hidden_states[-1][0]  # the target's final (normed) hidden states h_p
        x = torch.cat([norms["pre_fc_norm_embedding"](hf.get_input_embeddings()(ids[0, 1:])),
                       norms["pre_fc_norm_hidden"](h)], dim=-1) @ fc.T
        pos = torch.arange(ids.shape[1] - 1)[None]
        rope_pos = pos if family == "qwen3_next" else pos[None].expand(3, -1, -1)  # Qwen3.5: mrope's 3 axes
        mask = torch.full((1, 1, pos.shape[1], pos.shape[1]), float("-inf")).triu(1)
        y = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=hf.model.rotary_emb(x[None], rope_pos))
        y = y[0] if isinstance(y, tuple) else y
        want = hf.lm_head(norms["norm"](y))[0]
    got = _mtp_logits(model_dir, ids[0].tolist(), h, fc)
    assert (got - want).abs().max().item() <= TOL


def _mtp_logits(model_dir: str, ids: List[int], target_hidden: torch.Tensor, fc: torch.Tensor) -> torch.Tensor:
    """Our MTP draft's logits at every position of one prefill: token ids[p + 1] with h_p."""
    args = ServerArgs(model_path=model_dir, dtype="float32", device="cpu", max_total_tokens=1024, max_running_requests=2)
    draft = ModelRunner(mtp_config(ModelConfig.from_pretrained(model_dir)), args)
    target = ModelRunner(ModelConfig.from_pretrained(model_dir), args)
    draft.model.set_embed_and_head(target.model.model.embed_tokens, target.model.lm_head)
    draft.model.fc.weight.data.copy_(fc)
    n = len(ids) - 1
    locs = draft.token_to_kv_pool_allocator.alloc(n).to(torch.int64)
    draft.req_to_token_pool.req_to_token[0, :n] = locs.to(torch.int32)
    batch = ModelWorkerBatch(
        forward_mode=ForwardMode.EXTEND, input_ids=torch.tensor(ids[1:]), req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([n]), out_cache_loc=locs, seq_lens_cpu=[n], extend_seq_lens=[n], extend_prefix_lens=[0],
        capture_all_logits=True, spec_hidden_states=target_hidden,
    )
    return draft.forward(ForwardBatch.init_new(batch, draft)).all_logits


@pytest.mark.parametrize("flags, what", [
    (dict(speculative_eagle_topk=2, speculative_num_steps=2, speculative_num_draft_tokens=3), "--speculative-eagle-topk > 1"),
    (dict(speculative_algorithm="NGRAM"), "--speculative-algorithm NGRAM"),
])
def test_what_speculation_on_a_hybrid_model_does_not_run_with_is_refused(agreeing, flags, what):
    model_dir, _ = agreeing
    flags = {"speculative_algorithm": "NEXTN", **flags}
    with pytest.raises((LoadError, ValueError)) as e:
        _engine(model_dir, **flags)
    msg = str(e.value)
    assert "\n" not in msg and what in msg


def test_the_mtp_layers_kv_comes_off_the_budget(agreeing):
    """Every slot holds the target's full-attention KV and the MTP layer's: the pool's slots are
    the budget over both (the MTP layer's, not the whole model's layers)."""
    model_dir, _ = agreeing
    budget = 8 * 2**20
    args = dict(max_total_tokens=None, cpu_kv_cache_bytes=budget, max_running_requests=16)
    plain = make_runner(model_dir, **args)
    spec = make_runner(model_dir, speculative_algorithm="NEXTN", **args, **CHAIN)
    state = plain.mamba_pool.mem_bytes()
    per_layer = 2 * 2 * 16 * 4  # K and V, 2 KV heads of 16 floats
    assert plain.max_total_num_tokens == (budget - state) // per_layer
    assert spec.max_total_num_tokens == (budget - state) // (2 * per_layer)  # + the one MTP layer


def test_nextn_on_a_checkpoint_without_mtp_layers_is_refused(tmp_path):
    model_dir = make_next_dir(str(tmp_path))  # no mtp_num_hidden_layers
    with pytest.raises((LoadError, ValueError)) as e:
        _engine(model_dir, speculative_algorithm="NEXTN", **CHAIN)
    assert "mtp_num_hidden_layers" in str(e.value) and "\n" not in str(e.value)
