"""Generation from trained params: the KV-cached decoding loop (decoding). May import models
and core."""
