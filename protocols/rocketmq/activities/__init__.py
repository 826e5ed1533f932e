"""One module per group of RPCs of ``apache.rocketmq.v2.MessagingService`` (as Apache
RocketMQ's proxy keeps one ``*Activity`` per operation)."""
