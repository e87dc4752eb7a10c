"""`radixserve bench one-batch`: the latency of one prefill and one decode step of a static batch.

For each batch size B, B requests of `--input-len` random tokens are prefilled in one EXTEND
forward, then decoded for `--decode-steps` DECODE forwards (median per step, at a context of
input_len..input_len+steps). Ours drives `ModelRunner` directly, the way the scheduler would:
a req_to_token row per request, KV slots from the allocator, ModelWorkerBatch ->
ForwardBatch.init_new -> forward -> greedy argmax. No scheduler, so this isolates the model +
paged-attention cost.

In the same run the same weights are run by transformers (AutoModelForCausalLM, float32,
contiguous DynamicCache): prefill of the [B, input_len] batch (logits of the last position
only, as `generate` does), then one token per request per step with past_key_values.

Each shape is warmed up once (one prefill and one decode step, not timed). The two systems'
decode steps alternate (ours, HF, ours, HF, ...) so that load from other processes on a shared
machine lands on both; the median step is reported, and the ratio ours / HF is the number to read.
On a GPU each timed call ends with a device synchronize.

Model-bandwidth utilization (MBU) of a decode step: the bytes it must read (the weights, less
an untied input embedding, of which it reads bs rows, plus the K and V of every cached token
of every request) / step time / the memory bandwidth measured here by a large device copy
(`--mem-bandwidth-gbs` overrides it). A decode step at small batch is bound by those reads.

    radixserve bench one-batch                               # B = 1 16 64, input 512, tiny model
    radixserve bench one-batch --batch-sizes 1 2 --input-len 16 --decode-steps 2 --output /tmp/x.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List

import torch

from radixserve.bench.datasets import FIRST_ORDINARY_ID
from radixserve.bench.report import machine_info, markdown_table, write_json
from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode, ModelWorkerBatch
from radixserve.server_args import ServerArgs
from radixserve.utils import progress

DEFAULT_OUTPUT = "benchmarks/one_batch.json"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("one-batch", help="prefill / decode step latency of one static batch, vs transformers")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=8, help="timed decode steps (median reported)")
    p.add_argument("--skip-hf", action="store_true", help="do not run the transformers baseline")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="JSON results path ('' to skip)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's default, one per core)")
    p.add_argument("--mem-bandwidth-gbs", type=float, default=None,
                   help="memory bandwidth in GB/s for MBU (default: measured by a device copy)")
    ServerArgs.add_cli_args(p)
    p.set_defaults(func=run)
    return p


# ---- ours ------------------------------------------------------------------------------------
class _OursDriver:
    """Owns a ModelRunner; runs one static batch with explicit req_to_token rows and KV slots."""

    def __init__(self, server_args: ServerArgs):
        from radixserve.mem_cache.chunk_cache import ChunkCache
        from radixserve.mem_cache.kv_ledger import KVLedger
        from radixserve.model_executor.model_runner import ModelRunner
        from radixserve.models.model_config import ModelConfig
        from radixserve.tiny_model import get_tiny_model_path

        path = server_args.model_path or get_tiny_model_path()
        self.runner = ModelRunner(ModelConfig.from_pretrained(path), server_args)
        self.model_path = path
        r2t, alloc = self.runner.req_to_token_pool, self.runner.token_to_kv_pool_allocator
        self.ledger = KVLedger(r2t, alloc, ChunkCache(r2t, alloc))  # no prefix sharing here

    def reset(self) -> None:
        self.ledger.clear()

    def _alloc(self, n: int) -> torch.Tensor:
        try:
            return self.ledger.alloc_slots(n)
        except RuntimeError:
            raise ValueError(f"KV pool too small for this benchmark: raise --max-total-tokens (need {n} more slots)") from None

    def _alloc_rows(self, bs: int) -> List[int]:
        rows = self.ledger.alloc_rows(bs)  # (reset() frees them with the slots)
        if rows is None:
            raise ValueError(f"Too few request rows for batch size {bs}: raise --max-running-requests")
        return rows

    def prefill(self, rows: List[int], prompts: torch.Tensor) -> torch.Tensor:
        """One EXTEND forward of all prompts ([B, L]); returns the greedy next tokens [B]."""
        bs, n = prompts.shape
        locs = self._alloc(bs * n)
        self.ledger.write_spans(rows, [0] * bs, [n] * bs, locs)
        batch = ModelWorkerBatch(
            forward_mode=ForwardMode.EXTEND,
            input_ids=prompts.reshape(-1),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens=torch.full((bs,), n, dtype=torch.int64),
            out_cache_loc=locs,
            seq_lens_cpu=[n] * bs,
            extend_seq_lens=[n] * bs,
            extend_prefix_lens=[0] * bs,
        )
        out = self.runner.forward(ForwardBatch.init_new(batch, self.runner))
        return torch.argmax(out.next_token_logits, dim=-1)

    def decode(self, rows: List[int], seq_lens_before: List[int], tokens: torch.Tensor) -> torch.Tensor:
        """One DECODE forward: token i goes at position seq_lens_before[i] of request i."""
        bs = len(rows)
        loc = self._alloc(bs)
        row_t = torch.tensor(rows, dtype=torch.int64)
        self.ledger.write_at(row_t, torch.tensor(seq_lens_before), loc)
        seq_lens = [s + 1 for s in seq_lens_before]
        batch = ModelWorkerBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=tokens,
            req_pool_indices=row_t,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=loc,
            seq_lens_cpu=seq_lens,
        )
        out = self.runner.forward(ForwardBatch.init_new(batch, self.runner))
        return torch.argmax(out.next_token_logits, dim=-1)

    # The timed protocol (see _measure): warm_up, then prefill, then step() per decode step.
    def warm_up(self, prompts: torch.Tensor) -> None:
        """One prefill + one decode step of this shape, then an empty pool again."""
        bs, n = prompts.shape
        self.reset()
        rows = self._alloc_rows(bs)
        self.decode(rows, [n] * bs, self.prefill(rows, prompts))
        self.reset()

    def start(self, prompts: torch.Tensor) -> float:
        """The timed prefill; then one untimed decode step. Returns the prefill seconds."""
        bs, n = prompts.shape
        self._rows = self._alloc_rows(bs)
        t0 = time.perf_counter()
        tokens = self.prefill(self._rows, prompts)
        _sync(tokens)
        elapsed = time.perf_counter() - t0
        self._tokens = self.decode(self._rows, [n] * bs, tokens)
        self._seq = n + 1
        return elapsed

    def step(self) -> float:
        t0 = time.perf_counter()
        self._tokens = self.decode(self._rows, [self._seq] * len(self._rows), self._tokens)
        _sync(self._tokens)
        elapsed = time.perf_counter() - t0
        self._seq += 1
        return elapsed

    def finish(self) -> None:
        self.reset()


# ---- transformers ------------------------------------------------------------------------------
class _HFDriver:
    def __init__(self, model_path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
        self.device = device

    @torch.inference_mode()
    def _prefill(self, prompts: torch.Tensor):
        from transformers import DynamicCache

        cache = DynamicCache()
        out = self.model(input_ids=prompts, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.past_key_values, torch.argmax(out.logits[:, -1], dim=-1)

    @torch.inference_mode()
    def _decode(self, cache, tokens: torch.Tensor):
        out = self.model(input_ids=tokens[:, None], past_key_values=cache, use_cache=True)
        return out.past_key_values, torch.argmax(out.logits[:, -1], dim=-1)

    def warm_up(self, prompts: torch.Tensor) -> None:
        cache, tokens = self._prefill(prompts.to(self.device))
        self._decode(cache, tokens)

    def start(self, prompts: torch.Tensor) -> float:
        prompts = prompts.to(self.device)
        t0 = time.perf_counter()
        cache, tokens = self._prefill(prompts)
        _sync(tokens)
        elapsed = time.perf_counter() - t0
        self._cache, self._tokens = self._decode(cache, tokens)  # first decode step: not timed
        return elapsed

    def step(self) -> float:
        t0 = time.perf_counter()
        self._cache, self._tokens = self._decode(self._cache, self._tokens)
        _sync(self._tokens)
        return time.perf_counter() - t0

    def finish(self) -> None:
        self._cache = self._tokens = None


def _sync(t: torch.Tensor) -> None:
    """Timings must include the device work, not only its launch."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


