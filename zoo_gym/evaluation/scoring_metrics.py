"""What rewards can be scored on (`ServerEvaluator.score_loss`): the completion loss, or greedy exact match's 0-1
loss (a verifiable task's accuracy). Torch-free, so the server's settings check --scoring-metric by it."""

SCORING_METRICS = ("loss", "exact-match")
