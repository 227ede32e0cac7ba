"""Deprecated: moved to forge.weights.delta_sync (the weight plane's package, forge/weights/). Importable under this name, with a
DeprecationWarning, until callers have moved."""

import importlib as _importlib
import warnings as _warnings

_warnings.warn("forge.delta_sync is deprecated: use forge.weights.delta_sync", DeprecationWarning, stacklevel=2)

for _name in ['forge.weights.delta_sync']:
    globals().update({key: value for key, value in vars(_importlib.import_module(_name)).items()
                      if not key.startswith("__")})
