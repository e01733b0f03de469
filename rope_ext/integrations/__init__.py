"""Integrations that switch other libraries' models onto rope_ext's ops.

- :mod:`rope_ext.integrations.transformers`: HF transformers model families.
"""
