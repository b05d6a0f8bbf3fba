"""Parquet in, part files out: reading, prompt conversion, output schema, commits and resume."""
