"""KVManager, KVSender, KVReceiver (SGLang's names): the connection between a prefill server and
the decode servers it feeds, one request (a `bootstrap_room`) at a time.

    decode                                             prefill (ROUTER on its bootstrap port)
    KVReceiver.init(slots) --- KVPreallocInfo(room) --->  peers[room]: KVSender WaitingForInput
                                                          ... prefill runs ...
    KVPoll.Success  <-- KVTransferDone(room, token) ----  KVSender.send(slots): backend writes KV
    KVPoll.Failed   <--------- KVAbort(room) ---------->  either side gives up
    heartbeat: KVPing / KVPong while rooms are in flight (a dead prefill fails its rooms)

SGLang's bootstrap server is an HTTP service where every TP rank of a prefill server registers;
with one rank per server the bootstrap port itself is the handshake socket.

A thread owns every socket. The scheduler thread hands it commands through an inproc socket and
reads the per-room state it keeps in plain dicts (single writes, safe under the GIL), so a slow
peer or a large transfer never blocks a scheduling step.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import zmq

from radixserve.disaggregation.transfer import KVTransferBackend
from radixserve.disaggregation.utils import (
    DisaggregationMode, FirstToken, KVAbort, KVArgs, KVPing, KVPoll, KVPong, KVPreallocInfo, KVTransferDone,
    decode_message, encode_message, input_hash,
)

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0  # a prefill server silent this long has its rooms failed
POLL_MS = 100
_ids = itertools.count()


@dataclass
class _Prealloc:
    """Prefill side: what the decode side sent for a room."""

    identity: bytes
    info: KVPreallocInfo
    arrived: float


@dataclass
class _Inflight:
    """Decode side: a room whose slots were sent to a prefill server."""

    peer: Tuple[str, int]
    dst_slots: torch.Tensor


class KVManager:
    def __init__(self, mode: DisaggregationMode, backend: KVTransferBackend, host: str, bootstrap_port: int, timeout: float):
        self.mode = mode
        self.backend = backend
        self.kv_args: KVArgs = backend.kv_args()
        self.timeout = timeout
        # Room state, written by the thread, read by the scheduler.
        self.failed: Dict[int, str] = {}
        self.done: Dict[int, FirstToken] = {}
        self.peers: Dict[int, _Prealloc] = {}  # prefill: decode slots per room
        self.aborted: Dict[int, Tuple[str, float]] = {}  # prefill: rooms ended before their slots came
        self.sending: Dict[int, float] = {}  # prefill: rooms handed to the thread
        self.inflight: Dict[int, _Inflight] = {}  # decode: rooms waiting for their KV

        self.ctx = zmq.Context()
        self.cmd_addr = f"inproc://kv-manager-{next(_ids)}"
        self._cmd_push = self.ctx.socket(zmq.PUSH)
        self._cmd_push.bind(self.cmd_addr)
        self._cmd_lock = threading.Lock()
        self.router: Optional[zmq.Socket] = None
        if mode == DisaggregationMode.PREFILL:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises
            self.router.setsockopt(zmq.LINGER, 0)
            bind_host = "*" if host in ("0.0.0.0", "::", "") else host
            try:
                self.router.bind(f"tcp://{bind_host}:{bootstrap_port}")
            except zmq.ZMQError as e:
                raise RuntimeError(f"--disaggregation-bootstrap-port {bootstrap_port} on {host}: {e}") from None
        self.dealers: Dict[Tuple[str, int], zmq.Socket] = {}
        self.last_pong: Dict[Tuple[str, int], float] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kv-manager", daemon=True)
        self.thread.start()

    # ---- the scheduler's side -----------------------------------------------------------------
    def command(self, *cmd: Any) -> None:
        with self._cmd_lock:
            self._cmd_push.send_pyobj(cmd)  # inproc, in-process only

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2)
        self.backend.close()

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        cmd_pull = self.ctx.socket(zmq.PULL)
        cmd_pull.connect(self.cmd_addr)
        poller = zmq.Poller()
        poller.register(cmd_pull, zmq.POLLIN)
        if self.router is not None:
            poller.register(self.router, zmq.POLLIN)
        last_beat = 0.0
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(POLL_MS))
                if cmd_pull in events:
                    while True:
                        try:
                            cmd = cmd_pull.recv_pyobj(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_command(cmd, poller)
                for sock in events:
                    if sock is not cmd_pull:
                        self._drain_peer_socket(sock)
                if time.monotonic() - last_beat >= HEARTBEAT_INTERVAL_S:
                    last_beat = time.monotonic()
                    self._heartbeat()
            except Exception:  # a bug here must not end the transfers of every other request
                logger.exception("KV manager thread: unexpected error (continuing)")

    def _drain_peer_socket(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity = b""
            if sock is self.router:
                identity, frames = frames[0], frames[1:]
            try:
                msg = decode_message(frames)
            except ValueError as e:
                logger.warning("Dropped a message on the bootstrap connection: %s", e)
                continue
            if sock is self.router:
                self._on_decode_message(identity, msg)
            else:
                self._on_prefill_message(self._peer_of(sock), msg)

    def _send_to_decode(self, identity: bytes, msg: object) -> None:
        try:
            self.router.send_multipart([identity] + encode_message(msg))
        except zmq.ZMQError as e:
            logger.warning("Could not reach a decode server: %s", e)

    # ---- prefill side -------------------------------------------------------------------------
    def _on_decode_message(self, identity: bytes, msg: object) -> None:
        if isinstance(msg, KVPing):
            self._send_to_decode(identity, KVPong())
        elif isinstance(msg, KVPreallocInfo):
            if msg.kv_args.backend != self.kv_args.backend:
                self._send_to_decode(identity, KVAbort(msg.room, (
                    f"the prefill server uses --disaggregation-transfer-backend {self.kv_args.backend}, "
                    f"the decode server {msg.kv_args.backend}; use the same on both")))
                return
            if msg.kv_args.layout() != self.kv_args.layout():
                self._send_to_decode(identity, KVAbort(msg.room, (
                    f"the prefill and decode servers' KV caches differ: (layers, kv heads, head dim, dtype) "
                    f"{self.kv_args.layout()} vs {msg.kv_args.layout()}; serve the same model with the same --dtype")))
                return
            if msg.room in self.aborted:  # the request ended here before the decode side was ready
                self._send_to_decode(identity, KVAbort(msg.room, self.aborted.pop(msg.room)[0]))
                return
            self.peers[msg.room] = _Prealloc(identity, msg, time.monotonic())
        elif isinstance(msg, KVAbort):
            self.failed[msg.room] = msg.message
            self.peers.pop(msg.room, None)

    def _on_command(self, cmd: tuple, poller: zmq.Poller) -> None:
        kind, room = cmd[0], cmd[1]
        if kind == "send":
            self._transfer(room, *cmd[2:])
        elif kind == "abort" and self.mode == DisaggregationMode.PREFILL:
            peer = self.peers.pop(room, None)
            if peer is not None:
                self._send_to_decode(peer.identity, KVAbort(room, cmd[2]))
            else:
                self.aborted[room] = (cmd[2], time.monotonic())
        elif kind == "prealloc":
            self._send_prealloc(poller, room, *cmd[2:])
        elif kind == "abort":  # decode side: tell the prefill server, whether or not slots were sent
            self.inflight.pop(room, None)
            self._dealer(poller, cmd[3]).send_multipart(encode_message(KVAbort(room, cmd[2])))

    def _transfer(self, room: int, src_slots: torch.Tensor, input_ids_hash: int, first_token: FirstToken) -> None:
        peer = self.peers.pop(room, None)
        try:
            if peer is None:
                raise RuntimeError("the decode server's slots for this request are gone")
            if peer.info.input_hash != input_ids_hash or peer.info.input_len != len(src_slots):
                raise RuntimeError("the prefill and decode servers tokenized the prompt differently")
            dst = torch.tensor(peer.info.dst_slots, dtype=torch.int64)
            k, v = self.backend.write(peer.info.kv_args, src_slots, dst)
            self.router.send_multipart([peer.identity] + encode_message(KVTransferDone(room, first_token, k, v)))
            self.done[room] = first_token
        except Exception as e:
            message = f"KV transfer failed: {e}"
            logger.warning("Room %d: %s", room, message)
            self.failed[room] = message
            if peer is not None:
                self._send_to_decode(peer.identity, KVAbort(room, message))

    def _gc_stale_peers(self) -> None:
        """Slots a decode server reserved for a request this server never got: release them."""
        now = time.monotonic()
        for room, (_, at) in list(self.aborted.items()):
            if now - at > self.timeout:
                del self.aborted[room]
        for room, peer in list(self.peers.items()):
            if now - peer.arrived > self.timeout and room not in self.sending:
                del self.peers[room]
                self._send_to_decode(peer.identity, KVAbort(room, "the prefill server never received this request"))

    # ---- decode side --------------------------------------------------------------------------
    def _dealer(self, poller: zmq.Poller, peer: Tuple[str, int]) -> zmq.Socket:
        sock = self.dealers.get(peer)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{peer[0]}:{peer[1]}")
            poller.register(sock, zmq.POLLIN)
            self.dealers[peer] = sock
            self.last_pong[peer] = time.monotonic()
        return sock

    def _peer_of(self, sock: zmq.Socket) -> Tuple[str, int]:
        return next(p for p, s in self.dealers.items() if s is sock)

    def _send_prealloc(self, poller: zmq.Poller, room: int, peer: Tuple[str, int], info: KVPreallocInfo) -> None:
        if room in self.failed:
            return  # already given up while the command was queued
        sock = self._dealer(poller, peer)
        if not any(e.peer == peer for e in self.inflight.values()):
            self.last_pong[peer] = time.monotonic()  # the heartbeat clock starts with the first room
        self.inflight[room] = _Inflight(peer, torch.tensor(info.dst_slots, dtype=torch.int64))
        sock.send_multipart(encode_message(info))

    def _on_prefill_message(self, peer: Tuple[str, int], msg: object) -> None:
        self.last_pong[peer] = time.monotonic()
        if isinstance(msg, KVTransferDone):
            entry = self.inflight.pop(msg.room, None)
            if entry is None:
                return  # aborted meanwhile
            try:
                self.backend.receive(entry.dst_slots, msg.k, msg.v)
            except Exception as e:
                self.failed[msg.room] = f"storing the transferred KV failed: {e}"
                return
            self.done[msg.room] = msg.first_token
        elif isinstance(msg, KVAbort):
            if self.inflight.pop(msg.room, None) is not None:
                self.failed[msg.room] = msg.message

    def _heartbeat(self) -> None:
        if self.mode == DisaggregationMode.PREFILL:
            self._gc_stale_peers()
            return
        now = time.monotonic()
        waited_on = {e.peer for e in self.inflight.values()}
        for peer in waited_on:
            if now - self.last_pong[peer] > HEARTBEAT_TIMEOUT_S:
                message = f"the prefill server at {peer[0]}:{peer[1]} stopped answering (no heartbeat for {HEARTBEAT_TIMEOUT_S:.0f} s)"
                for room in [r for r, e in self.inflight.items() if e.peer == peer]:
                    self.inflight.pop(room, None)
                    self.failed[room] = message
            else:
                self.dealers[peer].send_multipart(encode_message(KVPing()))


class _KVConn:
    """One request's side of the connection: its room, and the end the thread recorded."""

    def __init__(self, mgr: KVManager, room: int):
        self.mgr, self.room = mgr, room

    def _ended(self) -> Optional[KVPoll]:
        if self.room in self.mgr.failed:
            return KVPoll.Failed
        return KVPoll.Success if self.room in self.mgr.done else None

    def failure(self) -> str:
        return self.mgr.failed.get(self.room, "")

    def clear(self) -> None:
        for d in (self.mgr.failed, self.mgr.done, self.mgr.sending):
            d.pop(self.room, None)


