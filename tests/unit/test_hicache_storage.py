"""HiCache's storage tier: the page hash chain, the file and mooncake backends (raw bytes round
trip, leading-key counts, clear, namespaces), the controller's threads (a prefetch never blocks,
the prefetch policies, a failing backend reads as misses with a log line), and the tier between
a HiRadixCache and storage (a second cache on the same store gets the first one's KV)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

import pytest
import torch

from radixserve.mem_cache.hiradix_cache import HiRadixCache
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.storage import (
    HiCacheStorage, HiCacheStorageController, PrefetchTimeout, create_storage_backend, page_hash_chain,
    storage_namespace,
)
from radixserve.mem_cache.storage.tier import HiCacheStorageTier

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mooncake_master import MooncakeMaster  # noqa: E402

LAYERS, HEADS, DIM, PAGE = 2, 2, 4, 4
PAGE_SHAPE = (2, LAYERS, PAGE, HEADS, DIM)


def pages(n: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(PAGE_SHAPE, generator=g).to(dtype) for _ in range(n)]


def hashes(n: int, seed: int = 0) -> List[str]:
    return page_hash_chain(list(range(seed, seed + n * PAGE)), PAGE)


# ---- page_hash_chain ---------------------------------------------------------------------------
def test_hash_chain_shares_the_leading_keys_of_a_shared_prefix_only():
    a = list(range(100, 120))
    b = a[:8] + [7] + a[9:]  # differs in the third page
    ha, hb = page_hash_chain(a, PAGE), page_hash_chain(b, PAGE)
    assert len(ha) == 5 and len(set(ha)) == 5
    assert ha[:2] == hb[:2] and all(x != y for x, y in zip(ha[2:], hb[2:]))  # chained: later pages differ too
    assert page_hash_chain(a + [1, 2], PAGE) == ha  # a partial page has no key
    assert page_hash_chain(a[8:], PAGE, prior_hash=ha[1]) == ha[2:]  # continues a chain


def test_hash_chain_extra_key_separates_adapters():
    ids = list(range(16))
    base, lora_a, lora_b = (page_hash_chain(ids, PAGE, k) for k in (None, "a", "b"))
    assert not set(base) & set(lora_a) and not set(lora_a) & set(lora_b)
    assert page_hash_chain(ids, PAGE, "a") == lora_a


def test_namespace_names_model_dtype_and_rank_and_stays_a_short_file_name():
    ns = storage_namespace("/models/Llama 3/8B", torch.bfloat16, 1, 2)
    assert ns == "models-Llama-3-8B-bfloat16-tp1of2"
    assert storage_namespace("/m", torch.float16, 0, 1) != storage_namespace("/m", torch.bfloat16, 0, 1)
    long = storage_namespace("/x" * 300, torch.float16, 0, 1)
    assert len(long) < 120 and long != storage_namespace("/y" + "/x" * 299, torch.float16, 0, 1)


# ---- the backends --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def master():
    m = MooncakeMaster()
    yield m
    for client in _CLIENTS.values():  # while the master lives: a client of a dead one closes slowly
        client.close()
    _CLIENTS.clear()
    m.kill()


# Mooncake clients live to the end of the run: closing one costs seconds (it unmounts its segment)
_CLIENTS: dict = {}


@pytest.fixture(params=["file", "mooncake"])
def make_backend(request, tmp_path):
    """make_backend(namespace) -> a backend. For mooncake each call of a test is another client
    (another server) of one master; the tests use keys of their own."""
    calls = []

    def make(namespace: str = "ns", dtype: torch.dtype = torch.bfloat16) -> HiCacheStorage:
        calls.append(1)
        if request.param == "file":
            return create_storage_backend("file", {"path": str(tmp_path / "store")}, PAGE_SHAPE, dtype, namespace)
        ident = (namespace, dtype, len(calls))
        if ident not in _CLIENTS:
            extra = request.getfixturevalue("master").extra_config()
            _CLIENTS[ident] = create_storage_backend("mooncake", extra, PAGE_SHAPE, dtype, namespace)
        return _CLIENTS[ident]

    return make


def test_pages_round_trip_byte_for_byte(make_backend):
    dtype = torch.bfloat16  # no numpy dtype: stored as its raw bytes
    writer, reader = make_backend(dtype=dtype), make_backend(dtype=dtype)  # mooncake: two clients
    keys, data = hashes(3), pages(3, dtype)
    assert writer.set(keys, data)
    got = reader.get(keys)
    assert all(g is not None and g.dtype == dtype and g.shape == PAGE_SHAPE for g in got)
    assert all(torch.equal(g.view(torch.uint8), d.view(torch.uint8)) for g, d in zip(got, data))
    assert writer.set(keys, data)  # present keys: stored again is no failure


def test_exists_counts_the_leading_present_keys(make_backend):
    b = make_backend()
    keys = hashes(4, seed=10)
    assert b.exists(keys) == 0
    assert b.set([keys[0], keys[1], keys[3]], pages(3))
    assert b.exists(keys) == 2
    assert b.get(keys)[2] is None
    assert b.exists(keys[3:]) == 1


def test_namespaces_never_see_each_other_and_clear_removes_only_its_own(make_backend):
    a, other = make_backend("model-a"), make_backend("model-b")
    keys = hashes(2, seed=20)
    assert a.set(keys, pages(2))
    assert other.exists(keys) == 0 and other.get(keys) == [None, None]
    assert other.set(keys, pages(2, seed=1))
    time.sleep(0.1)  # past the test master's lease on pages just read
    assert a.clear()
    assert a.exists(keys) == 0 and a.get(keys)[0] is None
    assert other.exists(keys) == 2  # the other namespace is untouched


def test_file_backend_writes_whole_files_and_a_torn_one_is_a_miss(tmp_path):
    b = create_storage_backend("file", {"path": str(tmp_path)}, PAGE_SHAPE, torch.bfloat16, "ns")
    keys = hashes(2, seed=30)
    assert b.set(keys, pages(2))
    assert sorted(os.listdir(tmp_path)) == sorted(f"ns-{k}.bin" for k in keys)  # no temporary file left
    with open(tmp_path / f"ns-{keys[1]}.bin", "r+b") as f:
        f.truncate(10)
    assert b.get(keys)[1] is None and b.get(keys)[0] is not None


def test_file_backend_directory_comes_from_sglangs_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "env"))
    b = create_storage_backend("file", {}, PAGE_SHAPE, torch.bfloat16, "ns")
    assert b.set(hashes(1), pages(1)) and len(os.listdir(tmp_path / "env")) == 1


def test_mooncake_config_comes_from_extra_config_then_sglangs_environment(monkeypatch):
    from radixserve.mem_cache.storage.mooncake import MooncakeStoreConfig

    monkeypatch.setenv("MOONCAKE_MASTER", "env-host:1")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "2gb")
    c = MooncakeStoreConfig.from_extra_config({"local_hostname": "10.0.0.2", "local_buffer_size": "8mb"})
    assert (c.master_server_address, c.global_segment_size, c.local_hostname) == ("env-host:1", 2 << 30, "10.0.0.2")
    assert c.local_buffer_size == 8 << 20 and c.protocol == "tcp" and c.metadata_server == "P2PHANDSHAKE"
    assert MooncakeStoreConfig.from_extra_config({"master_server_address": "m:2"}).master_server_address == "m:2"


def test_mooncake_refuses_to_start_without_a_reachable_master(monkeypatch):
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    with pytest.raises(ValueError, match="master_server_address"):
        create_storage_backend("mooncake", {}, PAGE_SHAPE, torch.bfloat16, "ns")
    with pytest.raises(RuntimeError, match="not reachable"):
        create_storage_backend("mooncake", {"master_server_address": "127.0.0.1:1"}, PAGE_SHAPE, torch.bfloat16, "ns")


KILLED_MASTER_SCENARIO = """
import json, logging, os, sys, time, torch
sys.path.insert(0, sys.argv[1])
from mooncake_master import MooncakeMaster
from radixserve.mem_cache.storage import create_storage_backend, page_hash_chain
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
shape = (2, 2, 4, 2, 4)
m = MooncakeMaster()
writer, reader = (create_storage_backend("mooncake", m.extra_config(), shape, torch.bfloat16, "ns") for _ in "ab")
keys, more = page_hash_chain(list(range(8)), 4), page_hash_chain(list(range(100, 108)), 4)
out = {"before": (writer.set(keys, [torch.ones(shape, dtype=torch.bfloat16)] * 2), reader.exists(keys))}
m.kill()
start = time.monotonic()
out["after"] = (reader.exists(keys), [p is None for p in reader.get(keys)], writer.set(more, [torch.ones(shape, dtype=torch.bfloat16)] * 2))
out["seconds"] = time.monotonic() - start
class Counting:  # counts what is asked of the store from here on
    def __init__(self, inner):
        self.inner, self.calls = inner, 0
    def __getattr__(self, name):
        self.calls += 1
        return getattr(self.inner, name)
