"""Code that runs inside the serving engine's environment, never imported by flashdraft.

``flashdraft.target.engine`` starts ``feature_worker.py`` with the engine environment's
interpreter (this directory is its ``sys.path[0]``, and its ``PYTHONPATH`` for the processes vLLM
starts), and vLLM loads ``hidden_states_connector`` by module name. These files import the standard
library, torch, safetensors and vLLM only. The package marker exists so that an installed
flashdraft ships them; nothing imports it.
"""
