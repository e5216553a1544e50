"""What the framework builders share: the builder interface, micro-batch passes, block
accounting and collective dtypes."""
