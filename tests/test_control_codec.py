"""The data-only control message codec (issue 10): round trips and rejections.

Every message shape the engine sends ("submit", "work", "abort", "bye",
"heartbeat", "waits") and plain nested data must come back equal and of the
same types; malformed input, unknown tags and pickle payloads must raise
``DecodeError`` without running anything.
"""

from __future__ import annotations

import collections
import math
import os
import pickle
import struct

import numpy as np
import pytest

from roundel.common.control import codec as control_codec
from roundel.ops import ReduceOp
from roundel.common.control.records import Batch, CachedBatch, Entry, OpKind, Request, TunedParams
from roundel.common.control.messages import Abort, Bye, Dispatch, Heartbeat, Submit, Tune, Waits

REQUEST = Request("grad.layer1.weight", OpKind.ALLREDUCE, 0, dtype="float32", shape=(256, 128),
                  reduce_op=ReduceOp.Average, prescale=0.5, postscale=2.0)
ALLTOALL = Request("a2a", OpKind.ALLTOALL, 3, dtype="int64", shape=(6, 2), splits=(1, 5), cacheable=False)
FAILED = Request("bad", OpKind.BROADCAST, 1, dtype="uint8", shape=(), root_rank=2, error="rank 2 has no data")

ENGINE_MESSAGES = [
    Submit(4, (1 << 700) | (1 << 63) | 5, [REQUEST, ALLTOALL, FAILED], {63: b"\x00\x00\x80?", 0: b""},
           [b"\x01\x02", None, None]),
    Submit(0, 0, [], {}, []),
    Dispatch(9, [
        Batch(OpKind.ALLREDUCE, 0, (Entry(REQUEST.name, REQUEST, cache_bit=12),
                                    Entry("g2", REQUEST._replace(name="g2")))),
        Batch(OpKind.ALLGATHER, 2, (Entry("ag", REQUEST._replace(name="ag", kind=OpKind.ALLGATHER),
                                          first_dims=(3, 0, 7)),), joined=(1,), last_joined=1),
        Batch(OpKind.ALLTOALL, 3, (Entry("a2a", ALLTOALL, splits=((1, 5), (2, 4))),)),
        Batch(OpKind.BROADCAST, 1, (Entry("bad", FAILED),), error="root ranks differ", error_type="internal"),
        CachedBatch(OpKind.ALLREDUCE, 0, (1 << 900) | (1 << 12) | 1),
        CachedBatch(OpKind.ALLREDUCE, 0, 1 << 3, b"\x00\x00\x80?\x00\x00\x00@"),
        Batch(OpKind.ALLREDUCE, 0, (Entry("loss", REQUEST._replace(name="loss", shape=())),), reduced=b"\x00\x00\x80?"),
    ], [3, 4, 1 << 40], [(9, 0), (8, 1 << 70)]),
    Abort("rank 2 died or lost its connection to the coordinator"),
    Bye(),
    Heartbeat("node-17.example"),
    Waits(12, ((0, "grad.w", "allreduce"), (2, "ag", "allgather"))),
    Tune(TunedParams(8 << 20, 5.0, True, False)),
]

PLAIN_VALUES = [
    None, True, False, 0, -1, (1 << 63) - 1, -(1 << 63), 1 << 63, -(1 << 200), 1 << 5000, 0.0, -2.5, math.inf,
    "", "héllo ✓", "\ud800 lone surrogate", b"", b"\x00\xff" * 100, (), [], {}, ((),), [[[]]],
    {"a": 1, (1, "b"): [None, b"x"], 3: {"nested": (True, 1.5)}}, (ReduceOp.Sum, OpKind.JOIN, 1),
]


