"""RocketMQ 5 gRPC (``apache.rocketmq.v2.MessagingService``) over polymq's processor."""

from protocols.rocketmq.listener import RocketMQListener, rocketmq_listener
from protocols.rocketmq.options import RocketMQOptions

__all__ = ["RocketMQListener", "RocketMQOptions", "rocketmq_listener"]
