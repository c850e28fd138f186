"""Redis Cluster URLs and slots: seeds, the namespace's one slot, errors without secrets."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from onceflow.kernel.errors import ConfigError, ServiceError
from onceflow.kernel.keyspace import Keyspace
from onceflow.kernel.settings import RedisSettings
from onceflow.kernel.slots import SlotLocator, is_cluster_url, namespace_slot, seed_urls
from onceflow.testing.services import free_port


def test_seeds_keep_credentials_database_and_tls():
    assert seed_urls("redis+cluster://:pw@h1:1,h2:2/0") == [
        "redis://:pw@h1:1/0",
        "redis://:pw@h2:2/0",
    ]
    assert seed_urls("rediss+cluster://user:pw@h:6380") == ["rediss://user:pw@h:6380"]
    assert seed_urls("redis://plain:6379/1") == ["redis://plain:6379/1"]
    assert is_cluster_url("rediss+cluster://h:1") and not is_cluster_url("redis://h:1")


@pytest.mark.parametrize("name", ["orders", "clicks-per-minute", "a.b_c-1", "x"])
def test_every_key_of_a_namespace_is_in_the_namespaces_slot(name):
    ks = Keyspace(name)
    keys = [ks.meta, ks.epoch, ks.batch(3), ks.seen("events", 7, 11), ks.state("count", 1)]
    keys += [ks.backup("events", 2, 0), ks.timers("event", "w", 1), ks.pending("out", 0)]
    assert {key_slot(k.encode()) for k in keys} == {namespace_slot(name)}


def test_cluster_urls_are_accepted_and_others_refused_without_the_password():
    assert RedisSettings.from_env("redis+cluster://:pw@h1:1,h2:2").cluster
    with pytest.raises(ConfigError) as refused:
        RedisSettings.from_env("cluster://:hunter2@h1:1")
    assert "hunter2" not in str(refused.value)


def test_no_seed_answering_is_one_error_naming_the_seeds_not_the_password():
    ports = [free_port(), free_port()]
    url = "redis+cluster://:hunter2@" + ",".join(f"127.0.0.1:{p}" for p in ports)
    with pytest.raises(ServiceError) as failed:
        SlotLocator(url, {}).cluster()
    text = str(failed.value)
    assert all(str(p) in text for p in ports)
    assert "hunter2" not in text
