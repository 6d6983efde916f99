"""configs/qwen2.py:0_5b, by its earlier name."""
from levanter_flax.config import variant_file

get_config = variant_file(__file__, "qwen2.py", "0_5b")
