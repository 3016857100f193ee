"""Rules: EventBridge event patterns (``patterns``) and the input transforms (``transforms``)."""
