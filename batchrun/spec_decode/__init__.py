"""Speculative decoding, end to end: the interface the engine and its runner use (base.py), the
methods behind a registry (method.py, registry.py; one folder each, dflash/), the verify
widths and their method-agnostic policy (verify_widths.py, width_policy.py) and the acceptance
rule with its round traces (acceptance.py)."""
