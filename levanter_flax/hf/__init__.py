"""Hugging Face checkpoints: a snapshot directory's config.json and safetensors read into a
family's params and written back (snapshot). Each family's key map lives with the family
(models/*.py, models/hf_keys.py). May import core and models."""
