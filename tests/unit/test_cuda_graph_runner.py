"""CudaGraphRunner on the CPU: the tiny model with the Triton backend (under Triton's interpreter),
captured and replayed through an eager stand-in for CUDA graphs. The stand-in keeps the
callable and the ForwardBatch built at capture and calls them again at replay, so only the
contents of the static tensors change between replays, as on a GPU: anything a backend
plans from Python-side values at capture stays frozen, and the comparisons below catch it.
The real torch.cuda.CUDAGraph path needs a GPU: with RADIXSERVE_TEST_DEVICE=cuda
(tests/unit/devices.py) the same tests run there with compiled kernels, still through the
stand-in, and test_real_cuda_graphs_replay_as_eager captures real graphs."""

import os

from devices import ON_GPU, TEST_DEVICE

# Before triton_ops is imported (see test_triton_kernels.py). Not on the GPU.
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import logging  # noqa: E402
from typing import List, Sequence  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from radixserve.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from radixserve.model_executor.cuda_graph_runner import (  # noqa: E402
    CudaGraphRunner,
    EagerGraphBackend,
    get_batch_sizes_to_capture,
)
from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch  # noqa: E402
from radixserve.model_executor.model_runner import ModelRunner  # noqa: E402
from radixserve.models.model_config import ModelConfig  # noqa: E402
from radixserve.server_args import ServerArgs  # noqa: E402
from radixserve.tiny_model import get_tiny_model_path  # noqa: E402

# The interpreter for this module's tests only (tests/unit/conftest.py; set above for the import; not on the GPU).
pytestmark = pytest.mark.usefixtures("triton_interpreter")

TOL = 1e-4
TOL_VS_TORCH_NATIVE = 1e-3  # as in test_triton_kernels.py
MAX_BS = 16
# One split: the fewest interpreted programs (the interpreter is the cost of this file);
# test_replay_with_several_kv_splits covers the preallocated split buffers with more.
NUM_KV_SPLITS = 1


class RecordingStandIn(EagerGraphBackend):
    """The eager stand-in, recording the batch size of each capture and the pool it was given."""

    def __init__(self) -> None:
        self.captured: List[int] = []
        self.pools: List[object] = []

    def new_pool(self) -> object:
        return object()

    def capture(self, fn, pool):
        graph = super().capture(fn, pool)
        self.captured.append(graph.output.shape[0])
        self.pools.append(pool)
        return graph


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    path = get_tiny_model_path()
    args = ServerArgs(model_path=str(path), dtype="float32", device=TEST_DEVICE, max_total_tokens=4096,
                      max_running_requests=32, attention_backend="triton", cuda_graph_max_bs=MAX_BS)
    r = ModelRunner(ModelConfig.from_pretrained(path), args)
    assert (r.cuda_graph_runner is not None) == ON_GPU  # real graphs on a GPU by itself, never on the CPU
    r.cuda_graph_runner = None  # the tests below drive graph runners of their own
    r.attn_backend.num_kv_splits = NUM_KV_SPLITS
    g = torch.Generator().manual_seed(0)
    pool = r.token_to_kv_pool
    for buf in pool.k_buffer + pool.v_buffer:  # garbage everywhere: reading a wrong slot shows
        buf.copy_(torch.randn(buf.shape, generator=g))
    alloc = r.token_to_kv_pool_allocator  # scattered slots, as a busy server has them
    alloc.free_pages = alloc.free_pages[torch.randperm(len(alloc.free_pages), generator=g)]
    return r


@pytest.fixture(scope="module")
def stand_in() -> RecordingStandIn:
    return RecordingStandIn()


@pytest.fixture(scope="module")
def graph_runner(runner, stand_in) -> CudaGraphRunner:
    return CudaGraphRunner(runner, stand_in)