class _BareLinearDriver:
    """The floor a decode step is compared with: the model's linear layers alone (every
    projection of every layer, and the LM head), as a bare loop of torch's F.linear on weights
    of the same shapes and dtype (one copy per layer, so they stream from memory as the model's
    do), on bs rows of activations."""

    def __init__(self, runner: Any):
        from radixserve.layers.linear import LinearBase

        model = runner.model
        shapes = [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, LinearBase)]
        lm_head = getattr(model, "lm_head", None)
        if lm_head is not None:
            shapes.append(tuple(lm_head.weight.shape))
        opts = dict(dtype=runner.dtype, device=runner.device)
        self.weights = [torch.randn(n, k, **opts) * k**-0.5 for n, k in shapes]
        self.device = runner.device
        self.xs: Dict[int, torch.Tensor] = {}

    def warm_up(self, prompts: torch.Tensor) -> None:
        bs = prompts.shape[0]
        self.xs = {k: torch.randn(bs, k, dtype=self.weights[0].dtype, device=self.device)
                   for k in {w.shape[1] for w in self.weights}}
        self.step()

    def start(self, prompts: torch.Tensor) -> float:
        return 0.0  # no prefill

    @torch.inference_mode()
    def step(self) -> float:
        t0 = time.perf_counter()
        for w in self.weights:
            torch.nn.functional.linear(self.xs[w.shape[1]], w)
        _sync(w)
        return time.perf_counter() - t0

    def finish(self) -> None:
        pass


