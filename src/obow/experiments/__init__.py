"""Experiments built from the library: the paper's comparison tables (:mod:`~obow.experiments.tables`) and
the built-in demo (:mod:`~obow.experiments.demo`)."""
