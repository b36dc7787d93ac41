"""The message catalogue: every message round-trips, and no frame crashes a decoder."""

import dataclasses
import types
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xmig import protocol
from xmig.protocol import CATALOGUE, Party, ProtocolError, decode, encode

SCALARS = {int: 3, float: 1.5, str: "x", bool: True, type(None): None}


def sample(hint):
    """A value of the type ``hint`` names."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return sample(typing.get_args(hint)[0])
    if dataclasses.is_dataclass(hint):
        return example(hint)
    if (origin or hint) is list:
        return []
    if (origin or hint) is dict:
        return {}
    return SCALARS[hint]


def example(cls):
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: sample(hints[f.name]) for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("op", sorted(CATALOGUE))
def test_every_message_round_trips_for_its_receiver(op):
    cls = CATALOGUE[op]
    msg = example(cls)
    frame = encode(msg)
    assert frame["op"] == op
    sender = next(iter(cls.SENDERS))
    assert decode(frame, cls.RECEIVER, sender) == msg


def test_every_message_has_one_name_and_a_direction():
    assert len({cls.OP for cls in CATALOGUE.values()}) == len(CATALOGUE)
    for cls in CATALOGUE.values():
        assert cls.SENDERS and cls.RECEIVER not in cls.SENDERS
        assert not (cls.RELAY and cls.FORWARD)


def test_relayed_orders_and_forwarded_reports_decode_on_their_way():
    park = encode(protocol.Park(generation=1, replaced=[2]))
    assert decode(park, Party.WORKER, Party.AGENT) == protocol.Park(generation=1, replaced=[2])
    parked = encode(example(protocol.Parked))
    assert isinstance(decode(parked, Party.AGENT, Party.WORKER), protocol.Parked)
    assert isinstance(decode(parked, Party.COORDINATOR, Party.AGENT), protocol.Parked)
    with pytest.raises(ProtocolError, match="not a message for the worker"):
        decode(encode(protocol.Shutdown()), Party.WORKER, Party.AGENT)
    with pytest.raises(ProtocolError, match="cannot come from the launcher"):
        decode(encode(example(protocol.Fault)), Party.COORDINATOR, Party.LAUNCHER)


@pytest.mark.parametrize("frame, error", [
    ({"op": "nope"}, "unknown message"),
    ({"no": "op"}, "unknown message"),
    ({"op": 5}, "unknown message"),
    ({"op": "progress", "rank": 1}, "field 'step' is missing"),
    ({"op": "progress", "rank": 1, "step": "2"}, "str is not int"),
    ({"op": "progress", "rank": True, "step": 2}, "bool is not int"),
    ({"op": "progress", "rank": 1, "step": 2, "extra": 0}, "unknown field 'extra'"),
    ({"op": "fault", "record": []}, "expected an object"),
    ({"op": "spares", "node": 1, "ready": None}, "NoneType is not int"),
])  # fmt: skip
def test_malformed_frames_are_protocol_errors(frame, error):
    with pytest.raises(ProtocolError, match=error):
        decode(frame, Party.COORDINATOR, Party.AGENT)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=20,
)  # fmt: skip


def frames():
    """Frames near real ones: a known op with fields of any JSON type, some missing."""

    def near(op):
        cls = CATALOGUE[op]
        names = [f.name for f in dataclasses.fields(cls)]
        return st.fixed_dictionaries(
            {"op": st.just(op)}, optional={n: JSON for n in [*names, "junk"]}
        )

    return st.sampled_from(sorted(CATALOGUE)).flatmap(near) | JSON


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frame=frames(), receiver=st.sampled_from(list(Party)),
       sender=st.sampled_from([*Party, None]))  # fmt: skip
def test_decoding_any_frame_returns_a_message_or_raises_protocol_error(frame, receiver, sender):
    try:
        msg = decode(frame, receiver, sender)
    except ProtocolError:
        return
    assert type(msg) is CATALOGUE[frame["op"]]
    assert decode(encode(msg), receiver, sender) == msg
