"""Parquet in, part files out, by direction: input/ (listing, reading, rows to requests), output/
(the output directory, its parts, statistics, claims), store.py (files local or in object
storage, behind one interface) and parts.py (the names of an output's files, atomic writes)."""
