"""--enable-deterministic-inference (issue 56): in the CPU's bf16 mode a set of prompts gets
bit-identical output tokens and logprobs run alone, all together, interleaved with 15 random other
requests, with chunked prefill at a small chunk size, after a prefix-cache hit, in the normal and
the overlap loop, and at TP 2; greedy and with a sampling_seed at temperature 0.8. Without the
flag the same comparison finds a difference (so the test can fail).

The model is random-weight, sized so the batch-size-dependent paths run: prompts of 150-230
tokens (the decode kernel splits keys when its batch leaves threads idle, below 4 x threads
requests, and not above), batches from 1 to 21 rows (the AVX2 GEMM's one- and two-row register
tiles sum even and odd k apart, larger ones in one chain), extends of one token (a prefix hit or
a chunk ending one token short of the prompt: the decode kernel without the flag).

TP 1 against TP 2: each rank's row-parallel K (o_proj's 1024 / 2, down_proj's 1024 / 2) is one
512-wide K chunk of the AVX2 GEMM, which sums the chunks of a row in order, chunk 0 then chunk 1:
the same a + b as gloo's all-reduce of the two ranks' partials. So on the AVX2 build TP 2 equals
TP 1 bit for bit. The AVX-512 build sums all of K in one chain per output (no chunks): there TP 2
cannot equal TP 1 (the all-reduce adds two half sums), and the test checks TP 2 against itself.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from processes import free_port, run_processes  # noqa: E402

NUM_PROMPTS = 6  # 4 greedy + 2 seeded at temperature 0.8
NUM_OTHERS = 15
MAX_NEW = 8
SEEDED_TEMPERATURE = 0.8

Outputs = Dict[str, Tuple[List[int], List[float]]]  # rid -> (output ids, their logprobs)


# ---- the model: the tiny Qwen3's tokenizer, a config sized for the TP 2 K chunks, seeded weights --
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from safetensors.torch import save_file

    from radixserve.tiny_model import TINY_MODEL_ASSETS, load_tiny_config, tiny_state_dict

    out = tmp_path_factory.mktemp("det_model")
    for src in TINY_MODEL_ASSETS.iterdir():
        if src.is_file():
            shutil.copyfile(src, out / src.name)
    config = load_tiny_config()
    config.update(intermediate_size=1024, num_attention_heads=16, num_key_value_heads=2, head_dim=64)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tiny_state_dict(config), str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


# ---- the workload ---------------------------------------------------------------------------------
def _params(i: int):
    from radixserve.sampling_params import SamplingParams

    if i < NUM_PROMPTS - 2:
        sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    else:
        sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=SEEDED_TEMPERATURE, ignore_eos=True,
                            sampling_seed=1000 + i)
    sp.normalize()
    return sp


def prompts() -> List[List[int]]:
    rng = random.Random(56)
    return [[rng.randrange(3, 8000) for _ in range(rng.randint(150, 230))] for _ in range(NUM_PROMPTS)]


def _req(rid: str, ids: List[int], sp):
    from radixserve.protocol import TokenizedGenerateReqInput

    return TokenizedGenerateReqInput(rid, None, list(ids), sp, return_logprob=True)


def _others(rng: random.Random) -> list:
    """15 random requests: other lengths, greedy and unseeded sampling, longer outputs."""
    from radixserve.sampling_params import SamplingParams

    reqs = []
    for j in range(NUM_OTHERS):
        sp = SamplingParams(max_new_tokens=rng.randint(2, 14), temperature=rng.choice([0.0, 1.0]), ignore_eos=True)
        sp.normalize()
        reqs.append(_req(f"other{j}", [rng.randrange(3, 8000) for _ in range(rng.randint(3, 300))], sp))
    return reqs


def waves(scenario: str) -> List[list]:
    """The requests of a scenario, wave by wave (a wave is sent once the scheduler is idle); the
    prompts' rids are p0..p5 in every scenario."""
    ps = prompts()
    mine = [_req(f"p{i}", p, _params(i)) for i, p in enumerate(ps)]
    rng = random.Random(7)
    if scenario == "alone":
        return [[r] for r in mine]
    if scenario == "together":
        return [mine]
    if scenario == "interleaved":
        mixed = mine + _others(rng)
        rng.shuffle(mixed)
        return [mixed]
    if scenario == "prefix_hit":
        # first requests sharing 97..(len - 1) leading tokens with each prompt (hits that end
        # inside a prompt, and one a token short of it: a one-token extend), then the prompts
        from radixserve.sampling_params import SamplingParams

        warm_sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
        warm_sp.normalize()
        cut = [97, 130, len(ps[2]) - 1, 64, 150, len(ps[5]) - 1]
        warm = [_req(f"warm{i}", p[: cut[i]] + ([5, 6, 7] if cut[i] < len(p) - 1 else []), warm_sp)
                for i, p in enumerate(ps)]
        return [warm, mine]
    if scenario == "alone_then_interleaved":  # the TP 2 run: both in one scheduler
        mixed = [_req(f"again{r.rid[1:]}", r.input_ids, r.sampling_params) for r in mine] + _others(rng)
        rng.shuffle(mixed)
        return [[r] for r in mine] + [mixed]
    raise ValueError(scenario)


