"""RocketMQ 5 gRPC (``apache.rocketmq.v2.MessagingService``) over polymq's processor."""

from polymq.protocols.rocketmq.listener import RocketMQListener, rocketmq_listener
from polymq.protocols.rocketmq.options import RocketMQOptions

__all__ = ["RocketMQListener", "RocketMQOptions", "rocketmq_listener"]
