"""The protocol adapters, one sub-package each (kafka, amqp, mqtt, rocketmq, mns, and
http for the HTTP app), talking to storage only through the gateway's processor."""
