"""Weights in and out: the checkpoint format (:mod:`~obow.weights.checkpoint`), backbones from checkpoints,
exported files or a seeded random initialisation (:mod:`~obow.weights.load`), export for other libraries
(:mod:`~obow.weights.export`) and the authors' released weights (:mod:`~obow.weights.official`)."""
