"""A `mooncake_master` on free local ports for tests (the wheel mooncake-transfer-engine-non-cuda
ships the binary), and a Mooncake Store client config pointing at it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from typing import Any, Dict

from processes import free_port  # tests/ is on the path of whoever imports this module


class MooncakeMaster:
    def __init__(self, lease_ms: int = 50):
        binary = shutil.which("mooncake_master")
        if binary is None:
            raise RuntimeError("mooncake_master is not on PATH: pip install mooncake-transfer-engine-non-cuda")
        self.port = free_port()
        # a short lease: pages read a moment ago can be removed (clear) in the tests
        self.proc = subprocess.Popen(
            [binary, f"-rpc_port={self.port}", f"-metrics_port={free_port()}", f"-default_kv_lease_ttl={lease_ms}",
             "-enable_metric_reporting=false"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mooncake_master did not start (exit code {self.proc.poll()})")
                time.sleep(0.05)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def extra_config(self, **more: Any) -> Dict[str, Any]:
        return {"master_server_address": self.address, "local_hostname": "127.0.0.1",
                "global_segment_size": "64mb", "local_buffer_size": "16mb", **more}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
