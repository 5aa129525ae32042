"""Numbers computed from predictions: the metrics (metrics), the separation regime of a dataset
(regime), shift curves (shift) and the report's comparison of models over seeds (comparison).
Imports only stages.core."""
