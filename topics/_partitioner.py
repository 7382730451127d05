"""Kafka's default partitioner (murmur2 of the key), bit-for-bit as the Java client does it.

A producer in any language that uses Kafka's default partitioner puts a trigger id on the
same partition as deferline does; co-partitioned topics rely on that.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """``org.apache.kafka.common.utils.Utils.murmur2`` as a signed 32-bit int."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    whole = length - length % 4
    for k in struct.unpack(f"<{whole >> 2}I", data[:whole]):  # little-endian 32-bit words
        k = (k * _M) & _MASK
        k ^= k >> 24
        h = ((h * _M) & _MASK) ^ ((k * _M) & _MASK)
    tail = length % 4
    if tail == 3:
        h ^= data[whole + 2] << 16
    if tail >= 2:
        h ^= data[whole + 1] << 8
    if tail >= 1:
        h ^= data[whole]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for(key: bytes, num_partitions: int) -> int:
    """The partition Kafka's default partitioner picks: ``toPositive(murmur2(key)) % n``."""
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    return (murmur2(key) & 0x7FFFFFFF) % num_partitions


class Murmur2Partitioner:
    """aiokafka ``partitioner=`` callable using :func:`partition_for`.

    Keyed records go where the Java client would put them; unkeyed records go to a random
    available partition.
    """

    def __call__(
        self, key: bytes | None, all_partitions: Sequence[int], available: Sequence[int]
    ) -> int:
        if key is None:
            return random.choice(available or all_partitions)
        return all_partitions[partition_for(key, len(all_partitions))]
