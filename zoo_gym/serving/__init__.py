"""gym-serve: many personal BitDelta variants over one shared base, behind an OpenAI-compatible API.

``variant`` (the ``.zgd`` file and its base sha256), ``adapted`` (the base's layers patched to add each
batch row's packed delta), ``model`` (forward and batched decoding), ``registry`` (loading, memory
budget, LRU), ``batcher`` (requests of different variants in one forward), ``app`` (FastAPI), ``cli``.
"""
