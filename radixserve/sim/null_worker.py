"""NullModelWorker (issue 57): the simulator's worker on a real clock, for measuring the host path.

`radixserve serve --null-worker` runs the whole served runtime (HTTP, TokenizerManager, Scheduler,
detokenizer, streaming) over this worker: the real ReqToTokenPool and TokenToKVPoolAllocator,
sized from the model's config as the simulator sizes them on a CPU, and a forward that computes
nothing and returns at once. What `radixserve bench serving` then measures is the host's work per
token alone: a GPU's forward can only hide host work shorter than itself.

The tokens are a function of the position alone, so a request's output does not depend on its
batch, chunking, retraction or the overlap loop: the token sampled after a sequence of length p is
`token_ids[p % len(token_ids)]` (`--null-worker-token-ids`; default: one id that is not EOS, so
every request runs to max_new_tokens as in a benchmark with ignore_eos). The "logits" behind them
are one-hot: the sampled token's logprob is 0, every other token's UNLIKELY (-inf is not JSON).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from radixserve.layers.logits_processor import LogitsProcessorOutput
from radixserve.model_executor.forward_batch import ModelWorkerBatch
from radixserve.model_executor.tp_worker import GenerationBatchResult
from radixserve.models.model_config import ModelConfig
from radixserve.server_args import ServerArgs
from radixserve.sim.cost_model import get_device
from radixserve.sim.worker import SimModelWorker, pick_sim_token

UNLIKELY = -1e4  # the logprob of every token but the position's (finite: JSON has no -inf)


def parse_token_ids(text: Optional[str], model_config: ModelConfig) -> List[int]:
    """--null-worker-token-ids "5,6,7" -> [5, 6, 7]; None -> one id that is not EOS."""
    if text is None or not text.strip():
        return [pick_sim_token(model_config)]
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--null-worker-token-ids must be comma-separated integers, got {text!r}") from None
    bad = [t for t in ids if not 0 <= t < model_config.vocab_size]
    if bad:
        raise ValueError(f"--null-worker-token-ids: {bad} outside the vocabulary [0, {model_config.vocab_size})")
    return ids


class NullModelWorker(SimModelWorker):
    """SimModelWorker's pools; a forward that takes no time and returns the position's token."""

    def __init__(self, server_args: ServerArgs, model_config: ModelConfig):
        super().__init__(server_args, model_config, get_device("cpu"))
        self.token_ids = parse_token_ids(server_args.null_worker_token_ids, model_config)
        self.dtype = torch.float32

    def token_at(self, seq_len: int) -> int:
        """The token sampled after a sequence of seq_len tokens."""
        return self.token_ids[seq_len % len(self.token_ids)]

    def forward_batch_generation(self, batch: ModelWorkerBatch, skip_sample: bool = False) -> GenerationBatchResult:
        self.num_forwards += 1
        if skip_sample:
            return GenerationBatchResult(None, torch.empty(0, dtype=torch.int64))
        ids = [self.token_at(s) for s in batch.seq_lens_cpu]
        result = GenerationBatchResult(self._logits_output(batch), torch.tensor(ids, dtype=torch.int64))
        if batch.return_logprob:
            self._add_logprobs(batch, ids, result)
        return result

    def _logits_output(self, batch: ModelWorkerBatch) -> Optional[LogitsProcessorOutput]:
        """Only what a request asked for: prompt logprobs (one-hot: 0 where the prompt token is the
        position's token, else UNLIKELY)."""
        pos = batch.input_logprob_positions
        if pos is None:
            return None
        tokens = batch.input_logprob_token_ids.tolist()
        # the prompt token at flat position i was "sampled" after a sequence ending just before it
        prev_lens = self._positions_in_sequence(batch, pos.tolist())
        vals = [0.0 if self.token_at(p) == t else UNLIKELY for p, t in zip(prev_lens, tokens)]
        out = LogitsProcessorOutput(next_token_logits=torch.empty(0), input_token_logprobs=torch.tensor(vals))
        if batch.input_token_ids_logprob_ids is not None:
            asked = batch.input_token_ids_logprob_ids.tolist()
            out.input_token_ids_logprobs = torch.tensor(
                [[0.0 if self.token_at(p) == t else UNLIKELY for t in row] for p, row in zip(prev_lens, asked)])
        return out

    @staticmethod
    def _positions_in_sequence(batch: ModelWorkerBatch, flat: Sequence[int]) -> List[int]:
        """Flat extend-token indices -> each token's position in its own sequence."""
        starts, offsets, acc = [], [], 0
        for ext, pre in zip(batch.extend_seq_lens or [], batch.extend_prefix_lens or []):
            starts.append(acc)
            offsets.append(pre)
            acc += ext
        out = []
        r = 0
        for f in flat:
            while r + 1 < len(starts) and starts[r + 1] <= f:
                r += 1
            out.append(offsets[r] + f - starts[r])
        return out

    def _add_logprobs(self, batch: ModelWorkerBatch, ids: List[int], result: GenerationBatchResult) -> None:
        """One-hot logits: the sampled token's logprob is 0; top-k is it, then UNLIKELY."""
        result.next_token_logprobs = torch.zeros(len(ids))
        ks = batch.top_logprobs_nums or [0] * len(ids)
        result.top_logprobs_val = [[0.0] + [UNLIKELY] * (k - 1) if k else [] for k in ks]
        result.top_logprobs_idx = [[t] + [i for i in range(k) if i != t][: k - 1] if k else [] for t, k in zip(ids, ks)]
        if batch.token_ids_logprobs is not None:
            result.token_ids_logprobs_val = [
                None if asked is None else [0.0 if a == t else UNLIKELY for a in asked]
                for t, asked in zip(ids, batch.token_ids_logprobs)]
