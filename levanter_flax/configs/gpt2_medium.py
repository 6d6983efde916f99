"""configs/gpt2.py:medium, by its earlier name."""
from levanter_flax.config import variant_file

get_config = variant_file(__file__, "gpt2.py", "medium")