class KVSender(_KVConn):
    """Prefill side of one request (SGLang's KVSender)."""

    def poll(self) -> KVPoll:
        ended = self._ended()  # KVPoll.Failed is 0: compare with None, never `or`
        if ended is not None:
            return ended
        if self.room in self.mgr.sending:
            return KVPoll.Transferring
        return KVPoll.WaitingForInput if self.room in self.mgr.peers else KVPoll.Bootstrapping

    def send(self, src_slots: torch.Tensor, input_ids: List[int], first_token: FirstToken) -> None:
        self.mgr.sending[self.room] = time.monotonic()
        self.mgr.command("send", self.room, src_slots.to(torch.int64).cpu(), input_hash(input_ids), first_token)

    def abort(self, message: str) -> None:
        self.mgr.command("abort", self.room, message)


class KVReceiver(_KVConn):
    """Decode side of one request (SGLang's KVReceiver): created when the request arrives,
    `init` once its slots are preallocated."""

    def __init__(self, mgr: KVManager, bootstrap_host: str, bootstrap_port: int, room: int):
        super().__init__(mgr, room)
        self.peer = (bootstrap_host, int(bootstrap_port))
        self.started = False

    def poll(self) -> KVPoll:
        ended = self._ended()
        if ended is not None:
            return ended
        return KVPoll.Transferring if self.started else KVPoll.WaitingForInput

    def init(self, dst_slots: torch.Tensor, input_ids: List[int]) -> None:
        info = KVPreallocInfo(self.room, len(input_ids), input_hash(input_ids), dst_slots.tolist(), self.mgr.kv_args)
        self.started = True
        self.mgr.command("prealloc", self.room, self.peer, info)

    def first_token(self) -> FirstToken:
        return self.mgr.done[self.room]

    def abort(self, message: str) -> None:
        self.mgr.command("abort", self.room, message, self.peer)
