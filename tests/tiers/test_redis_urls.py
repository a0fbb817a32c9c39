"""Redis URLs: what the block store refuses in one (a bad port, a database a cluster cannot have or
that is not a number, query options after a cluster's nodes) with RemoteTierError, and that a URL's
password never shows in an error, the store's own once it is closed included. No server needed."""

from __future__ import annotations

import numpy as np
import pytest

redis = pytest.importorskip("redis")

from prefixkv.tiers.fingerprint import Fingerprint, weights_digest  # noqa: E402
from prefixkv.tiers.redis_net import RemoteTierError  # noqa: E402
from prefixkv.tiers.redis_store import RedisBlockStore  # noqa: E402

FP = Fingerprint(weights_digest([("w", np.arange(8, dtype=np.float32))]), "float16", layers=2, kv_heads=2,
                 head_dim=8, block_size=4, hash_seed=7)


@pytest.mark.parametrize("url, words", [
    ("redis+cluster://127.0.0.1:99999", "out of range"), ("redis+cluster://127.0.0.1:abc", "integer"),
    ("redis+cluster://127.0.0.1:7000/3", "database 0"), ("redis://127.0.0.1:6379/x", "database"),
])
def test_unusable_urls_are_refused_with_remote_tier_error(url, words):
    """A cluster seed's bad port escaped as a plain ValueError from urllib; a database in a cluster URL
    (a cluster has only database 0) and a database that is not a number in a redis:// URL were
    ignored, so the store silently used database 0 (and clear() emptied database 0)."""
    with pytest.raises(RemoteTierError, match=words):
        RedisBlockStore(url, FP)


@pytest.mark.parametrize("url", ["redis+cluster://:hunter2@127.0.0.1:abc", "redis://:hunter2@127.0.0.1:6379/x",
                                 "redis+cluster://u:hunter2@127.0.0.1:7000/3"])
def test_an_unusable_urls_error_does_not_show_its_password(url):
    """The errors quoted the URL as given: a password went into terminals and logs."""
    with pytest.raises(RemoteTierError) as info:
        RedisBlockStore(url, FP)
    assert "hunter2" not in str(info.value) and "***" in str(info.value)


@pytest.mark.parametrize("url", ["redis+cluster://127.0.0.1:7000?password=hunter2",
                                 "redis+cluster://127.0.0.1:7000/0?ssl=true", "redis+cluster://127.0.0.1:7000/?x=1"])
def test_a_cluster_urls_query_options_are_refused_not_dropped(url):
    """A query after the nodes was read as part of the database ('database 0 only, got 0?ssl=true')
    or, with no database, dropped without a word (a password given there was never sent)."""
    with pytest.raises(RemoteTierError, match="query options") as info:
        RedisBlockStore(url, FP)
    assert "hunter2" not in str(info.value)


def test_a_closed_stores_error_masks_the_urls_password():
    """StoreClosed masks the store's URL's password, as every other error of the tier does
    (redis_net.masked_url)."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("redis")
    from redis_fixtures import free_port

    from prefixkv.tiers.fingerprint import Fingerprint, weights_digest
    from prefixkv.tiers.redis_store import RedisBlockStore, StoreClosed

    fp = Fingerprint(weights_digest([("w", np.arange(8, dtype=np.float32))]), "float16", layers=2, kv_heads=2,
                     head_dim=8, block_size=4, hash_seed=7)
    store = RedisBlockStore(f"redis://user:s3cret-pw@127.0.0.1:{free_port()}/0", fp)   # no round trip
    store.close(0.0)
    with pytest.raises(StoreClosed) as caught:
        store.probe([bytes(16)])
    assert "s3cret-pw" not in str(caught.value) and "127.0.0.1" in str(caught.value)
