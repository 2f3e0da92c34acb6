"""Online training of a drafter against a frozen target.

    trainer.py     Trainer: builds the run, the loop (every "when" asked of its owner)
    step.py        DrafterStep: one optimizer step; forward_backward: one micro-batch (drafter, then loss)
    stages.py      the feature stages: data -> h2d -> target forward (+ feature cache)
    placement.py   where features come from: colocated, or target ranks feeding drafter ranks
    state.py       checkpoint components, when to save, resume and its identity checks
    validation.py  held-out loss and real tau, and when to run them
    log.py         loss statistics, throughput, stage times, and when to write them
    checks.py      start-up checks of the run's inputs
    optim.py       AdamW and the warmup-cosine schedule
    runtime.py     the process: output lock, signals, host-memory tuning, RNG
    cli.py         `flashdraft train`
"""
