"""Which partition of an exchange a key goes to, computed without Spark.

An exchange is ``repartition(n, "key")`` on the encoded key (see
:mod:`onceflow.runtime.driver.compile`): Spark sends a row to ``pmod(murmur3(key, 42), n)``,
where ``murmur3`` is Spark's ``Murmur3_x86_32.hashUnsafeBytes`` on the key's bytes (the
``hash()`` SQL function). That function is MurmurHash3 over the whole 4-byte words, little
endian, and then — unlike the reference algorithm — mixes every remaining byte, sign-extended,
as a word of its own. A rescale (:mod:`onceflow.operations.rescale`) moves each key's state to
the partition a run with the new parallelism will send the key to, so this must agree with
Spark bit for bit; ``tests/kernel/test_key_hash.py`` compares it with Spark's own placement.
"""

from __future__ import annotations

SPARK_SEED = 42
_C1 = 0xCC9E2D51
_C2 = 0x1B873593
_MASK = 0xFFFFFFFF


def _mix_k1(k1: int) -> int:
    k1 = (k1 * _C1) & _MASK
    k1 = ((k1 << 15) | (k1 >> 17)) & _MASK
    return (k1 * _C2) & _MASK


def _mix_h1(h1: int, k1: int) -> int:
    h1 ^= k1
    h1 = ((h1 << 13) | (h1 >> 19)) & _MASK
    return (h1 * 5 + 0xE6546B64) & _MASK


def spark_hash(data: bytes, seed: int = SPARK_SEED) -> int:
    """Spark's ``hash()`` of a binary value: a signed 32-bit integer."""
    h1 = seed & _MASK
    aligned = len(data) - len(data) % 4
    for i in range(0, aligned, 4):
        h1 = _mix_h1(h1, _mix_k1(int.from_bytes(data[i : i + 4], "little")))
    for b in data[aligned:]:
        h1 = _mix_h1(h1, _mix_k1((b - 256 if b > 127 else b) & _MASK))
    h1 ^= len(data)
    h1 ^= h1 >> 16
    h1 = (h1 * 0x85EBCA6B) & _MASK
    h1 ^= h1 >> 13
    h1 = (h1 * 0xC2B2AE35) & _MASK
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


def exchange_partition(key: bytes, partitions: int) -> int:
    """The partition ``repartition(partitions, "key")`` sends an encoded key to."""
    return spark_hash(key) % partitions  # Python's % of a positive divisor is Spark's pmod
