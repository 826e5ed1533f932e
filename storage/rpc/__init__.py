"""The storage RPC: how gateways reach storage nodes and nodes reach nameservers.

Length-prefixed msgpack frames on TCP, many calls in flight per connection, typed
errors preserved (:mod:`storage.rpc.codec` is the wire format, pure;
:mod:`storage.rpc.peer` the asyncio client and server).
"""

from polymq.storage.rpc.codec import CodecError, register
from polymq.storage.rpc.peer import Handler, RpcClient, RpcServer

__all__ = ["CodecError", "Handler", "RpcClient", "RpcServer", "register"]
