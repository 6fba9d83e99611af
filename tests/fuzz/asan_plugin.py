"""A pytest plugin (``-p tests.fuzz.asan_plugin``) that makes ``router._pump`` the extension built
under the sanitizers (``LLMGW_PUMP_SO``, from ``python -m tests.fuzz.asan``), before any test
imports it."""

from __future__ import annotations

import importlib.util
import os
import sys

import router

_path = os.environ["LLMGW_PUMP_SO"]
_spec = importlib.util.spec_from_file_location("router._pump", _path)
if _spec is None or _spec.loader is None:
    raise ImportError(f"LLMGW_PUMP_SO={_path}: not a loadable extension module")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
sys.modules["router._pump"] = _module
router._pump = _module  # type: ignore[attr-defined]
