"""The fleet layer (extra ``fleet``: pyzmq, msgspec): several engine replicas behind a router.

* ``wire``: vLLM's KV event classes (``KVEventBatch``...) and prefixkv's heartbeat, msgpack.
* ``publisher``: a worker's KV events on a ZMQ PUB socket, a replay socket, heartbeats.
* ``subscriber``: a router's side: subscribes to workers, repairs sequence gaps, drops silent or
  restarted workers, keeps the index.
* ``index``: block hash -> workers (and tier) holding it, with predicted inserts.
* ``router``: ``round-robin``, ``least-load``, ``prefix``, ``kv-aware``, ``kv-aware+guard``.
* ``simulator`` and ``cli``: ``prefixkv fleet``, N real managers behind a router on a trace.
* ``worker``: a stand-alone worker process driven by JSON commands (the ZMQ tests use it).

Importing this package imports neither zmq nor msgspec; the modules that need them do.
"""
