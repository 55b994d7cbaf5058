"""Playground: a chat with the base model and the adapter (`view.PlaygroundView`)."""
