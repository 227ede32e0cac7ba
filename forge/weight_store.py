"""Deprecated: moved to forge.weights.store (the weight plane's package, forge/weights/). Importable under this name, with a
DeprecationWarning, until callers have moved."""

import importlib as _importlib
import warnings as _warnings

_warnings.warn("forge.weight_store is deprecated: use forge.weights.store", DeprecationWarning, stacklevel=2)

for _name in ['forge.weights.store']:
    globals().update({key: value for key, value in vars(_importlib.import_module(_name)).items()
                      if not key.startswith("__")})