# ---- running a scheduler over the waves -------------------------------------------------------------
def run(model_dir: str, scenario: str, deterministic: bool, overlap: bool = False, chunk: Optional[int] = None,
        tp_rank: int = 0, tp_size: int = 1, addr: str = "") -> Outputs:
    from radixserve.managers.scheduler import Scheduler
    from radixserve.protocol import BatchTokenIDOutput
    from radixserve.server_args import ServerArgs

    kw = dict(chunked_prefill_size=chunk) if chunk else {}
    args = ServerArgs(model_path=model_dir, dtype="bfloat16", device="cpu", max_total_tokens=16384,
                      max_running_requests=32, enable_deterministic_inference=deterministic,
                      disable_overlap_schedule=not overlap, tp_size=tp_size, dist_init_addr=addr or None, **kw)
    todo = waves(scenario)
    total = sum(len(w) for w in todo)
    got: Dict[str, Tuple[List[int], List[float]]] = {}

    def send(obj) -> None:
        if isinstance(obj, BatchTokenIDOutput):
            for i, rid in enumerate(obj.rids):
                ids, lps = got.setdefault(rid, ([], []))
                ids.extend(obj.decode_ids[i])
                lps.extend(obj.output_token_logprobs_val[i])

    sched = Scheduler(args, recv_fn=lambda: todo.pop(0) if todo and not sched.has_work() else [], send_fn=send,
                      tp_rank=tp_rank, tp_size=tp_size)
    assert sched.enable_overlap == overlap
    received = 0
    for _ in range(100_000):
        reqs = sched.recv_requests()
        received += len(reqs)
        sched.process_input_requests(reqs)
        sched.run_step()
        if received == total and not sched.has_work():
            break
    sched.shutdown()
    if tp_rank == 0:
        assert len(got) == total and all(len(ids) == len(lps) > 0 for ids, lps in got.values())
    return got


def _tp_rank(rank: int, addr: str, model_dir: str, out: str) -> None:
    torch.save(run(model_dir, "alone_then_interleaved", True, tp_rank=rank, tp_size=2, addr=addr), f"{out}.{rank}")


def prompts_of(outputs: Outputs, prefix: str = "p") -> Dict[int, Tuple[List[int], List[float]]]:
    return {i: outputs[f"{prefix}{i}"] for i in range(NUM_PROMPTS)}


def differences(a: Outputs, b: Outputs, prefix_b: str = "p") -> List[str]:
    """Where the prompts' tokens or logprobs (bit for bit) differ between two runs."""
    out = []
    for i, ((ids_a, lp_a), (ids_b, lp_b)) in enumerate(zip(prompts_of(a).values(), prompts_of(b, prefix_b).values())):
        if ids_a != ids_b:
            out.append(f"p{i} tokens {ids_a} vs {ids_b}")
        elif lp_a != lp_b:
            k = next(k for k, (x, y) in enumerate(zip(lp_a, lp_b)) if x != y)
            out.append(f"p{i} logprob {k}: {lp_a[k]!r} vs {lp_b[k]!r}")
    return out


