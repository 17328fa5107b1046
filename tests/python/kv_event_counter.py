#!/usr/bin/env python3
"""An independent count of the KV blocks a real vLLM engine holds, from its own event stream.

`cargo xtask real-vllm` compares kvsight's sidecar with this: both subscribe to the same engine,
this one decodes with vLLM's own msgspec structs (`vllm.distributed.kv_events.KVEventBatch`)
through libzmq (pyzmq), keeps the set of GPU block hashes stored and not removed, and fills any
gap in the sequence from the engine's replay socket, as vLLM's documented subscriber does.

usage: kv_event_counter.py ENDPOINT REPLAY_ENDPOINT
Prints "ready" once subscribed, then answers each stdin line "count" with one JSON line
{"resident": N, "batches": M, "last_seq": S}, and each line "events" with one JSON line
{"events": [...]} holding every GPU event decoded since the previous "events", in order:
{"stored": [hash, ...], "parent": hash | null, "tokens": [...], "block_size": B,
"lora_name": str | null} / {"removed": [hash, ...]} / {"cleared": true}, hashes as strings
(ints in decimal, bytes in hex) since vLLM may publish either. Exits on EOF.
"""
import json
import sys
import threading

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def hash_text(h) -> str:
    return h.hex() if isinstance(h, (bytes, bytearray)) else str(h)


class Counter:
    def __init__(self) -> None:
        self.resident: set = set()
        self.batches = 0
        self.next_seq = None
        self.lock = threading.Lock()
        self.log: list = []
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

    def apply(self, seq: int, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        with self.lock:
            self.batches += 1
            self.next_seq = seq + 1
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    if ev.medium in (None, "GPU"):
                        self.resident.update(ev.block_hashes)
                        self.log.append(
                            {
                                "stored": [hash_text(h) for h in ev.block_hashes],
                                "parent": None
                                if ev.parent_block_hash is None
                                else hash_text(ev.parent_block_hash),
                                "tokens": list(ev.token_ids),
                                "block_size": ev.block_size,
                                "lora_name": getattr(ev, "lora_name", None),
                            }
                        )
                elif isinstance(ev, BlockRemoved):
                    if ev.medium in (None, "GPU"):
                        self.resident.difference_update(ev.block_hashes)
                        self.log.append({"removed": [hash_text(h) for h in ev.block_hashes]})
                elif isinstance(ev, AllBlocksCleared):
                    self.resident.clear()
                    self.log.append({"cleared": True})


def replay(ctx: zmq.Context, endpoint: str, start: int, counter: Counter) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(endpoint)
    # vLLM's ROUTER expects (identity, empty delimiter, start seq) and answers
    # (empty, topic, seq, payload) per batch, then (empty, empty, END_SEQ, empty).
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    while True:
        frames = sock.recv_multipart()
        seq_bytes, payload = frames[-2], frames[-1]
        if seq_bytes == END_SEQ:
            break
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if counter.next_seq is None or seq >= counter.next_seq:
            counter.apply(seq, payload)
    sock.close(linger=0)


def main() -> None:
    endpoint, replay_endpoint = sys.argv[1], sys.argv[2]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    counter = Counter()
    # Whatever the engine published before this subscription took effect comes from replay.
    replay(ctx, replay_endpoint, 0, counter)

    def listen() -> None:
        while True:
            _topic, seq_bytes, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if counter.next_seq is not None and seq > counter.next_seq:
                replay(ctx, replay_endpoint, counter.next_seq, counter)
            if counter.next_seq is None or seq >= counter.next_seq:
                counter.apply(seq, payload)

    threading.Thread(target=listen, daemon=True).start()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "events":
            with counter.lock:
                log, counter.log = counter.log, []
            print(json.dumps({"events": log}), flush=True)
        elif line.strip() == "count":
            with counter.lock:
                print(
                    json.dumps(
                        {
                            "resident": len(counter.resident),
                            "batches": counter.batches,
                            "last_seq": (counter.next_seq or 0) - 1,
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
