"""Kafka's default partitioner (murmur2 of the key), bit-for-bit as the Java client does it.

A producer in any language that uses Kafka's default partitioner puts a trigger id on the
same partition as deferline does; co-partitioned topics rely on that.

The hash runs once or twice for every event on the triggerer's and the scheduler's hot
paths, so the compiled ``murmurhash2`` package computes it where it is installed (a
dependency: about 20 times faster than the loop below, which stays as the reference and the
fallback, and is tested equal to it).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Sequence

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2_reference(data: bytes) -> int:
    """``org.apache.kafka.common.utils.Utils.murmur2`` as a signed 32-bit int, in Python."""
    return _signed(_murmur2_python(data, _SEED))


def _murmur2_python(data: bytes, seed: int) -> int:
    """MurmurHash2 (32-bit) of ``data`` as an unsigned int."""
    length = len(data)
    h = (seed ^ length) & _MASK
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
    return h


def _signed(h: int) -> int:
    return h - (1 << 32) if h & 0x80000000 else h


_unsigned: Callable[[bytes, int], int]
try:
    from murmurhash2 import murmurhash2 as _unsigned
except ImportError:  # pragma: no cover - installed with deferline; absent only with --no-deps
    _unsigned = _murmur2_python


def murmur2(data: bytes) -> int:
    """``org.apache.kafka.common.utils.Utils.murmur2`` as a signed 32-bit int."""
    return _signed(_unsigned(data, _SEED))


def partition_for(key: bytes, num_partitions: int) -> int:
    """The partition Kafka's default partitioner picks: ``toPositive(murmur2(key)) % n``."""
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    return (_unsigned(key, _SEED) & 0x7FFFFFFF) % num_partitions


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
