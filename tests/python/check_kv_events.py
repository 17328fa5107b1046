#!/usr/bin/env python3
"""Checks the simulator's KV-event stream with the real stack vLLM uses: libzmq (pyzmq) sockets
and msgspec structs declared the way vLLM declares them.

Protocol with the Rust test that runs this (stdin lines, JSON first):
  1. read the spec: {"endpoint", "replay_endpoint", "topic", "layout": "map"|"array",
     "replay_layout": "new"|"old", "replay_start", "batches": [{"seq", "ts",
     "data_parallel_rank", "events": [{"type": ..., <field>: <value>, ...}]}]}
     Byte strings are given as {"hex": "..."}. For the map layout each event lists exactly the
     keys expected on the wire, in wire order; for the array layout, every 0.23 field.
  2. connect a SUB subscribed only to a topic that does not match; the test publishes batch 0;
  3. read the line "go"; subscribe to the real topic; the test publishes the other batches;
  4. the first live message must be seq 1 (batch 0 was filtered out), then every later batch in
     order; each payload must decode into vLLM's structs, equal the expectation, and re-encode
     with msgspec to the very same bytes;
  5. replay from replay_start with a DEALER: exactly the expected batches, then the end marker.
Exits 0 and prints "ok" on success; any failure raises.
"""

import json
import sys
from typing import Any

import msgspec
import zmq

END_SEQ = b"\xff" * 8
TIMEOUT_MS = 10_000


def vllm_structs(layout):
    """vLLM's event structs: 0.33's (events as maps) or 0.23's (events as tagged arrays)."""
    array_like = layout == "array"

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(
        msgspec.Struct, omit_defaults=True, gc=False, tag=True, array_like=array_like
    ):
        pass

    ExternalBlockHash = bytes | int

    if array_like:

        class BlockStored(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            parent_block_hash: ExternalBlockHash | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            extra_keys: list[tuple[Any, ...] | None] | None = None
            group_idx: int | None = None
            kv_cache_spec_kind: str | None = None
            kv_cache_spec_sliding_window: int | None = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            medium: str | None
            group_idx: int | None = None

    else:

        class BlockStored(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            parent_block_hash: ExternalBlockHash | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            extra_keys: list[tuple[Any, ...] | None] | None = None
            group_idx: int | None = None
            kv_cache_spec_kind: str | None = None
            kv_cache_spec_sliding_window: int | None = None
            locality: str | None = None
            ownership: str | None = None
            session_id: str | None = None
            lookahead_token_ids: list[list[int]] | None = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            medium: str | None
            group_idx: int | None = None
            locality: str | None = None
            ownership: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch


def plain(value):
    """Decoded values in the expectation's JSON shape."""
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, msgspec.Struct):
        out = {"type": type(value).__name__}
        out.update({f: plain(getattr(value, f)) for f in value.__struct_fields__})
        return out
    return value


def check_payload(payload, expected, layout, decoder):
    where = f"seq {expected['seq']}"
    batch = decoder.decode(payload)
    assert msgspec.msgpack.encode(batch) == payload, (
        f"{where}: msgspec re-encodes the decoded batch differently:\n"
        f"  ours   {payload.hex()}\n  msgspec {msgspec.msgpack.encode(batch).hex()}"
    )
    assert batch.ts == expected["ts"], f"{where}: ts {batch.ts} != {expected['ts']}"
    assert batch.data_parallel_rank == expected["data_parallel_rank"], where
    decoded = [plain(e) for e in batch.events]
    if layout == "map":
        # Raw maps: the keys on the wire, in order (omitted defaults must be absent).
        raw = msgspec.msgpack.decode(payload)
        raw_keys = [list(e.keys()) for e in raw[1]]
        want_keys = [list(e.keys()) for e in expected["events"]]
        assert raw_keys == want_keys, f"{where}: keys {raw_keys} != {want_keys}"
        for got, want in zip(decoded, expected["events"]):
            # Fields absent on the wire decode to their default, None.
            for field, value in got.items():
                assert value == want.get(field), (
                    f"{where}: {got['type']}.{field} = {value!r}, want {want.get(field)!r}"
                )
    else:
        raw = msgspec.msgpack.decode(payload)
        assert all(isinstance(e, list) for e in raw[1]), f"{where}: events not arrays"
        assert decoded == expected["events"], f"{where}: {decoded} != {expected['events']}"


def recv(sock):
    if not sock.poll(TIMEOUT_MS):
        raise TimeoutError(f"nothing received within {TIMEOUT_MS} ms")
    return sock.recv_multipart()


def main():
    spec = json.loads(sys.stdin.readline())
    layout, topic = spec["layout"], spec["topic"].encode()
    decoder = msgspec.msgpack.Decoder(vllm_structs(layout))
    batches = {b["seq"]: b for b in spec["batches"]}
    ctx = zmq.Context()

    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(spec["endpoint"])
    sub.setsockopt(zmq.SUBSCRIBE, b"no-such-topic")
    print("subscribed", flush=True)
    assert sys.stdin.readline().strip() == "go", "expected 'go' from the test"
    sub.setsockopt(zmq.SUBSCRIBE, topic)

    live = [s for s in sorted(batches) if s != 0]
    for want_seq in live:
        frames = recv(sub)
        assert len(frames) == 3, f"{len(frames)} frames on PUB"
        got_topic, seq_bytes, payload = frames
        assert got_topic == topic, f"topic {got_topic!r}"
        seq = int.from_bytes(seq_bytes, "big")
        assert len(seq_bytes) == 8 and seq == want_seq, (
            f"live seq {seq} (len {len(seq_bytes)}), want {want_seq}"
            + (" - batch 0 passed the non-matching subscription" if seq == 0 else "")
        )
        check_payload(payload, batches[seq], layout, decoder)

    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(spec["replay_endpoint"])
    start = spec["replay_start"]
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replayed = []
    for _ in range(len(batches) + 1):
        frames = recv(dealer)
        if spec["replay_layout"] == "new":
            assert len(frames) == 4 and frames[0] == b"", f"replay frames {frames!r}"
            _, got_topic, seq_bytes, payload = frames
            end_topic = b""
        else:
            assert len(frames) == 3 and frames[0] == b"", f"replay frames {frames!r}"
            _, seq_bytes, payload = frames
            got_topic = end_topic = None
        if seq_bytes == END_SEQ:
            assert payload == b"" and got_topic == end_topic, f"end marker {frames!r}"
            break
        assert got_topic is None or got_topic == topic, f"replay topic {got_topic!r}"
        seq = int.from_bytes(seq_bytes, "big")
        check_payload(payload, batches[seq], layout, decoder)
        replayed.append(seq)
    else:
        raise AssertionError("no end marker after every batch")
    want = [s for s in sorted(batches) if s >= start]
    assert replayed == want, f"replayed {replayed}, want {want}"

    sub.close()
    dealer.close()
    ctx.term()
    print("ok", flush=True)


if __name__ == "__main__":
    main()
