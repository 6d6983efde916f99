"""levanter_flax: an LLM trainer for JAX built on Flax Linen with explicit partition rules."""
import os

# TensorFlow (input pipeline only) prints a screenful of INFO lines on import.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
# Its oneDNN kernels speed up no op of the input pipeline, and on CPUs without AVX-512 they log
# an error-level line for the integer ops that decode a shard.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
