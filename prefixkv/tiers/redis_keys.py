"""Keys of blocks in a remote store, and the groups that share one Cluster slot.

Key of the block at position ``i`` of a chain (``chain[i]`` its chained hash)::

    <prefix>:v<format version>:<fingerprint hex>:{<tag>}:<chain[i] hex>

The fingerprint names everything that makes the bytes compatible, so a model,
dtype, layout, TP or seed change never reads old values. ``{tag}`` is a Redis
Cluster hash tag: blocks ``[g*G, (g+1)*G)`` of a chain share the tag of the
group's first block (the first 16 hex digits of its hash), hence one slot, one
node, one EXISTS/Lua round trip and one MGET; different prompts (and later
groups of one prompt) spread over the shards. ``G`` (``tag_blocks``) is 16
blocks, fewer where 16 values would pass about 8 MiB: a function of the
fingerprint alone, so every process that may read a value names it alike.
Because a chained hash fixes the whole prefix before it, a block's key is the
same from every prompt that contains it, and from every store configuration:
``max_group_blocks`` only caps the blocks one command names (``group``), and
``group_ranges`` cuts at tag-group boundaries too, so a command keeps to one slot.

Contract: ``keys`` needs the chain from block 0 up to ``stop`` (the tag of a
group comes from its first block even when a call starts mid-group).
"""

from __future__ import annotations

import re
from typing import Sequence

from ..errors import InvalidArgument
from .block_codec import FORMAT_VERSION, header_size
from ..checks import integer
from .fingerprint import Fingerprint

__all__ = ["KeySpace", "group_blocks", "check_prefix", "GROUP_MAX_BLOCKS", "GROUP_MAX_BYTES", "DEFAULT_PREFIX"]

GROUP_MAX_BLOCKS = 16
GROUP_MAX_BYTES = 8 * 2**20
DEFAULT_PREFIX = "pkv"
_PREFIX = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_TAG_HEX = 16
_HEX32 = "[0-9a-f]" * 32      # a fingerprint, in a SCAN pattern


