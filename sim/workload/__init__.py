"""What is computed, with no time and no fabric: model dimensions, the kernels of a block, and
their FLOP, byte and activation accounting."""
