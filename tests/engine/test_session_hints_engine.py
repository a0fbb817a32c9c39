"""Session hints from the engine, bench and HF: a finished request's blocks are released with its
session, its end reason (the caller's, else the engine's) and the clock; failures and sessionless
requests give none."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from prefixkv.engine import Engine, SchedulerConfig, TinyLlama, TinyLlamaConfig  # noqa: E402
from prefixkv.engine.metrics import SimulatedClock  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Recorder:
    """Wraps the engine's policy and keeps every hint it is given."""

    def __init__(self, policy):
        self.policy, self.hints = policy, []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def __len__(self):
        return len(self.policy)

    def __contains__(self, block):
        return block in self.policy

    def on_hint(self, hint):
        self.hints.append(hint)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TinyLlama(TinyLlamaConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                                     vocab_size=64))


def test_engine_releases_finished_requests_with_their_session_hint(model):
    engine = Engine.from_model(model, num_blocks=32, block_size=4, policy="session", clock=SimulatedClock(),
                               config=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4))
    recorder = Recorder(engine.manager.pool.policy)
    engine.manager.pool.policy = recorder
    engine.add_request([1, 2, 3, 4, 5], max_new_tokens=2, session="chat-1", end="tool_use")
    engine.add_request([1, 2, 3, 6, 7], max_new_tokens=3, session="chat-2")
    engine.add_request([9, 9, 9], max_new_tokens=1)                 # no session: no hint
    engine.run()
    by_session = {h.session: h for h in recorder.hints}
    assert set(by_session) == {"chat-1", "chat-2"}
    assert by_session["chat-1"].end == "tool_use" and by_session["chat-2"].end == "max_tokens"
    assert all(h.time is not None and h.time >= 0 for h in recorder.hints)
    engine.manager.check_invariants()


def test_bench_passes_the_traces_sessions_and_stop_reasons_to_the_engine():
    from prefixkv.bench.runner import prepare_trace
    from prefixkv.sim.workloads import builtin_trace

    requests = prepare_trace(builtin_trace("agent"))
    assert {r.end for r in requests} == {"tool_use", "end_turn"}
    assert all(r.session for r in requests)


def test_hf_cache_releases_rows_with_its_session_hint():
    transformers = pytest.importorskip("transformers")
    try:
        from prefixkv.integrations.hf import PrefixKVStore
    except ImportError as exc:
        pytest.skip(str(exc))
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    store = PrefixKVStore(model, num_blocks=32, block_size=4, hash_seed=0, policy="session")
    recorder = Recorder(store.manager.pool.policy)
    store.manager.pool.policy = recorder
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with store.cache(model, session="agent-7", end="end_turn") as cache:
        cache.prepare(ids)
        model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False)
    (hint,) = recorder.hints
    assert (hint.session, hint.end) == ("agent-7", "end_turn")
