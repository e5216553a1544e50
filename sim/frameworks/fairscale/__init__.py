"""FairScale's FullyShardedDataParallel (FSDP1)."""
