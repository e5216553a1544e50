"""Megatron-LM (Megatron-Core): tensor, sequence, pipeline and data parallelism with the
distributed optimizer, as its schedules issue them."""
