"""Damage one stored page the way a failing disk, a torn write or a misconfigured fleet would (issue 27's
fault tests), through the store's own naming of the page, from inside an engine process.

* ``flip``: one payload byte flipped (the value's last byte).
* ``truncate``: the value cut to half its length.
* ``foreign``: the value replaced by another fingerprint's (another model's) value of the same
  engine key, which that other store wrote.
"""

from __future__ import annotations

import os

from prefixkv.integrations.engine_store import EngineStore, engine_key_digest


def _disk_path(store: EngineStore, key: bytes) -> str:
    return store.store.layout.block_path(engine_key_digest(key))


def _redis(store: EngineStore, key: bytes):
    import redis

    client = redis.Redis.from_url(store.options.store)
    return client, store.store.keys.own_keys([engine_key_digest(key)])[0]


def read_value(store: EngineStore, key: bytes) -> bytes:
    if store.kind == "disk":
        with open(_disk_path(store, key), "rb") as f:
            return f.read()
    client, name = _redis(store, key)
    value = client.get(name)
    assert value is not None, "the page to damage is not stored"
    return value


def write_value(store: EngineStore, key: bytes, value: bytes) -> None:
    if store.kind == "disk":
        path = _disk_path(store, key)
        with open(path, "r+b") as f:
            f.write(value)
            f.truncate(len(value))
        return
    client, name = _redis(store, key)
    client.set(name, value)


def damage(store: EngineStore, key: bytes, how: str, other: EngineStore | None = None) -> None:
    value = read_value(store, key)
    if how == "flip":
        value = value[:-1] + bytes([value[-1] ^ 0x5A])
    elif how == "truncate":
        value = value[:len(value) // 2]
    elif how == "foreign":
        assert other is not None and other.fingerprint.hex != store.fingerprint.hex
        value = read_value(other, key)
    else:
        raise ValueError(f"unknown damage {how!r}")
    write_value(store, key, value)
    assert os.environ.get("PREFIXKV_NO_DAMAGE_CHECK") or read_value(store, key) == value