# ---- model-bandwidth utilization ---------------------------------------------------------------
def weight_bytes_read_per_step(model: torch.nn.Module) -> int:
    """Bytes of the weights one decode step reads: every parameter once (shared ones once),
    except an input embedding that is not also the LM head (only bs rows of it are read); a
    weight packed for the CPU GEMM (a module's weight_packed) is read in its packed form."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    lm_head = getattr(model, "lm_head", None)
    skip = set()
    if embed is not None and (lm_head is None or lm_head.weight is not embed.weight):
        skip.add(id(embed.weight))
    if lm_head is not None and getattr(lm_head, "weight_packed", None) is not None:
        skip.add(id(lm_head.weight))  # the LM head reads its packed copy
    params = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    packed = sum(m.weight_packed.data.numel() * m.weight_packed.data.element_size() for m in model.modules()
                 if getattr(m, "weight_packed", None) is not None)
    return params + packed


def kv_bytes_read_per_step(runner: Any, batch_size: int, context_len: float) -> float:
    """K and V of `context_len` tokens of each request, in every layer (this rank's heads)."""
    pool = runner.token_to_kv_pool
    k = pool.get_key_buffer(0)
    per_token = 2 * pool.layer_num * k.shape[1] * k.shape[2] * k.element_size()
    return batch_size * context_len * per_token


def measure_mem_bandwidth_gbs(device: str, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best-of-`repeats` device-to-device copy bandwidth, counting the read and the write."""
    if device == "cpu":
        nbytes = min(nbytes, 256 << 20)  # larger than the caches, cheap to allocate
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(dst)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def add_mbu(row: Dict[str, Any], runner: Any, input_len: int, decode_steps: int, bandwidth_gbs: float) -> None:
    """bytes read per decode step, the rate it implies and MBU, into `row` (ours only)."""
    bs = row["batch_size"]
    # Timed steps run at contexts input_len+2 .. input_len+1+decode_steps (one untimed step first).
    context = input_len + 1 + (decode_steps + 1) / 2
    weights = weight_bytes_read_per_step(runner.model)
    kv = kv_bytes_read_per_step(runner, bs, context)
    step_s = row["ours"]["decode_ms_per_step"] / 1e3
    achieved = (weights + kv) / step_s / 1e9
    row["ours"].update(weight_bytes=weights, kv_bytes_per_step=kv, decode_gb_s=achieved,
                       mem_bandwidth_gbs=bandwidth_gbs, mbu=achieved / bandwidth_gbs)


def _measure(drivers: Dict[str, Any], prompts: torch.Tensor, decode_steps: int) -> Dict[str, Dict[str, float]]:
    """Run the systems side by side: warm-ups, then the prefills, then their decode steps
    alternating (ours, HF, ours, HF...), so a burst of load from another process on this
    shared machine hits both rather than one of them."""
    bs, n = prompts.shape
    for d in drivers.values():
        d.warm_up(prompts)
    prefill_s = {name: d.start(prompts) for name, d in drivers.items()}
    step_s: Dict[str, List[float]] = {name: [] for name in drivers}
    step_cpu_s: Dict[str, List[float]] = {name: [] for name in drivers}
    for _ in range(decode_steps):
        for name, d in drivers.items():
            c0 = time.process_time()
            step_s[name].append(d.step())
            step_cpu_s[name].append(time.process_time() - c0)
    for d in drivers.values():
        d.finish()
    return {name: _summary(bs, n, prefill_s[name], step_s[name], step_cpu_s[name]) for name in drivers}


def _summary(bs: int, input_len: int, prefill_s: float, step_s: List[float], step_cpu_s: List[float]) -> Dict[str, float]:
    step = statistics.median(step_s)
    return {
        # CPU seconds of the step (all threads of this process): with --num-threads 1 it
        # measures the work and hardly moves when other processes load the machine.
        "decode_cpu_ms_per_step": statistics.median(step_cpu_s) * 1e3,
        "prefill_ms": prefill_s * 1e3,
        "prefill_tok_s": bs * input_len / prefill_s if prefill_s else None,
        "decode_ms_per_step": step * 1e3,
        "decode_ms_per_step_min": min(step_s) * 1e3,
        "decode_tok_s": bs / step,
    }


# ---- command -----------------------------------------------------------------------------------
def _bench_server_args(args: argparse.Namespace) -> ServerArgs:
    server_args = ServerArgs.from_cli_args(args)
    max_bs = max(args.batch_sizes)
    # Only what the largest batch needs (prompt + warm-up step + timed steps), not the 2 GiB default.
    need = max_bs * (args.input_len + args.decode_steps + 2) + 64
    changes: Dict[str, Any] = {}
    if server_args.max_total_tokens is None:
        changes["max_total_tokens"] = need
    if server_args.max_running_requests is None:
        changes["max_running_requests"] = max_bs
    if server_args.page_size != 1:
        raise ValueError("bench one-batch allocates single slots: run it with --page-size 1")
    return server_args.replace(**changes) if changes else server_args


def run(args: argparse.Namespace) -> int:
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if min(args.batch_sizes) < 1 or args.input_len < 1 or args.decode_steps < 1:
        raise ValueError("--batch-sizes, --input-len and --decode-steps must be >= 1")
    server_args = _bench_server_args(args)
    ours = _OursDriver(server_args)
    if args.input_len + args.decode_steps + 2 > ours.runner.context_len:
        raise ValueError(f"--input-len + --decode-steps exceeds the model's context ({ours.runner.context_len})")
    hf = None if args.skip_hf else _HFDriver(ours.model_path, ours.runner.dtype, ours.runner.device)  # same weights, dtype, device
    linear = _BareLinearDriver(ours.runner)
    bandwidth = args.mem_bandwidth_gbs or measure_mem_bandwidth_gbs(ours.runner.device)
    vocab = ours.runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(server_args.seed)

    results: List[Dict[str, Any]] = []
    for bs in progress(args.batch_sizes, desc="bench one-batch", unit="batch size"):  # a bar on a terminal only
        prompts = torch.randint(FIRST_ORDINARY_ID, vocab, (bs, args.input_len), generator=gen, dtype=torch.int64)
        drivers: Dict[str, Any] = {"ours": ours, "linear": linear} if hf is None else {"ours": ours, "hf": hf, "linear": linear}
        row: Dict[str, Any] = {"batch_size": bs, **_measure(drivers, prompts, args.decode_steps)}
        row["linear_ms"] = row.pop("linear")["decode_ms_per_step"]
        row["decode_over_linear"] = row["ours"]["decode_ms_per_step"] / row["linear_ms"]
        add_mbu(row, ours.runner, args.input_len, args.decode_steps, bandwidth)
        if hf is not None:
            row["prefill_ratio"] = row["ours"]["prefill_ms"] / row["hf"]["prefill_ms"]
            row["decode_ratio"] = row["ours"]["decode_ms_per_step"] / row["hf"]["decode_ms_per_step"]
            row["decode_cpu_ratio"] = row["ours"]["decode_cpu_ms_per_step"] / row["hf"]["decode_cpu_ms_per_step"]
        results.append(row)
        print(f"batch {bs}: ours decode {row['ours']['decode_ms_per_step']:.2f} ms/step (MBU {row['ours']['mbu']:.0%}, "
              f"{row['decode_over_linear']:.2f}x the bare linear layers' {row['linear_ms']:.2f} ms)"
              + (f", HF {row['hf']['decode_ms_per_step']:.2f} ms/step" if 'hf' in row else ""), flush=True)

    table = format_table(results)
    print(table)
    report = {
        "benchmark": "one_batch",
        "model_path": server_args.model_path or "tiny (embedded)",
        "dtype": str(ours.runner.dtype).replace("torch.", ""),
        "device": ours.runner.device,
        "input_len": args.input_len,
        "decode_steps": args.decode_steps,
        "batch_sizes": list(args.batch_sizes),
        "mem_bandwidth_gbs": bandwidth,
        "mem_bandwidth_source": "--mem-bandwidth-gbs" if args.mem_bandwidth_gbs else "measured (device copy)",
        **machine_info(),
        "notes": "decode_ms_per_step is the median over decode_steps steps after one untimed step; "
        "decode_ratio = ours / HF (lower is better, goal at batch 64: <= 1.3); decode_cpu_ratio is the same "
        "with CPU time per step (robust to other processes' load with --num-threads 1)",
        "results": results,
        "table": table,
    }
    if args.output:
        write_json(args.output, report)
        print(f"wrote {args.output}")
    return 0


def format_table(results: List[Dict[str, Any]]) -> str:
    has_hf = any("hf" in r for r in results)
    if has_hf:
        header = ["batch", "ours prefill ms", "HF prefill ms", "ours decode ms/step", "HF decode ms/step",
                  "decode ratio (ours/HF)", "decode tok/s ours / HF", "CPU-time ratio", "ours MBU",
                  "bare linear ms", "ours / linear"]
    else:
        header = ["batch", "ours prefill ms", "ours decode ms/step", "decode tok/s", "ours MBU", "bare linear ms",
                  "ours / linear"]
    lines = []
    for r in results:
        o = r["ours"]
        if has_hf:
            h = r.get("hf")
            lines.append([
                str(r["batch_size"]), f"{o['prefill_ms']:.1f}", f"{h['prefill_ms']:.1f}" if h else "-",
                f"{o['decode_ms_per_step']:.2f}", f"{h['decode_ms_per_step']:.2f}" if h else "-",
                f"{r['decode_ratio']:.2f}" if h else "-",
                f"{o['decode_tok_s']:.0f} / {h['decode_tok_s']:.0f}" if h else f"{o['decode_tok_s']:.0f} / -",
                f"{r['decode_cpu_ratio']:.2f}" if h else "-", _mbu_cell(o), *_linear_cells(r),
            ])
        else:
            lines.append([str(r["batch_size"]), f"{o['prefill_ms']:.1f}", f"{o['decode_ms_per_step']:.2f}",
                          f"{o['decode_tok_s']:.0f}", _mbu_cell(o), *_linear_cells(r)])
    return markdown_table(header, lines)


def _linear_cells(r: Dict[str, Any]) -> List[str]:
    if "linear_ms" not in r:
        return ["-", "-"]
    return [f"{r['linear_ms']:.2f}", f"{r['decode_over_linear']:.2f}"]


def _mbu_cell(o: Dict[str, Any]) -> str:
    return f"{o['mbu']:.1%}" if "mbu" in o else "-"
