"""A real two-stage pipeline's cluster traffic, read off the loopback interface as tcpdump would (a
raw AF_PACKET socket): every connection that opens with the cluster handshake (the store's, the
ring's, the control links') carries no plaintext after it: no message frame, no message type name,
no store request, not the prompt's token ids the plans carry."""
from __future__ import annotations

import socket
import struct
import threading

import pytest

from stagewise import LLM, SamplingParams
from stagewise.cluster.auth import MAGIC

pytestmark = pytest.mark.slow
ETH_P_ALL, PACKET_OUTGOING, SO_RCVBUFFORCE = 0x0003, 4, 33
PROMPT = [877, 613, 419, 761, 523, 887, 641, 733, 829, 571]


class LoopbackCapture:
    """Every TCP payload on `lo`, per flow (src, sport, dst, dport), in arrival order."""

    def __init__(self):
        try:
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        except PermissionError:
            pytest.skip("reading the wire needs CAP_NET_RAW (CI runs as root)")
        self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.2)
        self.flows: dict[tuple, bytearray] = {}
        self.stopped = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped:
            try:
                frame, addr = self.sock.recvfrom(65600)
            except TimeoutError:
                continue
            if addr[2] != PACKET_OUTGOING:                   # each loopback packet is seen twice
                self._take(frame)

    def _take(self, frame: bytes) -> None:
        if len(frame) < 34 or frame[12:14] != b"\x08\x00" or frame[23] != 6:      # IPv4, TCP
            return
        ihl = (frame[14] & 0x0F) * 4
        total = struct.unpack("!H", frame[16:18])[0]
        tcp = 14 + ihl
        sport, dport = struct.unpack("!HH", frame[tcp:tcp + 4])
        payload = frame[tcp + (frame[tcp + 12] >> 4) * 4:14 + total]
        if payload:
            key = (frame[26:30], sport, frame[30:34], dport)
            self.flows.setdefault(key, bytearray()).extend(payload)

    def stop(self) -> dict[tuple, bytes]:
        self.stopped = True
        self.thread.join(5)
        self.sock.close()
        return {k: bytes(v) for k, v in self.flows.items()}


def test_a_pipeline_sends_nothing_readable(llama_dir):
    capture = LoopbackCapture()
    try:
        with LLM(model=str(llama_dir), pp_size=2) as llm:
            out = llm.generate(prompt_token_ids=[PROMPT], use_tqdm=False,
                               sampling_params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 8
    finally:
        flows = capture.stop()
    greeted = [k for k, data in flows.items() if data.startswith(MAGIC)]     # listener -> dialler
    cluster = {k: flows.get(k, b"") for g in greeted for k in (g, (g[2], g[3], g[0], g[1]))}
    # the store (2 stages dial it), the ring (3 links) and the control links (2), each a greeted connection
    assert len(greeted) >= 7, sorted(len(v) for v in flows.values())
    assert sum(map(len, cluster.values())) > 8 * 2 * 64 * 4           # the decode steps' activations crossed
    prompt_json = ",".join(map(str, PROMPT[:4])).encode()
    for key, data in cluster.items():
        for needle in (b"SWM1", b"PlanMsg", b"ResultMsg", b"Heartbeat", b"ReadyMsg", b"StageAlive", b'"set"',
                       b"/link", prompt_json):
            assert needle not in data, f"{needle!r} crossed the wire in the clear on port {key[1]} -> {key[3]}"
