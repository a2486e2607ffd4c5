"""Encoding and decoding of wire messages (msgpack via msgspec; never pickle).

One reusable encoder and one typed decoder per direction. `decode_request` turns every bad
frame into a `RequestError` carrying the right `ErrorCode` and, when it can be recovered, the
request id, so the daemon can answer instead of crashing or going silent.
"""

from __future__ import annotations

import msgspec

from kvdepot.protocol.errors import ErrorCode, RequestError
from kvdepot.protocol.messages import REQUEST_TAGS, ErrorReply, Msg, Reply, Request

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_raw_decoder = msgspec.msgpack.Decoder()

MAX_FRAME_BYTES = 64 << 20  # no request legitimately needs more; larger frames are refused


def encode(msg: Msg) -> bytes:
    """Encode one message into one frame."""
    return _encoder.encode(msg)


def _rid_of(raw: object) -> int:
    # type() is int, not isinstance: msgpack true/false decode to bool, which is an int
    # subclass; echoing True as the rid would make the client unable to decode the ErrorReply.
    if isinstance(raw, list) and len(raw) >= 2 and type(raw[1]) is int and raw[1] >= 0:
        return raw[1]
    return 0


def decode_request(frame: bytes | memoryview) -> Request:
    """Decode a request frame.

    Raises:
        RequestError: code MALFORMED (undecodable or invalid fields) or UNKNOWN_MESSAGE (a
            well-formed message with an unknown tag); ``.rid`` holds the request id if it
            could be read, else 0.
    """
    if len(frame) > MAX_FRAME_BYTES:
        err = RequestError(ErrorCode.MALFORMED, f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
        err.rid = 0
        raise err
    try:
        return _request_decoder.decode(frame)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # DecodeError includes ValidationError;
        # msgspec raises UnicodeDecodeError (not DecodeError) for a msgpack str that is not UTF-8
        try:
            raw = _raw_decoder.decode(frame)
        except (msgspec.DecodeError, UnicodeDecodeError):
            raw = None
        rid = _rid_of(raw)
        if isinstance(raw, list) and raw and isinstance(raw[0], str) and raw[0] not in REQUEST_TAGS:
            err = RequestError(ErrorCode.UNKNOWN_MESSAGE, f"unknown message type {raw[0]!r}")
        else:
            err = RequestError(ErrorCode.MALFORMED, f"malformed request: {exc}")
        err.rid = rid
        raise err from None


def decode_reply(frame: bytes | memoryview) -> Reply:
    """Decode a reply frame (client side). Raises `msgspec.DecodeError` on garbage."""
    return _reply_decoder.decode(frame)


def error_frame(rid: int, code: ErrorCode, message: str) -> bytes:
    """An encoded `ErrorReply`."""
    return encode(ErrorReply(rid=rid, code=int(code), message=message))
