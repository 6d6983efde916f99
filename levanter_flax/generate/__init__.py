"""Generation from trained params: the KV-cached decoding loop (decoding), prompts to
completions (prompts), a trained run read back (trained) and written out for Hugging Face
(export). May import config and below: checkpoint, hf, models, core."""
