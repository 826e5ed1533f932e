"""A gRPC server of polymq's own (HTTP/2 framed by hand), serving the RocketMQ 5
listener: grpcio's asyncio server cost about 300 µs of CPU per unary call
(bench/rocketmq_servers.py)."""
