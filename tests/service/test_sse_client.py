"""The load generator's HTTP/1.1 chunked-body decoding (benchmarks/sse_client.py), on bodies
cut at every byte: what the benchmark counts must be what the server sent."""
from benchmarks.sse_client import _Dechunker

EVENTS = [b'data: {"choices": [{"text": "h\\u00e9llo "}]}\n\n', b"data: x\n\n" * 3,
          b"data: " + b"y" * 300 + b"\n\n", b"data: [DONE]\n\n"]


def chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x;ext=1\r\n" % len(p) + p + b"\r\n" if i % 2 else
                    b"%X\r\n" % len(p) + p + b"\r\n" for i, p in enumerate(parts)) + b"0\r\n\r\n"


def test_every_cut_gives_the_body_back():
    wire = chunked(EVENTS)
    for cut in range(len(wire) + 1):
        d = _Dechunker()
        body = d.feed(wire[:cut]) + d.feed(wire[cut:])
        assert body == b"".join(EVENTS), cut
        assert d.ended


def test_byte_by_byte_and_nothing_past_the_end():
    d = _Dechunker()
    body = b"".join(d.feed(bytes([b])) for b in chunked(EVENTS) + b"5\r\nafter\r\n")
    assert body == b"".join(EVENTS) and d.ended


def test_not_ended_until_the_last_chunk():
    d = _Dechunker()
    assert d.feed(chunked(EVENTS[:1])[:-5]) == EVENTS[0]
    assert not d.ended
