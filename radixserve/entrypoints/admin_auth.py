"""Who may call the operations routes (issue 45): the ones that change or inspect the server
rather than generate (weight updates and reads, LoRA load/unload, memory release/resume, pause,
profiling, cache flushes, run-time settings).

- With --admin-api-key KEY they take `Authorization: Bearer KEY` and nothing else (401 otherwise;
  the generation key of --api-key does not open them).
- Without it they answer only on a loopback --host (127.0.0.1, ::1, localhost): a server bound to
  another address refuses them with a 403 that says how to enable them, so a server exposed to a
  network never hands its weights or its pause switch to whoever can reach it.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any, Callable, Dict, FrozenSet, Optional

from fastapi.responses import JSONResponse

from radixserve.entrypoints.openai_protocol import error_body

ADMIN_PATHS: FrozenSet[str] = frozenset({
    "/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
    "/update_weights_from_distributed", "/destroy_weights_update_group", "/get_weights_by_name",
    "/update_weight_version", "/load_lora_adapter", "/unload_lora_adapter",
    "/release_memory_occupation", "/resume_memory_occupation", "/pause_generation", "/continue_generation",
    "/start_profile", "/stop_profile", "/flush_cache", "/clear_hicache_storage_backend", "/set_internal_state",
    "/start_expert_distribution_record", "/stop_expert_distribution_record", "/dump_expert_distribution_record", "/eplb_rebalance",
    "/dashboard/state",  # the live view's data (http_dashboard.py); the page itself holds none
})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: not known to be local
        return False


class AdminKeyMiddleware:
    def __init__(self, app: Any, admin_api_key: Optional[str], host: str):
        self.app = app
        self.expected = f"Bearer {admin_api_key}".encode() if admin_api_key else None
        self.open_locally = is_loopback(host)

    async def __call__(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") not in ADMIN_PATHS or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        if self.expected is not None:
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                message = "Unauthorized: this route needs the admin key: send 'Authorization: Bearer <admin api key>'."
                return await JSONResponse(error_body(message, "AuthenticationError", 401), 401)(scope, receive, send)
        elif not self.open_locally:
            message = (f"Forbidden: {scope.get('path')} changes or inspects the server, and this server listens on a "
                       f"non-loopback address without an admin key; start it with --admin-api-key KEY and send "
                       f"'Authorization: Bearer KEY' (or bind --host 127.0.0.1).")
            return await JSONResponse(error_body(message, "PermissionDenied", 403), 403)(scope, receive, send)
        return await self.app(scope, receive, send)
