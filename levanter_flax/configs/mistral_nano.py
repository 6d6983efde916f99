"""configs/mistral.py:nano, by its earlier name."""
from levanter_flax.config import variant_file

get_config = variant_file(__file__, "mistral.py", "nano")
