"""Generation from trained params: the engine (continuous batching over slots of one KV cache:
engine), prompts to completions (prompts), a trained run read back (trained) and written out
for Hugging Face (export). May import config and below: checkpoint, hf, models, core."""
