"""forge's test suite (a package, so that `tests.support` is this one and not a `tests` some dependency installs)."""