# ---- the kernels alone ------------------------------------------------------------------------------
@pytest.fixture
def ops():
    from radixserve.layers import batch_invariant, cpu_kernels

    mod = cpu_kernels.get()
    assert mod is not None and mod.has_bf16_gemm(), "the C++ CPU kernels (with the bf16 GEMM) did not build"
    yield mod
    batch_invariant.enable_batch_invariant_mode(False)


def test_bf16_gemm_rows_are_batch_invariant_under_the_flag(ops):
    """Every row count (1 row, 2, the 5-row tiles, past the 64-row work items) gives a row the same
    bits with the flag; without it the AVX2 build's one- and two-row tiles sum even and odd k apart."""
    from radixserve.layers import batch_invariant

    gen = torch.Generator().manual_seed(0)
    k, n = 1536, 96  # three 512-wide K chunks
    packed = ops.pack_bf16_weight((torch.randn(n, k, generator=gen) / 30).to(torch.bfloat16))
    bias = torch.randn(n, generator=gen)
    matmul = lambda x: ops.bf16_linear(x, packed, n, bias)  # noqa: E731
    batch_invariant.enable_batch_invariant_mode(True)
    assert ops.batch_invariant()
    assert batch_invariant.check_rows_invariant(matmul, k)
    batch_invariant.enable_batch_invariant_mode(False)
    if not ops.has_avx512_bf16():  # the AVX-512 tiles are one chain per output either way
        assert not batch_invariant.check_rows_invariant(matmul, k)


def _decode(ops, q, k_buf, v_buf, table, rows, lens, split):
    out = torch.empty_like(q)
    ops.decode_attention(out, q, k_buf, v_buf, table, rows, lens, 0.125, 0, split)
    return out


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_attention_fixed_split_is_batch_invariant(ops, kv_dtype):
    """A request decoded alone and in a batch of 9 (and with 1 or 3 threads): the same bits with
    split_tokens fixed; the adaptive split (0) splits the lone request and not the batch."""
    from radixserve.layers.batch_invariant import DECODE_SPLIT_TOKENS

    gen = torch.Generator().manual_seed(1)
    lens = torch.tensor([600, 300, 5, 129, 256, 257, 40, 512, 700], dtype=torch.int64)
    slots = torch.randperm(4096, generator=gen)[: int(lens.sum())].to(torch.int32)
    table = torch.zeros(len(lens), 1024, dtype=torch.int32)
    start = 0
    for i, n in enumerate(lens.tolist()):
        table[i, :n] = slots[start : start + n]
        start += n
    k_buf = torch.randn(4096, 2, 64, generator=gen).to(kv_dtype)
    v_buf = torch.randn(4096, 2, 64, generator=gen).to(kv_dtype)
    q = torch.randn(len(lens), 8, 64, generator=gen)
    rows = torch.arange(len(lens), dtype=torch.int64)
    batch = _decode(ops, q, k_buf, v_buf, table, rows, lens, DECODE_SPLIT_TOKENS)
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            for i in range(len(lens)):
                alone = _decode(ops, q[i : i + 1], k_buf, v_buf, table, rows[i : i + 1], lens[i : i + 1], DECODE_SPLIT_TOKENS)
                assert torch.equal(alone[0], batch[i]), (threads, i)
        torch.set_num_threads(2)
        adaptive = _decode(ops, q[:1], k_buf, v_buf, table, rows[:1], lens[:1], 0)
        assert not torch.equal(adaptive[0], _decode(ops, q, k_buf, v_buf, table, rows, lens, 0)[0])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype_name", ["Q8_0", "Q4_0"])
