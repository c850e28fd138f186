"""The exchange's partition of a key, computed in Python, against Spark's own placement.

A rescale (:mod:`onceflow.runtime.driver.rescale`) moves each key's state to the partition
``repartition(n, "key")`` will send it to; ``kernel.key_hash`` must agree with the JVM bit for
bit, for keys of every length (the tail bytes are where Spark's hash differs from MurmurHash3).
"""

from __future__ import annotations

import pytest

from onceflow.kernel.key_hash import exchange_partition, spark_hash
from tests.kernel.test_key_hash import _keys


@pytest.mark.spark
def test_hash_is_sparks_hash_function(spark) -> None:
    from pyspark.sql import functions as F  # noqa: N812

    keys = _keys()
    rows = spark.createDataFrame([(i, k) for i, k in enumerate(keys)], "i int, key binary")
    theirs = {r.i: r.h for r in rows.select("i", F.hash("key").alias("h")).collect()}
    ours = {i: spark_hash(k) for i, k in enumerate(keys)}
    assert ours == theirs


@pytest.mark.spark
@pytest.mark.parametrize("partitions", [1, 2, 3, 4, 7, 128])
def test_partition_is_where_repartition_sends_the_key(spark, partitions: int) -> None:
    from pyspark.sql import functions as F  # noqa: N812

    keys = _keys()
    rows = spark.createDataFrame([(i, k) for i, k in enumerate(keys)], "i int, key binary")
    placed = rows.repartition(partitions, "key").select("i", F.spark_partition_id().alias("p"))
    theirs = {r.i: r.p for r in placed.collect()}
    ours = {i: exchange_partition(k, partitions) for i, k in enumerate(keys)}
    assert ours == theirs
