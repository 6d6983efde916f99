"""Flax Linen language models."""
