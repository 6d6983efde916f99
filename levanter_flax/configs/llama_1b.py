"""configs/llama.py:1b, by its earlier name."""
from levanter_flax.config import variant_file

get_config = variant_file(__file__, "llama.py", "1b")
