"""--enable-deterministic-inference (SGLang's flag, issue 56): batch-invariant kernels, so that a
request gets the same tokens and logprobs whatever it is batched with, however its prompt was
chunked and whether its prefix came from the cache.

Every reduction of the forward is computed in an order fixed by the request's own data: the
same token at the same position sums the same numbers in the same order whatever else is in the
batch. Where each one comes from on the CPU:

  GEMM (bf16 weights)   cpu_kernels.cpp's bf16_linear. On AVX-512 every output sums its K in one
                        chain whatever the row tiling; on AVX2 one or two rows used to sum even and
                        odd k apart (two chains) and more rows one: set_batch_invariant(True) gives
                        every row count the one-chain tiles.
  GEMM (torch, float)   a weight the C++ GEMM does not hold (float32 models) is multiplied one row
                        at a time (`linear_rows`): torch's BLAS may tile and split K by row count.
  GEMM (GGUF blocks)    gemm_select stops switching paths by row count (GemmPlan.batch_invariant:
                        one path per shape), and the path is checked here at start
                        (`check_rows_invariant`); one that is not invariant is refused.
  decode attention      keys in fixed splits of DECODE_SPLIT_TOKENS absolute positions (merged in
                        split order), not "as many splits as the batch leaves threads idle"; no
                        shared-prefix pass (its tiles depend on which requests share the batch).
  extend attention      the C++ kernel walks keys from position 0 in fixed tiles, so cached keys and
                        the current chunk's keys are reduced in the same order; with the flag an
                        extend of one token (a chunk's or a prefix hit's last token) goes there too,
                        not to the decode kernel.
  RMSNorm, softmax,     per row already (one thread per row, the same vector code).
  sampler
  TP all-reduce         gloo's sum of 2 ranks is a + b on both (commutative): deterministic at TP 2.
  Triton attention      decode splits each request's own keys in num_kv_splits shares (per request
                        already); extend (batch_invariant=True) reads every key from the pool and cuts
                        both key and query blocks on absolute positions. Tested under the interpreter:
                        on CUDA the flag is refused (torch's cuBLAS GEMMs are not batch-invariant).

Sampling at temperature > 0 is reproducible with a per-request `sampling_seed` (sampler.py seeds
each row's noise from (seed, step)). What cannot be made deterministic is refused at start with one
line (ServerArgs.deterministic_inference_unsupported).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

# Keys per decode split under the flag: SGLang's split tile size for its Triton decode kernel in
# deterministic mode. A request shorter than this is one split (no merge pass).
DECODE_SPLIT_TOKENS = 256

_enabled = False  # one mode per process, set once at start (like gemm_select's plan)


def is_enabled() -> bool:
    return _enabled


def enable_batch_invariant_mode(on: bool = True) -> None:
    """Switch the process's kernels to their batch-invariant orders (the C++ ones too)."""
    global _enabled
    _enabled = on
    from radixserve.layers import cpu_kernels

    ops = cpu_kernels.get()
    if ops is not None and hasattr(ops, "set_batch_invariant"):
        ops.set_batch_invariant(on)


def decode_split_tokens() -> int:
    """The decode kernel's split_tokens argument: fixed under the flag, 0 (adaptive) otherwise."""
    return DECODE_SPLIT_TOKENS if _enabled else 0


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear one row at a time: every row takes the one-row path whatever the batch."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] <= 1:
        return F.linear(x, weight, bias)
    y = torch.cat([F.linear(x2[i : i + 1], weight, bias) for i in range(x2.shape[0])])
    return y.reshape(*x.shape[:-1], y.shape[-1])


CHECK_ROWS = (1, 2, 3, 7, 16, 17, 65)  # row counts that cross the kernels' tile and path boundaries


def check_rows_invariant(matmul: Callable[[torch.Tensor], torch.Tensor], k: int,
                         rows: Sequence[int] = CHECK_ROWS, seed: int = 0) -> bool:
    """Whether `matmul` (x [M, k] -> y [M, N]) gives every row the same bits at every row count."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(max(rows), k, generator=gen)
    full = matmul(x)
    return all(torch.equal(matmul(x[:m]), full[:m]) for m in rows)


def unsupported_for_model(device: str, is_hybrid: bool, sliding_window: Optional[int], head_dim: int) -> Optional[str]:
    """What of this model or machine the flag cannot make batch-invariant (None: nothing); the
    ModelRunner refuses it with one line before loading."""
    from radixserve.layers import cpu_kernels

    if device != "cpu":
        return f"--device {device} (the batch-invariant kernels are the CPU's)"
    if is_hybrid:
        return "a linear-attention model (its chunked prefill recurrence depends on the chunk boundaries)"
    if sliding_window is not None:
        return "a sliding-window model (its windowed extend runs one SDPA call per request, not the tiled kernel)"
    ops = cpu_kernels.get()
    if ops is None or not ops.has_extend_attention() or not hasattr(ops, "set_batch_invariant"):
        return f"the torch attention path (the C++ CPU kernels are off: {cpu_kernels.DISABLE_ENV} or no AVX2 build)"
    if head_dim % 16:
        return f"head_dim {head_dim} (the tiled extend kernel takes a multiple of 16)"
    return None
