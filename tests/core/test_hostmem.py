"""``prefixkv.hostmem``: the memory a size check may count on is MemAvailable, capped by the
container's cgroup limit (v1 or v2) less its usage, reclaimable file cache aside."""

from __future__ import annotations

import pytest


def _fake_proc(tmp_path, monkeypatch, files: dict[str, str], available_kib=256 * 2**20):
    from prefixkv import hostmem

    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {2 * available_kib} kB\nMemAvailable: {available_kib} kB\n")
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.setattr(hostmem, "MEMINFO", str(meminfo))
    monkeypatch.setattr(hostmem, "CGROUP_ROOT", str(root))
    return hostmem


@pytest.mark.parametrize("files", [
    {"memory.max": f"{8 << 30}\n", "memory.current": f"{3 << 30}\n", "memory.stat": f"anon 1\ninactive_file {1 << 30}\n"},
    {"memory/memory.limit_in_bytes": f"{8 << 30}\n", "memory/memory.usage_in_bytes": f"{3 << 30}\n",
     "memory/memory.stat": f"cache 5\ntotal_inactive_file {1 << 30}\n"},
])
def test_hostmem_counts_a_containers_memory_limit(tmp_path, monkeypatch, files):
    """MemAvailable is the host's: in a container limited to 8 GiB on a 256 GiB host, a size
    needing 100 GiB passed the check and the OOM killer ended the process, which this module
    exists to prevent. The cgroup's limit less its usage (reclaimable file cache aside) caps it."""
    hostmem = _fake_proc(tmp_path, monkeypatch, files)
    assert hostmem.available_bytes() == (8 << 30) - (2 << 30)
    with pytest.raises(hostmem.TooLarge, match="; 6 GiB is available"):
        hostmem.require(100 << 30, "a cache")
    hostmem.require(4 << 30, "a cache")


@pytest.mark.parametrize("files", [{}, {"memory.max": "max\n", "memory.current": "1\n"},
                                   {"memory/memory.limit_in_bytes": "9223372036854771712\n",
                                    "memory/memory.usage_in_bytes": "5\n"}])
def test_hostmem_without_a_cgroup_limit_uses_memavailable(tmp_path, monkeypatch, files):
    hostmem = _fake_proc(tmp_path, monkeypatch, files, available_kib=1024)
    assert hostmem.available_bytes() == 1024 * 1024
