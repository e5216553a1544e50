"""PyTorch DistributedDataParallel (and one-GPU training)."""
