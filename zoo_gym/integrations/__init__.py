"""Adapters of zoo_gym to other frameworks, each in its own subpackage behind its own extra; nothing below imports
them."""
