"""The worker side of flashdraft.judge.protocol: a request in, a result out, an error kept.

Imported by the workers beside it as ``worker_io`` (their directory is ``sys.path[0]``), under the
engine environment's interpreter: the standard library only.
"""

from __future__ import annotations

import json
import sys
import traceback


def failure(exc: BaseException) -> dict:
    """An error for the report: the engine's own reason and its traceback."""
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def serve(work) -> int:
    """``python WORKER REQUEST.json RESULT.json``: ``work(request, result)`` fills ``result``; an
    exception it raises becomes the result's ``error`` (``failure``), and the result is written
    either way (flashdraft reads a missing one as a crash). The exit status: 0."""
    request_path, result_path = sys.argv[1], sys.argv[2]
    with open(request_path, encoding="utf-8") as f:
        request = json.load(f)
    result: dict = {}
    try:
        work(request, result)
    except Exception as exc:  # the engine's own reason, for the report
        result.update(failure(exc))
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0
