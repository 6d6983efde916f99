"""configs/mixtral.py:8x7b, by its earlier name."""
from levanter_flax.config import variant_file

get_config = variant_file(__file__, "mixtral.py", "8x7b")
