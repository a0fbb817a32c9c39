"""prefixkv's mirror of vLLM's KV event wire format against frames vLLM made itself.

``tests/data/vllm_kv_events.json`` was written by ``benches/fleet_golden_frames.py`` with
vLLM 0.33.0's own classes and ``ZmqEventPublisher``; no vLLM is needed here.
"""

from __future__ import annotations

import json
import pathlib

import pytest

msgspec = pytest.importorskip("msgspec")

from prefixkv import KVCacheManager  # noqa: E402
from prefixkv.fleet import wire  # noqa: E402

GOLDEN = json.loads((pathlib.Path(__file__).resolve().parents[1] / "data" / "vllm_kv_events.json").read_text())


def _plain(value):
    """Decoded msgpack with bytes as {"hex": ...}, as the golden file describes values."""
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("name", sorted(GOLDEN["payloads"]))
def test_vllm_payloads_decode_and_reencode_byte_for_byte(name):
    payload = bytes.fromhex(GOLDEN["payloads"][name]["hex"])
    batch = wire.decode_batch(payload)
    assert isinstance(batch, wire.KVEventBatch)
    assert wire.encode(batch) == payload
    assert _plain(msgspec.msgpack.decode(wire.encode(batch))) == GOLDEN["payloads"][name]["decoded"]


def test_golden_payload_fields_are_read_as_vllm_meant_them():
    batch = wire.decode_batch(bytes.fromhex(GOLDEN["payloads"]["stored_removed_cleared"]["hex"]))
    stored, removed, cleared = batch.events
    assert isinstance(stored, wire.BlockStored) and stored.parent_block_hash == bytes([2]) * 16
    assert stored.token_ids == [9, 10, 11, 12] and stored.block_size == 4 and stored.medium == "GPU"
    assert isinstance(removed, wire.BlockRemoved) and removed.block_hashes == [bytes([1]) * 16, bytes([2]) * 16]
    assert isinstance(cleared, wire.AllBlocksCleared)
    ints = wire.decode_batch(bytes.fromhex(GOLDEN["payloads"]["int_hashes_cpu_tier"]["hex"]))
    assert ints.data_parallel_rank == 1 and ints.events[0].block_hashes == [11, 12]
    assert ints.events[0].medium == "CPU" and ints.events[0].lora_name == "adapter-a"


def test_vllm_publisher_frames_have_the_framing_prefixkv_reads():
    pub = GOLDEN["publisher"]
    for seq, frames in enumerate(pub["live"]):
        topic, seq_frame, payload = (bytes.fromhex(f) for f in frames)
        assert topic == pub["topic"].encode() and wire.seq_from(seq_frame) == seq
        assert wire.encode(wire.decode_batch(payload)) == payload
    *replayed, end = [[bytes.fromhex(f) for f in frames] for frames in pub["replay"]]
    assert [wire.seq_from(f[2]) for f in replayed] == list(range(pub["replay_request_start_seq"], len(pub["live"])))
    assert all(f[0] == b"" for f in replayed)          # the DEALER side sees the empty delimiter first
    assert end[2] == wire.END_SEQ and wire.seq_from(end[2]) == -1 and end[3] == b""


def test_core_events_become_vllm_events_with_tokens_and_chains():
    mgr = KVCacheManager(16, 4, hash_seed=0, record_events=True)
    prompt = mgr.prompt(list(range(10)))
    mgr.admit("a", prompt)
    mgr.free("a")
    mgr.reset_prefix_cache()
    events = wire.to_wire(mgr.drain_events(), block_size=4, tokens=wire.block_tokens(prompt))
    stored, cleared = events
    assert stored.block_hashes == prompt.block_hashes() and stored.parent_block_hash is None
    assert stored.token_ids == list(range(8)) and stored.block_size == 4 and stored.medium == "GPU"
    assert isinstance(cleared, wire.AllBlocksCleared)
    batch = wire.KVEventBatch(ts=1.0, events=events, data_parallel_rank=0)
    assert wire.decode_batch(wire.encode(batch)) == batch


def test_garbage_is_a_wire_error():
    with pytest.raises(wire.WireError, match="not a KVEventBatch"):
        wire.decode_batch(b"\x01\x02")
    with pytest.raises(wire.WireError, match="8 bytes"):
        wire.seq_from(b"\x00")


def test_host_tier_events_keep_their_medium_on_the_wire():
    from prefixkv import KVCacheManager
    from prefixkv.fleet.wire import to_wire

    mgr = KVCacheManager(4, 4, hash_seed=0, num_host_blocks=8, host_cache=True, record_events=True)
    for seq, tokens in (("a", list(range(16))), ("b", list(range(100, 116)))):
        mgr.admit(seq, tokens, compute_last_token=False)
        mgr.free(seq)
    events = to_wire(mgr.drain_events(), block_size=4)
    stored: dict = {}
    for e in events:
        if type(e).__name__ == "BlockStored":
            stored.setdefault(e.medium, []).extend(e.block_hashes)
    removed = [h for e in events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    # a's four blocks: stored on the GPU, evicted by b (removed from the GPU), stored on the CPU
    assert len(stored["GPU"]) == 8 and len(stored["CPU"]) == 4
    assert sorted(stored["CPU"]) == sorted(removed) == sorted(stored["GPU"][:4])
    assert {e.medium for e in events if type(e).__name__ == "BlockRemoved"} == {"GPU"}


def test_stored_blocks_carry_their_token_ids_to_the_wire():
    from prefixkv import KVCacheManager
    from prefixkv.fleet.wire import to_wire

    mgr = KVCacheManager(8, 4, hash_seed=0, record_events=True)
    mgr.admit("a", list(range(10)))
    mgr.append("a", [10, 11])                      # the decode fills the third block
    core = mgr.drain_events()
    assert [e.token_ids for e in core] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    (stored,) = to_wire(core, block_size=4)        # one chain under one parent
    assert stored.token_ids == list(range(12)) and len(stored.block_hashes) == 3
