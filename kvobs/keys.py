"""vLLM offload keys, read without vLLM.

Every supported vLLM release builds a key as ``block_hash + group_idx.to_bytes(4, "big")``
(``vllm.v1.kv_offload.base.make_offload_key``); tests pin this against the installed vLLM's own
functions. Keys are hashes of token ids: no prompt text can be recovered from them.
"""

from __future__ import annotations

from typing import NamedTuple


class DecodedKey(NamedTuple):
    block_hash: bytes
    group: int

    @property
    def hash_prefix(self) -> str:
        """The first 8 bytes of the block hash in hex, enough to tell keys apart in logs."""
        return self.block_hash[:8].hex()


def decode_key(key: bytes) -> DecodedKey:
    """Split an offload key into its block hash and KV-cache group index."""
    if len(key) < 5:
        raise ValueError(f"an offload key has at least 5 bytes (hash + 4-byte group), got {len(key)}")
    return DecodedKey(bytes(key[:-4]), key_group(key))


def key_group(key: bytes) -> int:
    """The KV-cache group index of an offload key."""
    return int.from_bytes(key[-4:], "big")
