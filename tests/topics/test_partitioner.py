"""Kafka's default partitioner, checked against the Java client.

The vectors were computed with kafka-clients 4.1.1 (Java 17):
``Utils.murmur2(key)`` and ``BuiltInPartitioner.partitionForKey(key, n)`` for n = 4, 12, 100,
which is what the Java producer does for a keyed record. Program:

    import org.apache.kafka.common.utils.Utils;
    import org.apache.kafka.clients.producer.internals.BuiltInPartitioner;
    // for each key: Utils.murmur2(k), BuiltInPartitioner.partitionForKey(k, 4 | 12 | 100)

run as ``java -cp '~/.cache/deferline/kafka-4.1.1/lib/*' Vectors.java``.
"""

import pytest
from aiokafka.partitioner import DefaultPartitioner
from deferline.topics import Murmur2Partitioner, murmur2, partition_for
from deferline.topics.testing import murmur2_reference
from hypothesis import given
from hypothesis import strategies as st

# (key as hex, murmur2, partition of 4, of 12, of 100)  # key as text
JAVA_VECTORS = [
    ("", 275646681, 1, 9, 81),
    ("61", -1563381124, 0, 4, 24),  # a
    ("6162", 316155434, 2, 2, 34),  # ab
    ("616263", 479470107, 3, 3, 7),  # abc
    ("61626364", -1323649548, 0, 8, 0),  # abcd
    ("6162636465", 461995741, 1, 1, 41),  # abcde
    ("6b61666b61", -798503068, 0, 4, 80),  # kafka
    ("64656665726c696e65", -426692907, 1, 5, 41),  # deferline
    ("747269676765722d31", -1692340853, 3, 3, 95),  # trigger-1
    ("747269676765722d3432", -1009610951, 1, 9, 97),  # trigger-42
    (  # 0ae8f3a2-5c1e-5b7a-9a55-1d2c3e4f5a6b
        "30616538663361322d356331652d356237612d396135352d316432633365346635613662",
        1853029606,
        2,
        10,
        6,
    ),
    (  # example_dag|wait_for_file|manual__2024-01-01T00:00:00+00:00|-1
        "6578616d706c655f6461677c776169745f666f725f66696c657c6d616e75616c5f5f3230"
        "32342d30312d30315430303a30303a30302b30303a30307c2d31",
        -1771661175,
        1,
        5,
        73,
    ),
    ("64c3a966c3a972c3a9", -1396964404, 0, 4, 44),  # déféré
    ("e697a5e69cace8aa9e", 1431860170, 2, 10, 70),  # 日本語
    (  # 95da8f8f-2ab4-5f96-9787-3fa094d531ca (the trigger id in docs/protocol.md)
        "39356461386638662d326162342d356639362d393738372d336661303934643533316361",
        873409067,
        3,
        11,
        67,
    ),
    ("fffe807f00", -199883469, 3, 11, 79),  # bytes ff fe 80 7f 00
    ("808080", -1134684817, 3, 7, 31),  # bytes 80 80 80
]


@pytest.mark.parametrize(("key_hex", "java_hash", "p4", "p12", "p100"), JAVA_VECTORS)
def test_matches_the_java_client(key_hex, java_hash, p4, p12, p100):
    key = bytes.fromhex(key_hex)
    assert murmur2(key) == java_hash
    assert murmur2_reference(key) == java_hash
    assert [partition_for(key, n) for n in (4, 12, 100)] == [p4, p12, p100]


@given(st.binary(max_size=200))
def test_the_compiled_hash_equals_the_python_one(key):
    assert murmur2(key) == murmur2_reference(key)


def test_the_compiled_hash_is_installed():
    """murmurhash2 is a dependency: without it every event pays the Python loop."""
    from deferline.topics.testing import murmur2_python, unsigned

    assert unsigned is not murmur2_python


def test_single_partition_and_bad_counts():
    assert partition_for(b"anything", 1) == 0
    with pytest.raises(ValueError, match="num_partitions"):
        partition_for(b"k", 0)


@given(st.binary(max_size=64), st.integers(min_value=1, max_value=1000))
def test_agrees_with_aiokafkas_partitioner(key, n):
    partitions = list(range(n))
    assert partition_for(key, n) == DefaultPartitioner()(key, partitions, partitions)


def test_aiokafka_partitioner_callable():
    partitioner = Murmur2Partitioner()
    key = bytes.fromhex(JAVA_VECTORS[8][0])  # trigger-1 -> partition 3 of 12
    assert partitioner(key, list(range(12)), [0]) == 3
    # aiokafka passes the partition ids; the result is one of them, by index.
    assert partitioner(key, [10, 11, 12, 13], []) == 13
    assert partitioner(None, [0, 1, 2], [2]) == 2
    assert partitioner(None, [0, 1, 2], []) in (0, 1, 2)
