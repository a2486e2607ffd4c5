"""kvdepot wire protocol: messages, codec and error codes."""

from kvdepot.protocol.codec import decode_reply, decode_request, encode, error_frame
from kvdepot.protocol.errors import ErrorCode, KVDepotError, RequestError
from kvdepot.protocol.messages import *  # noqa: F401,F403
from kvdepot.protocol.messages import PROTOCOL_VERSION

__all__ = ["decode_reply", "decode_request", "encode", "error_frame", "ErrorCode", "KVDepotError",
           "RequestError", "PROTOCOL_VERSION"]
