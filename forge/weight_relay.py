"""Deprecated: moved to forge.weights.relay (the weight plane's package, forge/weights/). Importable under this name, with a
DeprecationWarning, until callers have moved."""

import importlib as _importlib
import warnings as _warnings

_warnings.warn("forge.weight_relay is deprecated: use forge.weights.relay", DeprecationWarning, stacklevel=2)

for _name in ['forge.weights.relay']:
    globals().update({key: value for key, value in vars(_importlib.import_module(_name)).items()
                      if not key.startswith("__")})
