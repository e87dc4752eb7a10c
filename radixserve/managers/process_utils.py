"""What every child process of the served runtime does first (scheduler, detokenizer,
DataParallelController): set up its log lines, and exit when its launcher is gone."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from typing import Optional

from radixserve.server_args import ServerArgs


def configure_process_logging(server_args: ServerArgs, tag: str) -> None:
    logging.basicConfig(
        level=getattr(logging, server_args.log_level.upper(), logging.INFO),
        format=f"[%(asctime)s {tag}] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        force=True,
    )


def watch_parent(parent_pid: int, ipc_dir: Optional[str] = None, interval: float = 1.0) -> None:
    """Exit when the launching process is gone (killed with SIGKILL, say): never an orphan, and
    the socket directory the launcher could not remove goes too."""

    def loop() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent_pid:
                if ipc_dir:
                    shutil.rmtree(ipc_dir, ignore_errors=True)
                os._exit(1)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()
