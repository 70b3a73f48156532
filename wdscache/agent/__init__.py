"""What runs in the agent process and its sample workers.

The agent (:mod:`.core`) owns the cache directory: it downloads shards
(:mod:`.downloads`, :mod:`.fetch`), keeps them within the budget (:mod:`.cache`),
answers readers (:mod:`.readers`, :mod:`.opens`) and starts the worker processes
(:mod:`.pool`) that read cached shards and send samples. Nothing here is imported
by a training process; the package's ``__init__`` imports nothing, so a worker
pays only for the modules it uses.
"""
