"""The composed job spec: its parts, each option declared once on the part that holds it
(parts.py; the sampling part in batchrun/sampling/params.py), the declarations collected in
job-key order (options.py), the job file's JSON Schema derived from them (schema.py), the job
and its rules (job.py), its path keys (paths.py) and its fingerprint (fingerprint.py)."""
