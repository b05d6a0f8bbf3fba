"""Input rows: listing the input files, reading them, and turning rows into engine requests."""
