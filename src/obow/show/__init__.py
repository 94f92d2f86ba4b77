"""Pictures of what a run learned: ``obow show words``, ``obow show run`` and ``obow show neighbours``; and of
the views a recipe makes: ``obow show views``.

* :mod:`obow.show.words`: the image patches that each visual word of a level's vocabulary stands for;
* :mod:`obow.show.run_plots`: the curves of one or more runs' ``log.jsonl``;
* :mod:`obow.show.neighbours`: nearest training images of a few queries, learned features against random ones;
* :mod:`obow.show.views`: the teacher view, crops and patches of a folder's first images, by either pipeline.
"""
