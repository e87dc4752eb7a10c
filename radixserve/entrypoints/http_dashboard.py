"""The live view of the engine (issue 59): a page the server serves itself, and the one read-only
endpoint it polls about once a second.

    GET /dashboard                 the page (radixserve/assets/dashboard/: plain HTML, JS and CSS;
    GET /dashboard/assets/{name}   no build step, no CDN: it works offline)
    GET /dashboard/state           JSON: the scheduler's state per DP replica with its snapshot
                                   (queues, last batches, KV pool by owner, radix tree:
                                   managers/scheduler_dashboard.py) and the last minutes of
                                   per-second request buckets (managers/dashboard_history.py)

/dashboard/state is an operations route (admin_auth.ADMIN_PATHS): with --admin-api-key it takes that
key only (401 otherwise); without one it answers on a loopback --host only. The page and its files
hold no data, so they need no key (a browser cannot send one when it opens a page); the page asks
for the keys it needs and sends them itself. Its chat playground uses /v1/chat/completions.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any, Dict, FrozenSet, List

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from radixserve.managers.tokenizer_manager import RequestError, TokenizerManager

DASHBOARD_STATE_PATH = "/dashboard/state"
TIMELINE_SECONDS = 300  # the plots' window: the last five minutes
_ASSETS: Dict[str, str] = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
# The page and its files: served without a key (see the module's docstring)
DASHBOARD_PAGE_PATHS: FrozenSet[str] = frozenset({"/dashboard", *(f"/dashboard/assets/{n}" for n in _ASSETS)})


def _asset(name: str) -> bytes:
    return resources.files("radixserve").joinpath("assets", "dashboard", name).read_bytes()


async def dashboard_state(tm: TokenizerManager) -> Dict[str, Any]:
    st = await tm.get_internal_state(with_dashboard=True)
    replicas: List[Dict[str, Any]] = st.pop("dp_states", None) or [dict(st)]
    st.pop("dashboard", None)  # each replica's is in replicas
    await _decode_prefix_previews(tm, replicas)
    return {
        "time": time.time(),
        "model": tm.served_model_name,
        "context_len": tm.context_len,
        "dp_size": tm.server_args.dp_size,
        "server_status": tm.server_status.name,
        "num_pending_reqs": len(tm.rid_to_state),
        "scheduler": st,  # summed or averaged over replicas (dp_controller.merge)
        "replicas": replicas,
        "timeline": tm.timeline.since(TIMELINE_SECONDS),
    }


async def _decode_prefix_previews(tm: TokenizerManager, replicas: List[Dict[str, Any]]) -> None:
    """Each shared prefix gets `preview` and `preview_tail`: its first and last tokens as text (the
    tokenizer lives in this process)."""
    prefixes = [p for r in replicas for p in (r.get("dashboard") or {}).get("tree", {}).get("shared_prefixes", [])]
    if not prefixes:
        return
    ids = [p["head_ids"] for p in prefixes] + [p["tail_ids"] for p in prefixes]
    try:
        texts = await tm.detokenize(ids, False)
    except RequestError:  # no tokenizer (--skip-tokenizer-init): token ids only
        texts = [" ".join(map(str, x)) for x in ids]
    for p, head, tail in zip(prefixes, texts, texts[len(prefixes):]):
        p["preview"], p["preview_tail"] = head, tail


def add_dashboard_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard_page() -> HTMLResponse:
        """The live view: queues, batches, KV pool, radix tree, latency plots, a chat playground."""
        return HTMLResponse(_asset("index.html"))

    @app.get("/dashboard/assets/{name}", include_in_schema=False)
    async def dashboard_asset(name: str) -> Response:
        if name not in _ASSETS:
            raise RequestError(f"No dashboard asset {name!r}.", 404, "NotFoundError")
        return Response(_asset(name), media_type=_ASSETS[name])

    @app.get(DASHBOARD_STATE_PATH)
    async def dashboard_state_route() -> Dict[str, Any]:
        """What the page shows, now (an operations route: the admin key where one is set)."""
        return await dashboard_state(tm)
