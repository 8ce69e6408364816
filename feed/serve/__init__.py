"""The feed server: pull streams, push subscriptions and their publisher, retention."""

__all__: list[str] = []
