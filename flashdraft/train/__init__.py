"""Online training of a drafter against a frozen target.

    trainer.py     train(): the entry point; Trainer: builds the run, the loop (every "when" asked of its owner)
    startup.py     a rank's start-up shared by both roles: process, checks, target, data, the barrier
    target_rank.py a disaggregated target rank: serves features (flashdraft.feed), trains nothing
    step.py        DrafterStep: one optimizer step, strategy then backend; forward_backward: one micro-batch
    strategy.py    a drafter family's training: its blocks, forward + loss and logged sums (strategy_for)
    backend.py     DDP, no_sync, the global normaliser, clip, vote, optimizer and scheduler steps
    state.py       checkpoint components, when to save, resume and its identity checks
    validation.py  held-out loss and real tau, and when to run them
    log.py         loss statistics, throughput, stage times, and when to write them
    checks.py      start-up checks of the run's inputs
    optim.py       AdamW and the warmup-cosine schedule
    runtime.py     the process: output lock, signals, host-memory tuning, RNG
    cli.py         `flashdraft train`
"""