def decode_batch(runner: ModelRunner, rows: Sequence[int], prefix_lens: Sequence[int], seed: int,
                 **extra) -> ModelWorkerBatch:
    """One decode step for `rows`, each with `prefix_lens` tokens already in (random) KV."""
    g = torch.Generator().manual_seed(seed)
    alloc, r2t = runner.token_to_kv_pool_allocator, runner.req_to_token_pool.req_to_token
    for row, n in zip(rows, prefix_lens):
        r2t[row, : n + 1] = alloc.alloc(n + 1).to(torch.int32)  # prefix + the new token's slot
    seq_lens = [n + 1 for n in prefix_lens]
    return ModelWorkerBatch(
        forward_mode=ForwardMode.DECODE,
        input_ids=torch.randint(0, runner.model_config.vocab_size, (len(rows),), generator=g),
        req_pool_indices=torch.tensor(list(rows), dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        out_cache_loc=torch.tensor([int(r2t[row, n]) for row, n in zip(rows, prefix_lens)], dtype=torch.int64),
        seq_lens_cpu=seq_lens,
        **extra,
    )


def random_decode_batch(runner: ModelRunner, bs: int, seed: int) -> ModelWorkerBatch:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(runner.max_running_requests, generator=g)[:bs].tolist()
    prefix_lens = torch.randint(0, 60, (bs,), generator=g).tolist()  # ragged, some empty
    return decode_batch(runner, rows, prefix_lens, seed)


def kv_snapshot(runner: ModelRunner) -> torch.Tensor:
    pool = runner.token_to_kv_pool
    return torch.stack([b.clone() for b in pool.k_buffer + pool.v_buffer])  # [2 * layers, slots, ...]


def kv_restore(runner: ModelRunner, snap: torch.Tensor) -> None:
    pool = runner.token_to_kv_pool
    for buf, saved in zip(pool.k_buffer + pool.v_buffer, snap):
        buf.copy_(saved)


def eager_then(runner: ModelRunner, batch: ModelWorkerBatch, run, eager_backend=None):
    """Eager forward (no graph runner; the runner's backend unless eager_backend is given) from
    the current KV, then `run` from the same KV.
    Returns (eager output, eager KV, run's output, run's KV, KV before)."""
    saved = runner.cuda_graph_runner, runner.attn_backend
    runner.cuda_graph_runner, runner.attn_backend = None, eager_backend or runner.attn_backend
    before = kv_snapshot(runner)
    eager = runner.forward(ForwardBatch.init_new(batch, runner))
    kv_eager = kv_snapshot(runner)
    kv_restore(runner, before)
    runner.cuda_graph_runner, runner.attn_backend = saved
    out = run()
    return eager, kv_eager, out, kv_snapshot(runner), before


def check_replay(runner: ModelRunner, graph_runner: CudaGraphRunner, batch: ModelWorkerBatch) -> None:
    eager, kv_eager, out, kv_graph, before = eager_then(
        runner, batch, lambda: graph_runner.replay(ForwardBatch.init_new(batch, runner)))
    bs = batch.batch_size
    assert out.next_token_logits.shape == eager.next_token_logits.shape == (bs, runner.model_config.vocab_size)
    assert (out.next_token_logits - eager.next_token_logits).abs().max().item() <= TOL
    # The same KV everywhere but the padding slot; the new tokens' KV was really written.
    assert (kv_graph[:, 1:] - kv_eager[:, 1:]).abs().max().item() <= TOL
    assert not torch.equal(kv_graph[:, batch.out_cache_loc], before[:, batch.out_cache_loc])
    graph_bs = min(n for n in graph_runner.capture_bs if n >= bs)
    if graph_bs == bs:  # (padding always writes the same KV to slot 0: token 0 at position 0)
        assert torch.equal(kv_graph[:, 0], before[:, 0])
    # The padding requests were refilled for this replay (not left over from an earlier batch).
    fill = graph_runner.seq_len_fill_value
    assert graph_runner.req_pool_indices[bs:graph_bs].eq(0).all()
    assert graph_runner.seq_lens[bs:graph_bs].eq(fill).all()
    assert graph_runner.out_cache_loc[bs:graph_bs].eq(0).all()


# ---- 1. which batch sizes are captured ------------------------------------------------------
def test_capture_batch_sizes(graph_runner, stand_in):
    assert get_batch_sizes_to_capture(256, 4096) == [1, 2, 4, 8] + list(range(16, 257, 8))
    assert get_batch_sizes_to_capture(256, 4096)[-3:] == [240, 248, 256]
    assert get_batch_sizes_to_capture(20, 4096) == [1, 2, 4, 8, 16]
    assert get_batch_sizes_to_capture(256, 30) == [1, 2, 4, 8, 16, 24]  # max running requests
    assert get_batch_sizes_to_capture(256, 3) == [1, 2]
    assert graph_runner.capture_bs == [1, 2, 4, 8, 16] and graph_runner.max_bs == MAX_BS
    assert sorted(graph_runner.graphs) == graph_runner.capture_bs
    assert stand_in.captured == [16, 8, 4, 2, 1]  # largest first, so it sizes the shared pool
    assert len(set(map(id, stand_in.pools))) == 1  # one pool for all graphs


# ---- 2. padded and exact replays match the eager forward ---------------------------------------
@pytest.mark.parametrize("bs", [3, 5, 16])  # padded to 4, padded to 8, exact
def test_replay_matches_eager(runner, graph_runner, bs):
    check_replay(runner, graph_runner, random_decode_batch(runner, bs, seed=bs))


# ---- 3. nothing from capture or from the previous replay leaks into the next -----------------
def test_consecutive_replays_with_different_batches(runner, graph_runner):
    # 7 and 5 both replay the bs-8 graph, with other rows, lengths and padding.
    for step, bs in enumerate([7, 5, 2]):
        check_replay(runner, graph_runner, random_decode_batch(runner, bs, seed=100 + step))


# ---- 4. what cannot be replayed runs eagerly, through ModelRunner.forward ---------------------
def test_can_run_and_eager_fallback(runner, graph_runner, monkeypatch):
    replays = []
    real_replay = graph_runner.replay
    monkeypatch.setattr(graph_runner, "replay", lambda fb: replays.append(fb.batch_size) or real_replay(fb))
    monkeypatch.setattr(runner, "cuda_graph_runner", graph_runner)

    decode = random_decode_batch(runner, 5, seed=7)
    too_big = random_decode_batch(runner, MAX_BS + 1, seed=8)
    all_logits = random_decode_batch(runner, 3, seed=9)
    all_logits.capture_all_logits = True
    logprobs = random_decode_batch(runner, 3, seed=10)
    logprobs.input_logprob_positions = torch.tensor([1])
    logprobs.input_logprob_token_ids = torch.tensor([4])
    extend = decode_batch(runner, [0, 1], [0, 0], seed=11)  # a 2-request prefill of 1 token each
    extend.forward_mode, extend.extend_seq_lens, extend.extend_prefix_lens = ForwardMode.EXTEND, [1, 1], [0, 0]
    mixed = decode_batch(runner, [2, 3], [0, 6], seed=12)
    mixed.forward_mode, mixed.extend_seq_lens, mixed.extend_prefix_lens = ForwardMode.MIXED, [1, 1], [0, 6]
    fallbacks = (too_big, all_logits, logprobs, extend, mixed)

    assert graph_runner.can_run(decode) and graph_runner.can_run(ForwardBatch.init_new(decode, runner))
    for batch in fallbacks:
        assert not graph_runner.can_run(batch)
        assert not graph_runner.can_run(ForwardBatch.init_new(batch, runner))

    # Against the torch-native backend (fast on the CPU); Triton-vs-eager-Triton is test 2's.
    reference = TorchNativeAttnBackend(TEST_DEVICE)
    # The replayable batch goes through the graph, and skips the eager metadata.
    fb = ForwardBatch.init_new(decode, runner)
    assert fb.attn_metadata is None
    ref, _, out, _, _ = eager_then(runner, decode, lambda: runner.forward(fb), reference)
    assert replays == [5]
    assert (out.next_token_logits - ref.next_token_logits).abs().max().item() <= TOL_VS_TORCH_NATIVE

    for batch in fallbacks:
        ref, _, out, _, _ = eager_then(
            runner, batch, lambda b=batch: runner.forward(ForwardBatch.init_new(b, runner)), reference)
        assert out.next_token_logits.shape == (batch.batch_size, runner.model_config.vocab_size)
        assert (out.next_token_logits - ref.next_token_logits).abs().max().item() <= TOL_VS_TORCH_NATIVE
        for extra in ("all_logits", "input_token_logprobs"):  # what a graph does not produce
            got, want = getattr(out, extra), getattr(ref, extra)
            assert (got is None) == (want is None)
            assert want is None or (got - want).abs().max().item() <= TOL_VS_TORCH_NATIVE
    assert replays == [5]  # none of them was replayed


# ---- 5. a backend that plans from capture-time (CPU-side) values cannot pass ------------------
def test_torch_native_backend_cannot_be_captured(runner, monkeypatch, caplog):
    monkeypatch.setattr(runner, "attn_backend", TorchNativeAttnBackend(TEST_DEVICE))
    with pytest.raises(NotImplementedError, match="cannot run under CUDA graphs.*CPU-side lengths"):
        CudaGraphRunner(runner, EagerGraphBackend())
    # ModelRunner turns graphs off for it (and says why) instead of failing, even on CUDA.
    monkeypatch.setattr(runner, "device", "cuda")
    with caplog.at_level(logging.INFO, logger="radixserve.model_executor.model_runner"):
        assert runner.init_cuda_graphs() is None and not runner.use_cuda_graph()
    assert "CUDA graphs off: TorchNativeAttnBackend" in caplog.text
    monkeypatch.setattr(runner, "server_args", runner.server_args.replace(disable_cuda_graph=True))
    monkeypatch.setattr(runner, "attn_backend", TritonAttnBackend(TEST_DEVICE))
    assert runner.init_cuda_graphs() is None and not runner.use_cuda_graph()


class FrozenMetadataTriton(TritonAttnBackend):
    """Like a backend that reads seq_lens_cpu: plans from the lengths it sees at capture and
    refills nothing at replay. Fine eagerly; wrong under (stand-in) graphs."""

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens):
        md = super().init_forward_metadata_capture_cuda_graph(bs, req_pool_indices, seq_lens)
        md.req_pool_indices, md.seq_lens = req_pool_indices.clone(), seq_lens.clone()
        return md

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens):
        pass


