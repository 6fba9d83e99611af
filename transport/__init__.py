"""The HTTP/2 (gRPC, Connect) stream machinery that the agent, the control plane and the router share.

``schema`` is the wire contract (messages, envelope codec, status vocabulary) and stays pure; the
sockets, trio and h2 driving live here: :mod:`transport.h2io` is the connection and stream plumbing
both ends use; :mod:`transport.client` holds the client side of an RPC's end (``RpcClientStream``,
which the agent's stream builds on) and a small server-streaming client (the router's route watch).
"""
