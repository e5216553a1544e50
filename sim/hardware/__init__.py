"""How long work takes: the GPU compute model, attention kernels, power, the host (CPU, DRAM,
NVMe) and compute/communication interference."""