def _same(a, b) -> bool:
    """Equal and of exactly the same types all the way down (1 == True == 1.0 is not enough)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(k1, k2) and _same(a[k1], b[k2]) for k1, k2 in zip(a, b))
    return a == b


@pytest.mark.parametrize("message", ENGINE_MESSAGES + PLAIN_VALUES, ids=repr)
def test_codec_round_trips_engine_messages_and_plain_data(message):
    encoded = control_codec.encode(message)
    assert _same(control_codec.decode(encoded), message)
    assert _same(control_codec.decode(control_codec.encode(message)), message)  # again, through the caches


class _Shape(tuple):
    """Like torch.Size: a tuple subclass."""


def test_codec_round_trips_nan_and_stand_ins_as_plain_values():
    assert math.isnan(control_codec.decode(control_codec.encode(math.nan)))
    stand_ins = (_Shape((2, 3)), collections.OrderedDict(a=1), np.int64(7), np.float32(0.5))
    assert _same(control_codec.decode(control_codec.encode(stand_ins)), ((2, 3), {"a": 1}, 7, 0.5))


@pytest.mark.parametrize("value", [object(), {1, 2}, print, frozenset(), complex(1, 2),
                                   collections.namedtuple("Unknown", "a")(1)], ids=repr)
def test_codec_refuses_to_encode_other_types(value):
    with pytest.raises(TypeError, match="cannot carry"):
        control_codec.encode(("submit", value))


class _CreatesMarker:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.makedirs, (self.path,)


def _malformed() -> list[tuple[str, bytes]]:
    good = control_codec.encode(ENGINE_MESSAGES[2])
    request = control_codec.encode(REQUEST)
    cases = [("empty", b""), ("unknown tag", b"Z"), ("tag byte 0x80", b"\x80\x00"),
             ("stray bytes", control_codec.encode(("bye",)) + b"N"),
             ("string longer than the frame", b"s" + struct.pack("!I", 1000) + b"abc"),
             ("list claiming 2**32-1 items", b"l\xff\xff\xff\xff"),
             ("bad utf-8", b"s" + struct.pack("!I", 2) + b"\xff\xfe"),
             ("enum value out of range", b"o" + struct.pack("!q", 99)),
             ("unhashable dict key", b"m" + struct.pack("!I", 1) + b"l" + struct.pack("!I", 0) + b"N"),
             ("nested 1000 deep", b"t\x00\x00\x00\x01" * 1000 + b"N"),
             ("Request with a str kind", control_codec.encode(REQUEST._replace(kind="allreduce"))),
             ("Request with a list shape", control_codec.encode(REQUEST._replace(shape=[1, 2]))),
             ("Request with an int name", control_codec.encode(REQUEST._replace(name=5))),
             ("Entry holding a dict as request", control_codec.encode(Entry("x", {"a": 1}))),
             ("Batch entries holding a Request", control_codec.encode(Batch(OpKind.ALLREDUCE, 0, (REQUEST,)))),
             ("Dispatch batches holding a Request", control_codec.encode(Dispatch(1, [REQUEST], [], []))),
             ("Submit with a tuple of requests", control_codec.encode(Submit(1, 0, (REQUEST,), {}, [None]))),
             ("Submit holding a Batch", control_codec.encode(Submit(1, 0, [Batch(OpKind.ALLREDUCE, 0, ())], {}, [None]))),
             ("Heartbeat with an int host", control_codec.encode(Heartbeat(3))),
             ("Request with one field too few", b"R" + struct.pack("!I", len(request) - 5)
              + bytes([len(Request._fields) - 1]) + request[6:])]
    cases += [(f"truncated to {n} of {len(good)} bytes", good[:n]) for n in range(1, len(good), 7)]
    cases += [(f"pickle protocol {p}", pickle.dumps(("work", 1, [], [], []), protocol=p)) for p in (0, 2, 5)]
    return cases


@pytest.mark.parametrize("name,data", _malformed(), ids=[name for name, _ in _malformed()])
def test_codec_rejects_malformed_input(name, data):
    with pytest.raises(control_codec.DecodeError):
        control_codec.decode(data)


def test_codec_never_unpickles(tmp_path):
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(("work", _CreatesMarker(marker)), protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(control_codec.DecodeError):
        control_codec.decode(payload)
    assert not marker.exists()
