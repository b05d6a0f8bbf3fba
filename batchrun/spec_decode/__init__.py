"""Speculative decoding, end to end: the interface the engine and its runner use (base.py), the
acceptance rule, and DFlash drafting (dflash/)."""
