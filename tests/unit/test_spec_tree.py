"""Token trees in speculative decoding: the tree attention of a verify forward on every backend
(C++ decode kernel, torch SDPA with the mask, Triton under its interpreter; with
RADIXSERVE_TEST_DEVICE=cuda, tests/unit/devices.py, Triton compiled on the GPU and the other two
still on the CPU) against plain forwards of each root-to-token path; the accepted branch's KV
moved into place; tree acceptance, greedy and in distribution."""

import os

from devices import ON_GPU, TEST_DEVICE

# Before triton_ops is imported (see test_triton_kernels.py). Not on the GPU.
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from scipy.stats import chisquare  # noqa: E402

from radixserve.layers.attention.spec_tree import SpecTree  # noqa: E402
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch  # noqa: E402
from radixserve.model_executor.model_runner import ModelRunner  # noqa: E402
from radixserve.models.model_config import ModelConfig  # noqa: E402
from radixserve.server_args import ServerArgs  # noqa: E402
from radixserve.speculative.spec_info import NgramVerifyInput  # noqa: E402
from radixserve.speculative.tree import TreeDrafts, accepted_kv_moves, verify_tree  # noqa: E402
from radixserve.speculative.verify import verify_chain  # noqa: E402
from radixserve.tiny_model import get_tiny_model_path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from hf_utils import KVDriver  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from greedy_testing import sampling_info  # noqa: E402

# The interpreter for this module's tests only (tests/unit/conftest.py; set above for the import; not on the GPU).
pytestmark = pytest.mark.usefixtures("triton_interpreter")

TOL = 1e-4


def test_spec_tree_layout():
    #        0
    #      1   2
    #     3   4 5
    tree = SpecTree([[-1, 0, 0, 1, 2, 2], [-1]])
    assert tree.depths(0) == [0, 1, 1, 2, 2, 2]
    assert tree.path(0, 5) == [0, 2, 5]
    assert tree.positions([10, 7]).tolist() == [10, 11, 11, 12, 12, 12, 7]
    anc = tree.ancestor_mask(0)
    assert anc[4].nonzero().view(-1).tolist() == [0, 2, 4] and anc[1].nonzero().view(-1).tolist() == [0, 1]
    req_to_token = torch.arange(100, dtype=torch.int32).view(2, 50)
    loc = torch.arange(200, 207)
    table, rows, lens = tree.kv_rows(req_to_token, [1, 0], [3, 2], loc)
    assert table.shape[0] == 4  # a row per leaf: 3, 4, 5 and request 1's single token
    assert lens.tolist() == [4, 5, 5, 6, 6, 6, 3]
    for tok, path in [(4, [0, 2, 4]), (1, [0, 1]), (2, [0, 2])]:
        row = table[rows[tok], : lens[tok]].tolist()
        assert row == [50, 51, 52] + [200 + j for j in path]
    assert table[rows[6], :3].tolist() == [0, 1, 206]
    assert SpecTree.chains([3]).parents == [[-1, 0, 1]]


# ---- the verify forward on the tiny model --------------------------------------------------------
def _runner(backend: str) -> ModelRunner:
    path = get_tiny_model_path()
    device = TEST_DEVICE if backend == "triton" else "cpu"  # the C++ kernels and the CPU's torch path stay there
    args = ServerArgs(model_path=path, dtype="float32", device=device, max_total_tokens=1024, max_running_requests=16,
                      attention_backend="triton" if backend == "triton" else "torch_native")
    runner = ModelRunner(ModelConfig.from_pretrained(path), args)
    if backend == "torch":
        runner.attn_backend = TorchNativeAttnBackend("cpu", use_cpu_kernels=False)
    return runner


def _verify(drv: KVDriver, rows, prefix_lens, tokens, tree: SpecTree):
    """A TARGET_VERIFY forward of each row's tree tokens after its prefix, slots in chain layout
    (as the speculative workers allocate them). Returns (all logits, out_cache_loc)."""
    locs = [drv._alloc(len(t)) for t in tokens]
    req_to_token = drv.r.req_to_token_pool.req_to_token
    for row, p, loc in zip(rows, prefix_lens, locs):
        req_to_token[row, p : p + len(loc)] = loc.to(torch.int32)
    seq_lens = [p + len(t) for p, t in zip(prefix_lens, tokens)]
    batch = ModelWorkerBatch(
        forward_mode=ForwardMode.TARGET_VERIFY,
        input_ids=torch.tensor([x for t in tokens for x in t], dtype=torch.int64),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        out_cache_loc=torch.cat(locs),
        seq_lens_cpu=seq_lens,
        extend_seq_lens=[len(t) for t in tokens],
        extend_prefix_lens=list(prefix_lens),
        capture_all_logits=True,
        spec_tree=tree,
    )
    return drv.r.forward(ForwardBatch.init_new(batch, drv.r)).all_logits, torch.cat(locs)


