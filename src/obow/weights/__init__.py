"""Weights in and out: the checkpoint format (:mod:`~obow.weights.checkpoint`), backbones from checkpoints,
exported files or a seeded random initialisation (:mod:`~obow.weights.load`) and export for other libraries
(:mod:`~obow.weights.export`). The authors' released weights become obow checkpoints on the floor of the methods
(:mod:`obow.methods.official`)."""