def test_gguf_blocks_take_one_checked_path(ops, monkeypatch, qtype_name):
    """Under the flag a GGUF matrix takes one path at every row count (no switch by row bucket),
    checked batch-invariant at start; a path that is not is refused with one line."""
    import gguf
    import numpy as np

    import radixserve.layers.quantization.gguf as quant_gguf
    from radixserve.layers import batch_invariant, gemm_select

    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    w = np.random.default_rng(0).standard_normal((48, 512), dtype=np.float32)
    qw = quant_gguf.QuantizedWeight(int(qtype), torch.from_numpy(gguf.quants.quantize(w, qtype)), 512)
    before = gemm_select.current_plan()
    try:
        batch_invariant.enable_batch_invariant_mode(True)
        quant_gguf._batch_invariant_paths([qw], "auto")
        shape, paths = quant_gguf.gemm_shape(qw), quant_gguf.cpu_paths(qw.qtype)
        assert {gemm_select.current_plan().path(shape, m, paths) for m in (1, 16, 64, 256, 4096)} == {"int8"}
        # a path whose rows depend on the row count (as a BLAS that tiles by M may)
        monkeypatch.setitem(quant_gguf.CPU_PATHS, "int8", lambda x, w_: quant_gguf.dequantized_f32_matmul(x, w_) * (1 + 1e-6 * x.shape[0]))
        with pytest.raises(ValueError, match="--enable-deterministic-inference: the int8 GEMM path of"):
            quant_gguf._batch_invariant_paths([qw], "auto")
    finally:
        gemm_select.set_plan(before)


# ---- the tests ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def alone(model_dir) -> Outputs:
    return run(model_dir, "alone", True)


@pytest.mark.parametrize("scenario, overlap, chunk", [
    ("together", False, None),
    ("interleaved", False, None),
    ("interleaved", True, None),  # the overlap loop
    ("interleaved", False, 24),  # chunked prefill: 24-token chunks
    ("together", True, 44),  # p0 (221 tokens) in 44-token chunks: its last chunk is one token, in the overlap loop
    ("prefix_hit", False, None),
    ("prefix_hit", True, 40),
], ids=["together", "interleaved", "interleaved-overlap", "interleaved-chunk24", "together-overlap-chunk44",
        "prefix-hit", "prefix-hit-overlap-chunk40"])
def test_deterministic_outputs_equal_alone(model_dir, alone, scenario, overlap, chunk):
    got = run(model_dir, scenario, True, overlap=overlap, chunk=chunk)
    assert differences(alone, got) == []


def test_without_the_flag_outputs_differ(model_dir):
    """The same prompts without the flag: alone and interleaved differ somewhere (logprob bits at
    least), so the comparison above can fail."""
    ref = run(model_dir, "alone", False)
    diffs = differences(ref, run(model_dir, "interleaved", False)) + differences(ref, run(model_dir, "together", False))
    assert diffs, "without --enable-deterministic-inference the batched outputs equal the lone ones bit for bit"


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(alone):
    """The seeded prompts sampled (not their greedy continuation), reproducibly (the comparisons
    above): a seed decides the tokens, whatever the batch."""
    assert all(len(alone[f"p{i}"][0]) == MAX_NEW for i in range(NUM_PROMPTS))
    seeded = [alone[f"p{i}"] for i in (NUM_PROMPTS - 2, NUM_PROMPTS - 1)]
    # a sampled token's logprob is not always the maximum: at temperature 0.8 over ~2.5 nats of
    # entropy, some of 16 draws pick a lower-ranked token (greedy picks the max logprob)
    assert any(lp < -1.0 for _, lps in seeded for lp in lps)


def test_tp2_equals_itself_and_tp1_where_the_k_chunks_allow(model_dir, alone, tmp_path):
    from radixserve.layers import cpu_kernels

    ctx = mp.get_context("spawn")
    addr = f"127.0.0.1:{free_port()}"
    run_processes([ctx.Process(target=_tp_rank, args=(r, addr, model_dir, str(tmp_path / "tp2"))) for r in range(2)],
                  timeout=600)
    tp2 = torch.load(tmp_path / "tp2.0")
    assert differences(tp2, tp2, prefix_b="again") == []  # alone vs interleaved after the cache, at TP 2
    if not cpu_kernels.get().has_avx512_bf16():  # see the module docstring
        assert differences(alone, tp2) == []


def test_refused_combinations():
    from radixserve.server_args import ServerArgs

    for kw, words in [(dict(speculative_algorithm="NGRAM"), "--speculative-algorithm"),
                      (dict(enable_mixed_chunk=True), "--enable-mixed-chunk"),
                      (dict(device="cuda"), "--device cuda"),
                      (dict(enable_lora=True), "--enable-lora")]:
        with pytest.raises(ValueError, match="--enable-deterministic-inference does not run with " + words):
            ServerArgs(enable_deterministic_inference=True, **kw)
