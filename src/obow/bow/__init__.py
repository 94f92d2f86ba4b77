"""The BoW machinery of the paper (section 3): targets from the teacher's feature maps
(:mod:`~obow.bow.targets`), vocabulary update rules (:mod:`~obow.bow.vocabulary`), the BoW prediction head
(:mod:`~obow.bow.predictor`), the loss (:mod:`~obow.bow.loss`) and off-line k-means (:mod:`~obow.bow.kmeans`).

The allowed values of the settings these modules read are declared here, without importing PyTorch, so
that :mod:`obow.config` can check a recipe against them.
"""

#: How a feature is coded against the vocabulary: soft (paper eq. 1), hard (Table 3), Sinkhorn-balanced.
ASSIGNMENTS = ("soft", "hard", "sinkhorn")
#: How a map's codes become one BoW: max over locations (official) or mean.
POOLINGS = ("max", "avg")
#: How the queue vocabulary draws one feature per image.
QUEUE_SAMPLINGS = ("local_average", "local", "global_average")
#: Vocabulary update rules: the queue (paper) or online k-means (appendix).
VOCABULARIES = ("queue", "kmeans")
#: BoW prediction heads: the dynamic weight generator (paper) or fixed per-word weights (Table 3).
HEADS = ("dynamic", "fixed")