reader.store, writer.store = Counting(reader.store), Counting(writer.store)
out["again"] = (reader.exists(keys), writer.set(more, [torch.ones(shape, dtype=torch.bfloat16)] * 2))
out["again_store_calls"] = reader.store.calls + writer.store.calls
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)  # a client of a dead master takes a minute to close; the scenario is over
"""


def test_a_killed_mooncake_master_reads_as_misses_and_drops_writes():
    """In a process of its own: clients of a dead master are slow to shut down."""
    import json
    import subprocess

    proc = subprocess.run([sys.executable, "-c", KILLED_MASTER_SCENARIO, str(Path(__file__).resolve().parents[1])],
                          capture_output=True, text=True, timeout=120)
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert result, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = json.loads(result[0][len("RESULT "):])
    assert out["before"] == [True, 2]
    assert out["after"] == [0, [True, True], False]  # misses and a dropped write, no exception
    assert out["seconds"] < 60  # Mooncake's own timeouts bound each call: no hang
    # the failed store is not asked again at once (an event, not a time: nothing reaches the client)
    assert out["again"] == [0, False] and out["again_store_calls"] == 0, out
    logs = [line for line in proc.stdout.splitlines() if line.startswith("LOG ")]
    assert any("a miss" in line for line in logs) and any("put failed" in line for line in logs), logs


class DeadClient:
    """A MooncakeDistributedStore whose master is gone: every call fails (and is counted)."""

    def __init__(self) -> None:
        self.calls = 0

    def batch_is_exist(self, keys):
        self.calls += 1
        return [-900] * len(keys)

    def put(self, key, value):
        self.calls += 1
        return -900


def test_mooncake_store_backs_off_after_a_failure_then_asks_again(monkeypatch, caplog):
    from radixserve.mem_cache.storage import mooncake

    monkeypatch.setattr(mooncake, "RETRY_AFTER_S", 0.2)
    client = DeadClient()
    store = mooncake.MooncakeStore(PAGE_SHAPE, torch.bfloat16, "ns", {"master_server_address": "h:1"}, store=client)
    with caplog.at_level(logging.WARNING):
        assert store.exists(hashes(2)) == 0 and client.calls == 1
        assert store.exists(hashes(2)) == 0 and not store.set(hashes(1), pages(1)) and store.get(hashes(1)) == [None]
        assert client.calls == 1  # backing off: misses and dropped writes without a call
    assert caplog.text.count("is_exist failed (error -900); a miss") == 1  # one line for the failure
    time.sleep(0.25)
    assert not store.set(hashes(1), pages(1)) and client.calls == 2  # tried again


# ---- the controller ------------------------------------------------------------------------------
class FakeStorage(HiCacheStorage):
    """In memory; get() can be held back (gate) or made to raise."""

    def __init__(self) -> None:
        super().__init__(PAGE_SHAPE, torch.bfloat16, "fake")
        self.data = {}
        self.gate = threading.Event()
        self.gate.set()
        self.fail: Optional[Exception] = None
        self.cleared = 0

    def exists(self, keys):
        if self.fail:
            raise self.fail
        n = 0
        while n < len(keys) and keys[n] in self.data:
            n += 1
        return n

    def get(self, keys):
        self.gate.wait(10)
        if self.fail:
            raise self.fail
        return [self.data.get(k) for k in keys]

    def set(self, keys, pages):
        if self.fail:
            raise self.fail
        self.data.update(zip(keys, pages))
        return True

    def clear(self):
        self.data.clear()
        self.cleared += 1
        return True


def controller(policy: str = "best_effort", **kw) -> "tuple[HiCacheStorageController, FakeStorage]":
    store = FakeStorage()
    return HiCacheStorageController(store, policy, PAGE, io_batch_pages=2, **kw), store


def test_prefetch_returns_at_once_and_pages_arrive_in_order():
    c, store = controller()
    keys, data = hashes(5, seed=50), pages(5)
    assert c.backup(keys, data) and c.wait_backups(5)
    assert c.counters.pages_written == 5
    store.gate.clear()  # the store "hangs"
    op = c.prefetch(keys + hashes(1, seed=99))  # the last key is not stored
    assert not op.done and op.pages_ready() == 0  # prefetch() did not wait for it
    assert c.can_take(op)  # best_effort: go on with nothing
    store.gate.set()
    assert op.wait(5) and op.hit_pages == 5
    assert [torch.equal(a, b) for a, b in zip(op.take(), data)] == [True] * 5
    assert c.counters.pages_read == 5


def test_policies_decide_when_a_request_may_take_the_pages():
    for policy, takes_while_running in (("best_effort", True), ("wait_complete", False), ("timeout", False)):
        c, store = controller(policy, timeout=PrefetchTimeout(base=0.2, per_ki_token=0, max=1))
        c.backup(hashes(2), pages(2))
        c.wait_backups(5)
        store.gate.clear()
        op = c.prefetch(hashes(2))
        assert c.can_take(op) is takes_while_running, policy
        if policy == "timeout":
            time.sleep(0.25)
            assert c.can_take(op) and not op.done  # the bound passed: go on without it
        store.gate.set()
        op.wait(5)
        assert c.can_take(op) and op.pages_ready() == 2


def test_cancel_stops_a_prefetch_between_batches():
    c, store = controller()
    c.backup(hashes(6), pages(6))
    c.wait_backups(5)
    store.gate.clear()
    op = c.prefetch(hashes(6))
    time.sleep(0.05)
    op.cancel()
    store.gate.set()
    op.wait(5)
    assert op.pages_ready() == 2  # the batch in flight (2 pages), nothing after it


def test_a_failing_backend_reads_as_misses_with_a_log_line_and_the_threads_live_on(caplog):
    c, store = controller()
    store.fail = OSError("disk gone")
    with caplog.at_level(logging.WARNING):
        op = c.prefetch(hashes(3))
        assert op.wait(5) and op.pages_ready() == 0
        assert c.backup(hashes(3), pages(3)) and c.wait_backups(5)
    assert "prefetch failed (disk gone)" in caplog.text and "backup failed (disk gone)" in caplog.text
    assert c.counters.pages_failed == 3 and c.counters.pages_written == 0
    store.fail = None  # it recovers: the same threads serve again
    c.backup(hashes(3), pages(3))
    c.wait_backups(5)
    op = c.prefetch(hashes(3))
    assert op.wait(5) and op.pages_ready() == 3


def test_a_full_write_queue_drops_writes_and_clear_drops_queued_work():
    c, store = controller(max_queued_writes=1)
    store.fail = None
    with c._io_lock:  # the backup thread is stuck in a write
        c.backup(hashes(1, seed=1), pages(1))
        time.sleep(0.05)
        assert c.backup(hashes(1, seed=2), pages(1))  # queued
        assert not c.backup(hashes(1, seed=3), pages(1))  # the queue is full: dropped
    c.wait_backups(5)
    assert c.counters.pages_dropped == 1 and len(store.data) == 2
    assert c.clear() and store.cleared == 1 and not store.data


# ---- the tier between a HiRadixCache and storage -------------------------------------------------
def make_cache(tier: HiCacheStorageTier, device_tokens: int = 64, host_tokens: int = 64):
    kv = MHATokenToKVPool(device_tokens, PAGE, torch.float32, HEADS, DIM, LAYERS)
    alloc = TokenToKVPoolAllocator(device_tokens, PAGE)
    cache = HiRadixCache(ReqToTokenPool(4, 256), alloc, kv, host_tokens, PAGE, "write_through")
    cache.set_storage(tier)
    return cache, kv


def insert_computed(cache: HiRadixCache, kv: MHATokenToKVPool, key: List[int]) -> torch.Tensor:
    slots = cache.token_to_kv_pool_allocator.alloc(len(key))
    for buf in (*kv.k_buffer, *kv.v_buffer):
        buf[slots] = torch.randn(len(key), HEADS, DIM)
    cache.insert(key, slots)
    return kv_of(kv, slots)


def kv_of(kv: MHATokenToKVPool, slots: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.stack([k[slots] for k in kv.k_buffer]), torch.stack([v[slots] for v in kv.v_buffer])])


def tier_on(path: Path, policy: str = "wait_complete", namespace: str = "ns") -> HiCacheStorageTier:
    backend = create_storage_backend("file", {"path": str(path)}, (2, LAYERS, PAGE, HEADS, DIM), torch.float32, namespace)
    return HiCacheStorageTier(HiCacheStorageController(backend, policy, PAGE), PAGE, prefetch_threshold=PAGE)


def test_a_second_cache_on_the_same_store_loads_the_first_ones_kv(tmp_path):
    first = tier_on(tmp_path)
    cache_a, kv_a = make_cache(first)
    key = list(range(1, 25))  # 6 pages
    want = insert_computed(cache_a, kv_a, key)  # write_through: host copy, then storage
    assert first.controller.wait_backups(5) and first.controller.counters.pages_written == 6

    second = tier_on(tmp_path)  # a restarted server: empty pools, the same directory
    cache_b, kv_b = make_cache(second)
    cache_b.match_prefix(key + [99, 98])  # starts the prefetch; a match never waits for it
    assert next(iter(second.pending.values())).wait(5)  # (the scheduler holds the request meanwhile)
    match = cache_b.match_prefix(key + [99, 98])
    assert len(match.device_indices) == 0 and match.host_hit_length == 24
    slots, _ = cache_b.init_load_back(match.last_host_node, match.host_hit_length)
    assert torch.equal(kv_of(kv_b, slots), want)
    assert cache_b.loaded_storage_tokens == 24
    cache_b.check_other_tiers()

    other_adapter = tier_on(tmp_path)
    cache_c, _ = make_cache(other_adapter)
    assert cache_c.match_prefix(key, extra_key="lora-x").host_hit_length == 0  # other keys
    other_model = tier_on(tmp_path, namespace="other")
    cache_d, _ = make_cache(other_model)
    assert cache_d.match_prefix(key).host_hit_length == 0


def test_best_effort_takes_only_what_arrived_and_never_waits(tmp_path):
    first = tier_on(tmp_path)
    cache_a, kv_a = make_cache(first)
    key = list(range(1, 17))
    want = insert_computed(cache_a, kv_a, key)
    first.controller.wait_backups(5)

    second = tier_on(tmp_path, policy="best_effort")
    cache_b, kv_b = make_cache(second)
    assert cache_b.match_prefix(key).host_hit_length == 0  # the prefetch just began: recompute
    op = next(iter(second.pending.values()))
    assert op.wait(5)
    match = cache_b.match_prefix(key)  # a later match (the request's next look) takes the pages
    assert match.host_hit_length == 16
    slots, _ = cache_b.init_load_back(match.last_host_node, match.host_hit_length)
    assert torch.equal(kv_of(kv_b, slots), want)
    cache_b.check_other_tiers()


def test_a_prefetch_for_another_continuation_gives_only_the_pages_they_share(tmp_path):
    first = tier_on(tmp_path)
    cache_a, kv_a = make_cache(first)
    a = list(range(1, 13))  # 3 pages
    want = insert_computed(cache_a, kv_a, a)
    first.controller.wait_backups(5)

    second = tier_on(tmp_path, policy="best_effort")
    cache_b, kv_b = make_cache(second)
    cache_b.match_prefix(a)  # starts a prefetch of a's 3 pages
    assert next(iter(second.pending.values())).wait(5)
    b = a[:4] + [500, 501, 502, 503, 504, 505, 506, 507]  # a's first page, then other tokens
    match = cache_b.match_prefix(b)  # finds a's prefetch by the first page's key
    assert match.host_hit_length == 4  # the one page b shares with a, not a's other two
    slots, _ = cache_b.init_load_back(match.last_host_node, match.host_hit_length)
    assert torch.equal(kv_of(kv_b, slots), want[:, :, :4])
    cache_b.check_other_tiers()


# ---- the flags -------------------------------------------------------------------------------------
def test_storage_flags_parse_their_json_and_refuse_what_cannot_run():
    import argparse

    from radixserve.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args([
        "--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
        "--hicache-storage-backend-extra-config", '{"master_server_address": "h:5"}',
        "--hicache-storage-prefetch-policy", "timeout"]))
    assert args.hicache_storage_backend_extra_config == {"master_server_address": "h:5"}
    assert args.replace(hicache_storage_prefetch_policy="wait_complete").hicache_storage_backend_extra_config == {
        "master_server_address": "h:5"}
    assert ServerArgs().hicache_storage_backend is None  # no storage tier by default
    refused = [
        ({"hicache_storage_backend": "file"}, "needs --enable-hierarchical-cache"),
        ({"hicache_storage_backend": "s3"}, "must be one of file, mooncake"),
        ({"hicache_storage_backend": "file", "hicache_storage_prefetch_policy": "eager"}, "best_effort, wait_complete, timeout"),
        ({"hicache_storage_backend": "file", "hicache_storage_backend_extra_config": "{nope"}, "is not JSON"),
        ({"hicache_storage_backend": "file", "hicache_storage_backend_extra_config": "[1]"}, "must be a JSON object"),
        ({"hicache_storage_backend": "file", "tp_size": 2}, "--tp-size 1"),
    ]
    for kw, message in refused:
        kw = {"enable_hierarchical_cache": "needs" not in message, **kw}
        with pytest.raises(ValueError, match=message.replace("-", r"\-")):
            ServerArgs(**kw)
