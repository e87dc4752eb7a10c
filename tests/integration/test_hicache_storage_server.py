"""HiCache's storage tier behind the HTTP server: a restarted server on the same `file`
directory answers a long prompt from storage (meta_info.cached_tokens_details.storage) with the
same greedy output; POST /clear_hicache_storage_backend (SGLang's route) empties the store, and
is a 400 with the reason on a server without a storage tier; a storage backend without
--enable-hierarchical-cache is refused at start with one line."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

from conftest import REPO, ServerProcess, greedy


def storage_server(path) -> ServerProcess:
    extra = json.dumps({"path": str(path), "prefetch_threshold": 16})
    return ServerProcess("--max-total-tokens", "2048", "--page-size", "4", "--enable-hierarchical-cache",
                         "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", extra,
                         "--hicache-storage-prefetch-policy", "wait_complete")


def test_a_restarted_server_answers_from_the_file_store_and_clear_empties_it(tmp_path):
    prompt = [random.Random(3).randrange(3, 8192) for _ in range(150)]
    body = {"input_ids": prompt, "sampling_params": greedy(8)}
    first = storage_server(tmp_path)
    with first.client() as c:
        before = c.post("/generate", json=body).json()
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("*.bin"))) < 150 // 4 and time.monotonic() < deadline:
        time.sleep(0.1)  # the backup thread writes beside the scheduler
    assert first.stop() == 0

    second = storage_server(tmp_path)
    try:
        with second.client() as c:
            after = c.post("/generate", json=body).json()
            assert after["output_ids"] == before["output_ids"]
            details = after["meta_info"]["cached_tokens_details"]
            assert details["storage"] >= 144 and after["meta_info"]["cached_tokens"] == sum(details.values())
            r = c.post("/clear_hicache_storage_backend")
            assert r.status_code == 200 and r.text == "Hierarchical cache storage backend cleared.\n"
            assert not list(tmp_path.glob("*.bin"))
    finally:
        assert second.stop() == 0


def test_clear_without_a_storage_tier_is_a_400_that_says_how_to_configure_one(http):
    r = http.post("/clear_hicache_storage_backend")
    assert r.status_code == 400 and "--hicache-storage-backend" in r.text


def test_a_storage_backend_without_hicache_is_refused_at_start():
    proc = subprocess.run([sys.executable, "-m", "radixserve.cli", "serve", "--hicache-storage-backend", "file"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--hicache-storage-backend needs --enable-hierarchical-cache" in proc.stderr + proc.stdout
