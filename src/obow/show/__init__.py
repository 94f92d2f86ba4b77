"""Pictures of what a run learned: ``obow show words``, ``obow show run`` and ``obow show neighbours``; and of
the views a recipe makes: ``obow show views``.

* :mod:`obow.show.words`: the image patches that each visual word of a level's vocabulary stands for;
* :mod:`obow.show.run_plots`: the curves of one or more runs' ``log.jsonl``;
* :mod:`obow.show.neighbours`: nearest training images of a few queries, learned features against random ones;
* :mod:`obow.show.views`: the teacher view, crops and patches of a folder's first images, by either pipeline.
"""


def drawable(text: str) -> str:
    """``text`` as matplotlib and Pillow can draw it: the bytes of a name in no UTF-8 (an old archive's Latin-1, which
    Python reads as surrogates, and which matplotlib refuses with an error) written as escapes, ``caf\\xe9``."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
