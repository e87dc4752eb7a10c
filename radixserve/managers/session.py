"""Sessions (SGLang's open_session / session_params): a session continues a conversation from
a previous request's tokens, so the radix cache serves that prefix and the client sends only
the new turn."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from radixserve.protocol import CloseSessionReqInput, OpenSessionReqInput, SessionParams


# Finished requests a session remembers (a later turn may continue any of them).
MAX_REQS_PER_SESSION = 64


class SessionError(ValueError):
    """A session request that cannot be served (the front end answers 400)."""


@dataclass
class Session:
    session_id: str
    tokens: Dict[str, List[int]] = field(default_factory=dict)  # rid -> its input + output ids
    last_rid: Optional[str] = None
    last_used: float = field(default_factory=time.monotonic)


class SessionStore:
    def __init__(self, ttl: Optional[float] = None) -> None:
        self.sessions: Dict[str, Session] = {}
        self.ttl = ttl  # --session-timeout: a session unused this long is closed (None: never)

    def __len__(self) -> int:
        return len(self.sessions)

    def open(self, obj: OpenSessionReqInput, new_id: str) -> str:
        sid = obj.session_id or new_id
        if sid in self.sessions:
            raise SessionError(f"Session {sid!r} is already open.")
        self.sessions[sid] = Session(sid)
        return sid

    def expire(self, ttl: Optional[float] = None) -> None:
        """Close the sessions unused for `ttl` seconds (default: self.ttl, --session-timeout)."""
        ttl = self.ttl if ttl is None else ttl
        if ttl is None:
            return
        now = time.monotonic()
        for sid in [sid for sid, s in self.sessions.items() if now - s.last_used > ttl]:
            del self.sessions[sid]

    def close(self, obj: CloseSessionReqInput) -> None:
        self.expire()
        if self.sessions.pop(obj.session_id, None) is None:
            raise SessionError(f"Session {obj.session_id!r} does not exist.")

    def continue_prompt(self, params: Any, input_ids: List[int]) -> tuple:
        """The prompt of a request in a session: request `rid`'s tokens (default: the last
        request's), cut to `offset` tokens, then input_ids. Returns (ids, session id)."""
        try:
            sp = params if isinstance(params, SessionParams) else SessionParams(**dict(params))
        except (TypeError, ValueError) as e:
            raise SessionError(f"Bad session_params: {e}") from None
        self.expire()  # an expired session is closed, even if nothing opened one since
        session = self.sessions.get(sp.id)
        if session is None:
            raise SessionError(f"Session {sp.id!r} does not exist (open it with /open_session).")
        session.last_used = time.monotonic()
        context: List[int] = []
        prev = sp.rid or session.last_rid
        if prev is not None:
            if prev not in session.tokens:
                raise SessionError(f"Request {prev!r} is not a finished request of session {sp.id!r}.")
            context = session.tokens[prev]
            if sp.offset is not None and sp.offset >= 0:
                context = context[: sp.offset]
        return context + input_ids, sp.id

    def record(self, session_id: Optional[str], rid: str, tokens: List[int]) -> None:
        """A request of the session finished (not aborted): later turns may continue it."""
        session = self.sessions.get(session_id) if session_id else None
        if session is not None:
            if len(session.tokens) >= MAX_REQS_PER_SESSION:  # bounded memory: the oldest goes
                del session.tokens[next(iter(session.tokens))]
            session.tokens[rid] = tokens
            session.last_rid = rid
            session.last_used = time.monotonic()
