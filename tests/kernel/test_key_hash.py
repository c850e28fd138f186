"""The exchange's partition of a key, computed in Python: values Spark's ``hash()`` gives.

Compared with Spark itself (the JVM's hash and ``repartition``'s placement) in
``tests/runtime/test_exchange_placement.py``; pinned here so a run without Spark sees drift.
"""

from __future__ import annotations

import random

from onceflow.kernel import codec
from onceflow.kernel.key_hash import exchange_partition, spark_hash


def _keys() -> list[bytes]:
    rng = random.Random(5)
    keys = [b"", b"a", b"ab", b"abc", b"abcd", b"\xff", b"\x80\x00\xfe", bytes(range(256))]
    keys += [rng.randbytes(rng.randrange(0, 40)) for _ in range(400)]
    keys += [codec.encode(k) for k in ("u1", "user-17", 7, -3, 2**40, ("a", 1), b"\x00bytes")]
    return keys


def test_known_values() -> None:
    # Values Spark's hash() gives (tests/runtime/test_exchange_placement.py asks the JVM);
    # pinned so that the pure function cannot drift in a run without Spark.
    assert spark_hash(b"") == 142593372
    assert spark_hash(b"abc") == 1322437556
    assert spark_hash(b"abcde") == 814637928
    assert spark_hash(b"\xff") == 1398487324
    assert all(0 <= exchange_partition(k, 7) < 7 for k in _keys())
