"""The event bus (docs/eventbus.md): CloudEvents 1.0 in over HTTP, rules with
EventBridge-style patterns, delivery to topics, MNS queues and webhooks."""
