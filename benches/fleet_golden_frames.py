"""Record golden KV-event frames with vLLM's own classes and publisher (wire compatibility).

Run with the peers' vLLM venv (not prefixkv's: this script must not import prefixkv):

    bash ../shared/peers/setup_venvs.sh vllm          # builds $TMPDIR/prefixkv-peers/vllm-min
    $TMPDIR/prefixkv-peers/vllm-min/bin/python benches/fleet_golden_frames.py

It writes ``tests/data/vllm_kv_events.json``: sample ``KVEventBatch`` payloads encoded by
``vllm.distributed.kv_events`` (msgspec), and the multipart frames that vLLM's real
``ZmqEventPublisher`` sends on its PUB socket and answers on its replay (ROUTER) socket, caught
on 127.0.0.1. ``tests/fleet/test_fleet_wire.py`` decodes and re-encodes them with prefixkv's mirror
of those classes (``prefixkv.fleet.wire``) byte for byte, so CI checks wire compatibility
without vLLM installed.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import msgspec
import vllm
import zmq
from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                        ZmqEventPublisher)

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "vllm_kv_events.json"
TOPIC = "kv@worker-0"


def _describe(value):
    """A JSON view of a decoded value (bytes as {"hex": ...}), so tests compare meaning too."""
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, dict):
        return {k: _describe(v) for k, v in value.items()}
    return value


def sample_batches() -> dict[str, KVEventBatch]:
    """Batches covering every event type and the field shapes prefixkv produces."""
    h = [bytes([i]) * 16 for i in range(1, 5)]   # prefixkv's xxh3-128 digests: 16 bytes
    return {
        # A chain of two 4-token blocks from the root, on the device, no LoRA.
        "stored_root_chain": KVEventBatch(ts=1700000000.25, events=[
            BlockStored(block_hashes=[h[0], h[1]], parent_block_hash=None, token_ids=list(range(8)),
                        block_size=4, lora_id=None, medium="GPU", lora_name=None)], data_parallel_rank=0),
        # A continuation under a parent, a removal and a clear, in one batch.
        "stored_removed_cleared": KVEventBatch(ts=1700000001.5, events=[
            BlockStored(block_hashes=[h[2]], parent_block_hash=h[1], token_ids=[9, 10, 11, 12],
                        block_size=4, lora_id=None, medium="GPU", lora_name=None),
            BlockRemoved(block_hashes=[h[0], h[1]], medium="GPU"),
            AllBlocksCleared()], data_parallel_rank=0),
        # Integer hashes (vLLM's ExternalBlockHash is bytes | int; Mooncake traces use ints), a CPU
        # tier, a LoRA, extra keys per block and a data-parallel rank.
        "int_hashes_cpu_tier": KVEventBatch(ts=2.0, events=[
            BlockStored(block_hashes=[11, 12], parent_block_hash=10, token_ids=[1] * 32, block_size=16,
                        lora_id=3, medium="CPU", lora_name="adapter-a",
                        extra_keys=[("adapter-a", "tenant-1"), None]),
            BlockRemoved(block_hashes=[11], medium="CPU")], data_parallel_rank=1),
        "empty": KVEventBatch(ts=3.0, events=[], data_parallel_rank=0),
    }


def record_publisher_frames(batches: list[KVEventBatch]) -> dict:
    """What vLLM's ZmqEventPublisher really sends: live (topic, seq, payload) frames, then a
    replay from sequence 1 through its ROUTER socket, ending with its end marker."""
    ctx = zmq.Context.instance()
    # vLLM's publisher connects (rather than binds) to a non-wildcard endpoint: bind the SUB side
    # on a free loopback port and hand the publisher that address; its replay socket always binds.
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    replay_port = _free_port(ctx)
    pub = ZmqEventPublisher(0, endpoint=f"tcp://127.0.0.1:{port}",
                            replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic=TOPIC)
    time.sleep(2.0)   # PUB -> SUB connection settles (the slow-joiner rule; a busy 2-core machine is slow)
    for batch in batches:
        pub.publish(batch)
    live = []
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    for _ in batches:
        live.append([f.hex() for f in sub.recv_multipart()])
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.RCVTIMEO, 10_000)
    req.connect(f"tcp://127.0.0.1:{replay_port}")
    req.send_multipart([b"", (1).to_bytes(8, "big")])
    replay = []
    while True:
        frames = req.recv_multipart()
        replay.append([f.hex() for f in frames])
        if frames[2] == ZmqEventPublisher.END_SEQ:
            break
    pub.shutdown()
    sub.close(0)
    req.close(0)
    return {"topic": TOPIC, "live": live, "replay_request_start_seq": 1, "replay": replay}


def _free_port(ctx) -> int:
    import socket

    with socket.socket() as probe:   # a plain socket closes at once; a ZMQ one lingers in its I/O thread
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> int:
    batches = sample_batches()
    payloads = {}
    for name, batch in batches.items():
        data = msgspec.msgpack.encode(batch)
        payloads[name] = {"hex": data.hex(), "decoded": _describe(msgspec.msgpack.decode(data))}
    frames = record_publisher_frames(list(batches.values()))
    doc = {"vllm_version": vllm.__version__, "msgspec_version": msgspec.__version__,
           "pyzmq_version": zmq.__version__, "python": sys.version.split()[0],
           "source": "vllm.distributed.kv_events (KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared, "
                     "ZmqEventPublisher)",
           "payloads": payloads, "publisher": frames}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT}: {len(payloads)} payloads, {len(frames['live'])} live and "
          f"{len(frames['replay'])} replay frames from vLLM {vllm.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
