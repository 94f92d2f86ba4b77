"""The BoW machinery of the paper (section 3): targets from the teacher's feature maps
(:mod:`~obow.bow.targets`), vocabulary update rules (:mod:`~obow.bow.vocabulary`), the BoW prediction head
(:mod:`~obow.bow.predictor`), the loss (:mod:`~obow.bow.loss`) and off-line k-means (:mod:`~obow.bow.kmeans`).

The allowed values of the settings these modules read are declared in :mod:`obow.config.choices`.
"""
