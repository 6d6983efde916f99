"""The devices: the mesh and the partition rules that become NamedShardings (partitioning),
jax.distributed's multi-process start (distributed) and the backend's start before any array
exists (backend). May import core."""
