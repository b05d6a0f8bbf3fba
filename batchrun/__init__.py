"""batchrun: offline batch inference over Parquet with paged-KV Qwen3 and DFlash drafts."""

__version__ = "0.1.0"