def group_blocks(value_bytes: int, max_blocks: int = GROUP_MAX_BLOCKS, max_bytes: int = GROUP_MAX_BYTES) -> int:
    """Blocks per group: at most ``max_blocks`` and at most ``max_bytes`` of values (at least 1)."""
    value_bytes = integer("value_bytes", value_bytes, low=1)
    max_blocks = integer("max_blocks", max_blocks, low=1)
    return max(1, min(max_blocks, max_bytes // value_bytes))


def check_prefix(prefix: object, argument: str = "prefix") -> str:
    """A key prefix: it goes into SCAN patterns, so only characters that are not glob syntax."""
    if not isinstance(prefix, str) or not _PREFIX.match(prefix):
        raise InvalidArgument(argument, f"a key prefix is 1-64 of [A-Za-z0-9_.-] (it goes into SCAN patterns), "
                                        f"got {prefix!r}")
    return prefix


class KeySpace:
    """Key names for one fingerprint under one prefix."""

    __slots__ = ("prefix", "fingerprint", "group", "tag_blocks", "value_bytes", "_base")

    def __init__(self, fingerprint: Fingerprint, prefix: str = DEFAULT_PREFIX,
                 max_group_blocks: int = GROUP_MAX_BLOCKS) -> None:
        self.prefix = check_prefix(prefix)
        self.fingerprint = fingerprint
        # The largest value: header with content (block_size uint32 token ids; extra keys are small)
        # + payload. A group's budget is reckoned on it so a group never exceeds ~8 MiB.
        self.value_bytes = header_size(fingerprint, 4 * fingerprint.block_size) + fingerprint.block_bytes
        # The tag group is part of every key, so it may depend on nothing a replica sets for itself:
        # a max_group_blocks of its own would name every block past its first group differently.
        self.tag_blocks = group_blocks(self.value_bytes)
        self.group = min(self.tag_blocks, group_blocks(self.value_bytes, max_group_blocks))
        self._base = f"{prefix}:v{FORMAT_VERSION}:{fingerprint.hex}:".encode()

    def key(self, chain: Sequence[bytes], i: int) -> bytes:
        return self.keys(chain, i, i + 1)[0]

    def tag_start(self, i: int) -> int:
        """The block whose hash tags block ``i``'s key (the first of its tag group)."""
        return i - i % self.tag_blocks

    def check_chain(self, chain: Sequence[bytes], start: int, stop: int) -> None:
        """Refuse (``InvalidArgument``) a chain whose hashes ``keys(chain, start, stop)`` reads are not
        ``bytes``; a call checks this before it counts or sends anything."""
        if stop <= start:
            return
        for h in chain[self.tag_start(start):stop]:
            if not isinstance(h, bytes):
                raise InvalidArgument("chain", f"block hashes must be bytes (a token prompt's chained hashes), "
                                               f"got {type(h).__name__}")

    def keys(self, chain: Sequence[bytes], start: int, stop: int) -> list[bytes]:
        """Keys of blocks ``start .. stop-1``. Block hashes must be ``bytes``."""
        base, group = self._base, self.tag_blocks
        out = []
        tag = b""
        try:
            for i in range(start, stop):
                if i == start or i % group == 0:
                    tag = b"%s{%s}:" % (base, chain[i - i % group].hex()[:_TAG_HEX].encode())
                out.append(tag + chain[i].hex().encode())
        except (AttributeError, TypeError):
            self.check_chain(chain, start, stop)
            raise
        return out

    def own_keys(self, hashes: Sequence[bytes]) -> list[bytes]:
        """Keys of independent blocks named by their own hash (no chain): each is tagged by its own
        hash, so it has a slot of its own in a cluster. The shape of every other block key (the
        ``block_key_shape``), so ``tier stats`` and ``clear`` count and delete them alike."""
        base = self._base
        out = []
        for h in hashes:
            text = h.hex().encode()
            out.append(b"%s{%s}:%s" % (base, text[:_TAG_HEX], text))
        return out

    def group_ranges(self, start: int, stop: int) -> list[tuple[int, int]]:
        """``[a, b)`` ranges covering ``start .. stop-1``, cut at tag-group boundaries (one slot per
        range) and at most ``group`` blocks long."""
        out = []
        i, tag, group = start, self.tag_blocks, self.group
        while i < stop:
            end = min(stop, i - i % tag + tag, i + group)
            out.append((i, end))
            i = end
        return out

    @staticmethod
    def block_key_shape(prefix: str = DEFAULT_PREFIX, fingerprint_hex: str | None = None) -> "re.Pattern[bytes]":
        """The exact shape of a block key (``fullmatch`` it), for what ``pattern`` cannot say: SCAN's glob
        has no 'digits only' or 'hex only', so ``v[0-9]*`` also matches ``v2:sessions:...``."""
        check_prefix(prefix)
        version = rb"\d+" if fingerprint_hex is None else str(FORMAT_VERSION).encode()
        fingerprint = rb"[0-9a-f]{32}" if fingerprint_hex is None else KeySpace._fingerprint_hex(fingerprint_hex).encode()
        return re.compile(re.escape(prefix.encode()) + rb":v" + version + rb":" + fingerprint
                          + rb":\{[0-9a-f]{%d}\}:(?:[0-9a-f]{2}){8,64}" % _TAG_HEX)

    @staticmethod
    def _fingerprint_hex(fingerprint_hex: object) -> str:
        if not isinstance(fingerprint_hex, str) or not re.fullmatch(r"[0-9a-f]{32}", fingerprint_hex):
            raise InvalidArgument("fingerprint_hex", f"a fingerprint is 32 lowercase hex digits, got {fingerprint_hex!r}")
        return fingerprint_hex

    @staticmethod
    def pattern(prefix: str = DEFAULT_PREFIX, fingerprint_hex: str | None = None) -> bytes:
        """SCAN pattern for every block under ``prefix`` (all versions), or of one fingerprint.

        Shaped like a block key (``v<digits>``, a 32-hex-digit fingerprint, a ``{tag}``), so
        another application's keys under the same prefix (``pkv:visits``) do not match. A glob
        is coarser than a key: filter what SCAN returns with ``block_key_shape``."""
        check_prefix(prefix)
        if fingerprint_hex is None:
            return f"{prefix}:v[0-9]*:{_HEX32}:{{*}}:*".encode()
        KeySpace._fingerprint_hex(fingerprint_hex)
        return f"{prefix}:v{FORMAT_VERSION}:{fingerprint_hex}:{{*}}:*".encode()
