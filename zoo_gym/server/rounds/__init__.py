"""Round logic: the round manager, sync and async policies, publishing, settlement, evaluation."""
