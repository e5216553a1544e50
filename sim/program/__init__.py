"""The IR between the framework builders and the engine: ops, rank classes and programs
(:mod:`.ir`), and the rank meshes the builders draw their groups from (:mod:`.mesh`)."""
