"""Deprecated: moved to forge.weights.segment, forge.weights.checksums, forge.weights.manifest, forge.weights.publisher (the weight plane's package, forge/weights/). Importable under this name, with a
DeprecationWarning, until callers have moved."""

import importlib as _importlib
import warnings as _warnings

_warnings.warn("forge.shm_weights is deprecated: use forge.weights.segment, forge.weights.checksums, forge.weights.manifest, forge.weights.publisher", DeprecationWarning, stacklevel=2)

for _name in ['forge.job', 'forge.weights.manifest', 'forge.weights.checksums', 'forge.weights.publisher', 'forge.weights.segment']:
    globals().update({key: value for key, value in vars(_importlib.import_module(_name)).items()
                      if not key.startswith("__")})