@pytest.mark.parametrize("backend", ["cpu_kernels", "torch", "triton"])
def test_tree_verify_forward_equals_each_path_alone(backend):
    runner = _runner(backend)
    vocab = runner.model_config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (11, 6)]
    parents = [[-1, 0, 0, 1, 2, 2, 4], [-1, 0, 1, 0]]
    trees = [torch.randint(0, vocab, (len(p),), generator=g).tolist() for p in parents]
    trees[0][0], trees[1][0] = prompts[0][-1], prompts[1][-1]  # token 0: the last committed token
    drv = KVDriver(runner, scatter_seed=1)
    # the prefixes: every prompt token but the last (which the verify forward feeds as token 0)
    drv.extend([0, 1], [0, 0], [p[:-1] for p in prompts])
    tree = SpecTree(parents)
    logits, loc = _verify(drv, [0, 1], [len(p) - 1 for p in prompts], trees, tree)

    # each token's path as a plain prefill of its own (fresh rows)
    seqs = [prompts[i][:-1] + [trees[i][j] for j in tree.path(i, j)] for i in range(2) for j in range(len(parents[i]))]
    ref_rows = list(range(2, 2 + len(seqs)))
    ref = drv.extend(ref_rows, [0] * len(seqs), seqs).all_logits
    ends = torch.cumsum(torch.tensor([len(s) for s in seqs]), 0) - 1
    assert (logits - ref[ends]).abs().max().item() <= TOL

    # accept request 0's branch 0 -> 2 -> 4 -> 6 (layout indices 2, 4, 6 at depths 1..3): after
    # the moves, a decode step at position L + 4 sees exactly that branch
    drafts = TreeDrafts([t[1:] for t in trees], tree)
    tgt, src = accepted_kv_moves(drafts, [[2, 4, 6], []], loc)
    assert tgt.tolist() == loc[[1, 2, 3]].tolist() and src.tolist() == loc[[2, 4, 6]].tolist()
    runner.token_to_kv_pool.move_kv_cache(tgt, src)
    nxt = int(torch.randint(0, vocab, (1,), generator=g))
    L = len(prompts[0]) - 1
    step = drv.decode([0], [L + 4], [nxt]).next_token_logits
    branch = prompts[0][:-1] + [trees[0][j] for j in (0, 2, 4, 6)] + [nxt]
    alone = drv.extend([2 + len(seqs)], [0], [branch]).all_logits[-1]
    assert (step[0] - alone).abs().max().item() <= TOL


# ---- acceptance ------------------------------------------------------------------------------------
def _peaked(argmax, vocab: int) -> torch.Tensor:
    logits = torch.zeros(len(argmax), vocab)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


def test_greedy_tree_acceptance_follows_the_branch_the_target_takes():
    vocab = 9
    # request 0: root children 3 (idx 1) and 5 (idx 2); 5 has child 6 (idx 3), 3 has child 7 (idx 4)
    # target argmax per token: root -> 5, idx1 -> 0, idx2 -> 6, idx3 -> 8, idx4 -> 1: accepts 5, 6 then 8
    # request 1: no drafts, argmax 4
    drafts = TreeDrafts([[3, 5, 6, 7], []], SpecTree([[-1, 0, 0, 2, 1], [-1]]))
    logits = _peaked([5, 0, 6, 8, 1, 4], vocab)
    out, paths = verify_tree(logits, sampling_info(2, vocab, temperature=0), drafts, return_logprob=True, top_logprobs_nums=[2, 1])
    assert out.accept_lens == [2, 0] and out.token_ids == [[5, 6, 8], [4]]
    assert paths == [[2, 3], []]
    expected = torch.log_softmax(logits, -1)
    assert out.logprobs[0] == pytest.approx([expected[0, 5].item(), expected[2, 6].item(), expected[3, 8].item()])
    assert [r[0] for r in out.top_logprobs_idx[0]] == [5, 6, 8]


def test_a_chain_tree_accepts_as_verify_chain():
    vocab = 8
    chains = [[3, 5, 6], [4], []]
    argmax = [3, 5, 2, 7, 1, 0, 6]
    logits = _peaked(argmax, vocab)
    tree_out, _ = verify_tree(logits, sampling_info(3, vocab, temperature=0), TreeDrafts.chains(chains))
    chain_out = verify_chain(logits, sampling_info(3, vocab, temperature=0), NgramVerifyInput(chains))
    assert tree_out.accept_lens == chain_out.accept_lens and tree_out.token_ids == chain_out.token_ids


def test_tree_sampling_keeps_the_target_distribution():
    """Many independent rows of one tree (root children 1 and 2, token 1 has child 4): the first
    committed token is distributed as p_root, and the one after an accepted 1 as p at token 1."""
    torch.manual_seed(0)
    vocab, n = 6, 30000
    p_root = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
    p_one = torch.tensor([0.05, 0.05, 0.40, 0.10, 0.30, 0.10])
    p_two = torch.tensor([0.10, 0.10, 0.10, 0.10, 0.10, 0.50])
    p_four = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    per_row = torch.stack([p_root, p_one, p_two, p_four]).log()
    drafts = TreeDrafts([[1, 2, 4]] * n, SpecTree([[-1, 0, 0, 1]] * n))
    out, _ = verify_tree(per_row.repeat(n, 1), sampling_info(n, vocab, temperature=1.0), drafts)
    first = torch.bincount(torch.tensor([t[0] for t in out.token_ids]), minlength=vocab).float()
    assert chisquare(first.numpy(), (p_root * n).numpy()).pvalue > 1e-3
    after_one = [t[1] for t in out.token_ids if t[0] == 1]
    second = torch.bincount(torch.tensor(after_one), minlength=vocab).float()
    assert chisquare(second.numpy(), (p_one * len(after_one)).numpy()).pvalue > 1e-3
    assert all(len(t) == 1 for t in out.token_ids if t[0] not in (1, 2))
