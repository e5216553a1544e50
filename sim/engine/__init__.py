"""The simpy engine that runs a program on the fabric, the one host-clock rule, HBM sharing,
the caching allocator and the recorder."""
