"""levanter_flax: an LLM trainer for JAX built on Flax Linen with explicit partition rules."""
import os

# TensorFlow (input pipeline only) prints a screenful of INFO lines on import.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
