"""PD disaggregation's pieces in one process: the wire format, the KVManager handshake and
transfer with both backends (loopback), the refusals of mismatched servers, and the
scheduler's slot conservation check (--test-check-memory) catching a lost or double-held page."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from radixserve.disaggregation.conn import KVManager, KVReceiver, KVSender
from radixserve.disaggregation.transfer import create_transfer_backend
from radixserve.disaggregation.utils import (
    DisaggregationMode, FirstToken, KVAbort, KVArgs, KVPing, KVPoll, KVPreallocInfo, KVTransferDone,
    contiguous_runs, decode_message, encode_message,
)
from radixserve.mem_cache.base_prefix_cache import MemoryLeakError
from radixserve.mem_cache.memory_pool import MHATokenToKVPool

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from processes import free_port  # noqa: E402


def pool(fill: bool, head_dim: int = 4, dtype: torch.dtype = torch.bfloat16) -> MHATokenToKVPool:
    p = MHATokenToKVPool(64, 1, dtype, head_num=2, head_dim=head_dim, layer_num=3)
    if fill:
        for buf in p.k_buffer + p.v_buffer:
            buf.copy_(torch.randn(buf.shape))
    return p


def wait_state(conn, want: KVPoll, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while conn.poll() != want:
        assert time.monotonic() < deadline, f"{conn.poll()!r} != {want!r}"
        time.sleep(0.01)


def test_messages_round_trip_and_malformed_ones_are_refused():
    k = torch.randn(3, 5, 2, 4).bfloat16()
    msgs = [
        KVPreallocInfo(7, 3, 12345, [4, 5, 6], KVArgs(3, 2, 4, "torch.bfloat16", 16, "mooncake", "h:1", [1, 2], [3, 4])),
        KVTransferDone(7, FirstToken(42, -0.5, [-0.5, -1.0], [42, 7], cached_tokens=2), k, k + 1),
        KVAbort(7, "gone"), KVPing(),
    ]
    for msg in msgs:
        back = decode_message(encode_message(msg))
        assert type(back) is type(msg)
        for name, value in vars(msg).items():
            got = getattr(back, name)
            assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
    for frames in ([b"not json"], [b'{"type": "Exploit", "fields": {}}'], [b'{"type": "KVAbort", "fields": {"x": 1}}'],
                   [b'{"type": "KVTransferDone", "fields": {"room": 1, "first_token": null, "k": {"tensor": 5, "shape": [1], "dtype": "float32"}}}']):
        with pytest.raises(ValueError):
            decode_message(frames)


def test_contiguous_runs_split_where_either_side_jumps():
    src, dst = torch.tensor([5, 6, 7, 9, 10, 11]), torch.tensor([1, 2, 4, 5, 6, 9])
    assert contiguous_runs(src, dst) == ([5, 7, 9, 11], [1, 4, 5, 9], [2, 1, 2, 1])
    assert contiguous_runs(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64)) == ([], [], [])


def managers(backend_p: str, backend_d: str, decode_pool: MHATokenToKVPool):
    port = free_port()
    src_pool = pool(fill=True)
    p = KVManager(DisaggregationMode.PREFILL, create_transfer_backend(backend_p, src_pool, "127.0.0.1"), "127.0.0.1", port, 30)
    d = KVManager(DisaggregationMode.DECODE, create_transfer_backend(backend_d, decode_pool, "127.0.0.1"), "127.0.0.1", port, 30)
    return p, d, src_pool, port


@pytest.mark.parametrize("backend", ["fake", "mooncake"])
def test_the_kv_of_a_request_lands_in_the_preallocated_slots(backend):
    dst_pool = pool(fill=False)
    p, d, src_pool, port = managers(backend, backend, dst_pool)
    try:
        ids = list(range(100, 107))
        src = torch.tensor([3, 4, 5, 9, 10, 20, 21])
        dst = torch.tensor([40, 41, 42, 43, 7, 8, 30])
        sender, receiver = KVSender(p, 99), KVReceiver(d, "127.0.0.1", port, 99)
        assert sender.poll() == KVPoll.Bootstrapping and receiver.poll() == KVPoll.WaitingForInput
        receiver.init(dst, ids)
        wait_state(sender, KVPoll.WaitingForInput)  # the decode side's slots arrived
        sender.send(src, ids, FirstToken(11, -0.25, cached_tokens=3))
        wait_state(receiver, KVPoll.Success)
        wait_state(sender, KVPoll.Success)
        assert receiver.first_token() == FirstToken(11, -0.25, cached_tokens=3)
        for a, b in zip(src_pool.k_buffer + src_pool.v_buffer, dst_pool.k_buffer + dst_pool.v_buffer):
            assert torch.equal(a[src], b[dst])
            untouched = torch.ones(b.shape[0], dtype=torch.bool)
            untouched[dst] = False
            assert not b[untouched].any()  # nothing written elsewhere
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("decode_pool,backend_d,message", [
    (pool(fill=False, head_dim=8), "fake", "KV caches differ"),
    (pool(fill=False), "mooncake", "uses --disaggregation-transfer-backend fake"),
])
def test_mismatched_servers_fail_the_request_with_a_reason(decode_pool, backend_d, message):
    p, d, _, port = managers("fake", backend_d, decode_pool)
    try:
        receiver = KVReceiver(d, "127.0.0.1", port, 5)
        receiver.init(torch.arange(1, 4), [1, 2, 3])
        wait_state(receiver, KVPoll.Failed)
        assert message in receiver.failure()
    finally:
        p.close()
        d.close()


def test_a_prompt_tokenized_differently_fails_both_sides():
    p, d, _, port = managers("fake", "fake", pool(fill=False))
    try:
        sender, receiver = KVSender(p, 8), KVReceiver(d, "127.0.0.1", port, 8)
        receiver.init(torch.arange(1, 4), [1, 2, 3])
        wait_state(sender, KVPoll.WaitingForInput)
        sender.send(torch.arange(1, 4), [1, 2, 4], FirstToken(0))
        wait_state(sender, KVPoll.Failed)
        wait_state(receiver, KVPoll.Failed)
        assert "tokenized the prompt differently" in receiver.failure()
    finally:
        p.close()
        d.close()


def test_a_decode_abort_reaches_the_waiting_prefill_request():
    p, d, _, port = managers("fake", "fake", pool(fill=False))
    try:
        sender, receiver = KVSender(p, 9), KVReceiver(d, "127.0.0.1", port, 9)
        receiver.abort("client went away")  # still in the decode server's prealloc queue
        wait_state(sender, KVPoll.Failed)
        assert sender.failure() == "client went away"
    finally:
        p.close()
        d.close()


def test_slot_conservation_check_catches_a_lost_and_a_double_held_page():
    from radixserve.engine import Engine

    engine = Engine(max_total_tokens=512, test_check_memory=True)
    engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 4})
    sched = engine.scheduler
    sched.check_slot_conservation()  # holds after a normal run
    lost = sched.token_to_kv_pool_allocator.alloc(1)  # a page nobody owns
    with pytest.raises(MemoryLeakError, match="neither free nor held"):
        sched.check_slot_conservation()
    sched.token_to_kv_pool_allocator.free(lost)
    sched.check_slot_conservation()
    cached = sched.tree_cache.all_values_flatten()[:1]
    sched.token_to_kv_pool_allocator.is_free[cached] = True  # a cached page also marked free
    with pytest.raises(MemoryLeakError, match="both free and in use"):
        sched.check_slot_conservation()


def test_a_prefill_abort_reaches_a_decode_server_that_preallocates_later():
    p, d, _, port = managers("fake", "fake", pool(fill=False))
    try:
        KVSender(p, 10).abort("aborted on the prefill server")  # before the decode side is ready
        receiver = KVReceiver(d, "127.0.0.1", port, 10)
        time.sleep(0.3)
        receiver.init(torch.arange(1, 4), [1, 2, 3])
        wait_state(receiver, KVPoll.Failed)
        assert receiver.failure() == "aborted on the prefill server"
    finally:
        p.close()
        d.close()
