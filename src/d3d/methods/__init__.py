"""Decoding methods, one module per method, and the registry that names them (registry: light, read by
the CLI's parser; catalog: imports every built-in method and answers which to run)."""
