"""Deprecated: moved to apps.server.checkpoints (apps/server/moved.py), importable from here for a release."""

from apps.server.moved import moved_from

__getattr__ = moved_from(__name__)
