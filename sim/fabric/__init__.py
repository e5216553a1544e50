"""The fabric: topology (graph builders, routing), the max-min flow network, and NCCL's
collectives on it."""
