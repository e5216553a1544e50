"""The IR between the framework builders and the engine: ops, rank classes and programs."""
