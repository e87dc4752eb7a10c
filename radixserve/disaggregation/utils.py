"""Names shared by both sides of PD disaggregation (SGLang's DisaggregationMode and KVPoll) and
the messages the two servers exchange over their bootstrap connection."""

from __future__ import annotations

import dataclasses
import json
import socket
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import List, Optional, Tuple

import torch


class DisaggregationMode(str, Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class KVPoll(IntEnum):
    """A request's transfer state, as KVSender.poll / KVReceiver.poll report it (SGLang's)."""

    Failed = 0
    Bootstrapping = 1  # prefill: waiting for the decode side's preallocated slots
    WaitingForInput = 2  # prefill: slots known, prefill may run; decode: slots may be preallocated
    Transferring = 3
    Success = 4


@dataclass
class KVArgs:
    """One server's KV pool as the other side needs it: the layout (which must match) and, for
    Mooncake, the engine's session id and the address of every layer's K and V buffer."""

    layer_num: int
    head_num: int
    head_dim: int
    dtype: str
    slot_bytes: int  # bytes of one token's K (or V) in one layer
    backend: str = "fake"  # --disaggregation-transfer-backend (both sides must agree)
    session_id: str = ""
    k_ptrs: List[int] = field(default_factory=list)
    v_ptrs: List[int] = field(default_factory=list)

    def layout(self) -> Tuple[int, int, int, str]:
        return (self.layer_num, self.head_num, self.head_dim, self.dtype)


@dataclass
class FirstToken:
    """The token the prefill server sampled, sent with the KV (the decode side appends it)."""

    token_id: int
    logprob: Optional[float] = None
    top_logprobs_val: Optional[List[float]] = None
    top_logprobs_idx: Optional[List[int]] = None
    cached_tokens: int = 0  # prompt tokens the prefill server found in its prefix cache


# ---- messages: decode -> prefill --------------------------------------------------------------
@dataclass
class KVPreallocInfo:
    """The decode side has slots for `room`'s prompt: write its KV there."""

    room: int
    input_len: int
    input_hash: int  # both sides must have the same prompt tokens
    dst_slots: List[int]
    kv_args: KVArgs


@dataclass
class KVPing:
    """Liveness probe of a prefill server the decode side waits on."""


# ---- messages: prefill -> decode --------------------------------------------------------------
@dataclass
class KVTransferDone:
    room: int
    first_token: FirstToken
    # The fake backend's payload: K and V of every layer, [layer, tokens, heads, dim].
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None


@dataclass
class KVPong:
    pass


# ---- either way ----------------------------------------------------------------------------
@dataclass
class KVAbort:
    """The request of `room` failed or was aborted on the sender's side."""

    room: int
    message: str


def input_hash(token_ids: List[int]) -> int:
    return hash(tuple(token_ids))


def contiguous_runs(src: torch.Tensor, dst: torch.Tensor) -> Tuple[List[int], List[int], List[int]]:
    """Split a slot-to-slot copy into runs that are contiguous on both sides (one transfer
    each): (src starts, dst starts, lengths)."""
    if src.numel() == 0:
        return [], [], []
    breaks = ((src[1:] - src[:-1] != 1) | (dst[1:] - dst[:-1] != 1)).nonzero().flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    ends = torch.cat([breaks, torch.tensor([src.numel()])])
    return src[starts].tolist(), dst[starts].tolist(), (ends - starts).tolist()


def local_ip(host: str) -> str:
    """An address of this machine the peer can reach: `host` unless it is a wildcard, else the
    interface the default route leaves by, else loopback."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; this only picks a route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


# ---- wire format: JSON for the fields, raw frames for tensors (never pickle from the network) ----
_MESSAGES = {cls.__name__: cls for cls in (KVPreallocInfo, KVPing, KVTransferDone, KVPong, KVAbort)}
_NESTED = {"kv_args": KVArgs, "first_token": FirstToken}


def encode_message(msg: object) -> List[bytes]:
    fields_: dict = {}
    frames: List[bytes] = []
    for f in dataclasses.fields(msg):  # type: ignore[arg-type]
        value = getattr(msg, f.name)
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            fields_[f.name] = {"tensor": len(frames) + 1, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            frames.append(t.view(-1).view(torch.uint8).numpy().tobytes())
        elif dataclasses.is_dataclass(value):
            fields_[f.name] = dataclasses.asdict(value)
        else:
            fields_[f.name] = value
    return [json.dumps({"type": type(msg).__name__, "fields": fields_}).encode()] + frames


def decode_message(frames: List[bytes]) -> object:
    """The message of `frames`; raises ValueError on anything malformed."""
    try:
        head = json.loads(frames[0])
        cls = _MESSAGES[head["type"]]
        kwargs = {}
        for name, value in head["fields"].items():
            if isinstance(value, dict) and "tensor" in value:
                dtype = getattr(torch, value["dtype"])
                raw = torch.frombuffer(bytearray(frames[value["tensor"]]), dtype=torch.uint8)
                kwargs[name] = raw.view(dtype).reshape(value["shape"])
            elif name in _NESTED and value is not None:
                kwargs[name] = _NESTED[name](**value)
            else:
                kwargs[name] = value
        return cls(**kwargs)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise ValueError(f"malformed disaggregation message: {e}") from None