def test_stand_in_catches_a_backend_frozen_at_capture(runner, monkeypatch):
    monkeypatch.setattr(runner, "attn_backend", FrozenMetadataTriton(TEST_DEVICE, num_kv_splits=NUM_KV_SPLITS))
    monkeypatch.setattr(runner, "server_args", runner.server_args.replace(cuda_graph_max_bs=2))
    frozen = CudaGraphRunner(runner, EagerGraphBackend())
    batch = random_decode_batch(runner, 2, seed=21)
    eager, _, out, _, _ = eager_then(runner, batch, lambda: frozen.replay(ForwardBatch.init_new(batch, runner)))
    assert (out.next_token_logits - eager.next_token_logits).abs().max().item() > 1e-2


def test_replay_with_several_kv_splits(runner, monkeypatch):
    """The preallocated split buffers (mid_o / mid_lse) with 4 splits, shared by both graphs."""
    monkeypatch.setattr(runner, "attn_backend", TritonAttnBackend(TEST_DEVICE, num_kv_splits=4))
    monkeypatch.setattr(runner, "server_args", runner.server_args.replace(cuda_graph_max_bs=2))
    graph_runner = CudaGraphRunner(runner, EagerGraphBackend())
    assert graph_runner.capture_bs == [1, 2] and runner.attn_backend.graph_state.mid_o.shape[:3] == (2, 4, 4)
    check_replay(runner, graph_runner, decode_batch(runner, [4, 9], [70, 3], seed=22))


# ---- 6. the real torch.cuda.CUDAGraph path (GPU only) -------------------------------------------
@pytest.mark.skipif(not ON_GPU, reason="real CUDA graphs need RADIXSERVE_TEST_DEVICE=cuda (a GPU)")
def test_real_cuda_graphs_replay_as_eager(runner, monkeypatch):
    """CudaGraphBackend: padded and exact replays, one after another, match the eager forward."""
    # A backend of its own (its graph state): the stand-in graphs of the module fixture keep theirs.
    monkeypatch.setattr(runner, "attn_backend", TritonAttnBackend(TEST_DEVICE, num_kv_splits=4))
    monkeypatch.setattr(runner, "server_args", runner.server_args.replace(cuda_graph_max_bs=8))
    graph_runner = CudaGraphRunner(runner)  # no backend given: real CUDA graphs
    assert graph_runner.capture_bs == [1, 2, 4, 8] and sorted(graph_runner.graphs) == [1, 2, 4, 8]
    for step, bs in enumerate([3, 8, 5, 1]):
        check_replay(runner, graph_runner, random_decode_batch(runner, bs, seed=300 + step))
