"""The judges: an export decoded by someone else's code, next to flashdraft's own decode.

    engine.py     vLLM, the serving engine: `flashdraft eval --engine vllm`, `export --verify-engine`
    reference.py  the DFlash authors' reference decoder (PyPI ``dflash``)
    protocol.py   starting a worker (request and result files, its own session, ended on a signal),
                  and the verdict parts both judges share (one side's taus, the agreement lines)
    workers/      the scripts that run under the engine environment's interpreter (never imported)

Both run in the engine environment that flashdraft.vllm_env owns (the interpreter the user names,
or flashdraft's cached CPU build), the one the vLLM target backend (flashdraft.target.engine) uses
too. Nothing below flashdraft.evaluate / export / cli imports this package.
"""
