"""The judges' workers: scripts run with the engine environment's interpreter, never imported by flashdraft.

    <engine python> engine_worker.py REQUEST.json RESULT.json      vLLM decodes (flashdraft.judge.engine)
    <engine python> reference_worker.py REQUEST.json RESULT.json   the DFlash reference (flashdraft.judge.reference)

Each imports the standard library, its engine and ``worker_io`` (this directory is its
``sys.path[0]``), never flashdraft or the training environment. The package marker exists so that
an installed flashdraft ships them.
"""
