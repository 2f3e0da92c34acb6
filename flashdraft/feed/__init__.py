"""The feature producer: everything that makes a training step's inputs, up to the frozen
target's features, behind one object the trainer iterates (``steps.Feed``).

    steps.py          StepInput / Micro (what a step consumes) and Feed (items, done, metrics, report, close)
    stages.py         FeatureStages: data -> h2d -> target forward (+ feature cache)
    cache.py          the byte-bounded cache of target features reused across epochs
    colocated.py      ColocatedFeed: each rank runs its own stages
    disaggregated.py  DrafterFeed (a drafter rank receives) and serve_features (a target rank's loop)
    wire.py           the feature links' messages: kinds, the step header, HELLO, dtypes
    flow.py           the engine: threads, bounded channels, CUDA streams and events, buffer pools

Nothing here imports flashdraft.train: the trainer consumes a Feed, never the other way round.
"""
